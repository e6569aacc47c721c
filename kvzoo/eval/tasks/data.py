"""Datasets of kvzoo's offline lm-eval tasks, read from the shared data folder (kvzoo.eval.datasets: ../shared/data
or $KVZOO_DATA), or from `data_dir` given as task metadata (`--metadata '{"data_dir": "/path"}'`). No download."""

from __future__ import annotations

import json
import re

import datasets

from kvzoo.eval.datasets import DATASETS, dataset_path

# an article of the raw WikiText-2 text begins with a level-1 heading line " = Title = "
_ARTICLE = re.compile(r"^ = [^=].* = $", re.MULTILINE)


def _path(name: str, data_dir: str | None):
    return dataset_path(name, None if data_dir is None else f"{data_dir}/{DATASETS[name]}")


def wikitext_articles(text: str) -> list[str]:
    """The raw test split's articles, each from its level-1 heading to the next (the document-level form the
    stock `wikitext` task scores)."""
    starts = [m.start() for m in _ARTICLE.finditer(text)] + [len(text)]
    return [text[a:b].strip("\n") for a, b in zip(starts, starts[1:])]


def wikitext(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    text = _path("wikitext2", data_dir).read_text(encoding="utf-8")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"page": p} for p in wikitext_articles(text)])})


def gsm8k(data_dir: str | None = None, **_) -> datasets.DatasetDict:
    def split(name: str) -> datasets.Dataset:
        with _path(name, data_dir).open(encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return datasets.Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in rows])

    return datasets.DatasetDict({"train": split("gsm8k-train"), "test": split("gsm8k-test")})
