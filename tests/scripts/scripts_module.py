"""Load an entry point of scripts/ as a module, the way `python scripts/<name>.py` runs it: scripts/ first on the
module search path while it imports, so that its sibling helper scripts/timing.py imports as `timing`; or run an
entry point's or a reproduction's command line in this process."""

import importlib.util
import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parents[2] / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def run_in_process(monkeypatch, capsys, script: str, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of an entry point (scripts/<script>) or a reproduction (a module, as `python -m`
    runs it) run in this process, with the model and the datasets unreachable: a check that lets a bad value
    through to loading fails the test."""
    import kvzoo.cli
    import kvzoo.eval.datasets

    def never(*args, **kwargs):
        raise AssertionError("loading started before the arguments were checked")

    monkeypatch.setattr(kvzoo.cli, "load_from_args", never)
    monkeypatch.setattr(kvzoo.eval.datasets, "load_text", never)
    monkeypatch.setattr(sys, "argv", [script, *args])
    monkeypatch.setattr(sys, "path", [str(SCRIPTS)] + sys.path)     # as `python scripts/<script>` has it
    try:
        if script.endswith(".py"):
            runpy.run_path(str(SCRIPTS / script), run_name="__main__")
        else:
            monkeypatch.delitem(sys.modules, script, raising=False)     # imported by another test: run it afresh
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:
        code = done.code
        if code is None:
            code = 0
        elif not isinstance(code, int):                  # sys.exit(message): printed, exit 1, as Python does
            print(code, file=sys.stderr)
            code = 1
    out = capsys.readouterr()
    return code, out.out, out.err
