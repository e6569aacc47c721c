"""Shared fixtures: the converted default model and the evaluation data in ../shared/data."""

import os
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from tests.interpreted import skip_repeated_patching

# Triton kernels run on CPU tensors only under the interpreter, which must be chosen before triton is first
# imported (importing kvzoo does: the XQuant cache imports its kernel); a CUDA machine runs them compiled
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
skip_repeated_patching()

# under pytest-xdist (-n N) each worker gets its share of the cores, and so do the scripts its tests run in
# subprocesses (OMP_NUM_THREADS), so N workers do not oversubscribe them
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

from kvzoo.eval.datasets import data_dir  # noqa: E402


def shared_data_file(name: str) -> Path:
    """A file of the shared data folder; a missing folder fails the test (never skips it)."""
    file = data_dir() / name
    if not file.is_file():
        pytest.fail(f"{file} not found: the shared data folder must sit beside the repository "
                    f"(../shared/data) or be named by KVZOO_DATA")
    return file


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
    """once(name, compute): compute()'s result, computed by one process of the test run. pytest-xdist workers each
    set up a module's fixtures for the tests they get; for the costly ones, the first computes and saves the result
    (torch.save) under a lock, and the others load it."""
    def once(name: str, compute):
        if "PYTEST_XDIST_WORKER" not in os.environ:
            return compute()
        path = tmp_path_factory.getbasetemp().parent / f"{name}.pt"       # shared by the run's workers
        with FileLock(f"{path}.lock"):
            if path.is_file():
                return torch.load(path, weights_only=False)
            result = compute()
            torch.save(result, path)
            return result
    return once


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """weights/smollm2-135m-instruct, converted from the GGUF on first use (the real cache)."""
    from kvzoo.models.gguf_import import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    """(model, tokenizer) of the default model, fp32 on CPU, loaded once for the session: tests only read it."""
    import kvzoo

    return kvzoo.load_model(default_model_dir)


@pytest.fixture(scope="session")
def wikitext_text() -> str:
    return shared_data_file("wikitext2-test.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def llama2_tokenizer_file() -> Path:
    return shared_data_file("llama2-tokenizer.model")
