"""XQuant and XQuant-CL: what is cached (X for MHA, SVD latents for GQA, cross-layer deltas), exactness
with quantization off, simulated == streaming, bytes at SmolLM2's shapes, options."""

import os

import pytest
import torch

from kvzoo.cache.base import CacheSpec, fp16_kv_nbytes
from kvzoo.cache.kvquant import dequantize, quantize
from kvzoo.cache.store import token_group
from kvzoo.cache.xquant import rematerialize
from kvzoo.config import ModelConfig
from kvzoo.models.llama import Transformer
from kvzoo.models.loader import load_weights
from tests.cache.test_cache_contract import stream, tokens
from tests.cache.test_kivi import SMOLLM_ATTENTION, smollm_shaped_layer_cache
from tests.tiny import tiny_llama

KERNEL_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes") else "cuda"
T = 48


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    """4 layers, 4 query heads and 4 KV heads of 16: K and V each as wide as X (64)."""
    return load_weights(tiny_llama(tmp_path_factory.mktemp("mha"), num_key_value_heads=4, num_hidden_layers=4))


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """4 layers, 4 query heads sharing 2 KV heads of 16: W_k is 64 x 32, so the latents are 32 wide."""
    return load_weights(tiny_llama(tmp_path_factory.mktemp("gqa"), num_hidden_layers=4))


def layer_inputs(model):
    """Hooks that record every attention module's input x (the layer input after RMSNorm), per call."""
    seen = {i: [] for i in range(len(model.layers))}
    handles = [block.attn.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0]))
               for i, block in enumerate(model.layers)]
    return seen, handles


def test_paper_defaults():
    assert str(CacheSpec.parse("xquant")) == \
        "xquant:bits=4,group_size=128,residual=0,outlier_channel=False,high_layers=0,high_bits=4,policy=reference," \
        "up_dtype=model"
    assert str(CacheSpec.parse("xquant-cl")) == \
        "xquant-cl:bits=3,high_bits=4,high_layers=3,base_layer=2,group_size=128,residual=0,policy=reference," \
        "up_dtype=model"
    assert token_group(192, 128) == 96 and token_group(4096, 128) == 128 and token_group(576, 128) == 96


# ---- quantization off: the fp16 cache's attention, to fp32 rounding --------------------------------------
LOSSLESS = ["xquant:bits=16,group_size=8",                       # group 8: every token leaves the window
            "xquant:bits=16,group_size=8,residual=16",
            "xquant-cl:bits=16,high_bits=16,base_layer=1",       # layer 0 plain XQuant, 1 base, 2-3 deltas
            "xquant-cl:bits=16,high_bits=16,base_layer=0,group_size=8"]


@pytest.mark.parametrize("spec", LOSSLESS)
@pytest.mark.parametrize("arch", ["mha", "gqa"])
@torch.no_grad()
def test_no_quantization_reproduces_fp16(request, arch, spec):
    model = request.getfixturevalue(arch)
    x = tokens()
    reference, _ = stream(model, "fp16", x, prefill=20)
    ours, _ = stream(model, spec, x, prefill=20)
    simulated = model(x, model.new_cache(spec, 2, T, mode="simulated"))
    assert (ours - reference).abs().max() < 1e-5
    assert (simulated - reference).abs().max() < 1e-5


@torch.no_grad()
def test_mha_caches_x_itself(mha):
    x = tokens()
    seen, handles = layer_inputs(mha)
    _, cache = stream(mha, "xquant:bits=16,group_size=8", x, prefill=20)
    for h in handles:
        h.remove()
    for i, layer in enumerate(cache.layers):
        assert not layer.gqa and list(layer.store.codecs) == ["x"]
        X = torch.cat(seen[i], dim=1)                                         # (B, T, hidden)
        assert torch.equal(layer.store.codecs["x"].rows[:, :T], X)
    # X is as wide as K alone: half an fp16-precision KV cache (the model runs in fp32 here)
    assert cache.nbytes() == 4 * 2 * T * 64 * 4


@torch.no_grad()
def test_gqa_caches_svd_latents(gqa):
    x = tokens()
    seen, handles = layer_inputs(gqa)
    _, cache = stream(gqa, "xquant:bits=16,group_size=8", x, prefill=20)
    for h in handles:
        h.remove()
    for i, layer in enumerate(cache.layers):
        attn = layer.attn
        U_k, U_v = layer.down[:, :32], layer.down[:, 32:]                       # (hidden, r) each, r = 32
        assert torch.allclose(U_k @ layer.up_k, attn.k_proj.weight.T, atol=1e-5)   # W_k = U_k (Σ_k B_kᵀ)
        assert torch.allclose(U_v @ layer.up_v, attn.v_proj.weight.T, atol=1e-5)
        assert torch.allclose(U_k.T @ U_k, torch.eye(32), atol=1e-5)
        X = torch.cat(seen[i], dim=1)
        assert torch.allclose(layer.store.codecs["k"].rows[:, :T], X @ U_k, atol=1e-6)
        assert torch.allclose(layer.store.codecs["v"].rows[:, :T], X @ U_v, atol=1e-6)
    # two 32-wide latents: exactly the room of K and V
    assert cache.nbytes() == 4 * 2 * T * 2 * 32 * 4


@torch.no_grad()
def test_outlier_channel_keeps_the_first_latent_channel_exact(gqa):
    x = tokens()
    seen, handles = layer_inputs(gqa)
    _, cache = stream(gqa, "xquant:bits=2,group_size=16,outlier_channel=true", x, prefill=20)
    for h in handles:
        h.remove()
    layer = cache.layers[1]
    k_store = layer.store.codecs["k"]
    latent = (torch.cat(seen[1], dim=1) @ layer.down[:, :32])                 # X U_k (B, T, 32)
    assert k_store.coded == 31 and torch.allclose(k_store.first[:, :T, 0], latent[..., 0], atol=1e-6)
    want = quantize(latent[..., 1:], 2, 16, axis=-2)                            # channels 1.., per channel
    assert torch.allclose(k_store.held(T).dequantize(), want.dequantize(), atol=1e-5)
    assert layer.nbytes() == layer.formula_nbytes(T)


# ---- lossy: simulated mode equals token-by-token decoding ----------------------------------------------
LOSSY = ["xquant:bits=2,group_size=8,residual=8", "xquant:bits=3,group_size=16",
         "xquant-cl:bits=2,high_layers=2,base_layer=1,group_size=16",
         "xquant-cl:bits=3,high_bits=8,high_layers=1,base_layer=0,group_size=16"]


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("arch", ["mha", "gqa"])
@torch.no_grad()
def test_simulated_equals_token_by_token_decode(request, arch, spec):
    model = request.getfixturevalue(arch)
    x = tokens(seed=1)
    streamed, cache = stream(model, spec, x)
    simulated = model(x, model.new_cache(spec, 2, T, mode="simulated"))
    reference, _ = stream(model, "fp16", x)
    assert (simulated - streamed).abs().max() < 1e-4
    assert (streamed - reference).abs().max() > 1e-3                         # it is lossy
    assert all(layer.nbytes() == layer.formula_nbytes(T) for layer in cache.layers)


# ---- XQuant-CL: the accumulator recurrence ------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mha", "gqa"])
@torch.no_grad()
def test_cl_caches_quantized_deltas_against_the_accumulator(request, arch):
    """Layer 1 is the base (X̂_1 = Q4(X_1)); layers 2-3 cache Q2((X_i - X̂_{i-1}) U_kv) and X̂_i adds it back."""
    model = request.getfixturevalue(arch)
    x = tokens(seed=2)
    seen, handles = layer_inputs(model)
    cache = model.new_cache("xquant-cl:bits=2,high_layers=0,base_layer=1,group_size=16", 2, T)
    model(x, cache)
    for h in handles:
        h.remove()
    layers = cache.layers
    assert [layer.role for layer in layers] == ["xquant", "base", "delta", "delta"]
    assert [layer.bits for layer in layers] == [2, 4, 2, 2]
    assert all(layer._acc is None for layer in layers)                        # handed on, then dropped
    X = [seen[i][0] for i in range(4)]
    base = quantize(X[1], 4, 16)
    assert torch.equal(layers[1].store.codecs["x"].codes[:, :T], base.codes)
    acc = dequantize(base)
    for i in (2, 3):
        U = layers[i].down if arch == "gqa" else torch.eye(64)                # GQA: U_kv, r_kv = min(64, 2 * 32)
        delta = quantize((X[i].float() - acc) @ U, 2, 16)
        assert torch.equal(layers[i].store.codecs["x"].codes[:, :T], delta.codes)
        acc = acc + dequantize(delta) @ U.T


@torch.no_grad()
def test_cl_gqa_latent_is_narrower_than_x(tmp_path):
    """SVD of [W_k | W_v] (64 x 2*16): the deltas are cached 32 wide, not 64."""
    model = load_weights(tiny_llama(tmp_path, num_key_value_heads=1, num_hidden_layers=3))
    cache = model.new_cache("xquant-cl:bits=16,high_bits=16,base_layer=0", 2, T)
    assert [tuple(layer.store.codecs["x"].rows.shape) for layer in cache.layers] == [(2, T, 64), (2, T, 32), (2, T, 32)]
    x = tokens()
    reference, _ = stream(model, "fp16", x, prefill=20)
    ours, _ = stream(model, "xquant-cl:bits=16,high_bits=16,base_layer=0", x, prefill=20)
    assert (ours - reference).abs().max() < 1e-5


# ---- the fused rematerialization kernel on the decode path ------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("axis, first", [(-2, False), (-2, True), (-1, False)])
def test_fused_rematerialize_equals_torch_path(bits, axis, first):
    """What the cache does on a GPU (dequant_matmul, here under the interpreter) equals its torch path:
    X U_k per channel (with or without the exact first channel), X U_v per token, r = 192 as SmolLM2."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(bits)
    z = torch.randn(2, 64, 192, generator=gen).to(KERNEL_DEVICE)
    up = torch.randn(192, 96, generator=gen).to(KERNEL_DEVICE)
    q = quantize(z[..., 1:] if first else z, bits, 32 if axis == -2 else 64 if not first else 191, axis=axis)
    head = z[..., :1] if first else None
    fused = rematerialize(q, head, up, fused=True)
    assert torch.allclose(fused, rematerialize(q, head, up, fused=False), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cache takes the fused path on CUDA tensors")
@torch.no_grad()
def test_cuda_decode_uses_the_kernel(tmp_path, monkeypatch):
    """On a GPU every packed latent goes through dequant_matmul; swapping in its torch reference changes
    the logits only by rounding."""
    from kvzoo.kernels import xquant_remat

    model = load_weights(tiny_llama(tmp_path, num_hidden_layers=3)).cuda()
    x = tokens().cuda()
    spec = "xquant:bits=4,group_size=16,outlier_channel=true"
    calls = []

    kernel = xquant_remat.dequant_matmul

    def counting(q, weight):
        calls.append(q.bits)
        return kernel(q, weight)

    monkeypatch.setattr(xquant_remat, "dequant_matmul", counting)
    fused, _ = stream(model, spec, x, prefill=20)
    assert calls
    monkeypatch.setattr(xquant_remat, "dequant_matmul", xquant_remat.dequant_matmul_ref)
    reference, _ = stream(model, spec, x, prefill=20)
    assert torch.allclose(fused, reference, rtol=1e-3, atol=1e-3)


# ---- storage and bytes --------------------------------------------------------------------------------
def test_quantized_once_whatever_the_chunking():
    cache = smollm_shaped_layer_cache("xquant:bits=3,group_size=32,residual=64", 400, dtype=torch.float32)
    x = torch.randn(1, 400, 576, generator=torch.Generator().manual_seed(0))
    start, latents = 0, []
    for size in (1, 37, 5, 90, 1, 1, 66, 150, 49):
        cache.length = cache.store.append(cache.length, cache._rows(x[:, start:start + size]))
        latents.append(x[:, start:start + size] @ cache.down)               # X [U_k | U_v], as the cache does
        start += size
    # X U_k per channel: whole groups of 32 beyond the R = 64 window; X U_v per token: exactly R exact
    n_k, n_v = cache.window.quantized(cache.length), cache.value_window.quantized(cache.length)
    assert (n_k, n_v) == ((400 - 64) // 32 * 32, 400 - 64)
    z = torch.cat(latents, dim=1)                                            # (1, 400, 2 * 192)
    k_codes, v_codes = cache.store.codecs["k"].held(n_k), cache.store.codecs["v"].held(n_v)
    assert torch.equal(k_codes.codes, quantize(z[:, :n_k, :192], 3, 32, axis=-2).codes)     # per channel
    assert torch.equal(v_codes.codes, quantize(z[:, :n_v, 192:], 3, 32, axis=-1).codes)     # per token, Gt = 32
    assert torch.allclose(cache.store.recent_rows("v", cache.length), z[:, n_v:, 192:], atol=1e-5)
    assert torch.allclose(cache.store.recent_rows("k", cache.length), z[:, n_k:, :192], atol=1e-5)


@pytest.mark.parametrize("bits, per_token", [(4, 206), (3, 158), (2, 110)])
def test_smollm_bytes_per_token_at_2048(bits, per_token):
    """X U_k: 192*b/8 codes + 192 fp16 scale/zero pairs per 128 tokens; X U_v: 192*b/8 + 2 pairs of 96."""
    cache = smollm_shaped_layer_cache(f"xquant:bits={bits}", 2048)
    cache.length = cache.store.append(0, cache._rows(torch.randn(1, 2048, 576, dtype=torch.float16)))
    assert cache.window.quantized(cache.length) == 2048
    assert cache.nbytes() == cache.formula_nbytes(2048) == 2048 * per_token
    codes = cache.store.codecs["k"].codes
    assert codes.dtype == torch.int32 and codes.shape[-1] == 192 * bits // 32


def test_outlier_channel_bytes():
    cache = smollm_shaped_layer_cache("xquant:bits=4,outlier_channel=true", 2048)
    cache.length = cache.store.append(0, cache._rows(torch.randn(1, 2048, 576, dtype=torch.float16)))
    # channels 1..191: 24 words (191 codes padded to 192) + 191 pairs per 128 tokens, + channel 0 in fp16
    assert cache.nbytes() == cache.formula_nbytes(2048) == 2048 * (96 + 2 + 104) + 191 * 16 * 4


@pytest.fixture(scope="module")
def smollm_shaped():
    """SmolLM2-135M's attention shapes over all 30 layers (random weights, tiny MLP and vocabulary)."""
    torch.manual_seed(0)
    return Transformer(ModelConfig(**(SMOLLM_ATTENTION | {"n_layers": 30})))


@pytest.mark.parametrize("spec, per_token", [
    ("xquant", 30 * 206),
    ("xquant:bits=2", 30 * 110),
    ("xquant:bits=2,high_layers=3", 3 * 206 + 27 * 110),     # Table 4's rule: the first 3 layers at 4 bits
    ("xquant-cl", 2 * 206 + 312 + 27 * 156),        # layers 0-1 XQuant 4-bit, base 2 (576 wide, 4-bit), 3-bit deltas
    ("xquant-cl:bits=2", 2 * 206 + 312 + 27 * 108),
])
@torch.no_grad()
def test_smollm_ratio_to_fp16_at_2048(smollm_shaped, spec, per_token):
    cache = smollm_shaped.new_cache(spec, batch_size=1, max_len=2048)
    smollm_shaped(torch.randint(0, 64, (1, 2048)), cache)
    assert cache.nbytes() == sum(layer.formula_nbytes(2048) for layer in cache.layers) == 2048 * per_token
    assert cache.nbytes() / fp16_kv_nbytes(30, 3, 64, 2048) == pytest.approx(per_token / 23040)


@torch.no_grad()
def test_kivi_first_layers_at_high_bits(smollm_shaped):
    """KIVI* of Table 4: layers 0-2 hold 4-bit codes (8 words per 64-wide head), the rest 2-bit (4 words)."""
    cache = smollm_shaped.new_cache("kivi-pre:bits=2,high_layers=3", batch_size=1, max_len=256)
    smollm_shaped(torch.randint(0, 64, (1, 256)), cache)
    assert [layer.store.codecs["k"].codes.shape[-1] for layer in cache.layers] == [8] * 3 + [4] * 27
    assert all(layer.nbytes() == layer.formula_nbytes(256) for layer in cache.layers)


@torch.no_grad()
def test_bf16_model_keeps_rows_in_bf16(tmp_path):
    model = load_weights(tiny_llama(tmp_path, num_hidden_layers=3), dtype="bfloat16")
    x = tokens()
    for spec in ("xquant:bits=4,group_size=16", "xquant-cl:bits=3,base_layer=1,high_layers=1,group_size=16"):
        logits, cache = stream(model, spec, x, prefill=20)
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
        assert cache.layers[0].nbytes() == cache.layers[0].formula_nbytes(T)
    assert cache.layers[0].plain.store.recent("k").dtype == torch.bfloat16


@torch.no_grad()
def test_up_projections_at_the_models_dtype_or_fp32(tmp_path):
    """up_dtype=model (the default) holds U and Σ Bᵀ as the model holds W_k, W_v; float32 keeps the SVD's fp32. In a
    bf16 model the two give the same logits within bf16 rounding; an fp32 model holds fp32 either way."""
    model = load_weights(tiny_llama(tmp_path, num_hidden_layers=3), dtype="bfloat16")
    x = tokens()
    logits = {}
    for up in ("model", "float32"):
        out, cache = stream(model, f"xquant:bits=4,group_size=16,up_dtype={up}", x, prefill=20)
        assert {t.dtype for layer in cache.layers for t in (layer.down, layer.up_k, layer.up_v)} == \
            {torch.bfloat16 if up == "model" else torch.float32}
        logits[up] = out.float()
    assert (logits["model"] - logits["float32"]).abs().max() < 0.05 * logits["float32"].abs().max()
    fp32 = load_weights(tiny_llama(tmp_path / "fp32", num_hidden_layers=1))
    assert fp32.new_cache("xquant", 1, 16).layers[0].up_k.dtype == torch.float32
    for up in ("model", "float32"):                  # XQuant-CL: U_kv of its GQA deltas, and its plain layers
        out, cache = stream(model, f"xquant-cl:bits=3,base_layer=1,high_layers=1,group_size=16,up_dtype={up}", x,
                            prefill=20)
        want = torch.bfloat16 if up == "model" else torch.float32
        assert cache.layers[0].plain.up_k.dtype == want
        assert cache.layers[2].down.dtype == cache.layers[2].up.dtype == want          # layer 2: a GQA delta
        logits[f"cl-{up}"] = out.float()
    assert (logits["cl-model"] - logits["cl-float32"]).abs().max() < 0.05 * logits["cl-float32"].abs().max()


# ---- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("xquant:bits=5", r"unsupported bits=5; accepted: 2, 3, 4, 8, or 16 \(no quantization"),
    ("xquant:residual=100", "residual must be a non-negative multiple of group_size 128, got 100"),
    ("xquant:group_size=0", "group_size must be >= 1, got 0"),
    ("xquant:outlier_channel=maybe", "outlier_channel='maybe' is not a valid bool"),
    ("xquant:window=4", "cache 'xquant' has no option window; accepted options: bits, group_size, residual, "
                        "outlier_channel, high_layers, high_bits"),
    ("xquant:high_bits=7", "unsupported high_bits=7"),
    ("xquant:up_dtype=half", "unknown up_dtype 'half'; accepted: model, float32"),
    ("xquant-cl:up_dtype=fp8", "unknown up_dtype 'fp8'; accepted: model, float32"),
    ("kivi:high_bits=7", "unsupported bit width 7"),
    ("kivi-pre:high_layers=-1", "high_layers must be >= 0, got -1"),
    ("xquant-cl:high_bits=1", "unsupported high_bits=1; accepted: 2, 3, 4, 8, or 16"),
    ("xquant-cl:base_layer=-1", "base_layer must be >= 0"),
    ("xquant-cl:high_layers=-2", "high_layers must be >= 0, got -2"),
])
def test_bad_options(text, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec.parse(text)


def test_outlier_channel_needs_a_gqa_model(mha):
    with pytest.raises(ValueError, match="outlier_channel applies to GQA models.*this model is MHA"):
        mha.new_cache("xquant:outlier_channel=true", 1, 16)


@torch.no_grad()
def test_base_layer_beyond_the_model(mha):
    cache = mha.new_cache("xquant-cl:base_layer=4", 1, 16)
    with pytest.raises(ValueError, match="base_layer=4 is not a layer of this 4-layer model; accepted: 0 to 3"):
        mha(tokens(batch=1, length=4), cache)


@pytest.mark.parametrize("n_kv,rep", [(1, 1), (2, 3), (3, 4)])
def test_weighed_attention_equals_attention_over_rematerialized_values(n_kv, rep):
    """The static step's attention, values weighed from their latent rows then projected per head, equals softmax
    attention over V = rows · up_v with the token's exact value last and masked rows ignored."""
    from types import SimpleNamespace

    from kvzoo.cache.xquant import heads, weigh_rows, weighed_attention
    from kvzoo.models.llama import RotaryEmbedding

    g = torch.Generator().manual_seed(n_kv * 10 + rep)
    B, K, c, d = 2, 24, 40, 16
    q = torch.randn(B, n_kv * rep, 1, d, generator=g)
    keys = heads(torch.randn(B, K, n_kv * d, generator=g), n_kv, torch.float32)      # a view, as the step holds it
    rope = RotaryEmbedding(SimpleNamespace(head_dim=d, rope_theta=10000.0, rope_scaling=None))
    tables = rope.cos_sin(torch.randint(0, 5000, (B, K), generator=g), torch.float32)  # the keys' positions
    rows = torch.randn(B, K, c, generator=g)
    rows[:, -1] = 0                                                                  # the token's row
    up_v = torch.randn(c, n_kv * d, generator=g)
    v = torch.randn(B, n_kv, 1, d, generator=g)
    live = torch.rand(B, 1, 1, K, generator=g) > 0.3
    live[..., -1] = True
    bias = torch.zeros(B, 1, 1, K).masked_fill(~live, float("-inf"))
    values = heads(rows @ up_v, n_kv, torch.float32).clone()                         # (B, n_kv, K, d)
    values[:, :, -1:] = v
    rotated = rope.apply_tables(keys, *tables)
    q_tables = rope.cos_sin(torch.randint(0, 5000, (B, 1), generator=g), torch.float32)
    want = torch.nn.functional.scaled_dot_product_attention(rope.apply_tables(q, *q_tables), rotated, values,
                                                            attn_mask=live, enable_gqa=rep > 1)
    got = weighed_attention(q, q_tables, keys, tables, bias, weigh_rows(rows), up_v, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
