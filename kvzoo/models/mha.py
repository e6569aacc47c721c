"""Grouped-query attention turned into the equivalent multi-head attention, on the model's own weights.

Under GQA query head h reads KV head h // n_rep (n_rep = n_heads / n_kv_heads: SDPA's enable_gqa and
kvzoo.cache.base.attend_split's repeat_interleave). Repeating each KV head's rows of W_k and W_v n_rep times,
in that order, gives n_heads KV heads where KV head h is the old KV head h // n_rep: the model computes the
same function (logits equal up to float rounding), but its cache strategies now see an MHA model. What for:
XQuant's MHA path (kvzoo/cache/xquant.py: n_kv_heads == n_heads, X itself cached per token, no SVD latents)
can then run on real weights, e.g. the embedded SmolLM2-135M (9 query heads, 3 KV heads); `--mha` on the
command line (kvzoo/cli.py). The K/V cache of every other strategy grows n_rep times, as for a true MHA model.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from kvzoo.models.llama import Transformer


def repeat_kv_rows(t: Tensor, n_kv_heads: int, n_rep: int) -> Tensor:
    """Weight (n_kv*hd, hidden) or bias (n_kv*hd,) of k_proj/v_proj -> (n_kv*n_rep*hd, ...), each KV head's
    block of hd rows repeated n_rep times in place (head j -> heads j*n_rep .. j*n_rep + n_rep - 1)."""
    heads = t.reshape(n_kv_heads, t.shape[0] // n_kv_heads, *t.shape[1:])
    return heads.repeat_interleave(n_rep, dim=0).reshape(t.shape[0] * n_rep, *t.shape[1:])


@torch.no_grad()
def expand_to_mha(model: Transformer) -> Transformer:
    """Turn `model` (in place; also returned) into the MHA model computing the same function: every
    attention module's k_proj and v_proj get each KV head's rows (and bias, if any) repeated
    n_heads / n_kv_heads times, its n_kv_heads becomes n_heads, and model.cfg is replaced by a copy with
    n_kv_heads = n_heads. A model that is already MHA is returned unchanged. Caches built before the call
    (model.new_cache) hold the old shapes: build new ones. Refused (ValueError), before anything changes:
    n_heads not a multiple of n_kv_heads, k_proj/v_proj that are not plain nn.Linear (weight-quantized
    W4Linear: expand first, then quantize), or an attention module whose head counts disagree with the config."""
    cfg = model.cfg
    world = model.shard.world if model.shard is not None else 1      # a tensor-parallel rank holds 1/world
    if cfg.n_kv_heads == cfg.n_heads:
        return model
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"cannot expand to MHA: {cfg.n_heads} query heads are not a multiple of "
                         f"{cfg.n_kv_heads} KV heads")
    n_rep = cfg.n_heads // cfg.n_kv_heads
    attns = [block.attn for block in model.layers]
    for i, attn in enumerate(attns):
        if (attn.n_heads * world, attn.n_kv_heads * world, attn.head_dim) != (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim):
            raise ValueError(f"cannot expand to MHA: layer {i}'s attention has {attn.n_heads} query heads and "
                             f"{attn.n_kv_heads} KV heads of {attn.head_dim}, the config "
                             f"{cfg.n_heads} and {cfg.n_kv_heads} of {cfg.head_dim}")
        for name in ("k_proj", "v_proj"):
            lin = getattr(attn, name)
            if type(lin) is not nn.Linear:
                raise ValueError(f"cannot expand to MHA: layer {i}'s {name} is a {type(lin).__name__}, not a plain "
                                 "nn.Linear (expand before quantizing the weights)")
            if lin.out_features != attn.n_kv_heads * cfg.head_dim:
                raise ValueError(f"cannot expand to MHA: layer {i}'s {name} has {lin.out_features} outputs, "
                                 f"expected n_kv_heads * head_dim = {attn.n_kv_heads * cfg.head_dim}")

    for attn in attns:
        for name in ("k_proj", "v_proj"):
            lin = getattr(attn, name)
            lin.weight = nn.Parameter(repeat_kv_rows(lin.weight, attn.n_kv_heads, n_rep),
                                      requires_grad=lin.weight.requires_grad)
            if lin.bias is not None:
                lin.bias = nn.Parameter(repeat_kv_rows(lin.bias, attn.n_kv_heads, n_rep),
                                        requires_grad=lin.bias.requires_grad)
            lin.out_features = attn.n_heads * cfg.head_dim
        attn.n_kv_heads = attn.n_heads
    model.cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
    return model
