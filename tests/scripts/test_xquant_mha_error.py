"""repro/xquant/mha_error.py: the three rematerialization paths' K/V errors, on constructed X and end to end
(main() in this process) on a tiny random Llama with a character-level tokenizer."""

import json
import math
import sys

import pytest
import torch

from kvzoo.models.loader import load_weights
from repro.xquant import mha_error as script
from repro.xquant.mha_error import BITS, PATHS, layer_errors
from tests.scripts.test_xquant_outliers import tiny_dir  # noqa: F401  (fixture: a tiny Llama + tokenizer)


def test_errors_fall_with_bits_and_an_outlier_channel_is_seen(tiny_dir):  # noqa: F811
    model = load_weights(tiny_dir)
    x = torch.randn(1, 256, model.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    x[..., 3] *= 40                                                     # one outlier channel
    out = layer_errors(model.layers[0].attn, x)
    assert out["tokens"] == 256 and out["token_group"] == 128 and out["channel_group"] == 64
    for path in PATHS:
        for t in "kv":
            errs = [out["errors"][b][path][t] for b in BITS]
            assert all(math.isfinite(e) and 0 <= e < 10 for e in errs) and errs[0] > errs[1] > errs[2]
    assert out["top_channel"] == 3 and out["top_channel_over_median"] > 10
    assert out["spiky_tokens"] > 0.5 and 0 <= out["spiky_groups"] <= out["spiky_tokens"] <= 1


def test_main_writes_json_and_plot(tiny_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\n" * 20)
    target, figure = tmp_path / "out" / "err.json", tmp_path / "out" / "err.png"
    argv = ["--model", str(tiny_dir), "--device", "cpu", "--data-path", str(text), "--windows", "1",
            "--seq-len", "32", "--json", str(target)]
    if _has_matplotlib():
        argv += ["--plot", str(figure)]
    monkeypatch.setattr(sys, "argv", ["repro.xquant.mha_error", *argv])
    script.main()
    assert "3  mha" in capsys.readouterr().out
    result = json.loads(target.read_text())
    assert {"model", "windows", "seq_len", "tokens_used", "token_group", "channel_group", "bits", "summary",
            "layers"} <= set(result)
    assert result["windows"] == 1 and result["tokens_used"] == 32 and result["token_group"] == 32
    assert [layer["layer"] for layer in result["layers"]] == [0, 1]
    for b in BITS:
        for p in PATHS:
            for t in "kv":
                assert set(result["summary"][f"{b}bit_{p}_{t}"]) == {"mean", "worst", "worst_layer"}
    for key in ("spiky_groups", "spiky_tokens", "top_channel_over_median"):
        assert math.isfinite(result["summary"][key]["mean"])
    for layer in result["layers"]:
        for p in PATHS:
            for t in "kv":
                errs = [layer["errors"][str(b)][p][t] for b in BITS]
                assert all(math.isfinite(e) and e >= 0 for e in errs) and errs[0] > errs[1] > errs[2], (p, t, errs)
    if "--plot" in argv:
        assert figure.stat().st_size > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_main_refuses_a_window_longer_than_the_text(tiny_dir, tmp_path, monkeypatch):  # noqa: F811
    text = tmp_path / "text.txt"
    text.write_text("abc " * 10)
    monkeypatch.setattr(sys, "argv", ["repro.xquant.mha_error", "--model", str(tiny_dir), "--device", "cpu",
                                      "--data-path", str(text), "--windows", "2", "--seq-len", "32"])
    with pytest.raises(ValueError, match="fewer than 2 windows of 32"):
        script.main()
