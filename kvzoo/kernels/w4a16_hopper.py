"""W4A16 for 1-16 rows of x on Hopper (sm_90), in Gluon: the 4-bit codes are unpacked in registers straight into the
A operand of the tensor cores, so a weight goes from DRAM to the tensor cores through registers only (the group
kernel of kvzoo/kernels/w4a16.py stores its unpacked tile to shared memory for tl.dot). Same layout (W4Weight) and
split-K; the module docstring of w4a16.py has both. Two kernels:

    out (M, N) = x (M, K) @ dequant(w)ᵀ, computed transposed: outᵀ (TILE_N, NP) per program
    grid (N / TILE_N, splits): program (tile, split) owns TILE_N = 64 output features (16 per warp, the MMA's M) and the
    steps [split * STEPS_PER_SPLIT, ...) of 128 input channels (one group at G = 128); NP = 8 or 16 columns (rows
    of x, padded).

2-16 rows (_w4_kernel), the warpgroup MMA: a step's (64, 16) code words (a thread's four words of a feature
adjacent, 16 bytes) become (64, 128) exact fp16 codes in the registers of the A operand (DotOperandLayout, checked
trivial at compile time): one shr, lop3 and sub per two codes (codes j and j + 4 of a word as one half2), in a logical
channel order chosen so that no unpacked value moves between threads. A reduction's channel order is free as long as
x takes the same one, so the step's x tile (NP, 128) is permuted to it in registers (a relabelling of its layout)
before it is stored to shared memory, the wgmma's B operand. The group's scale and zero are applied to the codes by
one fp16 FMA per half2, so the weight the tensor cores see is code * scale + zero rounded once to fp16 (the reference
rounds it to x's dtype), and the products accumulate in fp32 across steps. A bf16 x is converted to fp16 (clamped to
its range) as its tile is stored. The operands of the next two steps are loaded before a step's work.

One row (_w4_row_kernel), mma.sync (m16n8k16) with both operands in registers: the same codes, order and rounding, but
each warp's 16 features are a product of their own, so the loop holds no barrier. A program first converts its
split's x to fp16 once and stores it to shared memory in the B operand's fragment order (a lane's operand for a step:
64 contiguous bytes, four 16-byte shared loads); every column of the B operand is that row (only column 0 is stored),
so no thread converts, moves or zeroes x in the loop. The unpack PTX reads each code pair under the magic 16.0
(SCALED_ASM: a shift, a lop3, an exact subtraction and the FMA with the feature's scale and zero). Codes, scales and
zeros are loaded two steps ahead, three steps an iteration, each with a register set of its own, so that no set is
copied to another; the loop has no branch (with one, the compiler moved the loads down to their step): the steps an
iteration runs past the split's end (at most two) multiply the split's last codes by x's zero rows. 96 registers.

Split-K (both): each split stores its fp32 partials; the last split of a tile to finish (a per-tile counter) adds
them in split order and rounds once.

Speed (Llama-3.1-8B layers; docs/kvpareto.md): 2-16 rows, one H100, fp16 x: 1.67-1.87x fp16's product on gate/up
and down, 58-66% of the read floor of their codes (`python -m repro.kvpareto.bench`). One row, one H200, bf16 x, a
block's joined 4-bit products in one CUDA graph: 59.5 us against bf16's 120.0 (2.02x; docs/decode.md, "x in shared
memory for one row").

Groups must be a multiple of 128 channels (AWQ's 128). KVZOO_W4A16_KERNEL=triton|gluon|auto (default) overrides the
choice: triton never takes these kernels, gluon takes them for fewer than MIN_FEATURES outputs too.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from kvzoo.kernels.innerq_hopper import _reinterpret
from kvzoo.kernels.outer_hopper import barrier
from kvzoo.kernels.quant_matvec import kernel_choice, pair_asm, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_W4A16_KERNEL")
ENABLED = CHOICE != "triton"
MAX_ROWS = 16                        # rows of x these kernels serve (the wgmma's N: 8 or 16)
# fewer output features stay with the group kernel: Llama-3.1-8B's k/v (1,024) gains nothing at 2-4 rows and loses
# at 8-16 (results/kvpareto/w4a16-8b-gluon.md); the model joins it with q and v (kvzoo.models.llama.joined_product)
MIN_FEATURES = 0 if CHOICE == "gluon" else 2048
STEP = 128                           # input channels a step (16 words of codes per feature)
TILE_N, N_WARPS = 64, 4
# split-K sizing: programs a multiprocessor keeps busy, of at least 2 steps (five, which the one-row kernel's
# registers fit, took the same time; six were slower, docs/decode.md)
PROGRAMS_PER_SM = 4
MAX_X_STEPS = 63                     # the one-row kernel's x in shared memory and a zero row: 64 rows (16 KB) at most
ROW_REGISTERS = 96                   # the one-row kernel's register cap (ptxas maxnreg, which Triton 3.6 needs to keep
                                     # its loop free of spills)
_TILE = gl.constexpr(TILE_N)


PAIR_ASM, PAIR_CON = (gl.constexpr(part) for part in pair_asm(4))


@gluon.jit
def _unpack(words, LP: gl.constexpr):
    """(R, 16) code words (a step) -> (R, 128) exact fp16 codes in logical channel order
    k' = 32 i + 16 j1 + 8 j0 + 2 q + e, for code j + 4 e (j = 2 j1 + j0) of word 4 q + i (real channel
    8 (4 q + i) + j + 4 e). Output j of the PTX holds codes j and j + 4 of a word (its bits 4j and 16 + 4j) as a
    half2: masked into the mantissa of 1024.0, which is then subtracted."""
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    pairs = gl.expand_dims(words, 2) + gl.zeros([R, W, 2], gl.int32, LP)             # (R, W, 2): the word twice
    return _in_order(gl.inline_asm_elementwise(PAIR_ASM, PAIR_CON, [pairs], dtype=(gl.float16,) * 4, is_pure=True,
                                               pack=2))


@gluon.jit
def _in_order(o):
    """The unpack PTX's four outputs, each (R, W, 2) (output j: codes j and j + 4 of each word), as (R, 8 W) in
    _unpack's logical channel order."""
    R: gl.constexpr = o[0].shape[0]
    W: gl.constexpr = o[0].shape[1]
    x = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))                            # (R, W, e, j0, j1)
    x = gl.permute(gl.reshape(x, (R, 4, W // 4, 2, 2, 2)), (0, 2, 5, 4, 1, 3))        # (R, i, j1, j0, q, e)
    return gl.reshape(x, (R, 8 * W))


@gluon.jit
def _logical(x):
    """(NP, 128) x in real channel order 32 q + 8 i + 4 e + 2 j1 + j0 -> logical order (_unpack's), in registers."""
    NP: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    x = gl.permute(gl.reshape(x, (NP, 4, C // 32, 2, 2, 2)), (0, 2, 4, 5, 1, 3))       # (NP, i, j1, j0, q, e)
    return gl.reshape(x, (NP, C))


@gluon.jit
def _fp16_logical(xt, DT: gl.constexpr):
    """An x tile in logical order, fp16 (bf16 clamped to the fp16 range, as outer_hopper's query)."""
    if DT == gl.bfloat16:
        xt = gl.minimum(gl.maximum(xt.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
    return _logical(xt)


@gluon.jit
def _operands(codes_ptr, scale_ptr, zero_ptr, x_ptr, t, words_at, meta_at, x_at, x_live, W: gl.constexpr,
              GROUP: gl.constexpr):
    """Step t's (64, W) code words, its features' (64, 1) scales and zeros, and its (NP, 8W) x tile (real order)."""
    g = t * (8 * W) // GROUP
    return (gl.load(codes_ptr + words_at + t * W), gl.load(scale_ptr + meta_at + g),
            gl.load(zero_ptr + meta_at + g), gl.load(x_ptr + x_at + t * (8 * W), mask=x_live, other=0))


@gluon.jit
def _w4_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, part_ptr, count_ptr, M, N, K, STEPS_PER_SPLIT,
               GROUP: gl.constexpr, NP: gl.constexpr, SPLIT: gl.constexpr, LP: gl.constexpr):
    DT: gl.constexpr = x_ptr.dtype.element_ty
    W: gl.constexpr = 16                                                             # words a feature and step
    C: gl.constexpr = 8 * W                                                          # channels a step
    LW: gl.constexpr = gl.SliceLayout(2, LP)                                         # words (TILE_N, W)
    # the layout the unpacked (TILE_N, C) codes come in (traced; no code), that of the A operand's registers
    LU: gl.constexpr = _unpack(gl.zeros([_TILE, W], gl.int32, LW), LP).type.layout
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NP, 16])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LX: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])              # x tile, 16 bytes a thread
    XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    tile = gl.program_id(0)
    split = gl.program_id(1)
    feats = tile * _TILE + gl.arange(0, _TILE, layout=gl.SliceLayout(1, LW))
    words_at = (gl.minimum(feats, N - 1).to(gl.int64)[:, None] * (K // 8)
                + gl.arange(0, W, layout=gl.SliceLayout(0, LW))[None, :])
    f_s = tile * _TILE + gl.arange(0, _TILE, layout=gl.SliceLayout(1, LU))
    meta_at = (gl.minimum(f_s, N - 1).to(gl.int64) * (K // GROUP))[:, None]        # (TILE_N, 1): a step, a group
    xm = gl.arange(0, NP, layout=gl.SliceLayout(1, LX))
    x_at = xm.to(gl.int64)[:, None] * K + gl.arange(0, C, layout=gl.SliceLayout(0, LX))[None, :]
    x_live = (xm < M)[:, None]

    x_s = gl.allocate_shared_memory(gl.float16, [NP, C], XS)
    acc = gl.zeros([_TILE, NP], gl.float32, MMA)                                     # outᵀ
    t0 = split * STEPS_PER_SPLIT
    t_end = gl.minimum(t0 + STEPS_PER_SPLIT, K // C)
    # operands are loaded two steps ahead (past the last step, its own again): a ring of two in registers
    last = t_end - 1
    cur = _operands(codes_ptr, scale_ptr, zero_ptr, x_ptr, t0, words_at, meta_at, x_at, x_live, W, GROUP)
    n1 = _operands(codes_ptr, scale_ptr, zero_ptr, x_ptr, gl.minimum(t0 + 1, last), words_at, meta_at, x_at, x_live,
                   W, GROUP)
    for t in range(t0, t_end):
        n2 = _operands(codes_ptr, scale_ptr, zero_ptr, x_ptr, gl.minimum(t + 2, last), words_at, meta_at, x_at,
                       x_live, W, GROUP)
        words, s, z, xt = cur
        x_s.store(_fp16_logical(xt, DT))
        w = _unpack(words, LP) * s + z                                              # one fp16 FMA a half2
        fence_async_shared()
        acc = warpgroup_mma(gl.convert_layout(w, LA, assert_trivial=True), x_s.permute((1, 0)), acc)
        cur, n1 = n1, n2

    _store_out(acc, out_ptr, part_ptr, count_ptr, tile, split, M, N, SPLIT)


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


# output j (0-3): codes j and j + 4 of word $4 (its bits 4 j and 16 + 4 j) shifted to mantissa bits 6-9 of each half,
# read as 16 + c under the magic 16.0 (0x4C00), 16 subtracted (exact), times the scale pair $6 plus the zero pair $7
SCALED_ASM = gl.constexpr("{ .reg .b32 t, m; mov.b32 m, 0x4C004C00; " + " ".join(
    f"{'shl' if j < 2 else 'shr'}.b32 t, $4, {abs(6 - 4 * j)}; lop3.b32 t, t, 0x03C003C0, m, 0xEA; "
    f"sub.f16x2 t, t, m; fma.rn.f16x2 ${j}, t, $6, $7;" for j in range(4)) + " }")
SCALED_CON = gl.constexpr("=r,=r,=r,=r,r,r,r,r")
ROW_NP = gl.constexpr(8)             # the one-row kernel's columns (the MMA's N): x's row in each


@gluon.jit
def _unpack_scaled(words, s, z, LP: gl.constexpr):
    """(R, 16) code words and their features' scales and zeros (R,) -> (R, 128) dequantized codes in _unpack's
    logical order, code * scale + zero rounded once to fp16 (SCALED_ASM)."""
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    pairs = gl.expand_dims(words, 2) + gl.zeros([R, W, 2], gl.int32, LP)             # (R, W, 2): the word twice
    s2 = gl.broadcast(gl.expand_dims(gl.expand_dims(s, 1), 2), pairs.to(gl.float16))[0]     # (R, W, 2)
    z2 = gl.broadcast(gl.expand_dims(gl.expand_dims(z, 1), 2), pairs.to(gl.float16))[0]
    return _in_order(gl.inline_asm_elementwise(SCALED_ASM, SCALED_CON, [pairs, s2, z2], dtype=(gl.float16,) * 4,
                                               is_pure=True, pack=2))


@gluon.jit
def _row_operands(codes_ptr, scale_ptr, zero_ptr, t, words_at, meta_at, W: gl.constexpr, GROUP: gl.constexpr):
    """Step t's (TILE_N, W) code words and its features' (TILE_N,) scales and zeros."""
    g = t * (8 * W) // GROUP
    return gl.load(codes_ptr + words_at + t * W), gl.load(scale_ptr + meta_at + g), gl.load(zero_ptr + meta_at + g)


@gluon.jit
def _row_step(ops, x_step, acc, LP: gl.constexpr, LA: gl.constexpr, LB: gl.constexpr, LF: gl.constexpr):
    """acc (TILE_N, ROW_NP) += a step's dequantized codes (ops: _row_operands') times its x (x_step: the (128,) fp16
    row in shared memory, fragment order), every column of the B operand the same row (only column 0 is stored)."""
    words, s, z = ops
    w = gl.convert_layout(_unpack_scaled(words, s, z, LP), LA, assert_trivial=True)
    xf = x_step.load(LF)                                                             # (128,): 4 x 16 bytes a thread
    xk = gl.reshape(gl.permute(gl.reshape(xf, (4, 8, 2, 2)), (1, 2, 0, 3)), (128,))     # (c, h, q, e): logical order
    xk = gl.convert_layout(xk, gl.SliceLayout(1, LB), assert_trivial=True)
    xb = gl.broadcast(gl.expand_dims(xk, 1), gl.zeros([128, ROW_NP], gl.float16, LB))[0]
    return mma_v2(w, xb, acc)


@gluon.jit
def _w4_row_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, part_ptr, count_ptr, M, N, K, STEPS_PER_SPLIT,
                   GROUP: gl.constexpr, SPLIT: gl.constexpr, XS: gl.constexpr, LP: gl.constexpr,
                   LF: gl.constexpr):
    W: gl.constexpr = 16                                                             # words a feature and step
    C: gl.constexpr = 8 * W                                                          # channels a step
    LW: gl.constexpr = gl.SliceLayout(2, LP)                                         # words (TILE_N, W)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    LX: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])              # x as loaded, 16 bytes a thread

    tile = gl.program_id(0)
    split = gl.program_id(1)
    t0 = split * STEPS_PER_SPLIT
    t_end = gl.minimum(t0 + STEPS_PER_SPLIT, K // C)
    # the split's x (XS rows, zero past its steps) once into shared memory, fp16 in fragment order (_x_frag_layout)
    xi = gl.arange(0, XS, layout=gl.SliceLayout(1, LX))
    x_at = (t0 + xi)[:, None] * C + gl.arange(0, C, layout=gl.SliceLayout(0, LX))[None, :]
    FLAT: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    x_s = gl.allocate_shared_memory(gl.float16, [XS, C], FLAT)
    xk = _fp16_logical(gl.load(x_ptr + x_at, mask=(t0 + xi < t_end)[:, None], other=0), x_ptr.dtype.element_ty)
    xf = gl.permute(gl.reshape(xk, (XS, 8, 2, 4, 2)), (0, 3, 1, 2, 4))               # (XS, q, c, h, e)
    _reinterpret(x_s, gl.float16, [XS * C], FLAT).store(gl.reshape(xf, (XS * C,)))
    barrier()

    feats = gl.minimum(tile * _TILE + gl.arange(0, _TILE, layout=gl.SliceLayout(1, LW)), N - 1).to(gl.int64)
    words_at = (feats[:, None] * (K // C)) * W + gl.arange(0, W, layout=gl.SliceLayout(0, LW))[None, :]
    meta_at = feats * (K // GROUP)                                                   # (TILE_N,): a step, a group
    acc = gl.zeros([_TILE, ROW_NP], gl.float32, MMA)                                 # outᵀ
    last = t_end - 1
    # three steps an iteration, each step's operands loaded two steps ahead into one of three register sets (past
    # the last step, its own again), so that no set is copied to another; no branch in the loop (a branch let the
    # compiler move the loads down to their step): the steps past the split's end read x's zero rows
    a = _row_operands(codes_ptr, scale_ptr, zero_ptr, t0, words_at, meta_at, W, GROUP)
    b = _row_operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t0 + 1, last), words_at, meta_at, W, GROUP)
    for t in range(t0, t_end, 3):
        c = _row_operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t + 2, last), words_at, meta_at, W, GROUP)
        acc = _row_step(a, x_s.index(t - t0), acc, LP, LA, LB, LF)
        a = _row_operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t + 3, last), words_at, meta_at, W, GROUP)
        acc = _row_step(b, x_s.index(gl.minimum(t + 1 - t0, XS - 1)), acc, LP, LA, LB, LF)
        b = _row_operands(codes_ptr, scale_ptr, zero_ptr, gl.minimum(t + 4, last), words_at, meta_at, W, GROUP)
        acc = _row_step(c, x_s.index(gl.minimum(t + 2 - t0, XS - 1)), acc, LP, LA, LB, LF)
    _store_out(acc, out_ptr, part_ptr, count_ptr, tile, split, M, N, SPLIT)


@functools.cache
def _x_frag_layout() -> gl.DistributedLinearLayout:
    """A step's x (128,) in shared memory's fragment order j = 32 q + 4 c + 2 h + e as the one-row kernel loads it:
    lane 4 g + q holds j = 32 q .. 32 q + 31 (logical channels 16 c + 8 h + 2 q + e, its B operand), every g and
    every warp the same."""
    return gl.DistributedLinearLayout([[1], [2], [4], [8], [16]], [[32], [64], [0], [0], [0]], [[0], [0]], [], [128])


@functools.cache
def _words_layout() -> gl.DistributedLinearLayout:
    """The words' (TILE_N, 16, 2) layout, that of the A operand's registers: lanes 4 g + q hold features g and g + 8
    of their warp's 16 and words 4 q .. 4 q + 3 (registers: the pair axis, the next words, feature + 8), warps the
    four 16-feature slices."""
    return gl.DistributedLinearLayout([[0, 0, 1], [0, 1, 0], [0, 2, 0], [8, 0, 0]],
                                      [[0, 4, 0], [0, 8, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
                                      [[16, 0, 0], [32, 0, 0]], [], [TILE_N, 16, 2])


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def eligible(x2: Tensor, group_size: int, N: int, K: int) -> bool:
    """Whether w4a16_matmul takes these kernels for x2 (M, K) and an (N, K) weight: enabled, a compiled fp16/bf16 run
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
    if M == 1:
        split = max(split, -(-steps // MAX_X_STEPS))
    per_split = -(-steps // split)
    split = -(-steps // per_split)                                      # no empty splits
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else out
    if M == 1:
        _w4_row_kernel[(tiles, split)](x2, codes, scale, zero, out, part, counters, M, N, K, per_split,
                                       GROUP=group_size, SPLIT=split, XS=triton.next_power_of_2(per_split + 1),
                                       LP=_words_layout(), LF=_x_frag_layout(), num_warps=N_WARPS,
                                       maxnreg=ROW_REGISTERS)
    else:
        _w4_kernel[(tiles, split)](x2, codes, scale, zero, out, part, counters, M, N, K, per_split, GROUP=group_size,
                                   NP=8 if M <= 8 else 16, SPLIT=split, LP=_words_layout(), num_warps=N_WARPS)
    return out
