"""KV Pareto's KV quantization: K-smoothing leaves attention unchanged, what each granularity stores, the
precisions and options."""


import pytest
import torch

from kvzoo.cache.base import CacheSpec
from tests.cache.test_cache_contract import model, stream, tokens  # noqa: F401  (the tiny model fixture)

T = 48


@pytest.mark.parametrize("mode", ["streaming", "simulated"])
@torch.no_grad()
def test_k_smoothing_leaves_softmax_unchanged(model, mode):  # noqa: F811
    """q·(k - m) = q·k - q·m: every score of a query moves by the same amount, so without quantization
    smoothing changes nothing but rounding."""
    x = tokens(seed=20)
    runs = {}
    for smooth in ("true", "false"):
        spec = f"kvpareto:k_bits=16,v_bits=16,k_smooth={smooth}"
        if mode == "streaming":
            runs[smooth], _ = stream(model, spec, x, prefill=20)
        else:
            runs[smooth] = model(x, model.new_cache(spec, 2, T, mode="simulated", prompt=20))
    assert (runs["true"] - runs["false"]).abs().max() < 1e-5


@torch.no_grad()
def test_k_smoothing_stores_the_prefill_mean(model):  # noqa: F811
    x = tokens(seed=21)
    _, cache = stream(model, "kvpareto:k_bits=16,v_bits=16", x, prefill=20)
    layer = cache.layers[0]
    keys = layer.store.read(T, torch.float32)["k"] + layer.k_mean             # stored smoothed: add the mean back
    assert (keys[:, :, :20].mean(2, keepdim=True) - layer.k_mean).abs().max() < 1e-5


def test_k_smoothing_lowers_int4_error_on_offset_channels():
    """Keys whose channels sit far from zero: per-token int4 groups waste their range on the offset."""
    from kvzoo.cache.kvquant import dequantize, quantize

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 256, 64, generator=g) + 8 * torch.randn(1, 2, 1, 64, generator=g)
    q = torch.randn(1, 2, 64, 1, generator=g)
    plain = dequantize(quantize(keys, 4, 32)) @ q
    smooth_keys = keys - keys.mean(2, keepdim=True)
    smoothed = dequantize(quantize(smooth_keys, 4, 32)) @ q
    err_plain = (plain - keys @ q).abs().mean()
    err_smooth = (smoothed - smooth_keys @ q).abs().mean()    # the same scores up to a per-query shift
    assert err_smooth < err_plain / 4


@torch.no_grad()
def test_what_each_granularity_stores(model):  # noqa: F811
    x = tokens(seed=22)
    d = model.cfg.head_dim
    _, cache = stream(model, "kvpareto:k_bits=4,v_bits=2,group_size=16", x[:, :21], prefill=5)
    ks = cache.layers[0].store.codecs["k"]
    assert ks.scale.shape[-1] == d // 16 and ks.codes.shape[-1] == d * 4 // 32
    # block: the two complete blocks of 8 are quantized, the 5 tokens of the third are held exact
    _, cache = stream(model, "kvpareto:k_bits=2,v_bits=2,granularity=block,group_size=8", x[:, :21], prefill=5)
    store = cache.layers[0].store
    values = store.read(21, torch.float32)["v"]
    assert store.counts(21) == (0, 16, 5) and torch.equal(values[:, :, 16:], store.recent_rows("v", 21))
    assert values[:, :, :16].unique().numel() <= 2 * 2 * 2 * 4                 # 4 levels per (row, head, block)
    assert cache.layers[0].nbytes() == cache.layers[0].formula_nbytes(21)
    # a 16-bit K beside block-quantized V: every key held once and exact (the complete blocks as the codec's rows,
    # the block being filled in the window), as layer 0 of an unquantized cache holds them
    _, mixed = stream(model, "kvpareto:k_bits=16,v_bits=2,granularity=block,group_size=8", x[:, :21], prefill=5)
    _, exact = stream(model, "kvpareto:k_bits=16,v_bits=16", x[:, :21], prefill=5)
    keys = [c.layers[0].store.read(21, torch.float32)["k"] for c in (mixed, exact)]
    assert torch.equal(*keys) and mixed.layers[0].nbytes() == mixed.layers[0].formula_nbytes(21)
    # tensor: one scale per row and token, from a running range that only grows
    _, cache = stream(model, "kvpareto:k_bits=8,v_bits=8,granularity=tensor", x[:, :21], prefill=5)
    scale = cache.layers[0].store.codecs["v"].scale[:, :21].float()
    assert tuple(scale.shape) == (2, 21) and (scale[:, 1:] >= scale[:, :-1] - 1e-3).all()


def test_paper_grid_and_bad_options():
    for k, v in ((8, 8), (8, 4), (8, 2), (4, 4), (4, 2), (2, 2)):
        for granularity in ("token", "block", "tensor"):
            CacheSpec.parse(f"kvpareto:k_bits={k},v_bits={v},granularity={granularity},group_size=64")
    with pytest.raises(ValueError, match="k_bits must be one of 2, 4, 8, 16, got 3"):
        CacheSpec.parse("kvpareto:k_bits=3")
    with pytest.raises(ValueError, match="granularity must be one of token, block, tensor, got 'row'"):
        CacheSpec.parse("kvpareto:granularity=row")
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        CacheSpec.parse("kvpareto:group_size=0")


def test_token_groups_must_divide_the_head(model):  # noqa: F811
    with pytest.raises(ValueError, match="group_size 24 must divide the head dimension 32"):
        model.new_cache("kvpareto:group_size=24", 1, 8)
