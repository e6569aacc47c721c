"""AlignedKV: the bit planes, the two alignment rules and their error bounds, what the cache stores and
reads, the analysis and greedy scripts, and chat."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvzoo.cache.alignedkv import (AlignedKVOptions, estimate_output, exponent, join_planes, key_levels, read_levels,
                                   split_planes, truncate, value_levels)
from kvzoo.cache.base import CacheSpec
from repro.alignedkv.analysis import bucket_counts, decode_step
from tests.cache.test_cache_contract import model, stream, tokens  # noqa: F401  (the tiny model fixture)

REPO = Path(__file__).resolve().parents[2]


def outlier_data(*shape, seed=0):
    """fp16 data whose last-axis channels differ by up to 2^12 in scale, so that every level occurs."""
    g = torch.Generator().manual_seed(seed)
    scale = 2.0 ** torch.randint(-6, 7, (shape[-1],), generator=g)
    return (torch.randn(*shape, generator=g) * scale).half()


def test_planes_round_trip_and_truncation_fill():
    x = outlier_data(3, 5, 64)
    assert torch.equal(join_planes(*split_planes(x)).view(torch.int16), x.view(torch.int16))
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    assert torch.equal(truncate(x, 12).view(torch.int16).to(torch.int32) & 0xFFFF, (bits & 0xFFF0) | 0x8)
    assert torch.equal(truncate(x, 8).view(torch.int16).to(torch.int32) & 0xFFFF, (bits & 0xFF00) | 0x80)
    # filling with 100... errs by at most half of what was not read: 2^(e - m - 1) with m mantissa bits kept
    e = exponent(x).float()
    for bits_read, m in ((8, 2), (12, 6)):
        assert ((truncate(x, bits_read).float() - x.float()).abs() <= 2 ** (e - m - 1)).all()


def test_exponent_is_floor_log2():
    x = torch.tensor([1.0, 1.99, 2.0, 0.3, -5.0, 2 ** -20, 0.0])
    assert exponent(x).tolist() == [0, 0, 1, -2, 2, -20, -127]


def test_rule1_keeps_every_product_error_below_the_largest_addends_rounding():
    B, H, G, NB, BT, d = 1, 2, 3, 4, 16, 64
    k = outlier_data(B, H, NB, BT, d)
    q = outlier_data(B, H * G, 1, d, seed=1)
    k_exp = exponent(k.float().abs().amax(3))                                 # (B, H, NB, d)
    bits = key_levels(q, k_exp, 8)                                            # (B, H, 1, NB, d)
    assert {8, 12, 16} <= set(bits.unique().tolist())
    err = (read_levels(k, bits[:, :, 0, :, None]) - k.float())               # (B, H, NB, BT, d)
    a = exponent(q).view(B, H, G, 1, d) + k_exp[:, :, None]                  # (B, H, G, NB, d)
    target = 2.0 ** (a.amax(-1) - 10).float()                                # the largest addend's fp16 ulp
    products = (q.float().view(B, H, G, 1, 1, d) * err[:, :, None]).abs()    # (B, H, G, NB, BT, d)
    assert (products <= target[..., None, None]).all()
    # GQA: a KV head's bits are the most any of its query heads asks for
    per_head = [key_levels(q.view(B, H, G, 1, d)[:, :, g], k_exp, 8) for g in range(G)]
    assert torch.equal(bits, torch.stack(per_head).amax(0))


def test_rule2_keeps_every_product_error_below_the_estimated_outputs_rounding():
    B, H, G, S, d = 1, 1, 2, 128, 64
    v = outlier_data(B, H, S, d)
    p = torch.randn(B, H * G, 1, S).mul(3).softmax(-1)
    v_exp = exponent(v.float().abs().amax(-1))                                # (B, H, S)
    o_est = estimate_output(p, v[:, :, None].float(), topk=8)                 # (B, Hq, 1, d)
    bits = value_levels(p, o_est, v_exp, 8)                                   # (B, H, 1, S, d)
    assert {8, 12, 16} <= set(bits.unique().tolist())
    err = read_levels(v[:, :, None], bits) - v[:, :, None].float()          # (B, H, 1, S, d)
    products = (p.view(B, H, G, S, 1) * err[:, :, None, 0]).abs()           # (B, H, G, S, d)
    target = 2.0 ** (exponent(o_est).view(B, H, G, 1, d) - 10).float()
    assert (products <= target).all()
    assert not (value_levels(p, o_est, v_exp, 12) == 8).any()


def test_estimate_output_is_the_topk_partial_sum():
    p = torch.tensor([[[[0.1, 0.6, 0.3]]]])
    v = torch.tensor([[[[1.0, 0.0], [0.0, 2.0], [4.0, 4.0]]]])              # (1, 1, 3, 2)
    assert torch.allclose(estimate_output(p, v[:, :, None], 2), torch.tensor([[[[1.2, 2.4]]]]))


@torch.no_grad()
def test_the_cache_stores_planes_and_block_colmax(model):  # noqa: F811
    x = tokens(seed=7)
    _, cache = stream(model, "alignedkv:block=8", x[:, :21], prefill=5)
    layer = cache.layers[1]
    assert layer.length == 21 and layer.nbytes() == layer.formula_nbytes(21)
    keys = layer._stored_keys(0, 21)                                          # (B, H, 21, d) fp16
    blocks = keys[:, :, :16].float().view(*keys.shape[:2], 2, 8, -1).abs().amax(3)
    assert torch.equal(layer.k_exp[:, :, :2].int(), exponent(blocks))
    assert (layer.k_exp[:, :, 2] == 0).all()                                 # the block being filled: none yet
    values = layer._stored_values(21)
    assert torch.equal(layer.v_exp[:, :, :21].int(), exponent(values.float().abs().amax(-1)))


@torch.no_grad()
def test_decode_reads_fewer_bits_and_min_bits_bounds_them(model):  # noqa: F811
    x = tokens(seed=8)
    reads = {}
    for min_bits in (8, 12):
        _, cache = stream(model, f"alignedkv:block=8,min_bits={min_bits}", x, prefill=1)
        stats = [layer.stats for layer in cache.layers]
        reads[min_bits] = sum(s.mean_k_bits + s.mean_v_bits for s in stats) / (2 * len(stats))
        assert all(s.k_elements > 0 and s.v_elements > 0 for s in stats)
    assert 8 < reads[8] < reads[12] < 16


@torch.no_grad()
def test_padding_is_stored_as_zeros(model):  # noqa: F811
    cache = model.new_cache("alignedkv:block=8", 2, 16)
    pad = torch.tensor([3, 0])
    x = tokens(length=16, seed=9)
    model(x, cache, pad)
    keys = cache.layers[0]._stored_keys(0, 16)
    assert (keys[0, :, :3] == 0).all() and (keys[1, :, :3] != 0).any()


@pytest.mark.parametrize("text, message", [
    ("alignedkv:min_bits=10", "min_bits must be one of 8, 12, 16, got 10"),
    ("alignedkv:block=7", "block must be an even number of tokens >= 2, got 7"),
    ("alignedkv:topk=0", "topk must be >= 1, got 0"),
])
def test_bad_options(text, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec.parse(text)


def test_defaults_follow_the_docstring():
    assert AlignedKVOptions() == AlignedKVOptions(block=64, topk=32, min_bits=8)


# ---- the analysis on real caches of the embedded model --------------------------------------------------
def test_bucket_counts_follow_table1_edges():
    rel = torch.tensor([0.0, 1e-4, 1 / 1024, 1.5 / 1024, 1 / 512, 1 / 256, 1 / 128, 1.0])
    assert bucket_counts(rel) == [1, 1, 2, 1, 1, 2]


def test_decode_step_on_random_caches():
    q, k, v = outlier_data(6, 80, 32, seed=2), outlier_data(2, 80, 32, seed=3), outlier_data(2, 80, 32, seed=4)
    step = decode_step(q, k, v, t=70, block=16, topk=8)
    assert 8 <= step["k_bits_aligned"] < 16 and step["k_bits_aligned"] < step["k_bits"] < 16
    assert sum(step["qk"]["alignedkv"]) == 6 * 71 and sum(step["sv"]["truncated13"]) == 6 * 32
    with pytest.raises(ValueError, match="a step needs a complete block"):
        decode_step(q, k, v, t=10, block=16, topk=8)


def test_analysis_script_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")   # --plot (the `eval` extra)
    target, figure = tmp_path / "a.json", tmp_path / "a.png"
    cmd = [sys.executable, "-m", "repro.alignedkv.figure9", "--device", "cpu", "--contexts", "64,160", "--block", "32",
           "--json", str(target), "--plot", str(figure)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(target.read_text())
    assert [r["context"] for r in result["contexts"]] == [64, 160] and result["layers"] == 30
    assert all(8 <= r["kv_bits"] < 16 for r in result["contexts"])
    assert result["table1"]["qk"]["alignedkv"][0] + result["table1"]["qk"]["alignedkv"][1] > 0.5
    assert figure.stat().st_size > 0
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 2 and "exists; choose another path or pass --overwrite" in again.stderr


def test_greedy_script_matches_token_for_token(tmp_path):
    """The paper's Table 3 claim, small: 2 prompts x 40 tokens with blocks of 8 (so most reads are aligned)."""
    target = tmp_path / "g.json"
    cmd = [sys.executable, "-m", "repro.alignedkv.greedy", "--device", "cpu", "--prompts", "2",
           "--new-tokens", "40", "--cache", "alignedkv:block=8", "--baseline", "alignedkv:min_bits=16",
           "--json", str(target)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(target.read_text())
    assert result["identical"] == 2, result["rows"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"),
                    reason="the tiny model runs on the CPU: its kernel path needs the interpreter (the GPU runs them in "
                           "tests/kernels/test_alignedkv_kernel.py and tests/graphs/test_alignedkv_static.py)")
@pytest.mark.parametrize("spec", ["alignedkv:block=16,topk=4", "alignedkv:block=16,topk=64,min_bits=12"])
@torch.no_grad()
def test_kernel_decode_equals_the_torch_path(model, spec, monkeypatch):  # noqa: F811
    """The CUDA decode path (aligned_qk / aligned_pv, run here by the Triton interpreter) against the torch
    reference path, on the tiny model: same logits, token by token past two complete blocks."""
    pytest.importorskip("triton")
    from kvzoo.cache.alignedkv import AlignedKVCache

    x = tokens(seed=10)
    reference, _ = stream(model, spec, x, prefill=5)
    used = []
    monkeypatch.setattr(AlignedKVCache, "_fused_ok",
                        lambda self, q, pos: used.append(1) or self.length >= self.opts.block)
    fused, _ = stream(model, spec, x, prefill=5)
    assert len(used) > 0 and (fused - reference).abs().max() < 1e-4
