"""Weight-only 4-bit matmul (W4A16) for AWQ-quantized linear layers (kv-pareto.md §4.3: AWQ, 4-bit unsigned,
asymmetric, group 128 along the input channels).

    out (..., N) = x (..., K) @ dequant(w) (N, K)ᵀ        x fp16/bf16/fp32, out in x's dtype

Layout (W4Weight, built by kvzoo.cache.kvquant.quantize(w, 4, G, axis=-1) on the (out_features, in_features)
weight, codes then put in panel order): groups of G consecutive input channels of one output row share an fp16
scale and zero,
    codes  int32 (N, K/8)    code k of row n sits at bits (k*4) % 32 of word k // 8 (one bit stream along K)
    scale  fp16  (N, K/G)    w'[n, k] = code * scale[n, k // G] + zero[n, k // G]
    zero   fp16  (N, K/G)
so a weight costs 0.5 + 4/G bytes (0.53125 at G = 128). G must be a multiple of 8, so that a word of codes
never straddles two groups, and divide K.

Panel order (where K is a multiple of 128): the codes lie in panels of 64 rows (the last panel the N mod 64 rows
left), one panel after another; inside a panel 16 words (128 input channels) of each row, row after row, then the
next 16 words (to_panels, panel_offsets). So the 64 rows' codes of one 128-channel step are 4 KB in one piece, where
rows in order put 64 bytes of each row 2 KB apart at K = 4,096: an 8B transformer block's 4-bit products at one row
of x take 45.4 µs on an H200 in place of 50.2 (docs/decode.md). Scales and zeros keep rows in order, and other K
keep the codes' rows in order. The codes keep their (N, K/8) shape, so rows [64 i, 64 j) of the panel order are
those rows' own panel order: layers joined at multiples of 64 rows stay one weight (W4Linear.join).

Three kernels here, and one more for 1-16 rows on Hopper (kvzoo/kernels/w4a16_hopper.py, in Gluon: the codes
unpacked straight into the tensor cores' register operand; w4a16_matmul takes it with default tiles where it
applies). The one-row kernel (decode at batch 1: M = 1, G a power of two >= 16) sums on CUDA cores in the order
the codes are unpacked: code j of word w of a step is channel 8w + j, so x is loaded in that order (eight strided
(W,) vectors, W words per row and step) and no unpacked code is moved between threads. A step of block_k channels
(whole groups) takes a (BLOCK_N, W) tile of words, its codes as exact fp16/bf16 values (inline PTX; exact fp32 in
the interpreter and for fp32 x), products with x summed in fp32 per word; each word's sum is scaled by its group's
scale and kept per word until the end of the loop, with z sum_k x[k] per group: sum_k x[k] (c[k] s + z) = s (x . c)
+ z sum_k x[k]. The next step's words, scales and zeros are loaded before this step's sums (register double-
buffering), so a program always has a load in flight.

The group kernel (2-64 rows by default, any M with its tiles; G a power of two >= 16, AWQ's 128) multiplies the raw
codes on tensor cores: within a group, sum_k x[k] (c[k] s + z) = s (x . c) + z sum_k x[k], so a step of one group
unpacks a (BLOCK_N, G/8) tile of words into exact fp16/bf16 codes (inline PTX on CUDA: a code OR-ed into the
mantissa of a power of two, half2 at a time; quant_matvec.unpack_asm), takes (BLOCK_N, G) codes times the (G,
BLOCK_M) tile of x on tensor cores with fp32 accumulation, and applies the group's scale and zero to that (BLOCK_N,
BLOCK_M) product in fp32; the next group's operands are loaded before this one's product. The tile is computed
transposed (outputs x rows), so a few rows of x pad only the narrow side of the tensor-core tile (16 rows). Split-K
runs inside both kernels: each of a tile's splits stores its fp32 partial sums, and the last to finish (a per-tile
counter) adds them in split order, rounds once, and resets the counter, so a call is one launch. Against the
reference (below) they differ by the reference's rounding of each dequantized weight to x's dtype, and the summation
order.

The general kernel (prefill rows, other group sizes, explicit tiles with block_k > 0) follows the reference's
rounding: each weight is dequantized in fp32 (code * scale + zero), rounded to x's dtype (a no-op for fp32),
and multiplied with x in fp32 (fp32 accumulation; exact fp32 products, input_precision "ieee", when x is
fp32); the result is rounded once to x's dtype, so only the summation order differs. x is flattened to
(M, K); a program computes a (BLOCK_M, BLOCK_N) tile of out over its share of K (split-K: the K steps divided
among `split_k` programs, each writing fp32 partial sums that are added and rounded once afterwards), in
BLOCK_K steps. Each step loads a (BLOCK_N, BLOCK_K/8) tile of words and each word's group's scale/zero,
unpacks the words (BLOCK_N, BLOCK_K/8, 8) -> (BLOCK_N, BLOCK_K) with the exact 2^23 trick of
quant_matvec.unpack_codes, and multiplies by the (BLOCK_M, BLOCK_K) tile of x: tl.dot against the transposed
tile for M > 4, broadcast products summed over K for M <= 4. Rows past M, outputs past N and channels past K
are masked. Default tiles (`default_tiles`) were picked on an H100 with repro/kvpareto/bench.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.cache.kvquant import QTensor, dequantize, quantize
from kvzoo.kernels.quant_matvec import (check_runnable, check_tensor, join_codes, sm_count, unpack_asm, unpack_codes,
                                        unpacks_in_ptx)

try:
    from kvzoo.kernels import w4a16_hopper
except ImportError:          # a Triton without Gluon's Hopper API (older releases): the Triton kernels serve all
    w4a16_hopper = None

BITS = 4
CODES_PER_WORD = 32 // BITS
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PANEL_ROWS, PANEL_WORDS = 64, 16                 # a panel's rows; a code panel's words a row (128 input channels)


def in_panels(K: int) -> bool:
    """Whether a weight of K input channels keeps its codes in panel order (module docstring)."""
    return K % (PANEL_WORDS * CODES_PER_WORD) == 0


def to_panels(codes: Tensor) -> Tensor:
    """codes (N, K/8) with rows in order -> the same shape in panel order (module docstring)."""
    N, W = codes.shape
    whole = N // PANEL_ROWS * PANEL_ROWS
    head = codes[:whole].reshape(N // PANEL_ROWS, PANEL_ROWS, W // PANEL_WORDS, PANEL_WORDS)  # panel, row, step, word
    tail = codes[whole:].reshape(N - whole, W // PANEL_WORDS, PANEL_WORDS)                    # row, step, word
    return torch.cat([head.transpose(1, 2).flatten(), tail.transpose(0, 1).flatten()]).view(N, W)


def from_panels(codes: Tensor) -> Tensor:
    """to_panels' inverse: codes (N, K/8) in panel order -> rows in order."""
    N, W = codes.shape
    whole = N // PANEL_ROWS * PANEL_ROWS
    flat = codes.flatten()
    head = flat[:whole * W].view(N // PANEL_ROWS, W // PANEL_WORDS, PANEL_ROWS, PANEL_WORDS).transpose(1, 2)
    tail = flat[whole * W:].view(W // PANEL_WORDS, N - whole, PANEL_WORDS).transpose(0, 1)
    return torch.cat([head.reshape(whole, W), tail.reshape(N - whole, W)])


@triton.jit
def panel_rows(n, N, W, PANELS: tl.constexpr, WHOLE: tl.constexpr):
    """The parts of panel_offsets that depend on the row alone, for rows n of (N, W) code words: (start, stride),
    word (n, w) at start + (w // 16) * stride + w % 16 (panel_at); a kernel takes them once, before its loop.
    WHOLE (N a multiple of 64: every panel whole): the stride is a constant, so that the word's part of an offset
    is the same for every row."""
    if PANELS and WHOLE:
        return (n // 64) * 64 * W + (n % 64) * 16, 64 * 16
    elif PANELS:
        p = n // 64
        rows = tl.minimum(N - p * 64, 64)                          # the panel's rows: 64, or the last panel's
        return p * 64 * W + (n % 64) * 16, rows * 16
    else:
        return n * W, 16


@triton.jit
def panel_at(start, stride, w):
    """Offsets of words w of the rows whose panel_rows are (start, stride) (broadcast together)."""
    return start + (w // 16) * stride + w % 16


@triton.jit
def panel_offsets(n, w, N, W, PANELS: tl.constexpr):
    """Offsets of code words (n, w) of (N, W) words (n and w broadcast together): in panel order where PANELS
    (to_panels), else rows in order."""
    start, stride = panel_rows(n, N, W, PANELS, False)
    return panel_at(start, stride, w)


@dataclass
class W4Weight:
    """A (N, K) weight as asymmetric 4-bit codes with one fp16 scale and zero per group of G input channels."""

    codes: Tensor            # int32 (N, K/8), panel order where in_panels(K)
    scale: Tensor            # fp16 (N, K/G)
    zero: Tensor             # fp16 (N, K/G)
    group_size: int
    shape: tuple[int, int]   # (N, K) = (out_features, in_features)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes

    def rows(self) -> tuple[Tensor, Tensor, Tensor]:
        """codes, scale and zero with their rows in order (kvzoo.cache.kvquant's layout)."""
        codes = from_panels(self.codes) if in_panels(self.shape[1]) else self.codes
        return codes, self.scale, self.zero

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(N, K): dequantized in fp32, then rounded to dtype."""
        q = QTensor(*self.rows(), BITS, self.group_size, -1, self.shape)
        return dequantize(q, torch.float32).to(dtype)


def _check_group(K: int, group_size: int) -> None:
    if group_size <= 0 or group_size % CODES_PER_WORD:
        raise ValueError(f"group_size must be a positive multiple of {CODES_PER_WORD} (a word of 4-bit codes "
                         f"never straddles two groups), got {group_size}")
    if K % group_size:
        raise ValueError(f"K = {K} (in_features) is not a multiple of the group size {group_size}")


def quantize_weight(w: Tensor, group_size: int = 128) -> W4Weight:
    """w (N, K) = (out_features, in_features), fp32/fp16/bf16 -> asymmetric 4-bit codes, groups of group_size
    consecutive input channels per output row."""
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ValueError(f"w must be a 2-D (out_features, in_features) tensor, got "
                         f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
    if w.dtype not in X_DTYPES:
        raise ValueError(f"w must be fp16, bf16 or fp32, got {w.dtype}")
    _check_group(w.shape[1], group_size)
    q = quantize(w, BITS, group_size, axis=-1)
    if in_panels(w.shape[1]):
        return W4Weight(to_panels(q.codes), q.scale, q.zero, group_size, tuple(w.shape))
    return W4Weight(q.codes, q.scale, q.zero, group_size, tuple(w.shape))


@triton.jit
def _w4a16_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, STEPS_PER_SPLIT,
                  GROUP: tl.constexpr, PANELS: tl.constexpr, WHOLE: tl.constexpr, IEEE: tl.constexpr,
                  DOT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    CPW: tl.constexpr = 8                            # 4-bit codes per int32 word
    KW: tl.constexpr = BLOCK_K // CPW                # words per weight row per step
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    live_m = m < M
    live_n = n < N
    rows = m.to(tl.int64)
    cols = n.to(tl.int64)
    words_per_row = K // CPW
    groups_per_row = K // GROUP
    w_start, w_stride = panel_rows(cols[:, None], N, words_per_row, PANELS, WHOLE)
    shifts = (tl.arange(0, CPW) * 4)[None, None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = split * STEPS_PER_SPLIT * BLOCK_K
    k_end = tl.minimum(k_first + STEPS_PER_SPLIT * BLOCK_K, K)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                     mask=live_m[:, None] & (k < K)[None, :], other=0)                  # (BLOCK_M, BLOCK_K)
        wi = k0 // CPW + tl.arange(0, KW)                                              # word index in the row
        live_w = live_n[:, None] & (wi < words_per_row)[None, :]
        words = tl.load(codes_ptr + panel_at(w_start, w_stride, wi[None, :]), mask=live_w, other=0)
        meta = cols[:, None] * groups_per_row + (wi // (GROUP // CPW))[None, :]         # (BLOCK_N, KW): a word's group
        scale = tl.load(scale_ptr + meta, mask=live_w, other=0).to(tl.float32)
        zero = tl.load(zero_ptr + meta, mask=live_w, other=0).to(tl.float32)
        w = unpack_codes(words[:, :, None], shifts, 4) * scale[:, :, None] + zero[:, :, None]  # (BLOCK_N, KW, CPW)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K), can_reorder=False).to(xt.dtype)           # (BLOCK_N, BLOCK_K)
        if DOT:
            if IEEE:
                acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(w))
        else:                                        # a few rows: broadcast products, no tensor-core tile
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out_ptr += split.to(tl.int64) * M * N            # this split's partial sums (one plane when not split)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


@triton.jit
def _codes_step(codes_ptr, scale_ptr, zero_ptr, rows, live_n, g, g_end, GROUP: tl.constexpr, GPS: tl.constexpr):
    """Groups g .. g + GPS - 1 of BLOCK_N weight rows: words (BLOCK_N, GPS*G/8), scale and zero (BLOCK_N, GPS)
    as stored (groups at or past g_end masked to 0). rows: the rows' panel_rows and their first group's offset."""
    KW: tl.constexpr = GROUP // 8
    w_start, w_stride, g_start = rows
    wi = tl.arange(0, GPS * KW)
    gi = tl.arange(0, GPS)
    # a word a lane (scalar loads, as of rows in order): the layout of x's vectors in the one-row kernel
    at = tl.max_contiguous(panel_at(w_start, w_stride, (g * KW + wi)[None, :]), [1, 1])
    words = tl.load(codes_ptr + at, mask=live_n[:, None] & (g + wi // KW < g_end)[None, :], other=0)
    meta = g_start + (g + gi)[None, :]
    live = live_n[:, None] & (g + gi < g_end)[None, :]
    return words, tl.load(scale_ptr + meta, mask=live, other=0), tl.load(zero_ptr + meta, mask=live, other=0)


@triton.jit
def _store_splits(acc, out, part, live, PLANE, split, SPLIT: tl.constexpr, count_ptr, tile):
    """Store a tile's fp32 sums at out, in out's dtype. Split over K: each split stores its partial sums in its
    plane of part; the last split of the tile to finish (a per-tile counter) adds all of them in split order (the
    same sum whichever finishes last), rounds once, and resets the counter."""
    if SPLIT == 1:
        tl.store(out, acc.to(out.dtype.element_ty), mask=live)
    else:
        tl.store(part + split * PLANE, acc, mask=live)
        tl.debug_barrier()                           # every thread's partial is written before the count
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for other in range(SPLIT):
                total += tl.load(part + other * PLANE, mask=live, other=0, cache_modifier=".cg")
            tl.store(out, total.to(out.dtype.element_ty), mask=live)
            tl.atomic_xchg(count_ptr + tile, 0)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, part_ptr, count_ptr, N, K,
                       GROUPS_PER_SPLIT, GROUP: tl.constexpr, GPS: tl.constexpr, SPLIT: tl.constexpr,
                       PANELS: tl.constexpr, WHOLE: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr,
                       CON: tl.constexpr, BLOCK_N: tl.constexpr):
    KW: tl.constexpr = GROUP // 8                    # words of codes per weight row per group
    W: tl.constexpr = GPS * KW                       # words per weight row per step
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    live_n = n < N
    cols = n.to(tl.int64)
    words_per_row = K // 8
    groups_per_row = K // GROUP
    wi = tl.arange(0, W)
    kk = tl.arange(0, GPS * GROUP)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)                                     # zero * sum(x) terms
    acc_w = tl.zeros((BLOCK_N, W), dtype=tl.float32)                                 # scale * (x . c) per word
    g_first = split * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_first + GROUPS_PER_SPLIT, groups_per_row)
    w_start, w_stride = panel_rows(cols[:, None], N, words_per_row, PANELS, WHOLE)
    at = (w_start, w_stride, cols[:, None] * groups_per_row)                      # the rows' parts of the offsets
    words, scale, zero = _codes_step(codes_ptr, scale_ptr, zero_ptr, at, live_n, g_first, g_end, GROUP, GPS)
    for g in range(g_first, g_end, GPS):
        # the next step's codes are loaded before this step's sums
        words_n, scale_n, zero_n = _codes_step(codes_ptr, scale_ptr, zero_ptr, at, live_n, g + GPS, g_end, GROUP,
                                               GPS)
        live_k = g + kk // GROUP < g_end
        xg = tl.load(x_ptr + g * GROUP + kk, mask=live_k, other=0).to(tl.float32)       # (GPS*G,)
        x_sum = tl.sum(tl.reshape(xg, (GPS, GROUP)), 1)                                  # (GPS,) per group
        live_w = g + wi // KW < g_end
        part = tl.zeros((BLOCK_N, W), dtype=tl.float32)                                # x . c per word
        if FAST:        # codes as exact half2 values in PTX: output j is code j of each word
            o = tl.inline_asm_elementwise(ASM, CON, [words], dtype=(x_ptr.dtype.element_ty,) * 8, is_pure=True,
                                          pack=2)
            for j in tl.static_range(8):
                xj = tl.load(x_ptr + g * GROUP + wi * 8 + j, mask=live_w, other=0).to(tl.float32)  # (W,)
                part += o[j].to(tl.float32) * xj[None, :]
        else:
            for j in tl.static_range(8):
                xj = tl.load(x_ptr + g * GROUP + wi * 8 + j, mask=live_w, other=0).to(tl.float32)  # (W,)
                part += unpack_codes(words, 4 * j, 4) * xj[None, :]
        # scale each word's sum by its group's scale, (BLOCK_N, GPS) -> (BLOCK_N, GPS, KW) -> (BLOCK_N, W); the sum
        # across words (across threads) waits until after the loop
        word_scale = tl.reshape(tl.broadcast_to(scale.to(tl.float32)[:, :, None], (BLOCK_N, GPS, KW)), (BLOCK_N, W))
        acc_w += part * word_scale
        acc += tl.sum(zero.to(tl.float32) * x_sum[None, :], 1)
        words, scale, zero = words_n, scale_n, zero_n
    acc += tl.sum(acc_w, 1)
    _store_splits(acc, out_ptr + cols, part_ptr + cols, live_n, N, split, SPLIT, count_ptr, tl.program_id(0))


@triton.jit
def _w4a16_group_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, part_ptr, count_ptr, M, N, K, PLANE,
                        GROUPS_PER_SPLIT, GROUP: tl.constexpr, SPLIT: tl.constexpr, PANELS: tl.constexpr,
                        WHOLE: tl.constexpr, IEEE: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr,
                        CON: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    live_n = n < N
    live_m = m < M
    cols = n.to(tl.int64)
    rows = m.to(tl.int64)
    words_per_row = K // 8
    groups_per_row = K // GROUP
    kk = tl.arange(0, GROUP)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)                              # out transposed
    g_first = split * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_first + GROUPS_PER_SPLIT, groups_per_row)
    xt = tl.load(x_ptr + rows[None, :] * K + (g_first * GROUP + kk)[:, None],
                 mask=live_m[None, :] & (g_first * GROUP + kk < g_end * GROUP)[:, None], other=0)  # (GROUP, BLOCK_M)
    w_start, w_stride = panel_rows(cols[:, None], N, words_per_row, PANELS, WHOLE)
    at = (w_start, w_stride, cols[:, None] * groups_per_row)                      # the rows' parts of the offsets
    words, scale, zero = _codes_step(codes_ptr, scale_ptr, zero_ptr, at, live_n, g_first, g_end, GROUP,
                                     1)                                                # (BLOCK_N, G/8), (BLOCK_N, 1)
    for g in range(g_first, g_end):
        # the next group's operands are loaded before this group's product
        xt_n = tl.load(x_ptr + rows[None, :] * K + ((g + 1) * GROUP + kk)[:, None],
                       mask=live_m[None, :] & ((g + 1) * GROUP + kk < g_end * GROUP)[:, None], other=0)
        words_n, scale_n, zero_n = _codes_step(codes_ptr, scale_ptr, zero_ptr, at, live_n, g + 1, g_end, GROUP, 1)
        if FAST:        # codes as exact half2 values in PTX
            o = tl.inline_asm_elementwise(ASM, CON, [words], dtype=(xt.dtype,) * 8, is_pure=True, pack=2)
            c = join_codes(o, 4)                                                       # (BLOCK_N, GROUP)
        else:
            c = tl.reshape(unpack_codes(words[:, :, None], shifts, 4), (BLOCK_N, GROUP),
                           can_reorder=False).to(xt.dtype)                             # (BLOCK_N, GROUP)
        if IEEE:
            d = tl.dot(c, xt, input_precision="ieee")                                  # (BLOCK_N, BLOCK_M)
        else:
            d = tl.dot(c, xt)
        # sum_k x[k] (c[k] scale + zero) = scale * (x . c) + zero * sum_k x[k], per row and group
        acc += scale.to(tl.float32) * d + zero.to(tl.float32) * tl.sum(xt.to(tl.float32), 0)[None, :]
        xt, words, scale, zero = xt_n, words_n, scale_n, zero_n
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    _store_splits(acc, out_ptr + rows[None, :] * N + cols[:, None], part_ptr + rows[None, :] * N + cols[:, None],
                  live_n[:, None] & live_m[None, :], PLANE, split, SPLIT, count_ptr, tile)


def _check(x: Tensor, w: W4Weight) -> None:
    if not isinstance(w, W4Weight):
        raise ValueError(f"expected a W4Weight (quantize_weight), got {type(w).__name__}")
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor (..., K), got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input channels, the weight {tuple(w.shape)} expects K = {K}")
    _check_group(K, w.group_size)
    check_tensor(w.codes, "codes", (N, K // CODES_PER_WORD), (torch.int32,), x.device)
    check_tensor(w.scale, "scale", (N, K // w.group_size), (torch.float16,), x.device)
    check_tensor(w.zero, "zero", (N, K // w.group_size), (torch.float16,), x.device)


@dataclass(frozen=True)
class Tiles:
    """A launch configuration: rows BLOCK_M (0: by M), outputs BLOCK_N, channels BLOCK_K per step (0: the group
    kernel, one group per step), split_k (K divided among that many programs; 0: enough programs to fill the
    GPU). gemv: the one-row kernel (one row of x), block_k channels (a power-of-two number of whole groups, at
    least one) per step."""

    block_m: int = 0
    block_n: int = 64
    block_k: int = 64
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3
    gemv: bool = False


GEMV_ROWS = 4                                   # up to this many rows, the broadcast (non-tl.dot) path
GROUP_ROWS = 64                                 # up to this many rows, the group kernel (groups of >= 16)
# The winners of repro/kvpareto/bench.py's sweeps on an H100 (results/kvpareto/):
ONE_ROW = Tiles(block_n=16, block_k=256, num_warps=1, num_stages=1, gemv=True)  # M = 1, G a power of two >= 16
GROUPED = Tiles(block_n=64, block_k=0, num_stages=3)                  # M <= GROUP_ROWS, G a power of two >= 16
DECODE_LONG_K = Tiles(block_n=16, block_k=512)                        # M <= GEMV_ROWS, K >= 2048, other G
DECODE = Tiles(block_n=32, block_k=128, num_warps=8)                  # M <= GEMV_ROWS, small K, other G
SMALL = Tiles(block_m=16, block_n=32, block_k=128)                    # M <= 16, other G
PREFILL = Tiles(block_m=128, block_n=64, block_k=64, num_stages=4)    # larger M


def grouped_ok(group_size: int) -> bool:
    """The group kernel's steps are whole groups: a power of two of at least 16 channels (a tl.dot's depth)."""
    return group_size >= 16 and group_size & (group_size - 1) == 0


def default_tiles(M: int, K: int, group_size: int = 128) -> Tiles:
    if M == 1 and grouped_ok(group_size):
        return ONE_ROW if group_size <= ONE_ROW.block_k else Tiles(**{**vars(ONE_ROW), "block_k": group_size})
    if M <= GROUP_ROWS and grouped_ok(group_size):
        return GROUPED
    if M <= GEMV_ROWS:
        return DECODE_LONG_K if K >= 2048 else DECODE
    return SMALL if M <= 16 else PREFILL


# split-K sizing, programs per multiprocessor: the general kernel's two keep the memory system busy; the group
# kernel's four per SM (the most its registers allow; two for tiles of more than 16 rows), of at least two groups
# each, load the device evenly; the one-row kernel's sixteen (one warp each), of at least two steps each
# (results/kvpareto/w4a16-8b-h100.md)
PROGRAMS_PER_SM = 2
GROUPED_PROGRAMS_PER_SM = 4
ONE_ROW_PROGRAMS_PER_SM = 16
ONE_ROW_REGISTERS = 128         # the register cap (ptxas maxnreg) at which sixteen one-warp programs fill an SM


_COUNTERS: dict[torch.device, Tensor] = {}


def _counters(device: torch.device, n: int) -> Tensor:
    """The group kernel's per-tile split counters: zero between launches (the last split of a tile resets its
    own), so they are allocated once per device (at least 4096, so a CUDA-graph capture rarely grows them)."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        c = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c


def _one_row(x2: Tensor, w: W4Weight, t: Tiles) -> Tensor:
    """The one-row kernel on x2 (1, K) -> (1, N): codes times x summed on CUDA cores in unpacking order, split
    over K inside the kernel."""
    K = x2.shape[1]
    N, G = w.shape[0], w.group_size
    per_step = t.block_k // G                                           # groups per step
    tiles_n = triton.cdiv(N, t.block_n)
    steps = triton.cdiv(K // G, per_step)
    split = t.split_k or max(1, min(steps // 2, ONE_ROW_PROGRAMS_PER_SM * sm_count(x2.device) // tiles_n))
    per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per_split)                               # no empty splits
    out = torch.empty(1, N, dtype=x2.dtype, device=x2.device)
    part = torch.empty(split, 1, N, dtype=torch.float32, device=x2.device) if split > 1 else out
    asm, con = unpack_asm(4, x2.dtype == torch.bfloat16)
    _w4a16_gemv_kernel[(tiles_n, split)](
        x2, w.codes, w.scale, w.zero, out, part, _counters(x2.device, tiles_n), N, K, per_split * per_step,
        GROUP=G, GPS=per_step, SPLIT=split, PANELS=in_panels(K), WHOLE=N % PANEL_ROWS == 0,
        FAST=unpacks_in_ptx(x2), ASM=asm, CON=con, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages,
        maxnreg=ONE_ROW_REGISTERS)
    return out


def _grouped(x2: Tensor, w: W4Weight, t: Tiles) -> Tensor:
    """The group kernel on x2 (M, K) -> (M, N): raw codes times x on tensor cores, each group's scale and zero
    applied to its (BLOCK_N, BLOCK_M) product; the tile is computed transposed (outputs x rows), so that a few
    rows of x pad only the small side of the tensor-core tile."""
    M, K = x2.shape
    N, G = w.shape[0], w.group_size
    block_m = t.block_m or max(16, triton.next_power_of_2(M))
    tiles_mn = triton.cdiv(N, t.block_n) * triton.cdiv(M, block_m)
    groups = K // G
    per_sm = GROUPED_PROGRAMS_PER_SM if block_m <= 16 else GROUPED_PROGRAMS_PER_SM // 2   # larger tiles: fewer
    split = t.split_k or max(1, min(groups // 2, per_sm * sm_count(x2.device) // tiles_mn))
    per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, per_split)                              # no empty splits
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else out
    fast = unpacks_in_ptx(x2)
    asm, con = unpack_asm(4, x2.dtype == torch.bfloat16)
    _w4a16_group_kernel[(triton.cdiv(N, t.block_n), triton.cdiv(M, block_m), split)](
        x2, w.codes, w.scale, w.zero, out, part, _counters(x2.device, tiles_mn), M, N, K, M * N, per_split,
        GROUP=G, SPLIT=split, PANELS=in_panels(K), WHOLE=N % PANEL_ROWS == 0, IEEE=x2.dtype == torch.float32,
        FAST=fast, ASM=asm, CON=con,
        BLOCK_M=block_m, BLOCK_N=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def w4a16_matmul(x: Tensor, w: W4Weight, tiles: Tiles | None = None) -> Tensor:
    """x (..., K) @ dequant(w)ᵀ -> (..., N) in x's dtype (see the module docstring for the rounding).
    tiles None: the Gluon kernel where it applies (w4a16_hopper.eligible), else default_tiles(M, K, group), M = the
    number of rows of x."""
    _check(x, w)
    check_runnable(_w4a16_kernel, x.device)
    N, K = w.shape
    x2 = x.reshape(-1, K).contiguous()                                  # (M, K), M = prod(leading dims)
    M = x2.shape[0]
    t = tiles or default_tiles(M, K, w.group_size)
    if t.block_k % CODES_PER_WORD:
        raise ValueError(f"block_k must be a multiple of {CODES_PER_WORD} (whole words of codes), got {t.block_k}")
    if t.block_k == 0 and not grouped_ok(w.group_size):
        raise ValueError(f"the group kernel (block_k = 0) needs a group size that is a power of two >= 16, "
                         f"got {w.group_size}")
    if t.gemv:
        if M != 1:
            raise ValueError(f"the one-row kernel (gemv tiles) takes one row of x, got {M}")
        if not grouped_ok(w.group_size) or t.block_k < w.group_size or t.block_k & (t.block_k - 1):
            raise ValueError(f"the one-row kernel needs a group size that is a power of two >= 16 and block_k a "
                             f"power-of-two multiple of it, got group {w.group_size}, block_k {t.block_k}")
    if not (M and N):
        return torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    codes, scale, zero = w.codes.contiguous(), w.scale.contiguous(), w.zero.contiguous()
    if tiles is None and w4a16_hopper is not None and w4a16_hopper.eligible(x2, w.group_size, N, K):
        out = w4a16_hopper.w4a16_hopper(x2, codes, scale, zero, w.group_size,
                                        _counters(x.device, triton.cdiv(N, w4a16_hopper.TILE_N)), sm_count(x.device))
        return out.reshape(*x.shape[:-1], N)
    if t.gemv:
        return _one_row(x2, W4Weight(codes, scale, zero, w.group_size, w.shape), t).reshape(*x.shape[:-1], N)
    if t.block_k == 0:
        return _grouped(x2, W4Weight(codes, scale, zero, w.group_size, w.shape), t).reshape(*x.shape[:-1], N)
    dot = M > GEMV_ROWS or t.block_m > GEMV_ROWS
    block_m = t.block_m or (triton.next_power_of_2(M) if not dot else 16 if M <= 16 else 128)
    grid_mn = triton.cdiv(M, block_m) * triton.cdiv(N, t.block_n)
    steps = triton.cdiv(K, t.block_k)
    split = t.split_k or max(1, min(steps, PROGRAMS_PER_SM * sm_count(x.device) // max(grid_mn, 1)))
    per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per_split)                               # no empty splits
    out = torch.empty(split, M, N, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, t.block_n), split)
    _w4a16_kernel[grid](x2, codes, scale, zero, out, M, N, K, per_split,
                        GROUP=w.group_size, PANELS=in_panels(K), WHOLE=N % PANEL_ROWS == 0,
                        IEEE=x.dtype == torch.float32, DOT=dot,
                        BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                        num_warps=t.num_warps, num_stages=t.num_stages)
    out = out[0] if split == 1 else out.sum(0).to(x.dtype)              # (M, N): fp32 partials rounded once
    return out.reshape(*x.shape[:-1], N)                                # (..., N)


def w4a16_matmul_ref(x: Tensor, w: W4Weight) -> Tensor:
    """The torch reference: dequantize in fp32, round to x's dtype, multiply in fp32, cast to x's dtype."""
    return (x.float() @ w.dequantize(x.dtype).float().T).to(x.dtype)
