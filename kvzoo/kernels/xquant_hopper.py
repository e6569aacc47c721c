"""XQuant's weighing of its value latents (xquant_remat.weigh_gather) on Hopper (sm_90), in Gluon: 4-bit codes in
per-token groups of a multiple of 128 channels, the model fp16 or bf16, at most 32 query heads.

    partials[split, b] (BLOCK_H, r) = Σ_i p[b, :, i] · row src[i] of [dequant(codes[b]) ; window[b]]

over the rows i of one split, the same partials as xquant_remat._weigh_fold_kernel, summed by its _sum_splits_kernel.

    grid (r / 128, splits, B): program (channel block, split, batch row) weighs 128 channels (one group of a row:
    16 code words) over the split's rows, 64 a step, each of its four warps 16 of them.

Each warp runs its own mma.sync (m16n8k16) products, accᵀ (128 channels, BLOCK_H heads) += Cᵀ (128, 16 rows) ·
Wᵀ (16 rows, BLOCK_H), both operands in registers, no shared memory and no barrier in the loop (outer_hopper's
warp kernel, the output half of KIVI's attention):
  - C holds the codes centered, c - 8, exact fp16 values: a thread loads two adjacent code words (16 channels) of
    each of its four rows, the words of rows 2 p and 2 p + 1 are interleaved by halves (two prmt), and one shr, lop3
    and sub give an A register, code a of both rows (quant_matvec.pair_asm, centered). A's rows are the channels in
    a fixed order (_real), written back to their places at the end.
  - W is p · scale, rounded to fp16 once (the fold path's weight): with the codes centered, a row's
    Σ_t p_t (c_t s_t + z_t) = Σ_t (p_t s_t)(c_t - 8) + Σ_t p_t (z_t + 8 s_t), the second term summed in fp32 by
    each thread over its own rows and reduced once, after the loop.
  - Each step's code words, scales, zeros and p are loaded a step ahead and its src two ahead (the fold path's
    pipelining). Window rows (src in [N, N + W)) weigh nothing there (their scale and zero read 0); the loop notes
    the first and last step holding any, and a second loop weighs those steps' window rows from their exact values
    (fp16; bf16 rows converted, as the fold path does).
Numerics are the fold path's: the same operands rounded the same way, fp32 products, summed in another order.

Per step and thread: 8 words, 16 values of p, 4 scales and zeros; 64 codes unpacked into 32 registers and 32 mma.sync
(8 channel tiles x 4 head tiles at 32 heads). KVZOO_WEIGH_KERNEL=triton|gluon|auto (default) overrides the choice:
triton never takes this kernel; gluon and auto take it wherever its layout allows.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvzoo.kernels.outer_hopper import HIGH_HALVES, LOW_HALVES
from kvzoo.kernels.quant_matvec import kernel_choice, pair_asm, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_WEIGH_KERNEL")
ENABLED = CHOICE != "triton"
import os
N_WARPS, ROWS, MAX_HEADS = 4, 16, 32
CHANNELS = int(os.environ.get("KVZOO_WEIGH_CH", "64"))
REGISTERS = int(os.environ.get("KVZOO_WEIGH_REGS", "0"))
PROGRAMS_PER_SM = int(os.environ.get("KVZOO_WEIGH_PROGRAMS", "2"))
STEP = N_WARPS * ROWS                 # rows a program weighs a step
WARPS = gl.constexpr(N_WARPS)
BLOCK = gl.constexpr(STEP)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[N_WARPS, 1, 1], instr_shape=[1, 16, 8]))
CENTERED_ASM, CENTERED_CON = (gl.constexpr(part) for part in pair_asm(4, centered=True))


@gluon.jit
def _codes(words):
    """Code words (4, 16 rows, 16 words) in _layouts' LW -> Cᵀ (4, 128, 16), the product's A operand: row
    m = g + 8 h + 16 a of A is code a of word 2 g + h (_real), column k row _row(k) of the warp's 16. Rows 2 p and
    2 p + 1 share A's half2 registers, so their words are interleaved by halves first: slots 0-3 of both, then 4-7."""
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    W: gl.constexpr = words.shape[2]
    even, odd = gl.split(gl.permute(gl.reshape(words, (4, 8, 2, W)), (0, 1, 3, 2)))    # (4, 8 p, W u): rows 2p, +1
    lo = gl.inline_asm_elementwise(LOW_HALVES, "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(HIGH_HALVES, "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=1)
    x = gl.join(lo, hi)                                                            # (4, 8, W, s): slots 4 s + a
    o = gl.inline_asm_elementwise(CENTERED_ASM, CENTERED_CON, [gl.join(x, x)], dtype=(gl.float16,) * 4,
                                  is_pure=True, pack=2)                            # each (4, 8, W, s, parity)
    y = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))                           # (..., a0, a1)
    if W == 16:
        y = gl.reshape(y, (4, 2, 2, 2, 8, 2, 2, 2, 2, 2))         # (4, p2, p1, p0, g, h, s, par, a0, a1)
        y = gl.reshape(gl.permute(y, (0, 6, 9, 8, 5, 4, 3, 1, 2, 7)), (4, 128, 16))    # (4, s a1 a0 h g, p0 p2 p1 par)
    else:
        y = gl.reshape(y, (4, 2, 2, 2, 8, 2, 2, 2, 2))            # (4, p2, p1, p0, g, s, par, a0, a1)
        y = gl.reshape(gl.permute(y, (0, 8, 7, 5, 4, 3, 1, 2, 6)), (4, 64, 16))        # (4, a1 a0 s g, p0 p2 p1 par)
    return gl.convert_layout(y, A, assert_trivial=True)


@gluon.jit
def _weights(x):
    """(4, 16 rows, BLOCK_H) in _layouts' LP -> the product's B operand, its column k row _row(k)."""
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    H: gl.constexpr = x.shape[2]
    x = gl.permute(gl.reshape(x, (4, 2, 2, 2, 2, H)), (0, 3, 1, 2, 4, 5))       # rows (r3 r2 r1 r0) -> (r1 r3 r2 r0)
    return gl.convert_layout(gl.reshape(x, (4, 16, H)), BL, assert_trivial=True)


@gluon.jit
def _real(m, CH: gl.constexpr):
    """A's row m -> its channel in a block of CH: code m // 16 of word 2 (m % 8) + (m // 8) % 2 (CH = 128), code
    4 ((m // 8) % 2) + m // 16 of word m % 8 (CH = 64)."""
    if CH == 128:
        return 16 * (m % 8) + 8 * ((m // 8) % 2) + m // 16
    return 8 * (m % 8) + 4 * ((m // 8) % 2) + m // 16


@gluon.jit
def _rows(t, L2: gl.constexpr):
    """Rows t + 16 w + j of a step, (4, 16) in L2."""
    w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, L2))
    j = gl.arange(0, 16, layout=gl.SliceLayout(0, L2))
    return t + w[:, None] * 16 + j[None, :]


@gluon.jit
def _src(src_ptr, t, stop, L2: gl.constexpr, MASKED: gl.constexpr):
    """A step's indices into [codes ; window] (4, 16) int32 in L2; MASKED: rows past stop read N + W's stand-in
    0 (never weighed: their p is 0)."""
    i = _rows(t, L2)
    if MASKED:
        return gl.load(src_ptr + i, mask=i < stop, other=0).to(gl.int32)
    return gl.load(src_ptr + i).to(gl.int32)


@gluon.jit
def _operands(codes_ptr, scale_ptr, zero_ptr, p_ptr, t, src, stop, N, W, R, WORDS, HQ, k0, s_ph,
              GROUP: gl.constexpr, HAS_ZERO: gl.constexpr, ALL_H: gl.constexpr, BLOCK_H: gl.constexpr,
              LW: gl.constexpr, LP: gl.constexpr, MASKED: gl.constexpr):
    """Step t's operands as loaded (converted where they are used, so that no instruction of the step that loads
    them waits for them): code words (4, 16, 16) in LW, each row's scale and zero (4, 16) (0 where the row is not
    coded), p (4, 16, BLOCK_H) in LP, and each thread's rows that are window rows (4, 16, as a count). codes_ptr,
    scale_ptr, zero_ptr and p_ptr point at the program's batch row and channel block."""
    LR: gl.constexpr = gl.SliceLayout(2, LP)
    coded = src < N
    live = _rows(t, LR) < stop
    if MASKED:
        coded = coded & live
    src_w = gl.convert_layout(gl.where(coded, src, 0), gl.SliceLayout(2, LW), assert_trivial=True)
    u = gl.arange(0, LW.shape[2], layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    words = gl.load(codes_ptr + (src_w * WORDS)[:, :, None] + u[None, None, :])    # row 0 stands in: never weighed
    meta = gl.where(coded, src, 0) * (R // GROUP)
    scale = gl.load(scale_ptr + meta, mask=coded, other=0)
    zero = gl.load(zero_ptr + meta, mask=coded, other=0) if HAS_ZERO else scale
    windowed = (src >= N) & (src < N + W)
    if MASKED:
        windowed = windowed & live
    h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, gl.SliceLayout(1, LP)))
    at = (p_ptr + t) + (h[None, None, :] * s_ph + _rows(0, LR)[:, :, None])
    if MASKED:
        p = gl.load(at, mask=live[:, :, None] & (h < HQ)[None, None, :], other=0)
    elif ALL_H:
        p = gl.load(at)
    else:
        p = gl.load(at, mask=(h < HQ)[None, None, :], other=0)
    return words, scale, zero, p, windowed.to(gl.int32)


@gluon.jit
def _step(ops, acc, zacc, HAS_ZERO: gl.constexpr):
    """One step's products: accᵀ += Cᵀ · (p s)ᵀ, and each thread's Σ p (z + 8 s) over its own rows."""
    words, scale, zero, p, _ = ops
    BLOCK_H: gl.constexpr = p.shape[2]
    p = p.to(gl.float32)
    scale = scale.to(gl.float32)
    if HAS_ZERO:
        z = gl.expand_dims(zero.to(gl.float32) + 8.0 * scale, 2)
        zacc += gl.sum(gl.reshape(p * z, (WARPS, 4, 4, BLOCK_H)), axis=2)
    return mma_v2(_codes(words), _weights((p * gl.expand_dims(scale, 2)).to(gl.float16)), acc), zacc


@gluon.jit
def _found(ops, t, stop, win_lo, win_hi):
    """The first and last step (each row's own) that held a window row, given step t's operands."""
    return gl.where(ops[4] > 0, gl.minimum(win_lo, t), win_lo), gl.where(ops[4] > 0, gl.minimum(t + BLOCK, stop),
                                                                           win_hi)


@gluon.jit
def _weigh_kernel(codes_ptr, scale_ptr, zero_ptr, win_ptr, src_ptr, p_ptr, out_ptr, N, W, S, R, WORDS, HQ, PER_SPLIT,
                  s_wb, s_wn, s_pb, s_ph, GROUP: gl.constexpr, HAS_ZERO: gl.constexpr, ALL_H: gl.constexpr,
                  BLOCK_H: gl.constexpr, CH: gl.constexpr, LW: gl.constexpr, LP: gl.constexpr):
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LR: gl.constexpr = gl.SliceLayout(2, LP)
    k0 = gl.program_id(0) * CH
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    start = split * PER_SPLIT
    stop = gl.minimum(start + PER_SPLIT, S)
    # the program's batch row and channel block; rows are then int32 offsets (a row's codes below 2^31 words)
    codes_ptr += b * N * WORDS + k0 // 8
    scale_ptr += b * N * (R // GROUP) + k0 // GROUP
    zero_ptr += b * N * (R // GROUP) + k0 // GROUP
    p_ptr += b * s_pb

    acc = gl.zeros([WARPS, CH, BLOCK_H], gl.float32, MMA)                          # accᵀ, each warp its rows'
    zacc = gl.zeros([WARPS, 4, BLOCK_H], gl.float32, gl.SliceLayout(2, gl.reshape(
        gl.zeros([WARPS, 16, BLOCK_H], gl.float32, LP), (WARPS, 4, 4, BLOCK_H)).type.layout))
    win_lo = gl.zeros([WARPS, 16], gl.int32, LR) + stop     # the first and last step that held a window row
    win_hi = gl.zeros([WARPS, 16], gl.int32, LR) + start
    # whole steps, three a loop (each step's operands in registers of their own, so that none is copied, which would
    # wait for its load): no row past stop; a step's operands are loaded two steps ahead, its src three ahead (the
    # last three load themselves again, hits in the caches)
    pairs = start + (stop - start) // (3 * BLOCK) * (3 * BLOCK)
    if pairs > start:
        last = pairs - 3 * BLOCK
        ops_a = _operands(codes_ptr, scale_ptr, zero_ptr, p_ptr, start, _src(src_ptr, start, stop, LR, False), stop,
                          N, W, R, WORDS, HQ, k0, s_ph, GROUP, HAS_ZERO, ALL_H, BLOCK_H, LW, LP, False)
        ops_b = _operands(codes_ptr, scale_ptr, zero_ptr, p_ptr, start + BLOCK,
                          _src(src_ptr, start + BLOCK, stop, LR, False), stop, N, W, R, WORDS, HQ, k0, s_ph, GROUP,
                          HAS_ZERO, ALL_H, BLOCK_H, LW, LP, False)
        src_c = _src(src_ptr, start + 2 * BLOCK, stop, LR, False)
        for t in range(start, pairs, 3 * BLOCK):
            ops_c = _operands(codes_ptr, scale_ptr, zero_ptr, p_ptr, t + 2 * BLOCK, src_c, stop, N, W, R, WORDS, HQ,
                              k0, s_ph, GROUP, HAS_ZERO, ALL_H, BLOCK_H, LW, LP, False)
            src_a = _src(src_ptr, gl.minimum(t + 3 * BLOCK, last), stop, LR, False)
            win_lo, win_hi = _found(ops_a, t, stop, win_lo, win_hi)
            acc, zacc = _step(ops_a, acc, zacc, HAS_ZERO)
            ops_a = _operands(codes_ptr, scale_ptr, zero_ptr, p_ptr, gl.minimum(t + 3 * BLOCK, last), src_a, stop,
                              N, W, R, WORDS, HQ, k0, s_ph, GROUP, HAS_ZERO, ALL_H, BLOCK_H, LW, LP, False)
            src_b = _src(src_ptr, gl.minimum(t + 4 * BLOCK, last + BLOCK), stop, LR, False)
            win_lo, win_hi = _found(ops_b, t + BLOCK, stop, win_lo, win_hi)
            acc, zacc = _step(ops_b, acc, zacc, HAS_ZERO)
            ops_b = _operands(codes_ptr, scale_ptr, zero_ptr, p_ptr, gl.minimum(t + 4 * BLOCK, last + BLOCK), src_b,
                              stop, N, W, R, WORDS, HQ, k0, s_ph, GROUP, HAS_ZERO, ALL_H, BLOCK_H, LW, LP, False)
            src_c = _src(src_ptr, gl.minimum(t + 5 * BLOCK, last + 2 * BLOCK), stop, LR, False)
            win_lo, win_hi = _found(ops_c, t + 2 * BLOCK, stop, win_lo, win_hi)
            acc, zacc = _step(ops_c, acc, zacc, HAS_ZERO)
    for t in range(pairs, stop, BLOCK):        # the split's last rows (at most three steps), masked
        ops = _operands(codes_ptr, scale_ptr, zero_ptr, p_ptr, t, _src(src_ptr, t, stop, LR, True), stop, N, W, R,
                        WORDS, HQ, k0, s_ph, GROUP, HAS_ZERO, ALL_H, BLOCK_H, LW, LP, True)
        win_lo, win_hi = _found(ops, t, stop, win_lo, win_hi)
        acc, zacc = _step(ops, acc, zacc, HAS_ZERO)
    # the window rows of the steps that hold any, from their exact values
    m = gl.arange(0, CH, layout=gl.SliceLayout(0, gl.SliceLayout(2, A)))
    LA: gl.constexpr = gl.SliceLayout(1, A)
    for t in range(gl.min(gl.min(win_lo, axis=1), axis=0), gl.max(gl.max(win_hi, axis=1), axis=0), BLOCK):
        ia = _rows(t, LA)
        ka = gl.arange(0, 16, layout=gl.SliceLayout(0, LA))
        ia = ia - ka[None, :] + _row(ka)[None, :]                   # A's column k is row _row(k)
        at = gl.load(src_ptr + ia, mask=ia < stop, other=0).to(gl.int32)
        wa = (ia < stop) & (at >= N) & (at < N + W)
        exact = gl.load(win_ptr + b * s_wb + gl.where(wa, at - N, 0)[:, None, :] * s_wn
                        + (k0 + _real(m, CH))[None, :, None], mask=wa[:, None, :], other=0).to(gl.float16)
        src = _src(src_ptr, t, stop, LR, True)
        live = _rows(t, LR) < stop
        wp = live & (src >= N) & (src < N + W)
        h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, gl.SliceLayout(1, LP)))
        w = gl.load(p_ptr + h[None, None, :] * s_ph + _rows(t, LR)[:, :, None],
                    mask=wp[:, :, None] & (h < HQ)[None, None, :], other=0).to(gl.float16)
        acc = mma_v2(exact, _weights(w), acc)

    out = gl.sum(acc, axis=0)                                                      # (CH, BLOCK_H)
    OL: gl.constexpr = out.type.layout
    out = out + gl.expand_dims(gl.convert_layout(gl.sum(gl.sum(zacc, axis=1), axis=0), gl.SliceLayout(0, OL)), 0)
    mo = gl.arange(0, CH, layout=gl.SliceLayout(1, OL))
    ho = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, OL))
    rows = (split * gl.num_programs(2) + b) * BLOCK_H + ho
    gl.store(out_ptr + rows[None, :] * R + (k0 + _real(mo, CH))[:, None], out)


@gluon.jit
def _row(k):
    """B's and A's column k -> the row of the warp's 16 it holds (_weights' and _codes' permutation)."""
    return (k % 2) + 2 * ((k // 8) % 2) + 4 * ((k // 2) % 2) + 8 * ((k // 4) % 2)


@functools.cache
def _layouts(block_h: int, channels: int) -> tuple:
    """(LW, LP): the code words' (4, 16 rows, channels / 8 words) layout, lanes 4 g + q holding word g (64 channels),
    or words 2 g, 2 g + 1 (128; registers: word + 1, so an 8-byte load), of rows 4 q .. 4 q + 3 (registers row + 1,
    + 2; lanes row + 4, + 8), warps w the rows 16 w ..; and p's (4, 16 rows, block_h), lanes 4 g + q holding heads
    g + 8 n (registers) of the same rows (a 16-byte load a head). Unpacked and permuted (_codes, _weights), they are
    A's and B's registers."""
    heads = [[0, 0, 8 << i] for i in range(block_h.bit_length() - 4)]
    pair, words = ([[0, 0, 1]], [[0, 0, 2], [0, 0, 4], [0, 0, 8]]) if channels == 128 else \
        ([], [[0, 0, 1], [0, 0, 2], [0, 0, 4]])
    lw = gl.DistributedLinearLayout(pair + [[0, 1, 0], [0, 2, 0]], [[0, 4, 0], [0, 8, 0]] + words,
                                    [[1, 0, 0], [2, 0, 0]], [], [N_WARPS, ROWS, channels // 8])
    lp = gl.DistributedLinearLayout([[0, 1, 0], [0, 2, 0]] + heads,
                                    [[0, 4, 0], [0, 8, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
                                    [[1, 0, 0], [2, 0, 0]], [], [N_WARPS, ROWS, block_h])
    return lw, lp


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def eligible(bits: int, axis: int, group: int, r: int, heads: int, window: Tensor) -> bool:
    """Whether weigh_gather takes this kernel: enabled, an sm_90 GPU with the inline-PTX path (fp16/bf16 rows,
    compiled), 4-bit codes in per-token groups of a multiple of 128 channels, at most 32 query heads."""
    return (ENABLED and unpacks_in_ptx(window) and _is_hopper(window.device.index or 0) and bits == 4
            and axis == -1 and group % CHANNELS == 0 and r % CHANNELS == 0 and 0 < heads <= MAX_HEADS)


def weigh_splits(codes: Tensor, scale: Tensor, zero: Tensor | None, window: Tensor, src: Tensor, p: Tensor,
                 partials: Tensor, N: int, r: int, group: int, per_split: int) -> None:
    """Launch the kernel into partials (splits, B, BLOCK_H, r) fp32, BLOCK_H = partials.shape[2] (16 or 32 at
    least the heads); per_split a multiple of BLOCK."""
    splits, B, block_h, _ = partials.shape
    lw, lp = _layouts(block_h, CHANNELS)
    heads = p.shape[1]
    _weigh_kernel[(r // CHANNELS, splits, B)](
        codes, scale, zero if zero is not None else scale, window, src, p, partials, N, window.shape[1], src.numel(),
        r, codes.shape[-1], heads, per_split, window.stride(0), window.stride(1), p.stride(0), p.stride(1),
        GROUP=group, HAS_ZERO=zero is not None, ALL_H=heads == block_h, BLOCK_H=block_h, CH=CHANNELS, LW=lw, LP=lp,
        num_warps=N_WARPS, **({"maxnreg": REGISTERS} if REGISTERS else {}))
