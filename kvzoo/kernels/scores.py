"""Attention scores of one decode token's query heads against a key buffer, in fp32, for GQA.

    scores (B, Hq, K) = q (B, Hq, d) · keys (B, K, H*d)ᵀ * scale,   query head h*rep + r against KV head h's keys

XQuant's static step needs the softmax probabilities themselves (it weighs the value latents with them instead of
rematerializing V), so it cannot use SDPA, and a 16-bit product with an fp32 result went through cuBLAS's slow
unaligned kernels (78 µs per layer at 32K on an H100). Here a program owns one KV head and BLOCK keys, serves
all rep query heads of it with one tl.dot (rows padded to 16 for the tensor cores) in the inputs' dtype with fp32
accumulation, and reads each key once: 32K keys × 8 heads × 128 channels of bf16 (64 MiB) per call.

keys is any (B, K, H*d) view with a unit last stride (XQuant's keys are the up-projection's output, viewed per
head after RoPE), so no copy is made.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.kernels.quant_matvec import check_runnable

BLOCK = 128                  # keys per program


@triton.jit
def _scores_kernel(q_ptr, k_ptr, out_ptr, K, scale, s_kb, s_kt,
                   H: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    bh = tl.program_id(0)                        # b * H + h
    b = (bh // H).to(tl.int64)
    h = bh % H
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    r = tl.arange(0, REP_P)
    d = tl.arange(0, D)
    live_r = r < REP
    live_t = t < K
    heads = bh * REP + r                         # query heads of KV head h
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=live_r[:, None], other=0)          # (REP_P, D)
    k = tl.load(k_ptr + b * s_kb + t.to(tl.int64)[:, None] * s_kt + h * D + d[None, :], mask=live_t[:, None],
                other=0)                                                                       # (BLOCK, D)
    if UPCAST:                                   # the interpreter's bf16 dot is wrong: bf16 is exact in fp32
        q, k = q.to(tl.float32), k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale                                # (REP_P, BLOCK)
    tl.store(out_ptr + heads.to(tl.int64)[:, None] * K + t[None, :], s, mask=live_r[:, None] & live_t[None, :])


def gqa_scores(q: Tensor, keys: Tensor, scale: float) -> Tensor:
    """q (B, Hq, d) and keys (B, K, H*d) in one dtype (unit last stride), Hq a multiple of H -> (B, Hq, K) fp32."""
    if not isinstance(q, Tensor) or q.dim() != 3 or not isinstance(keys, Tensor) or keys.dim() != 3:
        raise ValueError("q must be (B, Hq, d) and keys (B, K, H*d)")
    B, Hq, d = q.shape
    K, width = keys.shape[1], keys.shape[2]
    if keys.shape[0] != B or width % d or Hq % (width // d) or keys.dtype != q.dtype or keys.device != q.device \
            or keys.stride(-1) != 1 or d & (d - 1) or d < 16:
        raise ValueError(f"keys must be a (B={B}, K, H*{d}) {q.dtype} tensor on {q.device} with a unit last stride, "
                         f"Hq={Hq} a multiple of H, d a power of two >= 16; got {keys.dtype} {tuple(keys.shape)}")
    check_runnable(_scores_kernel, q.device)
    H = width // d
    rep = Hq // H
    out = torch.empty(B, Hq, K, dtype=torch.float32, device=q.device)
    if B and K:
        _scores_kernel[(B * H, triton.cdiv(K, BLOCK))](
            q.contiguous(), keys, out, K, scale, keys.stride(0), keys.stride(1), H=H, REP=rep,
            REP_P=max(16, triton.next_power_of_2(rep)), D=d, BLOCK=BLOCK,
            PRECISION="ieee" if q.dtype == torch.float32 or not q.is_cuda else "tf32",
            UPCAST=q.dtype == torch.bfloat16 and not q.is_cuda)
    return out


def gqa_scores_ref(q: Tensor, keys: Tensor, scale: float) -> Tensor:
    """The torch reference, in fp32."""
    B, Hq, d = q.shape
    H = keys.shape[2] // d
    k = keys.float().view(B, -1, H, d).transpose(1, 2)                               # (B, H, K, d)
    return (q.float().view(B, H, Hq // H, d) @ k.transpose(-1, -2)).reshape(B, Hq, -1) * scale
