"""The transformer block's small operations, one kernel each, for the model on a GPU (kvzoo/models/llama.py).

A decode step spends little on each of these, but torch runs each as several kernels (an RMSNorm is six: a
cast, a square, a mean, an add, an rsqrt and two products; RoPE's tables and rotation of q and k about a
dozen), and at batch 1 a kernel costs a launch and a gap whatever it computes: about 45 small kernels a layer,
3-4 ms of a Llama-3.1-8B step on an H100 (docs/decode.md, "The block's small operations in one kernel each").
Here each is one kernel that rounds where the torch code rounds, so its results are the torch code's:

    rms_norm(x, w, eps)            w * bf16(x * rsqrt(mean(x^2) + eps)), x (..., N) -> (..., N)
    add_rms_norm(x, delta, w, eps) (x + delta, rms_norm(x + delta)): the residual add before the MLP's norm
    rope_qk(q, k, ids, inv_freq)   q (B, Hq, T, d), k (B, Hk, T, d) rotated to positions ids (B, T), the tables
                                   cos(ids * inv_freq), sin(...) made in the kernel -> new (B, H, T, d) tensors
    silu_mul(gate, up)             bf16(silu(gate)) * up

("bf16" stands for the inputs' dtype.) No multiply and add is contracted into one FMA, as in torch's separate
ops. The sums over x^2 run in fp32 in another order than torch's mean, so a norm can differ from torch's in the
last bit of an element; every other result equals the torch code's to the bit where the math library does
(cos, sin and exp from libdevice, division correctly rounded; checked on an H100 by
tests/kernels/test_layer_ops.py). The references
are the torch code of the model's modules (`RMSNorm.reference`, `RotaryEmbedding.reference`, `MLP.reference`).

On sm_90 (quant_matvec.launches_early) the norms and silu_mul let the kernel after them launch at their start
(griddepcontrol.launch_dependents): the 4-bit products (kvzoo/kernels/w4a16_hopper.py) are launched so, load their first
codes and wait for these kernels to finish before they read x. A kernel launched plainly after them is not affected.

Grids: the norms one program a row of N (N <= 16384, the row in registers); rope_qk one program a (row,
token) and 8 heads of q or of k (a decode token of Llama-3.1-8B: 5 programs; one program for all 40 heads took
6.7 us); silu_mul one program a block of 1,024 elements of a row. CPU tensors need TRITON_INTERPRET=1 (tests);
the model takes these kernels for CUDA tensors only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from kvzoo.kernels.quant_matvec import check_runnable, check_tensor, launches_early

MAX_ROW = 16384
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _precise(kernel) -> bool:
    """libdevice's math (CUDA's cosf, sinf, expf, rsqrtf, as torch's kernels call them) where compiled; the
    interpreter has no libdevice and takes triton's own functions."""
    return not isinstance(kernel, InterpretedFunction)


@triton.jit
def _math(x, OP: tl.constexpr, PRECISE: tl.constexpr):
    if OP == "cos":
        y = libdevice.cos(x) if PRECISE else tl.cos(x)
    elif OP == "sin":
        y = libdevice.sin(x) if PRECISE else tl.sin(x)
    elif OP == "exp":
        y = libdevice.exp(x) if PRECISE else tl.exp(x)
    else:
        y = libdevice.rsqrt(x) if PRECISE else tl.rsqrt(x)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, sum_ptr, N, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr, EARLY: tl.constexpr):
    if EARLY:                                        # the 4-bit product after it may launch now (module docstring)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64) * N
    j = tl.arange(0, BLOCK)
    live = j < N
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row + j, mask=live, other=0)
    if HAS_DELTA:                                    # the residual add, rounded as torch's x + delta
        x = (x.to(tl.float32) + tl.load(delta_ptr + row + j, mask=live, other=0).to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row + j, x, mask=live)
    xf = x.to(tl.float32)
    mean = tl.sum(xf * xf, axis=0) * (1.0 / N)
    normed = (xf * _math(mean + eps, "rsqrt", PRECISE)).to(dtype)
    w = tl.load(w_ptr + j, mask=live, other=0)
    tl.store(out_ptr + row + j, (w.to(tl.float32) * normed.to(tl.float32)).to(dtype), mask=live)


def _check_norm(x: Tensor, weight: Tensor) -> int:
    if not isinstance(x, Tensor) or x.dtype not in DTYPES:
        raise ValueError(f"x must be a float16, bfloat16 or float32 tensor, got {getattr(x, 'dtype', type(x))}")
    N = x.shape[-1]
    if N > MAX_ROW:
        raise ValueError(f"rows of at most {MAX_ROW} elements, got {N}")
    check_tensor(weight, "weight", (N,), (x.dtype,), x.device)
    check_runnable(_rms_norm_kernel, x.device)
    return N


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x (..., N) with weight (N,) of x's dtype, as `RMSNorm.reference`."""
    N = _check_norm(x, weight)
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        _rms_norm_kernel[(x.numel() // N,)](x, x, weight, out, out, N, eps, HAS_DELTA=False,
                                            BLOCK=triton.next_power_of_2(N), PRECISE=_precise(_rms_norm_kernel),
                                            EARLY=launches_early(x.device), num_warps=4, enable_fp_fusion=False)
    return out


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, its RMSNorm): the block's residual add and the next norm in one pass."""
    N = _check_norm(x, weight)
    check_tensor(delta, "delta", tuple(x.shape), (x.dtype,), x.device)
    x, delta = x.contiguous(), delta.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    if x.numel():
        _rms_norm_kernel[(x.numel() // N,)](x, delta, weight, out, total, N, eps, HAS_DELTA=True,
                                            BLOCK=triton.next_power_of_2(N), PRECISE=_precise(_rms_norm_kernel),
                                            EARLY=launches_early(x.device), num_warps=4, enable_fp_fusion=False)
    return total, out


@triton.jit
def _rotate_heads(x_ptr, out_ptr, b, t, h0, H, T, s_b, s_h, s_t, cos, sin,
                  HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS: tl.constexpr):
    """Heads [h0, h0 + HEADS) of x at (b, t), those below H, rotated into out (B, H, T, d), contiguous; cos, sin
    (HALF_P,) in x's dtype, HALF_P the power of two >= HALF = d/2."""
    dtype = out_ptr.dtype.element_ty
    h = h0 + tl.arange(0, HEADS)[:, None]
    j = tl.arange(0, HALF_P)[None, :]
    live = (h < H) & (j < HALF)
    at = x_ptr + b * s_b + h * s_h + t * s_t + j
    x1 = tl.load(at, mask=live, other=0).to(tl.float32)
    x2 = tl.load(at + HALF, mask=live, other=0).to(tl.float32)
    c = cos.to(tl.float32)[None, :]
    s = sin.to(tl.float32)[None, :]
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype as torch's ops round them
    out1 = ((x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    o = out_ptr + ((b * H + h) * T + t) * (2 * HALF) + j
    tl.store(o, out1, mask=live)
    tl.store(o + HALF, out2, mask=live)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, ids_ptr, freq_ptr, q_out, k_out, T, Hq, Hk,
                    s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_ib, s_it,
                    HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                   # b * T + t
    b, t = row // T, row % T
    block = tl.program_id(1)                              # HEADS heads of q, then of k
    q_blocks = tl.cdiv(Hq, HEADS)
    dtype = q_out.dtype.element_ty
    j = tl.arange(0, HALF_P)
    freq = tl.load(freq_ptr + j, mask=j < HALF, other=0).to(tl.float32)
    angle = tl.load(ids_ptr + b * s_ib + t * s_it).to(tl.float32) * freq
    cos = _math(angle, "cos", PRECISE).to(dtype)    # the tables, in the dtype as cos_sin makes them
    sin = _math(angle, "sin", PRECISE).to(dtype)
    if block < q_blocks:
        _rotate_heads(q_ptr, q_out, b, t, block * HEADS, Hq, T, s_qb, s_qh, s_qt, cos, sin, HALF, HALF_P, HEADS)
    else:
        _rotate_heads(k_ptr, k_out, b, t, (block - q_blocks) * HEADS, Hk, T, s_kb, s_kh, s_kt, cos, sin, HALF,
                      HALF_P, HEADS)


def rope_qk(q: Tensor, k: Tensor, ids: Tensor, inv_freq: Tensor, heads: int = 8) -> tuple[Tensor, Tensor]:
    """q (B, Hq, T, d) and k (B, Hk, T, d), any strides with unit stride on d, rotated to positions ids (B, T)
    by frequencies inv_freq (d/2,) (fp32; a model moved to another dtype holds them rounded to it), as
    `RotaryEmbedding.reference`; returns new contiguous tensors."""
    if not isinstance(q, Tensor) or not isinstance(k, Tensor) or q.dim() != 4 or k.dim() != 4:
        raise ValueError("q and k must be tensors (B, H, T, d)")
    B, Hq, T, d = q.shape
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if d % 2:
        raise ValueError(f"the head dim must be even (rotate-half pairs its halves), got {d}")
    check_tensor(k, "k", (B, k.shape[1], T, d), (q.dtype,), q.device)
    check_tensor(ids, "ids", (B, T), (torch.int64, torch.int32), q.device)
    check_tensor(inv_freq, "inv_freq", (d // 2,), DTYPES, q.device)
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have unit stride on their last dim")
    check_runnable(_rope_qk_kernel, q.device)
    Hk = k.shape[1]
    q_out = torch.empty(B, Hq, T, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(B, Hk, T, d, dtype=q.dtype, device=q.device)
    if B * T:
        grid = (B * T, triton.cdiv(Hq, heads) + triton.cdiv(Hk, heads))
        _rope_qk_kernel[grid](q, k, ids, inv_freq.contiguous(), q_out, k_out, T, Hq, Hk,
                              q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                              ids.stride(0), ids.stride(1), HALF=d // 2,
                              HALF_P=triton.next_power_of_2(d // 2), HEADS=heads,
                              PRECISE=_precise(_rope_qk_kernel), num_warps=4, enable_fp_fusion=False)
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, s_g, s_u, BLOCK: tl.constexpr, PRECISE: tl.constexpr,
                     EARLY: tl.constexpr):
    if EARLY:                                        # the down product after it may launch now (module docstring)
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = j < n
    dtype = g_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * s_g + j, mask=live, other=0).to(tl.float32)
    u = tl.load(u_ptr + row * s_u + j, mask=live, other=0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + _math(-g, "exp", PRECISE)).to(dtype)   # torch's silu: x / (1 + exp(-x)), rounded
    tl.store(out_ptr + row * n + j, (silu.to(tl.float32) * u).to(dtype), mask=live)


def silu_mul(gate: Tensor, up: Tensor, block: int = 1024) -> Tensor:
    """silu(gate) * up for two tensors (..., n) of one shape and dtype, as `MLP.reference`'s product; rows may be
    strided (the two halves of one projection's output), elements within a row contiguous."""
    if not isinstance(gate, Tensor) or gate.dtype not in DTYPES:
        raise ValueError(f"gate must be a float16, bfloat16 or float32 tensor, got {getattr(gate, 'dtype', gate)}")
    check_tensor(up, "up", tuple(gate.shape), (gate.dtype,), gate.device)
    check_runnable(_silu_mul_kernel, gate.device)
    n = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g, u = gate.reshape(-1, n), up.reshape(-1, n)              # (rows, n): views where the rows allow
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    if out.numel():
        _silu_mul_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0), BLOCK=block,
                                                               PRECISE=_precise(_silu_mul_kernel),
                                                               EARLY=launches_early(gate.device),
                                                               enable_fp_fusion=False)
    return out
