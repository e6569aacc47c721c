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
separate pass over them would write and read them again (64 MiB each way a layer at 32K: 52 µs on an H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.kernels.quant_matvec import check_runnable, check_tensor, sm_count

BLOCK = 32                   # keys a step
PER_SM = 2                   # programs per SM


@triton.jit
def _scores_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, out_ptr, K, PER_PROGRAM, scale, s_kb, s_kt, s_cb, s_ct,
                   H: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROPE: tl.constexpr):
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


def gqa_scores(q: Tensor, keys: Tensor, scale: float, tables: tuple[Tensor, Tensor] | None = None, block: int = BLOCK,
               num_warps: int = 4, num_stages: int = 3, programs: int | None = None) -> Tensor:
    """q (B, Hq, d) and keys (B, K, H*d) in one dtype (unit last stride), Hq a multiple of H -> (B, Hq, K) fp32;
    with tables (cos, sin) (B, 1, K, d), the keys rotated to those positions first. block keys a step, num_warps,
    num_stages and `programs` (default PER_SM per SM; each program one KV head's run of keys) tune the launch."""
    if not isinstance(q, Tensor) or q.dim() != 3 or not isinstance(keys, Tensor) or keys.dim() != 3:
        raise ValueError("q must be (B, Hq, d) and keys (B, K, H*d)")
    B, Hq, d = q.shape
    K, width = keys.shape[1], keys.shape[2]
    if keys.shape[0] != B or width % d or Hq % (width // d) or keys.dtype != q.dtype or keys.device != q.device \
            or keys.stride(-1) != 1 or d & (d - 1) or d < 16:
        raise ValueError(f"keys must be a (B={B}, K, H*{d}) {q.dtype} tensor on {q.device} with a unit last stride, "
                         f"Hq={Hq} a multiple of H, d a power of two >= 16; got {keys.dtype} {tuple(keys.shape)}")
    check_runnable(_scores_kernel, q.device)
    if tables is not None:
        for name, t in zip(("cos", "sin"), tables):
            check_tensor(t, name, (B, 1, K, d), (q.dtype,), q.device)
        if d < 32:                               # halves too narrow for a tensor-core product: rotate them first
            keys = _rotated(keys, *tables)
            tables = None
    cos, sin = (t.contiguous() for t in tables) if tables is not None else (keys, keys)   # unread without tables
    H = width // d
    rep = Hq // H
    out = torch.empty(B, Hq, K, dtype=torch.float32, device=q.device)
    if B and K:
        if programs is None:
            programs = sm_count(q.device) * PER_SM
        per_program = triton.cdiv(triton.cdiv(K, max(1, programs // (B * H))), block) * block
        _scores_kernel[(B * H, triton.cdiv(K, per_program))](
            q.contiguous(), keys, cos, sin, out, K, per_program, scale, keys.stride(0), keys.stride(1), K * d, d, H=H,
            REP=rep, REP_P=max(16, triton.next_power_of_2(rep)), D=d, BLOCK=block,
            PRECISION="ieee" if q.dtype == torch.float32 or not q.is_cuda else "tf32",
            UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda, ROPE=tables is not None, num_warps=num_warps,
            num_stages=num_stages)
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
