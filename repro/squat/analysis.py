"""SQuat, Figure 2: do queries lie in a low-dimensional subspace, and does SQuat keep attention scores?

Wang et al., "SQuat: Subspace-orthogonal KV Cache Quantization" (../shared/papers/squat.md), §3.1,
Definition 1, Figure 2 and Appendix D.1 (pre-RoPE queries and keys, a text run without quantization).

Setup on one window of L tokens: its first P tokens are the prompt, the rest the "response" (teacher-forced
text, so quantization never changes the trajectory). For each layer and KV head, the queries of the
query heads that share the KV head are stacked, as SQuat does for GQA:

    deviation(q, S) = || q/|q| - Proj_S(q/|q|) ||           Definition 1, in [0, 1]
    S = span of the top r right singular vectors of a query matrix built from
        (a) all tokens of the window   (b) the prompt's tokens only   (c) another window of the same
        dataset   (d) a window of another dataset
and the mean deviation of the response tokens' queries is reported over r (Figure 2, left).

Attention-score error (Figure 2, middle and right): the prompt's keys are quantized by KIVI's per-channel
quantizer and by SQuat's (subspace from the prompt's queries), both with the same bits and groups, and
|q·k - q·k̂| / sqrt(d) is collected over every response query and prompt key.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvzoo.cache.kvquant import dequantize, quantize
from kvzoo.cache.squat import grouped_queries, query_subspace, squat_quantize_keys
from kvzoo.eval.capture import per_layer_attention


def capture_qk(model, ids: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """Pre-RoPE queries (Hq, T, d) and keys (Hkv, T, d) of every layer for one sequence ids (T,), fp32,
    from a forward without a cache."""
    def qk(attn, x, pos):
        q, k, _ = attn.qkv(x)                                        # (1, Hq, T, d), (1, Hkv, T, d)
        return q[0].float(), k[0].float()

    pairs = per_layer_attention(model, ids, qk)
    return [q for q, _ in pairs], [k for _, k in pairs]


def grouped(q: Tensor, n_kv: int) -> Tensor:
    """(Hq, T, d) -> (Hkv, Hq/Hkv * T, d): the queries that meet each KV head, stacked along tokens."""
    return grouped_queries(q[None], n_kv)[0]


def subspace_basis(queries: Tensor, r: int) -> Tensor:
    """Orthonormal basis (..., r, d) of the top-r right singular vectors of queries (..., N, d)."""
    return torch.linalg.svd(queries, full_matrices=False).Vh[..., :r, :]


def deviation(queries: Tensor, basis: Tensor) -> Tensor:
    """Definition 1 for normalized queries (..., N, d) against a basis (..., r, d): (..., N) in [0, 1]."""
    q = queries / queries.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return (q - (q @ basis.transpose(-1, -2)) @ basis).norm(dim=-1)


def deviation_curves(q_text: Tensor, q_other: Tensor, q_far: Tensor, prompt: int, n_kv: int,
                     ranks: list[int]) -> dict[str, list[float]]:
    """Mean deviation of the response queries (tokens >= prompt) of one layer from the four subspaces of
    Figure 2 (left), for each r in ranks. q_* are (Hq, T, d) pre-RoPE queries of the text, another text of
    the same dataset and a text of another dataset."""
    sources = {"all tokens": grouped(q_text, n_kv), "prompt only": grouped(q_text[:, :prompt], n_kv),
               "another text": grouped(q_other, n_kv), "another dataset": grouped(q_far, n_kv)}
    response = grouped(q_text[:, prompt:], n_kv)                             # (Hkv, Hq/Hkv * (T - P), d)
    curves = {}
    for name, source in sources.items():
        vh = torch.linalg.svd(source, full_matrices=False).Vh                # (Hkv, d, d)
        curves[name] = [deviation(response, vh[:, :r]).mean().item() for r in ranks]
    return curves


def score_errors(q: Tensor, k: Tensor, prompt: int, bits: int, group_size: int, rank: int, lam: float,
                 block: int) -> dict[str, Tensor]:
    """|q·k - q·k̂| / sqrt(d) of one layer's response queries against its prompt keys quantized by KIVI's
    per-channel quantizer and by SQuat (same bits and groups; the prompt's whole groups only). Also the
    subspace error ||Q̂ (k - k̂)|| per key, which SQuat minimizes. q (Hq, T, d), k (Hkv, T, d)."""
    n_kv, d = k.shape[0], k.shape[-1]
    n = prompt // group_size * group_size
    keys = k[:, :n]                                                           # (Hkv, n, d)
    kivi = dequantize(quantize(keys, bits, group_size, axis=-2), torch.float32)
    sub = query_subspace(grouped(q[:, :prompt], n_kv)[None], rank)[0]         # (Hkv, r, d)
    squat = squat_quantize_keys(keys[None], sub[None], bits, group_size, lam, block)[0]
    response = grouped(q[:, prompt:], n_kv)                                   # (Hkv, M, d)
    exact = response @ keys.transpose(-1, -2)
    out = {}
    for name, approx in (("kivi", kivi), ("squat", squat)):
        out[f"{name}_score"] = ((response @ approx.transpose(-1, -2) - exact).abs() / d ** 0.5).flatten()
        out[f"{name}_subspace"] = ((keys - approx) @ sub.transpose(-1, -2)).norm(dim=-1).flatten()
    return out
