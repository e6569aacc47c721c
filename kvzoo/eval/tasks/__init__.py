"""lm-eval tasks that read kvzoo's shared data folder instead of downloading (kvzoo/eval/harness.py):

    kvzoo_wikitext     WikiText-2 test, its 62 articles scored by rolling loglikelihood (word and byte perplexity,
                       bits per byte), the stock `wikitext` task's detokenizer and metrics (kvzoo_wikitext.yaml)
    kvzoo_gsm8k_cot    GSM8K test, the stock `gsm8k_cot` task (the standard 8-shot chain-of-thought prompt, its
                       strict and flexible answer extraction) on local files: written by `task_dir` as a YAML that
                       includes the installed lm-eval's own gsm8k-cot.yaml, so the prompt is lm-eval's, not a copy

`task_dir()` is the folder to give lm-eval (`--include_path`, `TaskManager(include_path=...)`); `python -m
kvzoo.eval.harness` adds it itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def task_dir() -> Path:
    """A folder holding every kvzoo task: this package's YAML and helper modules, and kvzoo_gsm8k_cot.yaml
    pointing at the installed lm-eval's gsm8k-cot.yaml."""
    import lm_eval

    stock = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k-cot.yaml"
    if not stock.is_file():
        raise FileNotFoundError(f"the installed lm_eval has no {stock}: kvzoo_gsm8k_cot includes it (lm_eval>=0.4.5)")
    folder = Path(tempfile.gettempdir()) / f"kvzoo-tasks-{os.getuid()}"      # rewritten on every call
    folder.mkdir(exist_ok=True)
    for file in (*HERE.glob("*.yaml"), HERE / "data.py", HERE / "wikitext.py"):
        shutil.copy(file, folder / file.name)
    (folder / "kvzoo_gsm8k_cot.yaml").write_text(
        f"include: {stock}\ntask: kvzoo_gsm8k_cot\ntag: []\ncustom_dataset: !function data.gsm8k\n")
    return folder
