"""XQuant's rematerialization (xquant.md §3.1, §3.3, §3.4): dequantize cached codes and multiply them by a
projection.

    out (..., N, n_out) = dequant(codes) (..., N, r) @ weight (r, n_out)

XQuant caches X (MHA) or its latent X·U (GQA) as b-bit codes and rebuilds K = X̂ W_k, V = X̂ W_v (or the fused
Σ Bᵀ of the SVD) at every decode step; XQuant-CL up-projects its latent deltas the same way. The input is a
`kvzoo.cache.kvquant.QTensor` quantized along one of its last two axes:
    per-token   (axis -1): groups of G consecutive channels of one row      scale/zero (..., N, r/G)
    per-channel (axis -2): groups of G consecutive rows of one channel      scale/zero (..., N/G, r)
asymmetric (code*scale + zero) or symmetric ((code - 2^(b-1))*scale), b in {2, 3, 4, 8}. Codes are packed along
r as one bit stream (kvzoo.cache.kvquant.pack): channel j sits at bits (j*b) % 32 of word (j*b) // 32, so a
3-bit code may spill into the next word (the kernels read both words of such a code).

Two ways (dequant_matmul picks): fp16/bf16 weights on a GPU take two passes, the rows dequantized once into
a (..., N, r) buffer in the weight's dtype (_dequant_kernel) and multiplied by cuBLAS (one torch.mm); fp32
weights (up_dtype=float32) take one fused kernel (_remat_kernel), so the dequantized rows
never reach device memory but every output tile dequantizes its rows again.

Fused kernel tiling: a program computes a (BLOCK_M, BLOCK_N) tile of out, looping over r in BLOCK_K steps; each step
loads a (BLOCK_M, BLOCK_K*b/32) tile of words, unpacks it (BLOCK_M, BLOCK_K/cpw, cpw) -> (BLOCK_M, BLOCK_K)
with the exact 2^23 trick of quant_matvec.unpack_codes, applies each element's scale and zero (gathered:
any G that divides its axis), rounds to the weight's dtype and accumulates tl.dot in fp32. An fp32 weight keeps the dequantized rows in fp32: on a GPU the
dot is three TF32 tensor-core products (input_precision "tf32x3", about fp32 accuracy; exact "ieee" fp32 dots
ran on the CUDA cores at about 7 TFLOP/s, 9.8 ms per call and 607 ms per Llama-3.1-8B decode step at 32K on
an H100), under the interpreter exact fp32 products. Rows past N, channels past r and columns past n_out are
masked, so r need not be a power of two (SmolLM2's latent has r = 192).

Cost per call (§3.4): 2*N*r*n_out FLOPs against N*r*b/8 bytes of codes plus scales and r*n_out weights.

XQuant's static step does not rematerialize V: it weighs the value latents by the softmax and projects the sum
(kvzoo.cache.xquant.weighed_attention). weigh_gather computes that weighed sum Σ_t p_t dequant(row_t) from the codes
in one pass, split over the rows (flash-decoding), so the 16-bit rows are never written. H200, XQuant's 8B value
latents (32K x 1,024, 4-bit, per-token groups of 128), 32 query heads, batch 1: 23 us a layer in a profile of the
decode step, 33 us alone with L2 flushed, 38% of its read floor (docs/decode.md, "XQuant's weighing pipelined by
hand"). On an sm_90 GPU, from 64K rows (batch x S) up, 4-bit per-token groups take kvzoo.kernels.xquant_hopper's
Gluon kernel instead (464 against 677 us at 32K, batch 32, rows in the step's order), which writes the same
partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources
from triton.runtime.interpreter import InterpretedFunction

from kvzoo.cache.kvquant import QTensor, dequantize
from kvzoo.kernels import xquant_hopper
from kvzoo.kernels.quant_matvec import check_runnable, join_codes, sm_count, unpack_asm, unpack_codes, unpacks_in_ptx

REMAT_BITS = (2, 3, 4, 8)


@triton.jit
def _dequant_tile(codes_ptr, scale_ptr, zero_ptr, rows, live_m, k0, R, WORDS, GROUP: tl.constexpr,
                  BITS: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_ZERO: tl.constexpr, BLOCK_K: tl.constexpr):
    """Channels [k0, k0 + BLOCK_K) of rows `rows` (BLOCK_M,) dequantized: ((BLOCK_M, BLOCK_K) fp32, channel
    indices (BLOCK_K,)); masked rows and channels past R read 0."""
    k = k0 + tl.arange(0, BLOCK_K)
    if 32 % BITS == 0:            # whole codes per word: each word read once and split
        CPW: tl.constexpr = 32 // BITS               # codes per word
        KW: tl.constexpr = BLOCK_K // CPW            # words per row per step
        shifts = (tl.arange(0, CPW) * BITS)[None, None, :]
        wi = k0 // CPW + tl.arange(0, KW)                                          # word index in the row
        words = tl.load(codes_ptr + rows[:, None] * WORDS + wi[None, :],
                        mask=live_m[:, None] & (wi < WORDS)[None, :], other=0)      # (BLOCK_M, KW)
        x = tl.reshape(unpack_codes(words[:, :, None], shifts, BITS), (rows.shape[0], BLOCK_K), can_reorder=False)
    else:                         # 3 bits: code j at bit 3j of the row's bit stream, spilling into the next word
        bit = k * BITS
        at = rows[:, None] * WORDS + (bit // 32)[None, :]                           # (BLOCK_M, BLOCK_K)
        live_k = live_m[:, None] & (k < R)[None, :]
        off = (bit % 32).to(tl.uint32)[None, :]
        spill = off > 32 - BITS
        low = tl.load(codes_ptr + at, mask=live_k, other=0).to(tl.uint32, bitcast=True)
        high = tl.load(codes_ptr + at + 1, mask=live_k & spill, other=0).to(tl.uint32, bitcast=True)
        codes = ((low >> off) | (high << ((32 - off) % 32))) & ((1 << BITS) - 1)   # high is 0 unless spilling
        x = codes.to(tl.float32)
    live = live_m[:, None] & (k < R)[None, :]
    if PER_TOKEN:
        meta = rows[:, None] * (R // GROUP) + (k // GROUP)[None, :]
    else:
        meta = (rows // GROUP)[:, None] * R + k[None, :]
    scale = tl.load(scale_ptr + meta, mask=live, other=0).to(tl.float32)
    if HAS_ZERO:
        x = x * scale + tl.load(zero_ptr + meta, mask=live, other=0).to(tl.float32)
    else:
        x = (x - (1 << (BITS - 1))) * scale
    return x, k


@triton.jit
def _remat_kernel(codes_ptr, scale_ptr, zero_ptr, w_ptr, out_ptr, M, R, N_OUT, WORDS,
                  GROUP: tl.constexpr, BITS: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_ZERO: tl.constexpr,
                  FP32: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live_m = m < M
    live_n = n < N_OUT
    rows = m.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, R, BLOCK_K):
        x, k = _dequant_tile(codes_ptr, scale_ptr, zero_ptr, rows, live_m, k0, R, WORDS, GROUP, BITS, PER_TOKEN,
                             HAS_ZERO, BLOCK_K)
        w = tl.load(w_ptr + k[:, None] * N_OUT + n[None, :], mask=(k < R)[:, None] & live_n[None, :], other=0)
        if FP32:
            acc += tl.dot(x, w, input_precision=PRECISION)
        else:
            acc += tl.dot(x.to(w.dtype), w)
    tl.store(out_ptr + rows[:, None] * N_OUT + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, zero_ptr, out_ptr, M, R, WORDS,
                    GROUP: tl.constexpr, BITS: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_ZERO: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live_m = m < M
    rows = m.to(tl.int64)
    x, k = _dequant_tile(codes_ptr, scale_ptr, zero_ptr, rows, live_m, tl.program_id(1) * BLOCK_K, R, WORDS, GROUP,
                         BITS, PER_TOKEN, HAS_ZERO, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * R + k[None, :], x.to(out_ptr.dtype.element_ty),
             mask=live_m[:, None] & (k < R)[None, :])


@triton.jit
def _gather_kernel(codes_ptr, scale_ptr, zero_ptr, win_ptr, src_ptr, out_ptr, N, W, S, R, WORDS, s_wb, s_wn,
                   GROUP: tl.constexpr, BITS: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_ZERO: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(2).to(tl.int64)
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                      # rows of the output
    live_i = i < S
    src = tl.load(src_ptr + i, mask=live_i, other=0).to(tl.int64)
    coded = live_i & (src < N)
    windowed = live_i & (src >= N) & (src < N + W)
    x, k = _dequant_tile(codes_ptr, scale_ptr, zero_ptr, b * N + tl.where(coded, src, 0), coded,
                         tl.program_id(1) * BLOCK_K, R, WORDS, GROUP, BITS, PER_TOKEN, HAS_ZERO, BLOCK_K)
    live_k = (k < R)[None, :]
    row = win_ptr + b * s_wb + tl.where(windowed, src - N, 0)[:, None] * s_wn + k[None, :]
    x = tl.where(windowed[:, None], tl.load(row, mask=windowed[:, None] & live_k, other=0).to(tl.float32), x)
    tl.store(out_ptr + (b * S + i)[:, None] * R + k[None, :], x.to(out_ptr.dtype.element_ty),
             mask=live_i[:, None] & live_k)


@triton.jit
def _weigh_kernel(codes_ptr, scale_ptr, zero_ptr, win_ptr, src_ptr, p_ptr, out_ptr, N, W, S, R, WORDS, HQ, PER_SPLIT,
                  s_wb, s_wn, s_pb, s_ph, GROUP: tl.constexpr, BITS: tl.constexpr, PER_TOKEN: tl.constexpr,
                  HAS_ZERO: tl.constexpr, EXACT_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """One (channel block, split, batch row) of any layout: the split's rows src[i] of [dequant(codes) ; window],
    each element dequantized (_dequant_tile) and rounded to the window's dtype as bmm's operand is, weighed by
    p[b, :, i] rounded the same way, summed into an fp32 (BLOCK_H, BLOCK_K) partial. EXACT_DOT (the interpreter,
    whose bf16 dot is wrong) multiplies the rounded operands as exact fp32, which their products are."""
    k0 = tl.program_id(0) * BLOCK_K
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    k = k0 + tl.arange(0, BLOCK_K)
    dtype = win_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_H, BLOCK_K), dtype=tl.float32)
    start = split * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, S)
    for t in range(start, stop, BLOCK_T):
        i = t + tl.arange(0, BLOCK_T)
        live_i = i < stop
        src = tl.load(src_ptr + i, mask=live_i, other=0).to(tl.int64)
        coded = live_i & (src < N)
        windowed = live_i & (src >= N) & (src < N + W)
        rows = b * N + tl.where(coded, src, 0)
        p = tl.load(p_ptr + b * s_pb + h[:, None] * s_ph + i[None, :], mask=(h < HQ)[:, None] & live_i[None, :],
                    other=0)                                                     # (BLOCK_H, BLOCK_T) fp32
        x, _ = _dequant_tile(codes_ptr, scale_ptr, zero_ptr, rows, coded, k0, R, WORDS, GROUP, BITS, PER_TOKEN,
                             HAS_ZERO, BLOCK_K)
        if tl.max(windowed.to(tl.int32), 0) > 0:                                # a tile with window rows
            exact = tl.load(win_ptr + b * s_wb + tl.where(windowed, src - N, 0)[:, None] * s_wn + k[None, :],
                            mask=windowed[:, None] & (k < R)[None, :], other=0)  # (BLOCK_T, BLOCK_K)
            x = tl.where(windowed[:, None], exact.to(tl.float32), x)
        x = x.to(dtype)
        if EXACT_DOT:
            acc += tl.dot(p.to(dtype).to(tl.float32), x.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(dtype), x)
    out = out_ptr + ((split * tl.num_programs(2) + b) * BLOCK_H + h)[:, None] * R + k[None, :]
    tl.store(out, acc, mask=(h < HQ)[:, None] & (k < R)[None, :])


@triton.jit
def _fold_loads(codes_ptr, scale_ptr, zero_ptr, p_ptr, b, i, src, stop, h, HQ, k0, N, R, WORDS, s_pb, s_ph,
                GROUP: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, ALL_H: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """A tile's operands for _weigh_fold_kernel, rows i (BLOCK_T,) at src: its code words (BLOCK_T, BLOCK_K*b/32),
    each row's scale s and zero's term z + 2^(b-1) s (fp32; 0 where the row is not coded), and p (BLOCK_H, BLOCK_T)
    fp32. ALL_H: HQ == BLOCK_H, no head masked (Llama-3.1-8B's 32 query heads: 6% fewer loop instructions, 1.5%
    less time at 32K, batch 32)."""
    CPW: tl.constexpr = 32 // BITS
    live = i < stop
    coded = live & (src < N)
    rows = b * N + tl.where(coded, src, 0)                                         # row 0 stands in: never weighed
    words = tl.load(codes_ptr + rows[:, None] * WORDS + (k0 // CPW + tl.arange(0, BLOCK_K // CPW))[None, :])
    meta = rows * (R // GROUP) + k0 // GROUP
    scale = tl.load(scale_ptr + meta, mask=coded, other=0).to(tl.float32)
    if HAS_ZERO:
        zero = tl.load(zero_ptr + meta, mask=coded, other=0).to(tl.float32) + (1 << (BITS - 1)) * scale
    else:
        zero = tl.zeros_like(scale)
    heads = live[None, :] if ALL_H else (h < HQ)[:, None] & live[None, :]
    p = tl.load(p_ptr + b * s_pb + h[:, None] * s_ph + i[None, :], mask=heads, other=0)
    return words, scale, zero, p


@triton.jit
def _weigh_fold_kernel(codes_ptr, scale_ptr, zero_ptr, win_ptr, src_ptr, p_ptr, out_ptr, N, W, S, R, WORDS, HQ,
                       PER_SPLIT, s_wb, s_wn, s_pb, s_ph, GROUP: tl.constexpr, BITS: tl.constexpr,
                       HAS_ZERO: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr, CON: tl.constexpr,
                       EXACT_DOT: tl.constexpr, ALL_H: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """_weigh_kernel for per-token groups with the channel block inside one group (b in 2, 4, 8): each row's scale
    folds into its weight. With the codes centered, c' = c - 2^(b-1):
        Σ_t p_t (c_t s_t + z_t) = Σ_t (p_t s_t) c'_t + Σ_t p_t (z_t + 2^(b-1) s_t),
    so the exact codes c' (unpacked in PTX where FAST) are the tensor-core product's A operand and p_t s_t its B
    operand, both fp16 also in a bf16 model, and the zeros' term (0 for symmetric groups) a sum in fp32. The two
    terms cancel where the zero is large; centering and fp16 keep their rounding near bmm's (p_t s_t rounded to
    bf16 with uncentered codes erred up to 8 times more).
    The loop is software-pipelined by hand: a tile's words, scales and p are loaded one tile ahead and its src two
    ahead, so no load waits on another issued in the same step (left to Triton's pipelining, each tile's loads
    waited on its own src and p: 1.4x the time at 128 rows a tile, 5x at 64). Window rows (src in [N, N + W)) weigh nothing there (scale and zero 0); the tiles that hold
    them, found on the way, are weighed again from the window's exact rows (s = 1, z = 0, c' the value, exact in
    fp16 below 65,504)."""
    k0 = tl.program_id(0) * BLOCK_K
    split = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    k = k0 + tl.arange(0, BLOCK_K)
    CPW: tl.constexpr = 32 // BITS
    acc = tl.zeros((BLOCK_K, BLOCK_H), dtype=tl.float32)                           # transposed
    zacc = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)                          # Σ_t p_t z'_t, summed at the end
    start = split * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, S)
    ar = tl.arange(0, BLOCK_T)
    src = tl.load(src_ptr + start + ar, mask=start + ar < stop, other=0).to(tl.int64)
    ahead = _fold_loads(codes_ptr, scale_ptr, zero_ptr, p_ptr, b, start + ar, src, stop, h, HQ, k0, N, R, WORDS,
                        s_pb, s_ph, GROUP, BITS, HAS_ZERO, ALL_H, BLOCK_K)
    src_next = tl.load(src_ptr + start + BLOCK_T + ar, mask=start + BLOCK_T + ar < stop, other=0).to(tl.int64)
    win_lo = stop                                                                  # the tiles with window rows
    win_hi = start
    for t in range(start, stop, BLOCK_T):
        i = t + ar
        words, scale, zero, p = ahead
        windowed = (i < stop) & (src >= N) & (src < N + W)
        ahead = _fold_loads(codes_ptr, scale_ptr, zero_ptr, p_ptr, b, i + BLOCK_T, src_next, stop, h, HQ, k0, N, R,
                            WORDS, s_pb, s_ph, GROUP, BITS, HAS_ZERO, ALL_H, BLOCK_K)
        src = src_next
        src_next = tl.load(src_ptr + i + 2 * BLOCK_T, mask=i + 2 * BLOCK_T < stop, other=0).to(tl.int64)
        found = tl.max(windowed.to(tl.int32), 0) > 0
        win_lo = tl.where(found, tl.minimum(win_lo, t), win_lo)
        win_hi = tl.where(found, t + BLOCK_T, win_hi)
        if FAST:
            c = join_codes(tl.inline_asm_elementwise(ASM, CON, [words], dtype=(tl.float16,) * CPW, is_pure=True,
                                                     pack=2), BITS)
        else:
            c = tl.reshape(unpack_codes(words[:, :, None], (tl.arange(0, CPW) * BITS)[None, None, :], BITS)
                           - (1 << (BITS - 1)), (BLOCK_T, BLOCK_K), can_reorder=False).to(tl.float16)
        if HAS_ZERO:                                                               # symmetric groups: 0
            zacc += p * zero[None, :]
        w = (p * scale[None, :]).to(tl.float16)                                    # (BLOCK_H, BLOCK_T)
        if EXACT_DOT:
            acc += tl.dot(tl.trans(c).to(tl.float32), tl.trans(w).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(c), tl.trans(w))
    WIN_T: tl.constexpr = 16                                                       # rows a window step: few registers
    for t in range(win_lo, win_hi, WIN_T):
        i = t + tl.arange(0, WIN_T)
        live = i < stop
        at = tl.load(src_ptr + i, mask=live, other=0).to(tl.int64)
        windowed = live & (at >= N) & (at < N + W)
        if tl.max(windowed.to(tl.int32), 0) > 0:
            exact = tl.load(win_ptr + b * s_wb + tl.where(windowed, at - N, 0)[:, None] * s_wn + k[None, :],
                            mask=windowed[:, None] & (k < R)[None, :], other=0).to(tl.float16)  # (WIN_T, BLOCK_K)
            w = tl.load(p_ptr + b * s_pb + h[:, None] * s_ph + i[None, :], mask=(h < HQ)[:, None] & windowed[None, :],
                        other=0).to(tl.float16)                                    # (BLOCK_H, WIN_T)
            if EXACT_DOT:
                acc += tl.dot(tl.trans(exact).to(tl.float32), tl.trans(w).to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(tl.trans(exact), tl.trans(w))
    acc = tl.trans(acc) + tl.sum(zacc, 1)[:, None]
    out = out_ptr + ((split * tl.num_programs(2) + b) * BLOCK_H + h)[:, None] * R + k[None, :]
    tl.store(out, acc, mask=(h < HQ)[:, None] & (k < R)[None, :])


SUM_BLOCK = 128      # channels a program of _sum_splits_kernel sums: 8 programs a query row at r = 1,024


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, SPLITS, SPLIT_STRIDE, HQ, BLOCK_H, R, BLOCK: tl.constexpr):
    """out[b, h, k] = Σ_s partials[s, b, h, k] (fp32, in split order), rounded to out's dtype: row b * HQ + h,
    channels [program_id(1) * BLOCK, ...)."""
    row = tl.program_id(0)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    at = ((row // HQ) * BLOCK_H + row % HQ).to(tl.int64) * R + k
    acc = tl.zeros((BLOCK,), tl.float32)
    part = part_ptr + at
    for _ in range(SPLITS):
        acc += tl.load(part, mask=k < R, other=0)
        part += SPLIT_STRIDE
    tl.store(out_ptr + row.to(tl.int64) * R + k, acc.to(out_ptr.dtype.element_ty), mask=k < R)


def _check(q: QTensor, weight: Tensor | None) -> None:
    if not isinstance(q, QTensor):
        raise ValueError(f"expected a kvzoo.cache.kvquant.QTensor, got {type(q).__name__}")
    if q.bits not in REMAT_BITS:
        raise ValueError(f"the rematerialization kernel supports bits in {REMAT_BITS}, got {q.bits} "
                         "(use dequant_matmul_ref)")
    if q.axis not in (-1, -2) or len(q.shape) < 2:
        raise ValueError(f"codes must be quantized per token (axis -1) or per channel (axis -2), got axis {q.axis}")
    if weight is None:
        return
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[0] != q.shape[-1]:
        raise ValueError(f"weight must be (r, n_out) with r = {q.shape[-1]}, got "
                         f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"weight must be fp16, bf16 or fp32, got {weight.dtype}")
    if weight.device != q.codes.device:
        raise ValueError(f"weight is on {weight.device}, the codes on {q.codes.device}")


def dequant_rows(q: QTensor, dtype: torch.dtype, block_m: int = 16, block_k: int = 128) -> Tensor:
    """dequant(q) (..., N, r) in `dtype`, every code read once: the first pass of dequant_matmul's two-pass path.
    The tiles (here and in dequant_gather) were the fastest of a sweep on an H100 (XQuant's 8B latents, 32K x
    1,024, 4-bit: 41 us per call with 16 rows against 119 with 64)."""
    _check(q, None)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be fp16, bf16 or fp32, got {dtype}")
    device = q.codes.device
    check_runnable(_dequant_kernel, device)
    r = q.shape[-1]
    rows = q.codes.numel() // max(q.codes.shape[-1], 1)
    out = torch.empty(*q.shape, dtype=dtype, device=device)
    if rows and r:
        zero = q.zero.contiguous() if q.zero is not None else q.scale    # never read when symmetric
        _dequant_kernel[(triton.cdiv(rows, block_m), triton.cdiv(r, block_k))](
            q.codes.contiguous(), q.scale.contiguous(), zero, out, rows, r, q.codes.shape[-1], GROUP=q.group_size,
            BITS=q.bits, PER_TOKEN=q.axis == -1, HAS_ZERO=q.zero is not None, BLOCK_M=block_m, BLOCK_K=block_k)
    return out


def _check_rows(q: QTensor, window: Tensor, src: Tensor, kernel, dtypes: tuple[torch.dtype, ...] | None = None
                ) -> tuple[int, int, int]:
    """The shared checks of dequant_gather and weigh_gather (window's dtype in `dtypes` when given): (B, N, r)."""
    _check(q, None)
    device = q.codes.device
    check_runnable(kernel, device)
    if len(q.shape) != 3:
        raise ValueError(f"q must be (B, N, r) codes, got shape {tuple(q.shape)}")
    B, N, r = q.shape
    kind = " or ".join(str(t).removeprefix("torch.") for t in dtypes) + " " if dtypes else ""
    if not isinstance(window, Tensor) or window.dim() != 3 or window.shape[0] != B or window.shape[2] != r \
            or window.device != device or window.stride(-1) != 1 or (dtypes and window.dtype not in dtypes):
        raise ValueError(f"window must be a (B={B}, W, r={r}) {kind}tensor on {device} with unit stride on r")
    if not isinstance(src, Tensor) or src.dim() != 1 or src.device != device or src.is_floating_point():
        raise ValueError(f"src must be a 1-D integer tensor of row indices on {device}")
    if q.axis == -2 and N % q.group_size:
        raise ValueError(f"per-channel codes need whole groups: N = {N} is not a multiple of {q.group_size}")
    return B, N, r


def dequant_gather(q: QTensor, window: Tensor, src: Tensor, dtype: torch.dtype, block_m: int = 16,
                   block_k: int = 128, num_warps: int = 4) -> Tensor:
    """Rows of a stream gathered into a new order and dequantized in one pass: q (B, N, r) coded rows, window
    (B, W, r) exact rows after them, src (S,) long -> (B, S, r) in `dtype`, row i = row src[i] of [dequant(q) ;
    window], or zeros where src[i] >= N + W. (XQuant's static step puts the value latents in the key rows' order
    this way before multiplying them, instead of gathering the multiplied rows.)"""
    B, N, r = _check_rows(q, window, src, _gather_kernel)
    device = q.codes.device
    S = src.numel()
    out = torch.empty(B, S, r, dtype=dtype, device=device)
    if B and S and r:
        zero = q.zero.contiguous() if q.zero is not None else q.scale    # never read when symmetric
        _gather_kernel[(triton.cdiv(S, block_m), triton.cdiv(r, block_k), B)](
            q.codes.contiguous(), q.scale.contiguous(), zero, window if window.shape[1] else out, src.contiguous(),
            out, N, window.shape[1], S,
            r, q.codes.shape[-1], window.stride(0), window.stride(1), GROUP=q.group_size, BITS=q.bits,
            PER_TOKEN=q.axis == -1, HAS_ZERO=q.zero is not None, BLOCK_M=block_m, BLOCK_K=block_k,
            num_warps=num_warps)
    return out


def weigh_gather(q: QTensor, window: Tensor, src: Tensor, p: Tensor, block_t: int = 64, block_k: int = 128,
                 num_warps: int = 4, num_stages: int = 2, programs: int | None = None) -> Tensor:
    """Σ_i p[..., i] · row src[i] of [dequant(q) ; window], the gathered rows never written: q (B, N, r) coded rows,
    window (B, W, r) exact rows after them (fp16/bf16), src (S,) long (an index past both: a zero row), p (B, Hq, S)
    -> (B, Hq, r) in window's dtype. XQuant's static step weighs its value latents this way instead of
    bmm(p, dequant_gather(q, window, src)), each code read once instead of written and read again at 16 bits.
    Per-token groups of a multiple of 16 channels fold each row's scale into its weight (_weigh_fold_kernel): the
    codes enter the product exact, p_t s_t rounded to fp16, the zeros' term in fp32, where bmm rounds p_t and
    c_t s_t + z_t to the dtype; other layouts round as bmm does (_weigh_kernel). Split over S (flash-decoding) into
    `programs` programs (default 2 per SM), their fp32 partials summed in split order by a second launch and
    rounded to window's dtype once."""
    B, N, r = _check_rows(q, window, src, _weigh_kernel, (torch.float16, torch.bfloat16))
    device = q.codes.device
    S = src.numel()
    if not isinstance(p, Tensor) or p.dim() != 3 or p.shape[0] != B or p.shape[2] != S or p.device != device \
            or p.stride(-1) != 1:
        raise ValueError(f"p must be a (B={B}, Hq, S={S}) tensor on {device} with unit stride on S")
    Hq = p.shape[1]
    block_h = max(16, triton.next_power_of_2(Hq))                  # tl.dot's smallest M
    fold_k = min(block_k, q.group_size & -q.group_size)            # the largest power of two dividing a group
    fold = q.axis == -1 and 32 % q.bits == 0 and fold_k >= 16      # a channel block inside one per-token group
    block_k = fold_k if fold else block_k
    gluon = fold and xquant_hopper.eligible(q.bits, q.axis, q.group_size, r, Hq, B * S, window)
    block_k, block_t = (xquant_hopper.CHANNELS, xquant_hopper.STEP) if gluon else (block_k, block_t)
    columns = triton.cdiv(r, block_k)
    if programs is None:
        programs = (xquant_hopper.PROGRAMS_PER_SM if gluon else 2) * sm_count(device)
    per_split = triton.cdiv(triton.cdiv(S, max(1, programs // max(1, columns * B))), block_t) * block_t
    splits = max(1, triton.cdiv(S, per_split))
    if not (B and S and r and Hq):
        return torch.zeros(B, Hq, r, dtype=window.dtype, device=device)
    partials = torch.empty(splits, B, block_h, r, dtype=torch.float32, device=device)
    zero = q.zero.contiguous() if q.zero is not None else q.scale    # never read when symmetric
    codes = q.codes.contiguous() if N else q.codes.new_zeros(1, 1, q.codes.shape[-1])    # row 0 is read unmasked
    scale, window_rows, src = q.scale.contiguous(), window if window.shape[1] else window.new_empty(1, 1, r), \
        src.contiguous()
    args = (codes, scale, zero, window_rows, src, p, partials, N, window.shape[1], S, r, q.codes.shape[-1], Hq,
            per_split, window.stride(0), window.stride(1), p.stride(0), p.stride(1))
    common = dict(GROUP=q.group_size, BITS=q.bits, HAS_ZERO=q.zero is not None, BLOCK_H=block_h, BLOCK_T=block_t,
                  BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    if gluon:
        xquant_hopper.weigh_splits(codes, scale, zero if q.zero is not None else None, window_rows, window.shape[1],
                                   src, p, partials, N, r, q.group_size, per_split)
    elif fold:
        fast = unpacks_in_ptx(window)
        asm, con = unpack_asm(q.bits, centered=True) if fast else ("", "")
        _weigh_fold_kernel[(columns, splits, B)](
            *args, FAST=fast, ASM=asm, CON=con, EXACT_DOT=isinstance(_weigh_fold_kernel, InterpretedFunction),
            ALL_H=Hq == block_h, **common)
    else:
        _weigh_kernel[(columns, splits, B)](
            *args, PER_TOKEN=q.axis == -1, EXACT_DOT=isinstance(_weigh_kernel, InterpretedFunction), **common)
    out = torch.empty(B, Hq, r, dtype=window.dtype, device=device)
    _sum_splits_kernel[(B * Hq, triton.cdiv(r, SUM_BLOCK))](partials, out, splits, B * block_h * r, Hq, block_h, r,
                                                            BLOCK=SUM_BLOCK)
    return out


def tile_configs(block_m: int, block_n: int, num_stages: int) -> list[tuple[int, int, int]]:
    """(BLOCK_M, BLOCK_N, num_stages) to try, the asked tiles first, then each step smaller: fewer pipeline stages,
    then narrower N tiles (every N tile dequantizes its rows again, so N shrinks late), then shorter M tiles."""
    out = [(block_m, block_n, num_stages)]
    while True:
        m, n, stages = out[-1]
        if stages > 1:
            out.append((m, n, stages - 1))
        elif n > 32:
            out.append((m, n // 2, min(num_stages, 2)))
        elif m > 16:
            out.append((m // 2, n, 1))
        else:
            return out


_FITTING: dict[tuple, tuple[int, int, int]] = {}     # (device, dtype, bits, layout, asked tiles) -> tiles that fit


def dequant_matmul(q: QTensor, weight: Tensor, block_m: int = 64, block_n: int | None = None, block_k: int = 64,
                   num_warps: int = 4, num_stages: int = 3, two_pass: bool | None = None) -> Tensor:
    """dequant(q) @ weight, (..., N, r) @ (r, n_out) -> (..., N, n_out) in weight's dtype.
    two_pass (default on a GPU: fp16/bf16 weights, and 3-bit codes, whose spilling codes the fused kernel reads
    slowly) dequantizes the rows once (dequant_rows) and multiplies them with torch.mm (cuBLAS); otherwise one
    fused kernel, whose every output tile dequantizes its rows again (fp32 weights: tf32x3 dots, which cuBLAS
    has no equivalent of). H100, 32K rows, bf16 weights: 1,024 -> 1,024 (XQuant's 8B latents, 4-bit) 0.14 ms in
    two passes against 0.32 fused; 2,048 -> 4,096 (XQuant-CL's 8B deltas) 0.92 against 3.46 (2-bit) and 1.18
    against 25.9 (3-bit).
    The default tiles were the fastest of a sweep on an H100 (2/4-bit, r = 192 ... 4096): BLOCK_N = 256 (128 for
    n_out <= 192), since every output tile dequantizes its rows again. Tiles whose compiled kernel needs more
    shared memory than the device has (fp32 weights: tf32x3 dots keep split copies of both tiles) step down
    `tile_configs` until one fits, and the fitting tiles are remembered per device, dtype and layout."""
    _check(q, weight)
    check_runnable(_remat_kernel, weight.device)
    r, n_out = weight.shape
    rows = q.codes.numel() // max(q.codes.shape[-1], 1)                 # M = prod(leading dims) * N
    out = torch.empty(*q.shape[:-1], n_out, dtype=weight.dtype, device=weight.device)
    if rows == 0 or n_out == 0:
        return out
    if two_pass is None:
        two_pass = weight.is_cuda and (weight.dtype != torch.float32 or 32 % q.bits != 0)
    if two_pass:
        torch.mm(dequant_rows(q, weight.dtype).view(rows, r), weight, out=out.view(rows, n_out))
        return out
    codes, scale = q.codes.contiguous(), q.scale.contiguous()
    zero = q.zero.contiguous() if q.zero is not None else scale        # never read when symmetric
    asked = (block_m, block_n or (256 if n_out > 192 else 128), num_stages)
    key = (str(weight.device), weight.dtype, q.bits, q.axis, q.group_size, q.zero is not None, block_k, num_warps,
           asked)
    for bm, bn, stages in ([_FITTING[key]] if key in _FITTING else tile_configs(*asked)):
        grid = (triton.cdiv(rows, bm), triton.cdiv(n_out, bn))
        try:
            _remat_kernel[grid](codes, scale, zero, weight.contiguous(), out, rows, r, n_out, codes.shape[-1],
                                GROUP=q.group_size, BITS=q.bits, PER_TOKEN=q.axis == -1, HAS_ZERO=q.zero is not None,
                                FP32=weight.dtype == torch.float32,
                                PRECISION="tf32x3" if weight.is_cuda else "ieee",
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, num_warps=num_warps, num_stages=stages)
        except OutOfResources:
            continue
        _FITTING[key] = (bm, bn, stages)
        return out
    raise RuntimeError(f"no tile of the rematerialization kernel fits {weight.device}'s shared memory "
                       f"(tried down from BLOCK_M, BLOCK_N, stages = {asked})")


def dequant_matmul_ref(q: QTensor, weight: Tensor) -> Tensor:
    """The torch reference: dequantize in fp32, multiply in fp32, cast to weight's dtype."""
    return (dequantize(q, torch.float32) @ weight.float()).to(weight.dtype)
