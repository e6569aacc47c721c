"""repro/xquant/mha_error.py: the three rematerialization paths' K/V errors, end to end on a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvzoo.models.loader import load_weights
from repro.xquant.mha_error import BITS, layer_errors
from tests.scripts.test_xquant_outliers import tiny_dir  # noqa: F401  (fixture: a tiny Llama + tokenizer)

REPO = Path(__file__).resolve().parents[2]


def test_errors_are_finite_and_fall_with_bits(tiny_dir):  # noqa: F811
    model = load_weights(tiny_dir)
    x = torch.randn(1, 256, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x[..., 3] *= 40                                                     # one outlier channel
    out = layer_errors(model.layers[0].attn, x)
    for path in ("mha", "gqa", "kivi"):
        for t in "kv":
            errs = [out["errors"][b][path][t] for b in BITS]
            assert all(e == e and 0 <= e < 10 for e in errs) and errs[0] > errs[1] > errs[2]
    assert out["top_channel_over_median"] > 10 and 0 <= out["spiky_groups"] <= 1


def test_script_writes_json_and_plot(tiny_dir, tmp_path):  # noqa: F811
    pytest.importorskip("matplotlib")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\n" * 20)
    target, figure = tmp_path / "err.json", tmp_path / "err.png"
    cmd = [sys.executable, "-m", "repro.xquant.mha_error", "--model", str(tiny_dir), "--device", "cpu",
           "--data-path", str(text), "--windows", "1", "--seq-len", "128", "--json", str(target), "--plot", str(figure)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(target.read_text())
    assert len(result["layers"]) == 2 and "3bit_mha_k" in result["summary"] and figure.stat().st_size > 0
