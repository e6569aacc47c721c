"""W4A16 for 1-16 rows of x on Hopper (sm_90), in Gluon: the 4-bit codes are unpacked in registers straight into the
A operand of the tensor cores (mma.sync m16n8k16), so a weight goes from DRAM to the tensor cores through registers
only (the group kernel of kvzoo/kernels/w4a16.py stores its unpacked tile to shared memory for tl.dot). Same layout
(W4Weight) and split-K; the module docstring of w4a16.py has both. One kernel, _w4_kernel:

    out (M, N) = x (M, K) @ dequant(w)ᵀ, computed transposed: outᵀ (TILE_N, NP) per program
    grid (N / TILE_N, splits): program (tile, split) owns TILE_N = 64 output features (16 per warp, the MMA's M) and the
    steps [split * STEPS_PER_SPLIT, ...) of 128 input channels (one group at G = 128); NP = 8 or 16 columns (the
    MMA's N), column n holding row n mod R of x, R = next_pow2(M).

Codes: a program's tile is a panel of w4a16.py's panel order, so a step's (64, 16) code words are 4 KB in one piece
(a warp's 16 features 1 KB); its 64 scales and zeros are one fp16 each of 64 rows. The words (a thread's four words
of a feature adjacent, 16 bytes) become (64, 128) fp16 operands in the registers of the A operand (DotOperandLayout,
checked trivial at compile time), in a logical channel order chosen so that no unpacked value moves between threads.
At 1-8 rows the unpack PTX (OFFSET_ASM) makes each code pair an exact fp16 m + c in one lop3 (m = 1024 for even real
channels, 64 for odd ones, which the logical order puts in MMA steps of their own): 5 instructions a word. The
tensor cores sum x (m + c) exactly in fp32, and a step's scale s and zero z enter after its product, in fp32:
s Σ x c + z Σ x = s Σ x (m + c) + (z - 1024 s) Σ x_even + (z - 64 s) Σ x_odd,
x's sums over the step's even and odd channels taken by two more products with a ones operand. At 16 rows (two B
operands, whose registers leave no room for those sums) the unpack (SCALED_ASM) applies scale and zero to each pair
instead, code * scale + zero rounded once to fp16: 16 instructions a word. The reference rounds the dequantized
weight to x's dtype. Each warp's 16 features are a product of their own, so the steps hold no barrier. Codes, scales
and zeros are loaded three steps ahead, four steps an iteration, each with a register set of its own, so that no set
is copied to another; the loop has no branch (with one, the compiler moved the loads down to their step): the steps
an iteration runs past the split's end multiply the split's last codes by x's zero rows. 128 registers (REGISTERS).

x: a reduction's channel order is free as long as both operands take the same one, so x takes the codes' logical
order. A program converts x to fp16 (bf16 widened in pairs by PTX, then saturated to fp16's range two values at a
time in the order they are stored) XS steps at a time (X_BYTES of shared memory, between two barriers) and stores it
to shared memory in the B operand's fragment order: a lane's operand for a step and row is
64 contiguous bytes, four 16-byte shared loads, swizzled so that a quarter warp's loads fall on different banks. No
thread converts, moves or zeroes x between those stores.

Split-K: each split stores its fp32 partials; the last split of a tile to finish (a per-tile counter) adds them in
split order and rounds once.

Launch (sm_90, quant_matvec.launches_early): programmatic. The kernel before may let it launch while it runs
(griddepcontrol.launch_dependents: the model's RMSNorm and SiLU kernels in kvzoo/kernels/layer_ops.py do, and so does
this kernel, for the next product); its programs load their first three steps' codes, scales and zeros (weights, which
no kernel writes), then wait for the kernel before to finish (griddepcontrol.wait) before they read x or touch the
partials and counters. Where the kernel before does not let it, it starts once that kernel ends, about half a
microsecond later than a plain launch would (docs/decode.md).

Speed (Llama-3.1-8B, one H200, bf16 x, a block's joined 4-bit products in one CUDA graph; docs/decode.md, "The 4-bit
codes in panels"): 45.4, 48.1, 50.3, 52.3 and 73.8 us at M = 1, 2, 4, 8 and 16 against bf16's 119.8-122.3, 2.64x,
2.49x, 2.40x, 2.31x and 1.66x; a kernel that only streams the same bytes takes 34.3 us (3.49x; `python -m
repro.kvpareto.bench --step`).

Groups must be a multiple of 128 channels (AWQ's 128). KVZOO_W4A16_KERNEL=triton|gluon|auto (default) overrides the
choice: triton never takes this kernel, gluon takes it for fewer than MIN_FEATURES outputs too.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvzoo.kernels.innerq_hopper import _reinterpret
from kvzoo.kernels.outer_hopper import TO_HALF2, barrier, launch_options, let_next_launch, wait_previous
from kvzoo.kernels.quant_matvec import kernel_choice, launches_early, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_W4A16_KERNEL")
ENABLED = CHOICE != "triton"
MAX_ROWS = 16                        # rows of x this kernel serves (the B operand's columns: 8, or 16 in two MMAs)
# fewer output features stay with the group kernel; the model joins Llama-3.1-8B's k/v (1,024) with q
# (kvzoo.models.llama.joined_product)
MIN_FEATURES = 0 if CHOICE == "gluon" else 2048
STEP = 128                           # input channels a step (16 words of codes per feature)
TILE_N, N_WARPS = 64, 4
# split-K sizing: programs a multiprocessor keeps busy, of at least 2 steps (five, which the kernel's registers fit
# at one row, took the same time; six were slower, docs/decode.md)
PROGRAMS_PER_SM = 4
# x in shared memory a program: XS steps of R rows, at least 4 steps (16 KB at 16 rows); 16 and 32 KB took as long
# or longer at 8 and 16 rows (docs/decode.md)
X_BYTES = 8192
# the register cap (ptxas maxnreg; without one Triton 3.6 spills in the loop): PROGRAMS_PER_SM programs fill an SM's
# registers; at 1-8 rows 96 spilled with x's sums
REGISTERS = 128
_TILE = gl.constexpr(TILE_N)


@gluon.jit
def _in_order(o):
    """The unpack PTX's four outputs, each (R, W, 2) (output j: codes j and j + 4 of each word), as (R, 8 W) in
    logical channel order k' = 32 i + 16 j0 + 8 j1 + 2 q + e, for code j + 4 e (j = 2 j1 + j0) of word 4 q + i (real
    channel 8 (4 q + i) + j + 4 e): a thread's own registers, and each of the MMA's 16-channel steps holds channels of
    one parity j0."""
    R: gl.constexpr = o[0].shape[0]
    W: gl.constexpr = o[0].shape[1]
    x = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))                            # (R, W, e, j0, j1)
    x = gl.permute(gl.reshape(x, (R, 4, W // 4, 2, 2, 2)), (0, 2, 4, 5, 1, 3))        # (R, i, j0, j1, q, e)
    return gl.reshape(x, (R, 8 * W))


@gluon.jit
def _logical(x):
    """(NP, 128) x in real channel order 32 q + 8 i + 4 e + 2 j1 + j0 -> logical order (_in_order's), in registers."""
    NP: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    x = gl.permute(gl.reshape(x, (NP, 4, C // 32, 2, 2, 2)), (0, 2, 5, 4, 1, 3))       # (NP, i, j0, j1, q, e)
    return gl.reshape(x, (NP, C))


# a bf16 pair (one register) as two fp32 values: the low half shifted up, the high half masked
BF16_TO_F32 = gl.constexpr("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }")


@gluon.jit
def _half(x):
    """x as fp16: an fp32 x (a bf16 one widened) saturated to the fp16 range, as outer_hopper's query, each two
    adjacent elements of a thread one conversion."""
    if x.dtype == gl.float32:
        x = gl.inline_asm_elementwise(TO_HALF2, "=r,r,r", [x], dtype=gl.float16, is_pure=True, pack=2)
    return x


@gluon.jit
def _store_out(acc, out_ptr, part_ptr, count_ptr, tile, split, M, N, SPLIT: gl.constexpr):
    """Store a program's outᵀ (TILE_N, NP) fp32 sums into out (M, N) in its dtype; split over K, each split stores
    its partials and the last split of the tile to finish adds them in split order, rounds once and resets the
    tile's counter."""
    NP: gl.constexpr = acc.shape[1]
    L: gl.constexpr = acc.type.layout
    cols = gl.arange(0, NP, layout=gl.SliceLayout(0, L))
    f = tile * _TILE + gl.arange(0, _TILE, layout=gl.SliceLayout(1, L))
    at = cols[None, :] * N + f[:, None]                                              # out (M, N) holds outᵀ
    live = (f < N)[:, None] & (cols < M)[None, :]
    if SPLIT == 1:
        gl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=live)
    else:
        gl.store(part_ptr + split * M * N + at, acc, mask=live)
        barrier()                                            # every thread's partial is written before the count
        if gl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
            total = gl.zeros([_TILE, NP], gl.float32, L)
            for other in range(SPLIT):
                total += gl.load(part_ptr + other * M * N + at, mask=live, other=0, cache_modifier=".cg")
            gl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=live)
            gl.atomic_xchg(count_ptr + tile, 0)


# output j (0-3): codes j and j + 4 of word $4 (its bits 4 j and 16 + 4 j) as exact fp16 m + c, one lop3 each: the
# even codes' nibbles at mantissa bits 0-3 under the magic 1024.0 (0x6400), the odd ones' at bits 4-7 under 64.0
# (0x5400); codes 2, 3, 6 and 7 from the word shifted right by 8
OFFSET_ASM = gl.constexpr("{ .reg .b32 t; shr.b32 t, $4, 8; " + " ".join(
    f"lop3.b32 ${j}, {'t' if j > 1 else '$4'}, {'0x00F000F0, 0x54005400' if j % 2 else '0x000F000F, 0x64006400'}, 0xEA;"
    for j in range(4)) + " }")
MAGIC = gl.constexpr((1024.0, 64.0))                 # m of the even and the odd codes
# output j: codes j and j + 4 shifted to mantissa bits 6-9 of each half, read as 16 + c under the magic 16.0 (0x4C00),
# 16 subtracted (exact), times the scale pair $6 plus the zero pair $7: code * scale + zero rounded once to fp16
SCALED_ASM = gl.constexpr("{ .reg .b32 t, m; mov.b32 m, 0x4C004C00; " + " ".join(
    f"{'shl' if j < 2 else 'shr'}.b32 t, $4, {abs(6 - 4 * j)}; lop3.b32 t, t, 0x03C003C0, m, 0xEA; "
    f"sub.f16x2 t, t, m; fma.rn.f16x2 ${j}, t, $6, $7;" for j in range(4)) + " }")


@gluon.jit
def _unpack(words, s, z, LP: gl.constexpr, SCALED: gl.constexpr):
    """(R, 16) code words -> (R, 128) fp16 in logical order (_in_order's): SCALED, code * scale + zero with their
    features' scales and zeros s, z (R,) (SCALED_ASM); otherwise m + code, m = 1024 for even real channels and 64 for
    odd ones (OFFSET_ASM)."""
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    pairs = gl.expand_dims(words, 2) + gl.zeros([R, W, 2], gl.int32, LP)             # (R, W, 2): the word twice
    if SCALED:
        s2 = gl.broadcast(gl.expand_dims(gl.expand_dims(s, 1), 2), pairs.to(gl.float16))[0]     # (R, W, 2)
        z2 = gl.broadcast(gl.expand_dims(gl.expand_dims(z, 1), 2), pairs.to(gl.float16))[0]
        o = gl.inline_asm_elementwise(SCALED_ASM, "=r,=r,=r,=r,r,r,r,r", [pairs, s2, z2], dtype=(gl.float16,) * 4,
                                      is_pure=True, pack=2)
    else:
        o = gl.inline_asm_elementwise(OFFSET_ASM, "=r,=r,=r,=r,r,r", [pairs], dtype=(gl.float16,) * 4, is_pure=True,
                                      pack=2)
    return _in_order(o)


@gluon.jit
def _operands(codes_ptr, scale_ptr, zero_ptr, t, words_at, meta_at, step, W: gl.constexpr, GROUP: gl.constexpr):
    """Step t's (TILE_N, W) code words and its features' (TILE_N,) scales and zeros; a panel's steps lie `step`
    words apart (w4a16.py's panel order)."""
    g = t * (8 * W) // GROUP
    return gl.load(codes_ptr + words_at + t * step), gl.load(scale_ptr + meta_at + g), gl.load(zero_ptr + meta_at + g)


@gluon.jit
def _step(ops, x_step, acc, LP: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LF: gl.constexpr,
          L3: gl.constexpr):
    """acc (TILE_N, NP) += a step's codes (ops: _operands') times its x (x_step: the step's (4 R, 32) in shared
    memory, _x_frag_layout's); column n of the B operand is row n mod R (NP = max(8, R)).

    At 1-8 rows the tensor cores multiply x by the codes' m + c, and scale and zero enter per step in fp32, with x's
    sums over the step's even and odd channels (from the tensor cores too):
    s Σ x c + z Σ x = s Σ x (m + c) + (z - 1024 s) Σ x_even + (z - 64 s) Σ x_odd.
    At 16 rows (two B operands, whose registers leave no room for the sums) each weight is dequantized before its
    product."""
    words, s, z = ops
    R: gl.constexpr = x_step.shape[0] // 4
    NP: gl.constexpr = acc.shape[1]
    w = gl.convert_layout(_unpack(words, s, z, LP, NP > 8), LA, assert_trivial=True)
    xf = gl.reshape(x_step.load(LF), (R, 128))                                      # 4 x 16 bytes a row
    xk = gl.reshape(gl.permute(gl.reshape(xf, (R, 4, 8, 2, 2)), (0, 2, 3, 1, 4)), (R, 128))  # (c, h, q, e): logical
    xk = gl.permute(xk, (1, 0))                                                      # (128, R)
    if R < 8:
        xk = gl.convert_layout(xk, gl.SliceLayout(1, L3), assert_trivial=True)
        xb = gl.broadcast(gl.expand_dims(xk, 1), gl.zeros([128, 8 // R, R], gl.float16, L3))[0]
        xk = gl.reshape(xb, (128, 8))                                                # column i R + r: row r
    xb = gl.convert_layout(xk, LB, assert_trivial=True)
    if NP > 8:
        return mma_v2(w, xb, acc)
    MMA: gl.constexpr = acc.type.layout
    zero = gl.zeros(acc.shape, gl.float32, MMA)
    p = mma_v2(w, xb, zero)           # before the sums' products: the other order ran 2-8 rows 4-5% slower on 3.6
    # x summed over the even and the odd real channels: the MMA's 16-channel steps of either parity (j0, logical
    # channel bit 4), every row of the product the same
    halves = gl.split(gl.permute(gl.reshape(xb, (4, 2, 16, NP)), (0, 2, 3, 1)))      # (i, k, n) each, j0 = 0, 1
    ones = gl.full([acc.shape[0], 64], 1.0, gl.float16, LA)
    even = mma_v2(ones, gl.convert_layout(gl.reshape(halves[0], (64, NP)), LB, assert_trivial=True), zero)
    odd = mma_v2(ones, gl.convert_layout(gl.reshape(halves[1], (64, NP)), LB, assert_trivial=True), zero)
    s = gl.expand_dims(gl.convert_layout(s, gl.SliceLayout(1, MMA), assert_trivial=True).to(gl.float32), 1)
    z = gl.expand_dims(gl.convert_layout(z, gl.SliceLayout(1, MMA), assert_trivial=True).to(gl.float32), 1)
    return acc + p * s + (z - MAGIC[0] * s) * even + (z - MAGIC[1] * s) * odd


@gluon.jit
def _w4_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, part_ptr, count_ptr, M, N, K, STEPS_PER_SPLIT,
               GROUP: gl.constexpr, SPLIT: gl.constexpr, XS: gl.constexpr, R: gl.constexpr, LP: gl.constexpr,
               LF: gl.constexpr, L3: gl.constexpr):
    W: gl.constexpr = 16                                                             # words a feature and step
    C: gl.constexpr = 8 * W                                                          # channels a step
    NP: gl.constexpr = 8 if R < 8 else R
    XP: gl.constexpr = 16 if XS * R >= 16 else XS * R                               # rows of x a load (below)
    LW: gl.constexpr = gl.SliceLayout(2, LP)                                         # words (TILE_N, W)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    LX: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])              # x as loaded, 16 bytes a thread

    let_next_launch()
    tile = gl.program_id(0)
    split = gl.program_id(1)
    t0 = split * STEPS_PER_SPLIT
    t_end = gl.minimum(t0 + STEPS_PER_SPLIT, K // C)
    # x's (4 R, 32) rows a step in shared memory, their 16-byte chunks swizzled so that the 8 lanes of a quarter warp
    # (4 q and two rows) read 8 different banks' chunks: chunk k of row 4 r + q at k ^ (q // 2 + 2 (r mod 2)); 2
    # phases for one row, so that a step's 4 rows hold the same swizzle wherever they start
    XL: gl.constexpr = gl.SwizzledSharedLayout(8, 2, 2 if R == 1 else 4, [1, 0])
    x_s = gl.allocate_shared_memory(gl.float16, [XS, 4 * R, C // 4], XL)
    x_flat = _reinterpret(x_s, gl.float16, [XS * 4 * R, C // 4], XL)               # row 4 (i R + r) + q: step i
    xi = gl.arange(0, XP, layout=gl.SliceLayout(1, LX))                              # i R + r
    x_at = (xi % R)[:, None] * K + (xi // R)[:, None] * C + gl.arange(0, C, layout=gl.SliceLayout(0, LX))[None, :]

    # the tile is a panel of w4a16.py's panel order: 64 rows, or the last panel's (rows past N read its last row);
    # the pointers moved to the panel's first row, so that the offsets within it are int32
    rows = gl.minimum(N - tile * _TILE, _TILE)
    i = gl.minimum(gl.arange(0, _TILE, layout=gl.SliceLayout(1, LW)), rows - 1)
    panel = tile.to(gl.int64) * _TILE
    codes_ptr += panel * (K // 8)
    scale_ptr += panel * (K // GROUP)
    zero_ptr += panel * (K // GROUP)
    words_at = i[:, None] * W + gl.arange(0, W, layout=gl.SliceLayout(0, LW))[None, :]
    meta_at = i * (K // GROUP)                                                       # (TILE_N,): group 0
    step = W * rows
    acc = gl.zeros([_TILE, NP], gl.float32, MMA)                                     # outᵀ
    last = t_end - 1
    # four steps an iteration, each step's operands loaded three steps ahead into one of four register sets (past
    # the last step, its own again), so that no set is copied to another; no branch in the loop (a branch let the
    # compiler move the loads down to their step): the steps past the split's end read x's zero rows
    a = _operands(codes_ptr, scale_ptr, zero_ptr, t0, words_at, meta_at, step, W, GROUP)
    b = _operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t0 + 1, last), words_at, meta_at, step, W, GROUP)
    c = _operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t0 + 2, last), words_at, meta_at, step, W, GROUP)
    wait_previous()                                      # x is the kernel before's output (module docstring)
    for x0 in range(t0, t_end, XS):
        # the next XS steps' x (zero past the split's steps and past M rows) into shared memory, fp16 in fragment
        # order (_x_frag_layout), once every warp has done with the last
        barrier()
        for p in gl.static_range(XS * R // XP):                                   # XP rows of x a load
            xp = x0 + p * (XP // R)
            live = ((xp + xi // R < t_end) & (xi % R < M))[:, None]
            xk = gl.load(x_ptr + x_at + xp * C, mask=live, other=0)
            if x_ptr.dtype.element_ty == gl.bfloat16:            # widened here, to fp16 in stored order by _half
                xk = gl.inline_asm_elementwise(BF16_TO_F32, "=r,=r,r", [xk], dtype=gl.float32, is_pure=True, pack=2)
            xf = gl.permute(gl.reshape(_logical(xk), (XP, 8, 2, 4, 2)), (0, 3, 1, 2, 4))   # (XP, q, c, h, e)
            x_flat.slice(p * 4 * XP, 4 * XP).store(_half(gl.reshape(xf, (4 * XP, C // 4))))
        barrier()
        for t in range(x0, gl.minimum(x0 + XS, t_end), 4):
            d = _operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t + 3, last), words_at, meta_at, step, W, GROUP)
            acc = _step(a, x_s.index(t - x0), acc, LP, LA, LB, LF, L3)
            a = _operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t + 4, last), words_at, meta_at, step, W, GROUP)
            acc = _step(b, x_s.index(t + 1 - x0), acc, LP, LA, LB, LF, L3)
            b = _operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t + 5, last), words_at, meta_at, step, W, GROUP)
            acc = _step(c, x_s.index(t + 2 - x0), acc, LP, LA, LB, LF, L3)
            c = _operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t + 6, last), words_at, meta_at, step, W, GROUP)
            acc = _step(d, x_s.index(t + 3 - x0), acc, LP, LA, LB, LF, L3)
    _store_out(acc, out_ptr, part_ptr, count_ptr, tile, split, M, N, SPLIT)


@functools.cache
def _x_frag_layout(R: int) -> gl.DistributedLinearLayout:
    """A step's x (4 R, 32) in shared memory, row 4 r + q of it x's row r at fragment order j = 32 q .. 32 q + 31
    (j = 32 q + 4 c + 2 h + e holds logical channel 16 c + 8 h + 2 q + e, the B operand's), as _w4_kernel loads it:
    lane 4 g + q holds row g mod R's (R = 16: rows g and g + 8), every warp the same."""
    g = [[4 << b, 0] if 1 << b < R else [0, 0] for b in range(3)]
    regs = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]] + ([[32, 0]] if R == 16 else [])
    return gl.DistributedLinearLayout(regs, [[1, 0], [2, 0]] + g, [[0, 0], [0, 0]], [], [4 * R, 32])


@functools.cache
def _x_column_layout(R: int) -> gl.DistributedLinearLayout:
    """The B operand's (128, 8) layout as (128, 8 / R, R), R < 8: column i R + r."""
    n = [[0, 0, 1 << b] if 1 << b < R else [0, 1 << b >> R.bit_length() - 1, 0] for b in range(3)]
    return gl.DistributedLinearLayout([[1, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0], [64, 0, 0]],
                                      [[2, 0, 0], [4, 0, 0]] + n, [[0, 0, 0], [0, 0, 0]], [], [128, 8 // R, R])


@functools.cache
def _words_layout() -> gl.DistributedLinearLayout:
    """The words' (TILE_N, 16, 2) layout, that of the A operand's registers: lanes 4 g + q hold features g and g + 8
    of their warp's 16 and words 4 q .. 4 q + 3 (registers: the pair axis, the next words, feature + 8), warps the
    four 16-feature slices."""
    return gl.DistributedLinearLayout([[0, 0, 1], [0, 1, 0], [0, 2, 0], [8, 0, 0]],
                                      [[0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                      [[16, 0, 0], [32, 0, 0]], [], [TILE_N, 16, 2])


def x_steps(rows: int, per_split: int) -> int:
    """Steps of x a program holds in shared memory at a time: X_BYTES of R = next_pow2(M) rows, at least 4 (a loop
    iteration), no more than a split's."""
    return max(4, min(X_BYTES // (rows * STEP * 2), triton.next_power_of_2(per_split)))


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def eligible(x2: Tensor, group_size: int, N: int, K: int) -> bool:
    """Whether w4a16_matmul takes this kernel for x2 (M, K) and an (N, K) weight: enabled, a compiled fp16/bf16 run
    on an sm_90 GPU, 1-16 rows, at least MIN_FEATURES outputs, groups a multiple of 128 channels."""
    return (ENABLED and unpacks_in_ptx(x2) and _is_hopper(x2.device.index or 0)
            and 1 <= x2.shape[0] <= MAX_ROWS and N >= MIN_FEATURES and group_size % STEP == 0
            and K % STEP == 0)


def w4a16_hopper(x2: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, group_size: int, counters: Tensor,
                 sm_count: int, split_k: int = 0) -> Tensor:
    """x2 (M, K) contiguous fp16/bf16, codes int32 (N, K/8), scale and zero fp16 (N, K/G) -> (M, N) in x2's dtype.
    counters: int32, zero, at least N / TILE_N of them (left zero). split_k 0: enough programs to fill the GPU."""
    M, K = x2.shape
    N = codes.shape[0]
    tiles = -(-N // TILE_N)
    steps = K // STEP
    split = split_k or max(1, min(steps // 2, PROGRAMS_PER_SM * sm_count // tiles))
    per_split = -(-steps // split)
    split = -(-steps // per_split)                                      # no empty splits
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else out
    R = triton.next_power_of_2(M)
    _w4_kernel[(tiles, split)](x2, codes, scale, zero, out, part, counters, M, N, K, per_split, GROUP=group_size,
                               SPLIT=split, XS=x_steps(R, per_split), R=R, LP=_words_layout(), LF=_x_frag_layout(R),
                               L3=_x_column_layout(min(R, 4)), num_warps=N_WARPS, maxnreg=REGISTERS,
                               **launch_options(launches_early(x2.device)))
    return out
