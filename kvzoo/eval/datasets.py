"""Evaluation texts, read from the shared data folder (never copied into the repository).

    wikitext2   WikiText-2 raw test split, rows joined with "\\n\\n" (the GPTQ protocol), one text
    c4          a 2,000-document C4 sample (JSON lines); documents joined with "\\n\\n"
    gsm8k-test, gsm8k-train   GSM8K's splits, one {"question", "answer"} object a line (lm-eval tasks only)

The folder is ../shared/data beside the repository, or $KVZOO_DATA; a path can also be given per call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DATASETS = {"wikitext2": "wikitext2-test.txt", "c4": "c4-validation-2k.jsonl", "gsm8k-test": "gsm8k-test.jsonl",
            "gsm8k-train": "gsm8k-train.jsonl"}


def data_dir() -> Path:
    if os.environ.get("KVZOO_DATA"):
        return Path(os.environ["KVZOO_DATA"])
    return Path(__file__).resolve().parents[3] / "shared" / "data"


def dataset_path(name: str, path: str | Path | None = None) -> Path:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; accepted: {', '.join(DATASETS)}")
    file = Path(path) if path is not None else data_dir() / DATASETS[name]
    if not file.is_file():
        raise FileNotFoundError(f"{name} data not found at {file}; set KVZOO_DATA to the folder holding "
                                f"{DATASETS[name]} or pass its path (--data-path)")
    return file


def load_text(name: str, path: str | Path | None = None) -> str:
    """The whole evaluation text of dataset `name`, ready to tokenize in one go."""
    file = dataset_path(name, path)
    if name == "wikitext2":
        return file.read_text(encoding="utf-8")
    with file.open(encoding="utf-8") as f:
        return "\n\n".join(json.loads(line)["text"] for line in f if line.strip())
