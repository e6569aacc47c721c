"""The shared fixtures of tests/conftest.py that are not data: run_once."""

import uuid


def test_run_once_computes_once_for_every_worker(run_once, monkeypatch, tmp_path_factory):
    """Under pytest-xdist the first caller computes and saves the result; later callers (the other workers) load
    it without computing."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    name, calls = f"run-once-{uuid.uuid4().hex}", []

    def compute():
        calls.append(1)
        return {"rows": [1, 2, 3]}

    try:
        assert run_once(name, compute) == {"rows": [1, 2, 3]}
        assert run_once(name, compute) == {"rows": [1, 2, 3]}
        assert calls == [1]
    finally:                  # outside xdist the shared folder outlives the run: leave nothing there
        for suffix in (".pt", ".pt.lock"):
            (tmp_path_factory.getbasetemp().parent / f"{name}{suffix}").unlink(missing_ok=True)


def test_run_once_without_xdist_just_computes(run_once, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    calls = []
    run_once("run-once-plain", lambda: calls.append(1))
    run_once("run-once-plain", lambda: calls.append(1))
    assert calls == [1, 1]
