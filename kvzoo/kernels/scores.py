"""Attention scores of one decode token's query heads against a key buffer, in fp32, for GQA.

    scores (B, Hq, K) = q (B, Hq, d) · keys (B, K, H*d)ᵀ * scale,   query head h*rep + r against KV head h's keys

XQuant's static step needs the softmax probabilities themselves (it weighs the value latents with them instead of
rematerializing V), so it cannot use SDPA, and a 16-bit product with an fp32 result went through cuBLAS's slow
unaligned kernels (78 µs per layer at 32K on an H100). Here a program owns one KV head and a run of keys, which it
takes BLOCK at a time (so the loads of the next block are in flight while one is multiplied), serves all rep query
heads of it with one tl.dot (rows padded to 16 for the tensor cores) in the inputs' dtype with fp32 accumulation,
and reads each key once: 32K keys × 8 heads × 128 channels of bf16 (64 MiB) per call. Two programs per SM, 32
keys a step, 3 stages were the fastest of a sweep on an H100 (with RoPE, 32K keys: 44 µs against 72 for one
block of 128 keys per program; reading the keys and tables alone would take about 29).

keys is any (B, K, H*d) view with a unit last stride (XQuant's keys are the up-projection's output, viewed per
head), so no copy is made. With `tables` (RotaryEmbedding.cos_sin's cos and sin, (B, 1, K, d) in the keys' dtype)
the keys are stored before RoPE and each is rotated as it is loaded, in fp32 and rounded once to its dtype: a
separate pass over them would write and read them again (64 MiB each way a layer at 32K: 52 µs on an H100). With
`q_tables` the query heads too are given before RoPE and rotated as each program loads them.

The rest of XQuant's static step around the scores (kvzoo.cache.xquant.weighed_attention), each a launch where torch
took several or left the GPU idle:
    softmax_rows   the softmax over K with the step's mask (an additive bias) added, in (rows x K/2048) programs:
                   each block's max and sum of exponentials, then every score normalized by its row's
    add_weighted   the token's own value weighed by its probability and added to the heads' weighed latents
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.kernels.quant_matvec import check_runnable, check_tensor, sm_count

BLOCK = 32                   # keys a step
PER_SM = 2                   # programs per SM
SOFTMAX_BLOCK = 2048         # columns a program of the softmax


@triton.jit
def _scores_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qcos_ptr, qsin_ptr, out_ptr, K, PER_PROGRAM, scale, s_kb, s_kt,
                   s_cb, s_ct, H: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr,
                   BLOCK: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROPE: tl.constexpr,
                   Q_ROPE: tl.constexpr):
    bh = tl.program_id(0)                        # b * H + h
    b = (bh // H).to(tl.int64)
    h = bh % H
    r = tl.arange(0, REP_P)
    live_r = r < REP
    heads = bh * REP + r                         # query heads of KV head h
    j = tl.arange(0, D // 2)
    d = tl.arange(0, D)
    if ROPE:                                     # each half of q against its half of the rotated keys
        q_at = q_ptr + heads[:, None] * D + j[None, :]
        q1 = tl.load(q_at, mask=live_r[:, None], other=0)                                       # (REP_P, D/2)
        q2 = tl.load(q_at + D // 2, mask=live_r[:, None], other=0)
        if Q_ROPE:                               # q rotated to its position first, as RotaryEmbedding.apply_tables
            q_dtype = q_ptr.dtype.element_ty
            x1, x2 = q1.to(tl.float32), q2.to(tl.float32)
            qc1 = tl.load(qcos_ptr + b * D + j).to(tl.float32)[None, :]
            qc2 = tl.load(qcos_ptr + b * D + D // 2 + j).to(tl.float32)[None, :]
            qs1 = tl.load(qsin_ptr + b * D + j).to(tl.float32)[None, :]
            qs2 = tl.load(qsin_ptr + b * D + D // 2 + j).to(tl.float32)[None, :]
            q1 = ((x1 * qc1).to(q_dtype).to(tl.float32) - x2 * qs1).to(q_dtype)
            q2 = ((x2 * qc2).to(q_dtype).to(tl.float32) + x1 * qs2).to(q_dtype)
        if UPCAST:
            q1, q2 = q1.to(tl.float32), q2.to(tl.float32)
    else:
        q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=live_r[:, None], other=0)      # (REP_P, D)
        if UPCAST:                               # the interpreter's bf16 dot is wrong: bf16 is exact in fp32
            q = q.to(tl.float32)
    start = tl.program_id(1) * PER_PROGRAM
    for t0 in range(start, tl.minimum(start + PER_PROGRAM, K), BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        live_t = t < K
        rows = t.to(tl.int64)[:, None]
        if ROPE:
            k_at = k_ptr + b * s_kb + rows * s_kt + h * D + j[None, :]
            k1 = tl.load(k_at, mask=live_t[:, None], other=0).to(tl.float32)                    # (BLOCK, D/2)
            k2 = tl.load(k_at + D // 2, mask=live_t[:, None], other=0).to(tl.float32)
            c_at = b * s_cb + rows * s_ct + j[None, :]
            cos1 = tl.load(cos_ptr + c_at, mask=live_t[:, None], other=0).to(tl.float32)
            cos2 = tl.load(cos_ptr + c_at + D // 2, mask=live_t[:, None], other=0).to(tl.float32)
            sin1 = tl.load(sin_ptr + c_at, mask=live_t[:, None], other=0).to(tl.float32)
            sin2 = tl.load(sin_ptr + c_at + D // 2, mask=live_t[:, None], other=0).to(tl.float32)
            dtype = k_ptr.dtype.element_ty       # rotate-half in fp32, rounded once (as _rotated)
            r1 = (k1 * cos1 - k2 * sin1).to(dtype)
            r2 = (k2 * cos2 + k1 * sin2).to(dtype)
            if UPCAST:
                r1, r2 = r1.to(tl.float32), r2.to(tl.float32)
            s = tl.dot(q1, tl.trans(r1), input_precision=PRECISION)
            s = tl.dot(q2, tl.trans(r2), s, input_precision=PRECISION) * scale                # (REP_P, BLOCK)
        else:
            k = tl.load(k_ptr + b * s_kb + rows * s_kt + h * D + d[None, :], mask=live_t[:, None], other=0)
            if UPCAST:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale                        # (REP_P, BLOCK)
        tl.store(out_ptr + heads.to(tl.int64)[:, None] * K + t[None, :], s, mask=live_r[:, None] & live_t[None, :])


@triton.jit
def _biased(s_ptr, bias_ptr, row, t, K, R, s_bb, BIAS: tl.constexpr):
    """Scores s[row, t] (t < K, else -inf), plus bias[row // R, t] with BIAS."""
    s = tl.load(s_ptr + row * K + t, mask=t < K, other=float("-inf"))
    if BIAS:
        s += tl.load(bias_ptr + (row // R) * s_bb + t, mask=t < K, other=0).to(tl.float32)
    return s


@triton.jit
def _chunk_stats_kernel(s_ptr, bias_ptr, m_ptr, l_ptr, K, R, s_bb, BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0)'s columns [program_id(1) * BLOCK, ...), bias added: their max m and sum of exp(s - m)
    (m = -inf and l = 0 where every one is -inf)."""
    row = tl.program_id(0).to(tl.int64)
    s = _biased(s_ptr, bias_ptr, row, tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), K, R, s_bb, BIAS)
    m = tl.max(s, 0)
    l = tl.sum(tl.exp(s - tl.where(m == float("-inf"), 0.0, m)), 0)
    at = row * tl.num_programs(1) + tl.program_id(1)
    tl.store(m_ptr + at, m)
    tl.store(l_ptr + at, l)


@triton.jit
def _softmax_kernel(s_ptr, bias_ptr, m_ptr, l_ptr, p_ptr, K, R, s_bb, BIAS: tl.constexpr, CHUNKS_P: tl.constexpr,
                    BLOCK: tl.constexpr):
    """p = exp(s - M) / L over row program_id(0)'s columns [program_id(1) * BLOCK, ...), bias added, M and L the
    row's max and sum of exp(s - M) from its chunks' (m, l)."""
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.num_programs(1)
    c = tl.arange(0, CHUNKS_P)
    m = tl.load(m_ptr + row * chunks + c, mask=c < chunks, other=float("-inf"))
    l = tl.load(l_ptr + row * chunks + c, mask=c < chunks, other=0)
    top = tl.max(m, 0)
    total = tl.sum(l * tl.exp(m - top), 0)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    s = _biased(s_ptr, bias_ptr, row, t, K, R, s_bb, BIAS)
    tl.store(p_ptr + row * K + t, tl.exp(s - top) / total, mask=t < K)


def gqa_scores(q: Tensor, keys: Tensor, scale: float, tables: tuple[Tensor, Tensor] | None = None, block: int = BLOCK,
               num_warps: int = 4, num_stages: int = 3, programs: int | None = None,
               q_tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """q (B, Hq, d) and keys (B, K, H*d) in one dtype (unit last stride), Hq a multiple of H -> (B, Hq, K) fp32;
    with tables (cos, sin) (B, 1, K, d), the keys rotated to those positions first; with q_tables (cos, sin)
    (B, 1, 1, d) too, q given before RoPE and rotated to its position as each program loads it (the rotation
    RotaryEmbedding.apply_tables rounds: the cos product rounded to q's dtype, then the sin product added). block
    keys a step, num_warps, num_stages and `programs` (default PER_SM per SM; each program one KV head's run of
    keys) tune the launch."""
    if not isinstance(q, Tensor) or q.dim() != 3 or not isinstance(keys, Tensor) or keys.dim() != 3:
        raise ValueError("q must be (B, Hq, d) and keys (B, K, H*d)")
    B, Hq, d = q.shape
    K, width = keys.shape[1], keys.shape[2]
    if keys.shape[0] != B or width % d or Hq % (width // d) or keys.dtype != q.dtype or keys.device != q.device \
            or keys.stride(-1) != 1 or d & (d - 1) or d < 16:
        raise ValueError(f"keys must be a (B={B}, K, H*{d}) {q.dtype} tensor on {q.device} with a unit last stride, "
                         f"Hq={Hq} a multiple of H, d a power of two >= 16; got {keys.dtype} {tuple(keys.shape)}")
    check_runnable(_scores_kernel, q.device)
    if q_tables is not None:
        if tables is None:
            raise ValueError("q_tables rotate q beside keys rotated in the kernel: give the keys' tables too")
        for name, t in zip(("q cos", "q sin"), q_tables):
            check_tensor(t, name, (B, 1, 1, d), (q.dtype,), q.device)
    if tables is not None:
        for name, t in zip(("cos", "sin"), tables):
            check_tensor(t, name, (B, 1, K, d), (q.dtype,), q.device)
        if d < 32:                               # halves too narrow for a tensor-core product: rotate them first
            keys = _rotated(keys, *tables)
            tables = None
            if q_tables is not None:
                from kvzoo.models.llama import RotaryEmbedding

                q = RotaryEmbedding.apply_tables(q[:, None], *q_tables)[:, 0]
                q_tables = None
    cos, sin = (t.contiguous() for t in tables) if tables is not None else (keys, keys)   # unread without tables
    qcos, qsin = (t.contiguous() for t in q_tables) if q_tables is not None else (q, q)  # unread without q_tables
    H = width // d
    rep = Hq // H
    out = torch.empty(B, Hq, K, dtype=torch.float32, device=q.device)
    if B and K:
        if programs is None:
            programs = sm_count(q.device) * PER_SM
        per_program = triton.cdiv(triton.cdiv(K, max(1, programs // (B * H))), block) * block
        _scores_kernel[(B * H, triton.cdiv(K, per_program))](
            q.contiguous(), keys, cos, sin, qcos, qsin, out, K, per_program, scale, keys.stride(0), keys.stride(1),
            K * d, d, H=H, REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), D=d, BLOCK=block,
            PRECISION="ieee" if q.dtype == torch.float32 or not q.is_cuda else "tf32",
            UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda, ROPE=tables is not None, Q_ROPE=q_tables is not None,
            num_warps=num_warps, num_stages=num_stages)
    return out


def softmax_rows(s: Tensor, bias: Tensor | None = None, block: int = SOFTMAX_BLOCK) -> Tensor:
    """softmax over the last dim of s (B, R, K) fp32, contiguous, with bias (B, K) (any dtype, unit last stride;
    e.g. 0 or -inf) added to each of its R rows first, in two launches of (B*R x K/block) programs: each block's max
    and sum of exponentials, then every element normalized by its row's. Torch's softmax runs one block per row,
    which leaves an H200 idle for a decode step's few rows: 32 rows of 32K (XQuant's scores at batch 1) took 10 us
    and the bias another launch of 6, against 7 for both launches here (the step's profile, docs/decode.md)."""
    if not isinstance(s, Tensor) or s.dtype != torch.float32 or not s.is_contiguous() or s.dim() != 3:
        raise ValueError("s must be a contiguous fp32 tensor (B, R, K)")
    B, R, K = s.shape
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (B, K) or bias.device != s.device
                             or bias.stride(-1) != 1):
        raise ValueError(f"bias must be a (B={B}, K={K}) tensor on {s.device} with a unit last stride")
    check_runnable(_softmax_kernel, s.device)
    p = torch.empty_like(s)
    if B * R and K:
        chunks = triton.cdiv(K, block)
        m, l = (torch.empty(B * R, chunks, dtype=torch.float32, device=s.device) for _ in range(2))
        biased = (s, 0) if bias is None else (bias, bias.stride(0))                 # s: never read as the bias
        _chunk_stats_kernel[(B * R, chunks)](s, biased[0], m, l, K, R, biased[1], BIAS=bias is not None, BLOCK=block)
        _softmax_kernel[(B * R, chunks)](s, biased[0], m, l, p, K, R, biased[1], BIAS=bias is not None,
                                         CHUNKS_P=triton.next_power_of_2(chunks), BLOCK=block)
    return p


@triton.jit
def _add_weighted_kernel(a_ptr, w_ptr, v_ptr, out_ptr, s_ab, s_ah, s_ar, s_wb, s_wh, s_vb, s_vh,
                         H: tl.constexpr, REP: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr):
    """Query head row = (b * H + h) * REP + r: a[b, h, r] + w[b, h * REP + r] * v[b, h], in fp32, rounded."""
    row = tl.program_id(0)
    b = (row // (H * REP)).to(tl.int64)
    h = (row // REP) % H
    r = row % REP
    c = tl.arange(0, D_P)
    live = c < D
    a = tl.load(a_ptr + b * s_ab + h * s_ah + r * s_ar + c, mask=live, other=0).to(tl.float32)
    v = tl.load(v_ptr + b * s_vb + h * s_vh + c, mask=live, other=0).to(tl.float32)
    w = tl.load(w_ptr + b * s_wb + (h * REP + r) * s_wh)
    tl.store(out_ptr + row.to(tl.int64) * D + c, (a + w * v).to(out_ptr.dtype.element_ty), mask=live)


def add_weighted(a: Tensor, w: Tensor, v: Tensor) -> Tensor:
    """(a + w · v) in fp32, rounded to v's dtype: a (B, H, rep, d), w (B, H·rep) fp32 and v (B, H, d), each with a
    unit last stride (any other strides) -> (B, H·rep, d) contiguous. The product and the sum are rounded apart, as
    torch's `a.float() + w * v.float()` rounds them, in one launch (torch takes five: casts, the product, the sum and
    a copy of the strided a)."""
    if a.dim() != 4:
        raise ValueError(f"a must be (B, H, rep, d), got {tuple(a.shape)}")
    B, H, rep, d = a.shape
    if w.shape != (B, H * rep) or w.dtype != torch.float32 or v.shape != (B, H, d) or a.stride(-1) != 1 \
            or v.stride(-1) != 1:
        raise ValueError(f"a (B, H, rep, d), w (B, H*rep) fp32 and v (B, H, d) with unit last strides, got "
                         f"{tuple(a.shape)}, {tuple(w.shape)} {w.dtype}, {tuple(v.shape)}")
    check_runnable(_add_weighted_kernel, a.device)
    out = torch.empty(B, H * rep, d, dtype=v.dtype, device=a.device)
    if out.numel():
        _add_weighted_kernel[(B * H * rep,)](a, w, v, out, a.stride(0), a.stride(1), a.stride(2), w.stride(0),
                                             w.stride(1), v.stride(0), v.stride(1), H=H, REP=rep, D=d,
                                             D_P=triton.next_power_of_2(d), num_warps=1, enable_fp_fusion=False)
    return out


def _rotated(keys: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """keys (B, K, H*d) rotated by cos, sin (B, 1, K, d) in fp32, rounded once to their dtype (as the kernel)."""
    B, K, width = keys.shape
    d = cos.shape[-1]
    k = keys.float().view(B, K, width // d, d)                                       # (B, K, H, d)
    k1, k2 = k.chunk(2, dim=-1)
    cos, sin = cos.float().transpose(1, 2), sin.float().transpose(1, 2)              # (B, K, 1, d)
    return (k * cos + torch.cat((-k2, k1), dim=-1) * sin).to(keys.dtype).view(B, K, width)


def gqa_scores_ref(q: Tensor, keys: Tensor, scale: float, tables: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The torch reference, in fp32 (the keys rotated in fp32 and rounded once to their dtype, as the kernel)."""
    B, Hq, d = q.shape
    H = keys.shape[2] // d
    if tables is not None:
        keys = _rotated(keys, *tables)
    k = keys.float().view(B, -1, H, d).transpose(1, 2)                               # (B, H, K, d)
    return (q.float().view(B, H, Hq // H, d) @ k.transpose(-1, -2)).reshape(B, Hq, -1) * scale
