"""4-bit weights: W4Linear, RTN, AWQ's scale folding (exact before quantization) and its search (never worse
than RTN on the calibration activations, α = 0 being RTN)."""

import copy

import pytest
import torch

pytest.importorskip("triton")       # kvzoo.kernels.w4a16 (W4Weight, the reference quantizer) imports it

from kvzoo.kernels.w4a16 import quantize_weight  # noqa: E402
from kvzoo.weightquant.awq import (ALPHAS, W4Linear, _best_scale, _inputs, group_for, quantize_awq,  # noqa: E402
                                   quantize_rtn, quantize_weights)
from tests.cache.test_cache_contract import model, tokens  # noqa: E402, F401  (the tiny model fixture)


def test_w4linear_is_the_dequantized_product():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(3, 5, 64, generator=g)
    lin = W4Linear(w, 32)
    assert torch.allclose(lin(x), x @ quantize_weight(w, 32).dequantize().T, atol=1e-5)
    assert lin.weight.shape == (48, 64) and (lin.weight - w).abs().max() < 0.5
    assert sum(b.nbytes for b in lin.buffers()) == 48 * 64 // 2 + 48 * 2 * 4


@torch.no_grad()
def test_rtn_replaces_every_block_linear(model):  # noqa: F811
    m = quantize_rtn(copy.deepcopy(model), 16)
    assert all(isinstance(getattr(b.attn, n), W4Linear) for b in m.layers for n in ("q_proj", "o_proj"))
    assert isinstance(m.layers[0].mlp.down_proj, W4Linear) and not isinstance(m.lm_head, W4Linear)
    x = tokens(seed=30)
    assert (m(x) - model(x)).abs().max() < 1.0 and torch.isfinite(m(x)).all()


@torch.no_grad()
def test_awq_never_loses_to_rtn_on_its_calibration(model):  # noqa: F811
    calib = tokens(batch=2, length=32, seed=31)
    x = _inputs(model, calib)[0]["qkv"]
    x[:, 3] *= 50                                                          # an outlier input channel
    attn = model.layers[0].attn
    weights = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    s, alpha = _best_scale(x, weights, 16)
    w = torch.cat(weights)
    err = lambda wq: (x @ wq.T - x @ w.T).pow(2).mean()                     # noqa: E731
    awq = quantize_weight(w * s, 16).dequantize() / s
    assert alpha in ALPHAS and err(awq) <= err(quantize_weight(w, 16).dequantize()) + 1e-9


@torch.no_grad()
def test_awq_folding_keeps_the_model_and_quantizes_it(model, monkeypatch):  # noqa: F811
    """With quantization made exact, AWQ's folded scales leave the logits unchanged."""
    import kvzoo.weightquant.awq as awq

    folded = copy.deepcopy(model)
    monkeypatch.setattr(awq, "quantize_rtn", lambda m, g: m)            # keep the scaled fp weights
    chosen = quantize_awq(folded, tokens(batch=2, length=32, seed=32), group_size=16)
    x = tokens(seed=33)
    assert (folded(x) - model(x)).abs().max() < 1e-4 and len(chosen) == len(model.layers)
    monkeypatch.undo()
    quantized = copy.deepcopy(model)
    quantize_awq(quantized, tokens(batch=2, length=32, seed=32), group_size=16)
    assert isinstance(quantized.layers[1].mlp.up_proj, W4Linear)


def test_group_and_method_checks(model):  # noqa: F811
    assert group_for(model) == 32                                          # the tiny model's 64-wide layers
    with pytest.raises(ValueError, match="unknown weight quantization 'w3'; accepted: w16, w4-rtn, w4-awq"):
        quantize_weights(model, None, "w3")
