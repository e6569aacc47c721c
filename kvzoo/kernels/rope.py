"""Rotary position embedding applied in place to many rows in one pass (rotate-half, as Llama's q/k layout):

    x[..., :h] <- x1 * cos[..., :h] - x2 * sin[..., :h]
    x[..., h:] <- x2 * cos[..., h:] + x1 * sin[..., h:]          x1, x2 = x[..., :h], x[..., h:], h = d/2

computed in fp32 from the tables in x's dtype and rounded once. Strategies that keep keys before RoPE and
rebuild them at every decode step (XQuant, XQuant-CL) rotate every stored key once per step: torch's three
passes (kvzoo.models.llama.RotaryEmbedding.apply_tables) read and write all of them three times, this kernel
once (the 8B shape at 32K: 32K x 8 heads x 128 keys per layer, 64 MB in bf16).

    x        (B, H, T, d)  fp16 / bf16 / fp32, any strides with unit stride on d (a view of a larger buffer)
    cos, sin (B, 1, T, d)  in x's dtype, RotaryEmbedding.cos_sin's tables (shared by the H heads)

Grid (cdiv(T, BLOCK_T), B): a program reads the tables' BLOCK_T rows once and rotates those rows of every head,
both halves of each row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.kernels.quant_matvec import check_runnable, check_tensor


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, T, H, s_xb, s_xh, s_xt, s_cb, s_ct,
                 HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, HALF)
    live = (t < T)[:, None]
    rows = t.to(tl.int64)[:, None]
    t_at = b * s_cb + rows * s_ct + j[None, :]
    cos1 = tl.load(cos_ptr + t_at, mask=live, other=0).to(tl.float32)
    cos2 = tl.load(cos_ptr + t_at + HALF, mask=live, other=0).to(tl.float32)
    sin1 = tl.load(sin_ptr + t_at, mask=live, other=0).to(tl.float32)
    sin2 = tl.load(sin_ptr + t_at + HALF, mask=live, other=0).to(tl.float32)
    for h in range(H):                           # the tables' rows are read once for every head
        x_at = x_ptr + b * s_xb + h * s_xh + rows * s_xt + j[None, :]
        x1 = tl.load(x_at, mask=live, other=0).to(tl.float32)
        x2 = tl.load(x_at + HALF, mask=live, other=0).to(tl.float32)
        tl.store(x_at, (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty), mask=live)
        tl.store(x_at + HALF, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=live)


def rope_(x: Tensor, cos: Tensor, sin: Tensor, block_t: int = 64) -> Tensor:
    """Rotate x (B, H, T, d) in place by the tables cos, sin (B, 1, T, d); returns x."""
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError("x must be a tensor (B, H, T, d)")
    B, H, T, d = x.shape
    if d % 2 or d & (d - 1):
        raise ValueError(f"the head dim must be an even power of two, got {d}")
    if x.stride(-1) != 1:
        raise ValueError("x must have unit stride on its last dim")
    check_runnable(_rope_kernel, x.device)
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(t, name, (B, 1, T, d), (x.dtype,), x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    if x.numel():
        _rope_kernel[(triton.cdiv(T, block_t), B)](x, cos, sin, T, H, x.stride(0), x.stride(1), x.stride(2),
                                                   cos.stride(0), cos.stride(2), HALF=d // 2, BLOCK_T=block_t)
    return x


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The torch reference in fp32: x cos + rotate_half(x) sin, in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos.float() + torch.cat((-x2, x1), dim=-1) * sin.float()).to(x.dtype)
