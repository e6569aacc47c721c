"""kvzoo's hand-written Llama/Mistral against Hugging Face transformers on tiny random configs.

Each config is built offline, saved with save_pretrained (safetensors) and loaded through kvzoo's own
loader, so the name table and config parsing are exercised too. fp32, max |delta logit| <= 1e-4 for a
full forward and for token-by-token decode through the fp16 cache.
"""

import pytest
import torch

from kvzoo.models.loader import load_weights

transformers = pytest.importorskip("transformers")   # the `test` extra

TOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-5)

CONFIGS = {
    "llama-mha-untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-gqa-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama3-rope-scaling": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                                                rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    "mistral-sliding-window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
                                                     tie_word_embeddings=False)),
}


def build(kind: str, extra: dict, tmp_path):
    torch.manual_seed(0)
    config = getattr(transformers, kind)(**BASE, **extra)
    config._attn_implementation = "eager"
    model_cls = transformers.LlamaForCausalLM if kind == "LlamaConfig" else transformers.MistralForCausalLM
    hf = model_cls(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf, load_weights(tmp_path)


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request, tmp_path_factory):
    kind, extra = CONFIGS[request.param]
    return build(kind, extra, tmp_path_factory.mktemp(request.param))


@torch.no_grad()
def test_full_forward_matches_hf(pair):
    hf, ours = pair
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = hf(tokens).logits
    assert (ours(tokens) - ref).abs().max() <= TOL


@torch.no_grad()
def test_cached_decode_matches_hf(pair):
    hf, ours = pair
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    ref = hf(tokens).logits
    cache = ours.new_cache("fp16", batch_size=2, max_len=24)
    steps = [ours(tokens[:, :5], cache)]                      # prefill 5, then one token at a time
    steps += [ours(tokens[:, t:t + 1], cache) for t in range(5, 24)]
    assert (torch.cat(steps, dim=1) - ref).abs().max() <= TOL


@torch.no_grad()
def test_chunked_prefill_matches_full(pair):
    hf, ours = pair
    tokens = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    cache = ours.new_cache("fp16", batch_size=1, max_len=30)
    chunks = [ours(tokens[:, s:s + 8], cache) for s in range(0, 30, 8)]
    assert (torch.cat(chunks, dim=1) - hf(tokens).logits).abs().max() <= TOL


@torch.no_grad()
def test_left_padded_batch_matches_single_rows(pair):
    """Rows of different lengths, left-padded into one batch, give each row's unbatched logits."""
    _, ours = pair
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 97, (n,), generator=gen) for n in (11, 4, 8)]
    width, new = max(len(r) for r in rows), 6
    pad = torch.tensor([width - len(r) for r in rows])
    batch = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    cont = torch.randint(0, 97, (3, new), generator=gen)
    cache = ours.new_cache("fp16", batch_size=3, max_len=width + new)
    out = [ours(batch, cache, pad=pad)] + [ours(cont[:, t:t + 1], cache, pad=pad) for t in range(new)]
    out = torch.cat(out, dim=1)
    for b, row in enumerate(rows):
        alone = ours(torch.cat([row, cont[b]])[None])[0]
        assert (out[b, pad[b]:] - alone).abs().max() <= TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_close_to_fp32(dtype, tmp_path):
    hf, _ = build(*CONFIGS["llama-gqa-tied"], tmp_path)
    ours = load_weights(tmp_path, dtype=dtype)
    assert ours.lm_head.weight is ours.embed.weight and ours.embed.weight.dtype == dtype
    tokens = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(5))
    cache = ours.new_cache("fp16", batch_size=1, max_len=16)
    logits = torch.cat([ours(tokens[:, :8], cache)] + [ours(tokens[:, t:t + 1], cache) for t in range(8, 16)], 1)
    assert logits.dtype == dtype and cache.layers[0].k.dtype == dtype
    assert (logits.float() - hf(tokens).logits).abs().max() < 0.05


def test_rope_apply_equals_rotate():
    """RotaryEmbedding.apply (stored keys, three passes in place) rotates as forward's rotate does."""
    from kvzoo.config import ModelConfig
    from kvzoo.models.llama import RotaryEmbedding

    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
                               "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 1,
                               "vocab_size": 97})
    rope = RotaryEmbedding(cfg)
    x = torch.randn(2, 2, 40, 32, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(40).expand(2, 40) + torch.tensor([[0], [7]])
    cos, sin = rope.cos_sin(ids, x.dtype)
    assert torch.allclose(rope.apply(x, ids), rope.rotate(x, cos, sin), atol=1e-6)


def test_rope_position_tables_are_made_once():
    """position_tables: cos_sin of positions 0 .. n-1 as (n, d) tables, kept and handed back while n, dtype and the
    frequencies stay the same, made again when one changes."""
    from types import SimpleNamespace

    from kvzoo.models.llama import RotaryEmbedding

    rope = RotaryEmbedding(SimpleNamespace(head_dim=32, rope_theta=10000.0, rope_scaling=None))
    cos, sin = rope.position_tables(50, torch.float16)
    want = rope.cos_sin(torch.arange(50)[None], torch.float16)
    assert cos.shape == (50, 32) and torch.equal(cos, want[0][0, 0]) and torch.equal(sin, want[1][0, 0])
    assert rope.position_tables(50, torch.float16)[0] is cos
    assert rope.position_tables(60, torch.float16)[0].shape == (60, 32)
    assert rope.position_tables(50, torch.float32)[0].dtype == torch.float32
    rope.inv_freq = rope.inv_freq * 2                    # new frequencies (a model loaded again): new tables
    assert not torch.equal(rope.position_tables(50, torch.float16)[0], cos)
