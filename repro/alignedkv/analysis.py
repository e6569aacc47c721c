"""AlignedKV, Figure 9 and Table 1 on real caches: bits read per element, and the error of QKᵀ and SV.

Tan et al., "AlignedKV" (../shared/papers/alignedkv.md), "Reduction in Bit Widths" and "Accuracy of GEMM
Result". One text is run once without a cache; every layer's post-RoPE queries, keys and values are kept
(fp16, the format AlignedKV reads). A decode step at context t is then replayed per layer: the query of
slot t reads keys/values [0, t] through kvzoo.cache.alignedkv's rules (complete blocks aligned, the block
being filled and the token itself exact), and is compared with
    exact          the fp16 keys/values, fp32 products
    truncated-13   every element read at 13 bits (its low 3 bits replaced by 100), the paper's baseline
The QKᵀ error uses the exact keys' softmax nowhere; the SV error uses the exact probabilities for both, so
each GEMM's error is its own. Relative error = |R - R_exact| / |R_exact| per result element, both rounded to fp16 (the GEMMs'
output format, as in the paper's fp16 kernels).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvzoo.cache.alignedkv import (estimate_output, exponent, fp16_bits, from_bits, key_levels, read_levels,
                                   value_levels)
from kvzoo.eval.capture import per_layer_attention

BUCKETS = (0.0, 1 / 1024, 1 / 512, 1 / 256, 1 / 128)     # Table 1: 0, (0, 1/1024), ..., [1/128, inf)
BUCKET_NAMES = ("0", "(0,1/1024)", "[1/1024,1/512)", "[1/512,1/256)", "[1/256,1/128)", "[1/128,inf)")


def capture_qkv(model, ids: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per layer: post-RoPE queries (Hq, T, d), keys and values (Hkv, T, d) as fp16, for ids (T,)."""
    def qkv(attn, x, pos):
        q, k, v = attn.qkv(x)                                        # (1, Hq, T, d), (1, Hkv, T, d) x2
        q, k = attn.rope(q, k, pos.ids)
        return q[0].half(), k[0].half(), v[0].half()

    return per_layer_attention(model, ids, qkv)


def truncate13(x: Tensor) -> Tensor:
    """fp16 x read at 13 bits: the low 3 bits replaced by 100."""
    return from_bits((fp16_bits(x) & 0xFFF8) | 0x4)


def bucket_counts(rel: Tensor) -> list[int]:
    """How many relative errors fall in each Table 1 bucket."""
    rel = rel.flatten()
    edges = torch.tensor(BUCKETS[1:], device=rel.device)
    nonzero = rel[rel > 0]
    return [int((rel == 0).sum())] + torch.bincount(torch.bucketize(nonzero, edges, right=True),
                                                    minlength=len(BUCKETS)).tolist()


def relative(r: Tensor, exact: Tensor) -> Tensor:
    """|r - exact| / |exact| of results rounded to fp16, the GEMMs' output format (exact zeros stay 0)."""
    r, exact = r.half().float(), exact.half().float()
    return (r - exact).abs() / exact.abs().clamp_min(torch.finfo(torch.float32).tiny)


def decode_step(q: Tensor, k: Tensor, v: Tensor, t: int, block: int, topk: int, min_bits: int = 8) -> dict:
    """Replay one layer's decode step of slot t. q (Hq, T, d), k, v (H, T, d) fp16 from capture_qkv.
    Returns the bits read (aligned part and overall, K and V) and Table 1's bucket counts."""
    H, d = k.shape[0], k.shape[-1]
    Hq = q.shape[0]
    if not block <= t < k.shape[1]:
        raise ValueError(f"slot t={t} must lie in [block={block}, {k.shape[1]}): a step needs a complete block")
    n_aligned = t // block * block                                   # complete blocks before slot t
    keys, values = k[None, :, :t + 1], v[None, :, :t + 1]            # (1, H, S, d), S = t + 1
    qt = q[None, :, t:t + 1]                                         # (1, Hq, 1, d)
    k_exp = exponent(keys[:, :, :n_aligned].float().view(1, H, -1, block, d).abs().amax(3))   # (1, H, NB, d)
    v_exp = exponent(values.float().abs().amax(-1))                  # (1, H, S)
    rep = lambda x: x.repeat_interleave(Hq // H, dim=1).float()      # noqa: E731  (1, H, ...) -> (1, Hq, ...)

    def scores(read_keys: Tensor) -> Tensor:                          # (1, Hq, 1, S)
        return qt.float() @ rep(read_keys).transpose(-1, -2)

    k_bits = key_levels(qt, k_exp, min_bits)                         # (1, H, 1, NB, d)
    k_read = read_levels(keys[:, :, :n_aligned].view(1, H, -1, block, d), k_bits[:, :, 0, :, None])
    aligned_keys = torch.cat([k_read.view(1, H, n_aligned, d), keys[:, :, n_aligned:].float()], dim=2)
    s_exact, s_aligned = scores(keys), scores(aligned_keys)
    s_trunc = scores(torch.cat([truncate13(keys[:, :, :n_aligned]), keys[:, :, n_aligned:]], dim=2))

    p = (s_exact * d ** -0.5).softmax(-1)                            # (1, Hq, 1, S), exact probabilities
    o_est = estimate_output(p, values[:, :, None].float(), topk)     # (1, Hq, 1, d)
    v_bits = value_levels(p[..., :n_aligned], o_est, v_exp[:, :, :n_aligned], min_bits)   # (1, H, 1, NA, d)
    v_read = torch.cat([read_levels(values[:, :, None, :n_aligned], v_bits), values[:, :, None, n_aligned:].float()],
                       dim=3)                                        # (1, H, 1, S, d)
    o_exact = p @ rep(values)
    o_aligned = p @ rep(v_read[:, :, 0])
    o_trunc = p @ rep(torch.cat([truncate13(values[:, :, :n_aligned]), values[:, :, n_aligned:]], dim=2))

    S = t + 1
    k_mean = k_bits.float().mean().item() if n_aligned else 16.0
    v_mean = v_bits.float().mean().item() if n_aligned else 16.0
    return {
        "k_bits_aligned": k_mean, "v_bits_aligned": v_mean,
        "k_bits": (k_mean * n_aligned + 16 * (S - n_aligned)) / S,
        "v_bits": (v_mean * n_aligned + 16 * (S - n_aligned)) / S,
        "qk": {"alignedkv": bucket_counts(relative(s_aligned, s_exact)),
               "truncated13": bucket_counts(relative(s_trunc, s_exact))},
        "sv": {"alignedkv": bucket_counts(relative(o_aligned, o_exact)),
               "truncated13": bucket_counts(relative(o_trunc, o_exact))},
    }
