"""Shared fixtures: the converted default model and the evaluation data in ../shared/data."""

from pathlib import Path

import pytest

from kvzoo.eval.datasets import data_dir


def shared_data_file(name: str) -> Path:
    """A file of the shared data folder; a missing folder fails the test (never skips it)."""
    file = data_dir() / name
    if not file.is_file():
        pytest.fail(f"{file} not found: the shared data folder must sit beside the repository "
                    f"(../shared/data) or be named by KVZOO_DATA")
    return file


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """weights/smollm2-135m-instruct, converted from the GGUF on first use (the real cache)."""
    from kvzoo.models.gguf_import import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def wikitext_text() -> str:
    return shared_data_file("wikitext2-test.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def llama2_tokenizer_file() -> Path:
    return shared_data_file("llama2-tokenizer.model")
