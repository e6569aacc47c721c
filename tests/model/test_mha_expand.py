"""expand_to_mha (kvzoo/models/mha.py): a GQA model turned into the MHA model that computes the same function,
on a tiny random Llama and on the embedded SmolLM2-135M; `--mha` on the command line; XQuant taking its MHA
path (X cached per token, no SVD latents) on the expanded model."""

import argparse
import copy
import dataclasses

import pytest
import torch

import kvzoo
from kvzoo.cache.base import fp16_kv_nbytes
from kvzoo.cache.kvquant import quantize
from kvzoo.cache.store import token_group
from kvzoo.cli import add_model_args, load_from_args
from kvzoo.generate import generate
from kvzoo.models.loader import load_weights
from kvzoo.models.mha import expand_to_mha
from tests.tiny import tiny_llama

T = 48


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """2 layers, 4 query heads sharing 2 KV heads of 16 (hidden 64)."""
    return tiny_llama(tmp_path_factory.mktemp("gqa"))


@pytest.fixture(scope="module")
def pair(tiny_dir):
    """(the GQA model, the same checkpoint expanded to MHA)."""
    return load_weights(tiny_dir), expand_to_mha(load_weights(tiny_dir))


def tokens(batch=2, length=T, seed=0):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


class IdTokenizer:
    """Prompts given as token ids; decode only feeds Generation.texts."""

    pad_id, eos_ids = 0, []

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_expanded_heads_and_weights(pair):
    gqa, mha = pair
    assert (gqa.cfg.n_heads, gqa.cfg.n_kv_heads) == (4, 2)
    assert mha.cfg.n_kv_heads == mha.cfg.n_heads == 4 and mha.cfg.n_rep == 1
    assert mha.cfg == dataclasses.replace(gqa.cfg, n_kv_heads=4)                    # nothing else changed
    for g, m in zip(gqa.layers, mha.layers):
        assert m.attn.n_kv_heads == m.attn.n_heads == 4
        for name in ("k_proj", "v_proj"):
            w_g, w_m = getattr(g.attn, name).weight, getattr(m.attn, name).weight
            assert w_m.shape == (64, 64) and getattr(m.attn, name).out_features == 64
            for h in range(4):                   # query head h read KV head h // 2: now it has its own copy
                assert torch.equal(w_m[16 * h:16 * (h + 1)], w_g[16 * (h // 2):16 * (h // 2 + 1)])
        assert torch.equal(m.attn.q_proj.weight, g.attn.q_proj.weight)


@torch.no_grad()
def test_expanded_logits_equal_gqa(pair):
    gqa, mha = pair
    x = tokens()
    assert (mha(x) - gqa(x)).abs().max() < 1e-5
    # through the fp16 cache too: prefill then token-by-token decode, with left padding
    pad = torch.tensor([0, 5])
    outs = []
    for model in pair:
        cache = model.new_cache("fp16", 2, T)
        outs.append(torch.cat([model(x[:, :20], cache, pad=pad)]
                              + [model(x[:, t:t + 1], cache, pad=pad) for t in range(20, T)], dim=1))
    assert (outs[0] - outs[1]).abs().max() < 1e-5


def test_fp16_cache_generation_gives_the_same_tokens(pair):
    gqa, mha = pair
    prompts = [[5, 9, 11, 40, 2, 7, 7, 13, 50, 51, 52], [8, 60, 61]]
    want = generate(gqa, IdTokenizer(), prompts, max_new_tokens=24, temperature=0, cache="fp16")
    got = generate(mha, IdTokenizer(), prompts, max_new_tokens=24, temperature=0, cache="fp16")
    assert got.tokens == want.tokens and len(got.tokens[0]) == 24
    assert got.cache_nbytes == 2 * want.cache_nbytes                    # twice the KV heads, as a true MHA model


def test_mha_is_a_no_op_and_refusals(tiny_dir, tmp_path):
    mha = load_weights(tiny_llama(tmp_path / "mha", num_key_value_heads=4))
    before = {k: v.clone() for k, v in mha.state_dict().items()}
    cfg = mha.cfg
    assert expand_to_mha(mha) is mha and mha.cfg is cfg
    assert all(torch.equal(before[k], v) for k, v in mha.state_dict().items())

    from kvzoo.weightquant.awq import quantize_rtn
    quantized = quantize_rtn(load_weights(tiny_dir), group_size=16)
    with pytest.raises(ValueError, match="k_proj is a W4Linear, not a plain nn.Linear"):
        expand_to_mha(quantized)
    assert quantized.cfg.n_kv_heads == 2 and quantized.layers[0].attn.n_kv_heads == 2     # nothing changed


# ---- XQuant: the MHA path on the expanded model ---------------------------------------------------------
@torch.no_grad()
def test_xquant_takes_the_mha_path(pair):
    gqa, mha = pair
    spec, bits, G = "xquant:bits=4,group_size=16", 4, 16
    x = tokens(seed=1)
    seen = {i: [] for i in range(len(mha.layers))}
    hooks = [block.attn.register_forward_pre_hook(lambda mod, args, i=i: seen[i].append(args[0]))
             for i, block in enumerate(mha.layers)]
    cache = mha.new_cache(spec, 2, T, mode="simulated")
    logits = mha(x, cache)
    for h in hooks:
        h.remove()
    hidden, Gt = 64, token_group(64, G)
    for i, layer in enumerate(cache.layers):
        assert not layer.gqa and list(layer.store.codecs) == ["x"] and not hasattr(layer, "down")
        codec = layer.store.codecs["x"]
        assert codec.width == hidden and not codec.per_channel
        n = layer.window.quantized(T)
        assert n == T                                    # reference policy, R = 0: every token quantized at once
        want = quantize(seen[i][0], bits, Gt, axis=-1)   # X itself, per token, groups of Gt channels
        assert torch.equal(codec.held(n).codes, want.codes)
    # one X stream of hidden channels per token and layer: b/8 bytes a channel + an fp16 scale/zero per group
    per_token = hidden * bits // 8 + 4 * hidden // Gt
    assert cache.nbytes() == sum(layer.formula_nbytes(T) for layer in cache.layers) == 2 * 2 * T * per_token
    # the MHA path is lossy but close, and still one function: at bits=16 it is the GQA model's fp16 cache
    reference = gqa(x, gqa.new_cache("fp16", 2, T))
    assert torch.isfinite(logits).all() and 1e-3 < (logits - reference).abs().max() < 1.0
    exact = mha(x, mha.new_cache("xquant:bits=16,group_size=16", 2, T, mode="simulated"))
    assert (exact - reference).abs().max() < 1e-5
    # against the GQA model's own path: SVD latents X U_k, X U_v of rank n_kv*hd = 32 each
    gqa_layer = gqa.new_cache(spec, 2, T, mode="simulated").layers[0]
    assert gqa_layer.gqa and set(gqa_layer.store.codecs) == {"k", "v"} and gqa_layer.up_k.shape[0] == 32
    assert cache.nbytes() / fp16_kv_nbytes(2, mha.cfg.n_kv_heads, 16, 2 * T) == pytest.approx(per_token / (4 * 64))


# ---- the command line --------------------------------------------------------------------------------
def test_cli_mha_flag(tiny_dir, monkeypatch):
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    assert "XQuant's MHA path" in parser.format_help()
    monkeypatch.setattr(kvzoo, "load_model", lambda model, **kw: (load_weights(model, kw["device"], kw["dtype"]), None))
    for flags, n_kv in (([], 2), (["--mha"], 4)):
        args = parser.parse_args(["--model", str(tiny_dir), "--device", "cpu", *flags])
        model, _ = load_from_args(args)
        assert model.cfg.n_kv_heads == n_kv and all(b.attn.n_kv_heads == n_kv for b in model.layers)


# ---- the embedded SmolLM2-135M (9 query heads, 3 KV heads) --------------------------------------------
@torch.no_grad()
def test_embedded_model_expanded_computes_the_same(default_model):
    model, tok = default_model                       # session fixture: read only, so expand a copy
    mha = expand_to_mha(copy.deepcopy(model))
    assert (model.cfg.n_heads, model.cfg.n_kv_heads) == (9, 3) and mha.cfg.n_kv_heads == 9
    assert mha.lm_head.weight is mha.embed.weight    # tied embeddings still tied
    x = torch.tensor([tok.encode("The capital of France is Paris, and the capital of Italy is")])
    assert (mha(x) - model(x)).abs().max() < 1e-4
    layer = mha.new_cache("xquant", 1, 64).layers[0]
    assert not layer.gqa and layer.store.codecs["x"].width == 576
