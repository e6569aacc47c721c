"""Needle-in-a-haystack: prompts of the asked length with the needle where asked, scoring, the script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvzoo import load_model
from kvzoo.eval.datasets import load_text
from kvzoo.eval.needle import NEEDLE, QUESTION, needle_grid, prompt_ids

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def smollm():
    model, tokenizer = load_model()
    return model, tokenizer, tokenizer.encode(load_text("wikitext2")[:20000], bos=False)


@pytest.mark.parametrize("length, depth", [(200, 0.0), (300, 0.5), (257, 1.0)])
def test_prompt_has_the_length_needle_and_question(smollm, length, depth):
    _, tokenizer, filler = smollm
    ids = prompt_ids(tokenizer, filler, length, depth, "1234567")
    text = tokenizer.decode(ids)
    assert length - 3 <= len(ids) <= length
    assert NEEDLE.format(value="1234567") in text and QUESTION in text
    before, after = text.split(NEEDLE.format(value="1234567"))
    first_words = tokenizer.decode(filler[:8]).strip()
    if depth == 0.0:
        assert first_words not in before and first_words in after
    elif depth == 1.0:
        assert len(after.split(QUESTION)[0].strip()) == 0
    else:
        assert first_words in before and len(after.split(QUESTION)[0]) > 100


def test_grid_scores_exact_retrieval(smollm):
    model, tokenizer, filler = smollm
    cells = needle_grid(model, tokenizer, filler, [256], [0.0, 1.0])
    assert [c.depth for c in cells] == [0.0, 1.0] and all(c.found == (c.value in c.answer) for c in cells)
    assert all(c.found for c in cells)                       # the embedded model retrieves at 256 tokens
    batched = needle_grid(model, tokenizer, filler, [256], [0.0, 1.0], batch_size=2)
    assert [(c.value, c.answer) for c in batched] == [(c.value, c.answer) for c in cells]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        needle_grid(model, tokenizer, filler, [256], [0.5], batch_size=0)
    with pytest.raises(ValueError, match="depths must lie in"):
        needle_grid(model, tokenizer, filler, [256], [1.5])
    with pytest.raises(ValueError, match="exceed the model's context"):
        needle_grid(model, tokenizer, filler, [9000], [0.5])


def test_script_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")   # --plot (the `eval` extra)
    target, figure = tmp_path / "n.json", tmp_path / "n.png"
    cmd = [sys.executable, str(REPO / "scripts" / "needle.py"), "--device", "cpu", "--lengths", "256",
           "--depths", "0,1", "--cache", "kvpareto:k_bits=8,v_bits=8", "--prefill-chunk", "64",
           "--json", str(target), "--plot", str(figure)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(target.read_text())
    assert result["lengths"] == [256] and len(result["cells"]) == 2 and result["cache"].startswith("kvpareto")
    assert figure.stat().st_size > 0
    bad = subprocess.run(cmd[:4] + ["--lengths", "a,b"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "--lengths takes comma-separated numbers" in bad.stderr
