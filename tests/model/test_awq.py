"""4-bit weights: W4Linear, RTN, AWQ's scale folding (exact before quantization) and its search (never worse
than RTN on the calibration activations, α = 0 being RTN)."""

import copy

import pytest
import torch

pytest.importorskip("triton")       # kvzoo.kernels.w4a16 (W4Weight, the reference quantizer) imports it

from kvzoo.kernels.w4a16 import quantize_weight  # noqa: E402
from kvzoo.models.llama import consecutive_rows, joined_product  # noqa: E402
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
def test_rtn_joins_the_projections_that_share_an_input(model):  # noqa: F811
    """quantize_rtn joins q, k, v and gate, up: their codes, scales and zeros are views of one tensor each, and the
    joined product is the separate products side by side, until a buffer is replaced or a hook reads an input."""
    m = quantize_rtn(copy.deepcopy(model), 16)
    attn, mlp = m.layers[0].attn, m.layers[0].mlp
    x = torch.randn(2, 3, attn.q_proj.in_features, generator=torch.Generator().manual_seed(34))
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        for name in ("codes", "scale", "zero"):
            assert consecutive_rows([getattr(lin, name) for lin in group]) is not None
        torch.testing.assert_close(joined_product(x, *group), torch.cat([lin(x) for lin in group], dim=-1))
    hook = attn.k_proj.register_forward_pre_hook(lambda *args: None)
    assert joined_product(x, attn.q_proj, attn.k_proj, attn.v_proj) is None
    hook.remove()
    attn.k_proj.zero = attn.k_proj.zero.clone()                            # no longer a view of the joined zeros
    assert joined_product(x, attn.q_proj, attn.k_proj, attn.v_proj) is None
    assert joined_product(x, attn.o_proj, mlp.down_proj) is None           # never joined
    assert joined_product(x, mlp.gate_proj, mlp.up_proj) is not None


@pytest.mark.parametrize("rows,joins", [((64, 128, 40), True), ((40, 64), False), ((128, 64, 64), True)])
def test_w4linear_joins_in_panel_order_at_whole_panels(rows, joins):
    """Layers of K = 256 inputs hold their codes in panel order: they join where every layer but the last has a
    multiple of 64 outputs, and the joined buffers are the joined weight's (the product is the layers' side by
    side); elsewhere they stay apart, unchanged."""
    g = torch.Generator().manual_seed(sum(rows))
    layers = [W4Linear(torch.randn(n, 256, generator=g), 128) for n in rows]
    before = [lin.codes.clone() for lin in layers]
    W4Linear.join(*layers)
    assert all(torch.equal(lin.codes, b) for lin, b in zip(layers, before))
    x = torch.randn(3, 256, generator=g)
    got = joined_product(x, *layers)
    if not joins:
        assert got is None
        return
    torch.testing.assert_close(got, torch.cat([lin(x) for lin in layers], dim=-1))


def test_w4linear_join_refuses_layers_of_other_inputs():
    a, b = W4Linear(torch.randn(8, 64), 32), W4Linear(torch.randn(8, 32), 32)
    with pytest.raises(ValueError, match="one input size and group size"):
        W4Linear.join(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the joined products run on a GPU (llama._fused)")
@torch.no_grad()
def test_joined_4bit_products_keep_the_logits_on_a_gpu(model):  # noqa: F811
    """On a GPU the blocks take the joined 4-bit products (one W4A16 call for q, k, v and one for gate, up): the
    logits equal those of the same model with its layers unjoined."""
    import kvzoo.weightquant.awq as awq

    joined = quantize_rtn(copy.deepcopy(model).cuda().half(), 16)      # quantized where it runs: moving splits it
    apart = copy.deepcopy(joined)
    for block in apart.layers:
        for lin in (block.attn.k_proj, block.mlp.up_proj):
            lin.codes = lin.codes.clone()
    calls = []
    run = awq.w4a16_matmul
    awq.w4a16_matmul = lambda x, w: calls.append(w.shape) or run(x, w)
    try:
        x = tokens(seed=35).cuda()
        got, want = joined(x), apart(x)
    finally:
        awq.w4a16_matmul = run
    n = len(model.layers)
    assert len(calls) == 4 * n + 7 * n                     # joined: q/k/v, o, gate/up, down; apart: seven a block
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


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
