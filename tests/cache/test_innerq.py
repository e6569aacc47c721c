"""InnerQ: inner-dimension layout, hybrid modes, windows, key normalization, options."""

import pytest
import torch

from kvzoo.cache.base import CacheSpec
from kvzoo.cache.kvquant import dequantize_unified, quantize_unified
from tests.cache.test_kivi import smollm_shaped_layer_cache, store



def test_paper_defaults():
    assert str(CacheSpec.parse("innerq")) == \
        "innerq:bits=2,group_size=32,sink=32,recent=96,quant_mode=hybrid,key_norm=True,tie_norm=False," \
        "policy=reference,outer=False,fused=True"


def test_ratio_at_2048_tokens_matches_formula():
    cache = smollm_shaped_layer_cache("innerq:key_norm=false", 2048)
    k, v = torch.randn(2, 1, 3, 2048, 64, dtype=torch.float16)
    store(cache, k, v)
    # 1920 quantized tokens at 56.5 B (codes 32 + scale/slot 24 + mask 0.5) + 128 exact tokens at 256 B
    assert cache.window.quantized(cache.length) == 1920
    assert cache.nbytes() == cache.formula_nbytes(2048) == round(3 * (1920 * 56.5 + 128 * 256))


def test_inner_layout_groups_keys_per_token_and_values_per_channel():
    cache = smollm_shaped_layer_cache("innerq:sink=0,recent=0,quant_mode=asym,key_norm=false", 64, torch.float32)
    k, v = torch.randn(2, 1, 3, 64, 64)
    store(cache, k, v)
    got_k, got_v = (cache.store.codecs[name].read(64, torch.float32) for name in "kv")
    assert torch.equal(got_k, dequantize_unified(quantize_unified(k, 2, -1, "asym")))
    assert torch.equal(got_v, dequantize_unified(quantize_unified(v, 2, -2, "asym")))
    assert cache.store.codecs["k"].scale.shape[-2:] == (64, 2) and cache.store.codecs["v"].scale.shape[-2:] == (2, 64)
    outer = smollm_shaped_layer_cache("innerq:sink=0,recent=0,quant_mode=asym,key_norm=false,outer=true", 64,
                                      torch.float32)
    store(outer, k, v)
    assert torch.equal(outer.store.codecs["k"].read(64, torch.float32), dequantize_unified(quantize_unified(k, 2, -2, "asym")))


@pytest.mark.parametrize("mode", ["sym", "hybrid"])
def test_read_equals_the_unified_dequantization_with_sign_groups(mode):
    """A codec's read (signs flipped into the codes, scaled in place) equals dequantize_unified, the quantizer's
    reference, for symmetric groups along either axis."""
    for spec, axis in ((f"innerq:sink=0,recent=0,quant_mode={mode},key_norm=false", -1),
                       (f"innerq:sink=0,recent=0,quant_mode={mode},key_norm=false,outer=true", -2)):
        cache = smollm_shaped_layer_cache(spec, 64, torch.float32)
        k, v = torch.randn(2, 1, 3, 64, 64, generator=torch.Generator().manual_seed(6))
        store(cache, k, v)
        want = dequantize_unified(quantize_unified(k, 2, axis, mode))
        assert torch.equal(cache.store.codecs["k"].read(64, torch.float32), want)


def test_hybrid_picks_the_lower_error_per_group():
    x = torch.cat([torch.rand(1, 32) + 2.0, torch.randn(1, 32)], dim=0)    # an all-positive group, a centred one
    errors = {mode: (dequantize_unified(quantize_unified(x, 2, -1, mode)) - x).square().sum(-1)
              for mode in ("asym", "sym", "hybrid")}
    assert torch.all(errors["hybrid"] <= torch.minimum(errors["asym"], errors["sym"]) + 1e-6)
    assert quantize_unified(x, 2, -1, "hybrid").sym.tolist() == [[False], [True]]


def test_hybrid_prefill_masks_only_the_prompt():
    cache = smollm_shaped_layer_cache("innerq:sink=0,recent=32,quant_mode=hybrid_prefill,key_norm=false", 256, torch.float32)
    k, v = torch.randn(2, 1, 3, 256, 64)
    codecs = cache.store.codecs.values()
    for codec in codecs:
        codec.first_call = True
    store(cache, k[:, :, :128], v[:, :, :128])          # the prompt: 96 tokens quantized with hybrid groups
    for codec in codecs:
        codec.first_call = False
    store(cache, k[:, :, 128:], v[:, :, 128:])          # decode: later groups symmetric, no mask bits
    assert cache.store.codecs["k"].first_call_q == 96 and cache.window.quantized(cache.length) == 224
    sym = cache.store.codecs["k"].held(224).sym
    assert sym[:, :, 96:].all()
    assert cache.nbytes() == cache.formula_nbytes(256)
    hybrid = smollm_shaped_layer_cache("innerq:sink=0,recent=32,key_norm=false", 256, torch.float32)
    store(hybrid, k, v)
    assert hybrid.nbytes() - cache.nbytes() == 3 * (224 - 96) * 64 // 128      # the mask bits saved


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_key_normalization_per_channel_from_the_prompt_stores_normalized_keys(tie):
    """norm = sqrt(max |K|) per channel of the prompt's post-RoPE keys (tie_norm: the larger of each RoPE pair)."""
    cache = smollm_shaped_layer_cache(f"innerq:sink=0,recent=32,tie_norm={tie}", 128, torch.float32)
    attn = cache.attn
    from kvzoo.cache.base import Positions
    x = torch.randn(1, 40, 576)
    q, k, v = attn.qkv(x)
    pos = Positions.make(0, 40, torch.zeros(1, dtype=torch.long), None, has_pad=False)
    cache.prefill(x, q, k, v, pos)
    _, k_rot = attn.rope(q, k, pos.ids)
    peak = k_rot.abs().amax(dim=2, keepdim=True)
    if tie:
        peak = torch.maximum(peak[..., :32], peak[..., 32:]).repeat(1, 1, 1, 2)
    assert torch.allclose(cache.norm, peak.sqrt())
    keys = cache.store.read(cache.length, k_rot.dtype)["k"]
    assert torch.allclose(keys[:, :, 8:], (k_rot / cache.norm)[:, :, 8:])       # exactly the 32 newest keys exact


def test_reference_windows_keep_exactly_recent_keys():
    """Algorithms 1 and 2: exactly w_recent keys exact (a key quantized alone as it leaves), values a group of 32
    tokens at a time; `grouped` flushes keys like values."""
    cache = smollm_shaped_layer_cache("innerq:sink=32,recent=96,key_norm=false", 512, torch.float32)
    k, v = torch.randn(2, 1, 3, 300, 64)
    store(cache, k, v)
    assert cache.store.counts(300, "k") == (32, 300 - 32 - 96, 96)
    assert cache.store.counts(300, "v") == (32, (300 - 32 - 96) // 32 * 32, 300 - 32 - (300 - 32 - 96) // 32 * 32)
    assert cache.nbytes() == cache.formula_nbytes(300)
    grouped = smollm_shaped_layer_cache("innerq:sink=32,recent=96,key_norm=false,policy=grouped", 512, torch.float32)
    store(grouped, k, v)
    assert grouped.store.counts(300, "k") == grouped.store.counts(300, "v") == cache.store.counts(300, "v")


def test_key_mask_bits_written_a_token_at_a_time_equal_one_write():
    """Keys quantized one at a time (the reference window) pack their hybrid mask bits as one write would."""
    k, v = torch.randn(2, 1, 3, 100, 64)
    one = smollm_shaped_layer_cache("innerq:sink=0,recent=0,key_norm=false", 128, torch.float32)
    store(one, k, v)
    many = smollm_shaped_layer_cache("innerq:sink=0,recent=0,key_norm=false", 128, torch.float32)
    for t in range(100):
        store(many, k[:, :, t:t + 1], v[:, :, t:t + 1])
    a, b = one.store.codecs["k"], many.store.codecs["k"]
    assert torch.equal(a.mask, b.mask) and torch.equal(a.codes, b.codes)
    assert torch.equal(a.read(100, torch.float32), b.read(100, torch.float32))
    assert torch.equal(a.read(100, torch.float32, start=37), a.read(100, torch.float32)[:, :, 37:])


@pytest.mark.parametrize("mode", ["asym", "sym", "hybrid", "hybrid_prefill"])
def test_device_slot_writes_and_reads_equal_the_host_ones(mode):
    """The static step's write_at (keys a token at a time, values 32 at a time, at device-held slots) stores what
    the host's write stores, mask bits included, and read_at (keys at a device-held slot) reads what read does."""
    k, v = torch.randn(2, 1, 3, 96, 64, generator=torch.Generator().manual_seed(9))
    spec = f"innerq:sink=0,recent=0,key_norm=false,quant_mode={mode}"
    host, dev = (smollm_shaped_layer_cache(spec, 128, torch.float32) for _ in range(2))
    for cache in (host, dev):                    # the prompt: hybrid_prefill's groups with mask bits
        for codec in cache.store.codecs.values():
            codec.first_call = True
        cache.store.codecs["k"].write(0, 32, k[:, :, :32])
        cache.store.codecs["v"].write(0, 32, v[:, :, :32])
        for codec in cache.store.codecs.values():
            codec.first_call = False
    host.store.codecs["k"].write(32, 96, k[:, :, 32:])
    host.store.codecs["v"].write(32, 96, v[:, :, 32:])
    for t in range(32, 96):
        dev.store.codecs["k"].write_at(torch.tensor([t]), k[:, :, t:t + 1])
    for t in (32, 64):
        dev.store.codecs["v"].write_at(torch.tensor([t]), v[:, :, t:t + 32])
    for name in "kv":                # hybrid_prefill's later groups are symmetric whatever bits their words hold
        a, b = host.store.codecs[name], dev.store.codecs[name]
        for buf in ("codes", "scale", "slot") + (("mask",) if mode == "hybrid" else ()):
            assert torch.equal(getattr(a, buf), getattr(b, buf)), (name, buf)
        assert torch.equal(a.read(96, torch.float32), b.read(96, torch.float32))
    keys = host.store.codecs["k"]
    for start in (0, 37, 90):
        got = keys.read_at(torch.tensor([start]), 6, torch.float32)
        want = keys.read(min(start + 6, 96), torch.float32, start)
        assert torch.equal(got[:, :, :want.shape[2]], want)
    with pytest.raises(ValueError, match="written 32 tokens at a time, got 8"):
        dev.store.codecs["v"].write_at(torch.tensor([0]), v[:, :, :8])


@pytest.mark.parametrize("text, message", [
    ("innerq:group_size=64", "innerq group_size must be 32"),
    ("innerq:quant_mode=fancy", "unknown innerq quant_mode 'fancy'; accepted: asym, sym, hybrid, hybrid_prefill"),
    ("innerq:recent=100", "recent must be a non-negative multiple of 32"),
    ("innerq:bits=1", "unsupported bit width 1"),
    ("innerq:key_norm=maybe", "key_norm='maybe' is not a valid bool"),
])
def test_bad_options(text, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec.parse(text)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused decode kernel needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", ["innerq", "innerq:quant_mode=asym,bits=4", "innerq:quant_mode=hybrid_prefill,sink=0",
                                  "innerq:policy=grouped"])
@torch.no_grad()
def test_fused_decode_matches_torch_decode_on_cuda(spec, dtype, tmp_path):
    """The model decoding through the fused kernel and through the torch path (fp16: its fast path, which
    dequantizes in fp32 and rounds once, as dequantize_unified does)."""
    from kvzoo.models.loader import load_weights
    from tests.tiny import tiny_llama

    model = load_weights(tiny_llama(tmp_path, head_dim=64, hidden_size=128), device="cuda").to(dtype)
    x = torch.randint(0, 97, (2, 200), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    outs = []
    for fused in ("true", "false"):
        cache = model.new_cache(f"{spec},fused={fused}" if ":" in spec else f"{spec}:fused={fused}", 2, 200)
        steps = [model(x[:, :150], cache)] + [model(x[:, t:t + 1], cache) for t in range(150, 200)]
        outs.append(torch.cat(steps, dim=1))
    scale = outs[1].float().abs().max().item()
    assert (outs[0].float() - outs[1].float()).abs().max() < (1e-3 if dtype == torch.float32 else 4 * 2 ** -10 * scale)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="the Gluon kernel runs on an H100 (sm_90)")
@pytest.mark.parametrize("spec", ["innerq", "innerq:quant_mode=asym", "innerq:quant_mode=hybrid_prefill"])
@torch.no_grad()
def test_hopper_kernel_decodes_as_the_triton_kernel(spec, monkeypatch):
    """The model decoding 2-bit InnerQ through the Gluon split kernel (kvzoo/kernels/innerq_hopper.py) and through
    the Triton one: the same logits within fp16 rounding, over enough quantized tokens for whole steps."""
    from kvzoo.config import ModelConfig
    from kvzoo.kernels import innerq_hopper
    from kvzoo.models.llama import Transformer

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 256,
                               "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 12,
                               "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048})
    torch.manual_seed(0)
    model = Transformer(cfg).cuda().half().eval()                 # random weights, SmolLM2's head shape (GQA 3)
    # 8 rows of 1,500 prompt tokens: about 42 groups of 32 quantized, 9 splits of them, whole steps of 4 groups
    x = torch.randint(0, 97, (8, 1560), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    calls = []
    run = innerq_hopper.split_partials
    monkeypatch.setattr(innerq_hopper, "split_partials", lambda *a: calls.append(1) or run(*a))
    outs = []
    for enabled in (True, False):
        monkeypatch.setattr(innerq_hopper, "ENABLED", enabled)
        cache, before = model.new_cache(spec, 8, 1560), len(calls)
        steps = [model(x[:, :1500], cache)] + [model(x[:, t:t + 1], cache) for t in range(1500, 1560)]
        outs.append(torch.cat(steps, dim=1).float())
        assert (len(calls) > before) == enabled
    scale = outs[1].abs().max().item()
    assert (outs[0] - outs[1]).abs().max() < 4 * 2 ** -10 * scale
