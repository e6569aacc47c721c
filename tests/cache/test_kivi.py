"""KIVI / KIVI*: storage, bytes, the residual window, options, and the embedded model end to end."""

import argparse

import pytest
import torch

from kvzoo.cache.base import CacheSpec
from kvzoo.cache.kvquant import quantize
from kvzoo.cli import add_model_args, parse_cache_args
from kvzoo.config import ModelConfig
from kvzoo.models.llama import Transformer

SMOLLM_ATTENTION = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=576, intermediate_size=64,
                        n_layers=1, n_heads=9, n_kv_heads=3, head_dim=64, max_position_embeddings=8192)


def smollm_shaped_layer_cache(spec: str, max_len: int, dtype=torch.float16):
    """One layer cache with SmolLM2-135M's attention shapes (3 KV heads of 64), no weights needed."""
    model = Transformer(ModelConfig(**SMOLLM_ATTENTION)).to(dtype)
    return model.new_cache(spec, batch_size=1, max_len=max_len).layers[0]


def store(cache, k, v):
    """Store k (as the strategy keeps keys) and v (B, H, T, d) through the layer's windowed store."""
    cache.length = cache.store.append(cache.length, {"k": k, "v": v})


@pytest.mark.parametrize("name", ["kivi", "kivi-pre"])
def test_kivi_2bit_ratio_at_2048_tokens_matches_formula(name):
    cache = smollm_shaped_layer_cache(f"{name}:bits=2,group_size=32,residual=128,policy=grouped", 2048)
    k, v = torch.randn(2, 1, 3, 2048, 64, dtype=torch.float16)
    store(cache, k, v)
    fp16_bytes = 2 * 3 * 64 * 2 * 2048
    # (1920 quantized tokens * 48 B + 128 residual tokens * 256 B) / (2048 * 256 B), per KV head
    assert cache.nbytes() == cache.formula_nbytes(2048) == 3 * (1920 * 48 + 128 * 256)
    assert cache.nbytes() / fp16_bytes == pytest.approx(0.23828125)
    # the authors' windows: 2048 keys quantized (the residual just flushed), 1920 values; per KV head, keys
    # 2048 * (16 B codes + 4 * 64 / 32 B scale/zero), values 1920 * 24 + 128 * 128 B
    reference = smollm_shaped_layer_cache(f"{name}:bits=2,group_size=32,residual=128", 2048)
    store(reference, k, v)
    assert reference.nbytes() == reference.formula_nbytes(2048) == 3 * (2048 * 24 + 1920 * 24 + 128 * 128)
    codes = cache.store.codecs["k"].codes
    assert codes.dtype == torch.int32 and codes.shape[-1] == 64 * 2 // 32


@pytest.mark.parametrize("spec", ["kivi:bits=2", "kivi-pre:bits=2", "squat", "kivi:bits=2,group_size=64"])
def test_head_strides_are_multiples_of_16_as_the_kernels_are_compiled_for(spec):
    """The outer kernels' head strides (codes, scales and zeros of both streams) are multiples of 16: the launcher
    specializes them and the Gluon kernel's loads vectorize on it, as scripts/compile_sm90.py compiles it (STRIDES).
    Capacities come in whole groups of 32 slots."""
    from kvzoo.kernels.quant_matvec import head_rows

    for max_len in (300, 777, 4096):
        codecs = smollm_shaped_layer_cache(spec, max_len).store.codecs
        assert sorted(codecs) == ["k", "v"]
        for codec in codecs.values():
            assert codec.capacity > 0 and codec.capacity % 32 == 0
            assert all(head_rows(t)[1] % 16 == 0 for t in (codec.codes, codec.scale, codec.zero))


@pytest.mark.parametrize("policy, n_k, n_v", [("reference", 400 // 64 * 64, 400 - 64),
                                              ("grouped", (400 - 64) // 32 * 32, (400 - 64) // 32 * 32)])
def test_storage_is_quantized_once_whatever_the_chunking(policy, n_k, n_v):
    """Appending in odd chunks stores exactly the codes of quantizing each finished group once. The authors'
    windows (reference): keys flushed R at a time, exactly R values exact; grouped: R..R+G-1 of both."""
    cache = smollm_shaped_layer_cache(f"kivi:bits=3,group_size=32,residual=64,policy={policy}", 400,
                                      dtype=torch.float32)
    k, v = torch.randn(2, 1, 3, 400, 64)
    start = 0
    for size in (1, 37, 5, 90, 1, 1, 66, 150, 49):
        store(cache, k[:, :, start:start + size], v[:, :, start:start + size])
        start += size
    assert start == cache.length == 400
    assert (cache.window.quantized(400), cache.value_window.quantized(400)) == (n_k, n_v)
    want_k = quantize(k[:, :, :n_k], 3, 32, axis=-2).dequantize()
    want_v = quantize(v[:, :, :n_v], 3, 32, axis=-1).dequantize()
    got_k, got_v = (cache.store.codecs[name].read(n, torch.float32) for name, n in (("k", n_k), ("v", n_v)))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(cache.store.recent_rows("k", 400), k[:, :, n_k:])     # the windows are exact
    assert torch.equal(cache.store.recent_rows("v", 400), v[:, :, n_v:])


@pytest.mark.parametrize("text, message", [
    ("kivi:bits=5", "unsupported bit width 5; accepted: 2, 3, 4, 8"),
    ("kivi:residual=100", "residual must be a non-negative multiple of group_size 32"),
    ("kivi:group_size=abc", "option group_size='abc' is not a valid int"),
    ("kivi:window=4", "cache 'kivi' has no option window; accepted options: bits, group_size, residual, sink"),
    ("kivi:policy=paper", "unknown window policy 'paper'; accepted: reference, grouped, none"),
])
def test_bad_options_name_what_is_accepted(text, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec.parse(text)


def test_group_size_must_fit_the_head_dimension():
    with pytest.raises(ValueError, match="group_size 24 must divide the head dimension 64"):
        smollm_shaped_layer_cache("kivi:group_size=24,residual=48", 128)


def test_cache_and_cache_opts_make_one_spec():
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--cache", "kivi:bits=4,group_size=32", "--cache-opts", "residual=64"])
    assert str(parse_cache_args(args)) == \
        "kivi:bits=4,group_size=32,residual=64,sink=0,high_layers=0,high_bits=4,policy=reference"
    args = parser.parse_args(["--cache", "kivi-pre", "--cache-opts", "bits=3,residual=96,policy=grouped"])
    assert str(parse_cache_args(args)) == \
        "kivi-pre:bits=3,group_size=32,residual=96,sink=0,high_layers=0,high_bits=4,policy=grouped"
    args = parser.parse_args(["--cache", "fp16", "--cache-opts", "bits=2"])
    with pytest.raises(ValueError, match="cache 'fp16' has no option bits"):
        parse_cache_args(args)


@torch.inference_mode()
def test_streaming_decode_after_long_prompt_holds_packed_storage(default_model_dir, wikitext_text):
    from kvzoo.models.loader import load_weights
    from kvzoo.tokenizer import Tokenizer

    model, tok = load_weights(default_model_dir), Tokenizer.from_pretrained(default_model_dir)
    ids = torch.tensor(tok.encode(wikitext_text[:20000])[:1280])[None]
    cache = model.new_cache("kivi:bits=2,group_size=32,residual=128,policy=grouped", batch_size=1, max_len=1280)
    model(ids[:, :1024], cache)
    for t in range(1024, 1280):
        logits = model(ids[:, t:t + 1], cache)
    assert torch.isfinite(logits).all()
    layer = cache.layers[0]
    assert layer.window.quantized(layer.length) == 1152 and cache.length == 1280
    assert cache.nbytes() == sum(layer.formula_nbytes(1280) for layer in cache.layers)
    # 1152 tokens in 2-bit codes + fp16 scales, 128 fp32 (the model's dtype) residual tokens
    assert cache.nbytes() == 30 * 3 * (1152 * 48 + 128 * 2 * 64 * 4)


def test_sink_window_keeps_the_first_tokens_exact():
    """KIVI+sink (InnerQ's baseline, 32/96): slots [0, 32) exact, then whole quantized groups, then the window."""
    cache = smollm_shaped_layer_cache("kivi:bits=2,group_size=32,residual=96,sink=32,policy=grouped", 400,
                                      dtype=torch.float32)
    k, v = torch.randn(2, 1, 3, 200, 64)
    store(cache, k[:, :, :10], v[:, :, :10])
    store(cache, k[:, :, 10:], v[:, :, 10:])
    assert cache.window.quantized(cache.length) == (200 - 32 - 96) // 32 * 32 == 64
    keys, values = cache.store.read(cache.length, k.dtype).values()
    assert torch.equal(keys[:, :, :32], k[:, :, :32]) and torch.equal(values[:, :, 96:], v[:, :, 96:])
    assert torch.equal(keys[:, :, 32:96], quantize(k[:, :, 32:96], 2, 32, axis=-2).dequantize())
    assert cache.nbytes() == cache.formula_nbytes(200) == 3 * (64 * 48 + 136 * 2 * 64 * 4)


# ---- decode through the outer-layout kernels (on CPU under the Triton interpreter) --------------------
# each quantizes at least one group during 40 decode steps after a 40-token prompt (a flush phase)
KERNEL_DECODE = ["kivi:bits=2,group_size=32,residual=32", "kivi:bits=4,group_size=32,residual=0,sink=4",
                 "squat:bits=2,group_size=32,residual=0,sink=2"]


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """A tiny GQA Llama: 4 query heads on 2 KV heads of 32 channels."""
    from kvzoo.models.loader import load_weights
    from tests.tiny import tiny_llama

    return load_weights(tiny_llama(tmp_path_factory.mktemp("tiny"), head_dim=32))


def greedy_logits(model, cache: str, prompts: torch.Tensor, steps: int, pad=None) -> torch.Tensor:
    """Logits of `steps` greedy eager decode steps after prefilling `prompts`."""
    from kvzoo.generate import prefill

    kv = model.new_cache(cache, prompts.shape[0], prompts.shape[1] + steps)
    token, logits = prefill(model, prompts, kv, pad).argmax(-1), []
    for _ in range(steps):
        logits.append(model(token[:, None], kv, pad=pad)[:, -1])
        token = logits[-1].argmax(-1)
    assert kv.layers[0].window.quantized(kv.length) > 0                      # the history was quantized, so the kernels read codes
    return torch.stack(logits, 1)


@pytest.mark.parametrize("cache", KERNEL_DECODE)
def test_decode_through_the_kernels_equals_the_torch_path(gqa_model, cache, monkeypatch):
    """Decode reading the quantized history through qk_outer / pv_outer gives the logits of the torch path
    (dequantize everything, SDPA), across group flushes out of the window: on a GPU (compiled kernels), or on
    CPU with the kernels forced under the interpreter."""
    from kvzoo.cache.kivi import KIVICache

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not kernels_on_cpu():
        pytest.skip("forces the kernels on CPU tensors, which needs the Triton interpreter")
    prompts = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(6)).to(device)
    model = gqa_model.to(device)
    try:
        monkeypatch.setattr(KIVICache, "_kernels_serve", lambda self, q, pos: False)
        torch_path = greedy_logits(model, cache, prompts, 40)
        used = []
        monkeypatch.setattr(KIVICache, "_kernels_serve", lambda self, q, pos: used.append(1) or self._kernels_fit(pos))
        kernels = greedy_logits(model, cache, prompts, 40)
    finally:
        model.to("cpu")
    assert len(used) == 40 * model.cfg.n_layers
    torch.testing.assert_close(kernels, torch_path, rtol=1e-4, atol=1e-4)


def test_kernel_decode_is_not_taken_where_it_does_not_fit(gqa_model):
    """KIVI*'s pre-RoPE keys, 3 bits and groups of 64 keep the torch path, in decode and for the whole step;
    decode also keeps it for padded rows (a mask) and CPU tensors."""
    from kvzoo.cache.base import Positions

    plain = Positions.make(50, 1, torch.zeros(1, dtype=torch.long), has_pad=False)
    for spec, fits in [("kivi", True), ("kivi-pre", False), ("kivi:bits=3", False),
                       ("kivi:group_size=64,residual=64", False)]:
        for policy in ("reference", "grouped"):
            layer = gqa_model.new_cache(spec + ("," if ":" in spec else ":") + f"policy={policy}", 1, 64).layers[0]
            layer.length = 50
            assert layer._kernel_layout() is fits, spec
            assert layer.can_decode_static(padded=True) is (fits and kernels_on_cpu()), spec
            assert not layer._kernels_serve(torch.zeros(1, 4, 1, 32), plain)            # CPU tensors: never
    layer = gqa_model.new_cache("kivi", 1, 64).layers[0]
    layer.length = 50
    assert not layer._kernels_serve(torch.zeros(1, 4, 1, 32), Positions.make(50, 1, torch.tensor([2])))


def kernels_on_cpu() -> bool:
    try:
        from kvzoo.kernels.quant_matvec import kernels_run_on
    except ImportError:              # no triton: no kernel runs anywhere
        return False
    return kernels_run_on(torch.device("cpu"))


# ---- the whole-step static decode (kvzoo/graphs.py; eager on CPU, the kernels under the interpreter) ----
# KIVI* and SQuat-pre store keys before RoPE: the fused kernel rotates the quantized ones, the step the sink's and
# the key window's (the eager torch decode dequantizes and rotates every key)
PRE_ROPE_STATIC = ["kivi-pre:bits=4,group_size=32,residual=32,sink=3", "squat-pre:bits=2,group_size=32,residual=0,sink=2"]


@pytest.mark.parametrize("cache", KERNEL_DECODE + [KERNEL_DECODE[0] + ",policy=grouped"] + PRE_ROPE_STATIC)
def test_whole_step_equals_eager(gqa_model, cache):
    """decoder() picks the whole-step graph, and its steps equal the eager torch decode: 40 after a 2-token prompt
    of two rows (tokens joining the sink window, the first group of keys quantized inside the step) and 30 after a
    40-token one (groups leaving the residual window quantized at a device-held slot inside the step, the window
    moving down: every spec here quantizes its second group of keys at 64 to 68 tokens). With the authors' windows
    keys leave theirs R at a time and values one at a time: the fused kernel reads each slot's key and value from
    its own stream."""
    from tests.graphs.test_graphs import decode_both, whole_step_equals_eager

    if not kernels_on_cpu():
        pytest.skip("the static step runs the kernels, on CPU tensors only under the Triton interpreter")
    whole_step_equals_eager(gqa_model, cache)
    prompts = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(8))
    keys = gqa_model.new_cache(cache, 1, 70).layers[0].store.windows["k"]
    assert keys.quantized(40) < keys.quantized(68)                  # a group of keys leaves its window in the run
    eager, static = decode_both(gqa_model, prompts, None, steps=30, cache=cache)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


def test_whole_step_with_padding_and_sliding_window(gqa_model, tmp_path):
    """Padded rows and a Mistral's sliding window of 6 tokens: the step masks its keys with StaticStep.mask."""
    from kvzoo.graphs import GraphDecoder
    from kvzoo.models.loader import load_weights
    from tests.graphs.test_graphs import decode_both
    from tests.tiny import tiny_mistral

    if not kernels_on_cpu():
        pytest.skip("the static step runs the kernels, on CPU tensors only under the Triton interpreter")
    prompts = torch.randint(3, 97, (3, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([0, 4, 7])
    prompts[1, :4] = prompts[2, :7] = 0
    windowed = load_weights(tiny_mistral(tmp_path, head_dim=32))
    for m in (gqa_model, windowed):
        for cache in ("kivi:bits=2,group_size=32,residual=0,sink=2,policy=grouped",
                      "kivi:bits=2,group_size=32,residual=32,sink=2", "squat:bits=4,group_size=32,residual=0"):
            eager, static = decode_both(m, prompts, pad, steps=28, cache=cache, make=GraphDecoder)   # a flush at 32
            torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


def test_pre_rope_keeps_the_piecewise_step_where_the_mask_is_not_causal(gqa_model, tmp_path):
    """Padded rows, or a sliding window shorter than the cache: KIVI*'s keys would need RoPE in the masked path,
    which reads them with the unrotated outer kernels, so decoder() picks the piecewise step."""
    from kvzoo.generate import prefill
    from kvzoo.graphs import PiecewiseDecoder, decoder
    from kvzoo.models.loader import load_weights
    from tests.tiny import tiny_mistral

    if not kernels_on_cpu():
        pytest.skip("the static step runs the kernels, on CPU tensors only under the Triton interpreter")
    prompts = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([0, 4])
    kv = gqa_model.new_cache("kivi-pre", 2, 20)
    prefill(gqa_model, prompts, kv, pad)
    assert isinstance(decoder(gqa_model, kv, pad), PiecewiseDecoder)
    windowed = load_weights(tiny_mistral(tmp_path, head_dim=32))              # sliding window of 6 tokens
    kv = windowed.new_cache("kivi-pre", 2, 20)
    prefill(windowed, prompts, kv, None)
    assert isinstance(decoder(windowed, kv, None), PiecewiseDecoder)
