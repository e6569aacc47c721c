"""XQuant's weighing of its value latents (xquant_remat.weigh_gather) on Hopper (sm_90), in Gluon: 4-bit codes in
per-token groups of a multiple of 64 channels (whole int32 pairs of scales a row), the model fp16 or bf16, at most
32 query heads.

    partials[split, b] (BLOCK_H, r) = Σ_i p[b, :, i] · row src[i] of [dequant(codes[b]) ; window[b]]

over the rows i of one split, the same partials as xquant_remat._weigh_fold_kernel, summed by its _sum_splits_kernel.

    grid (r / 256, splits, B): program (channel block, split, batch row) weighs 256 channels, 64 a warp (8 code
    words a row), over the split's rows, 64 a step in four chunks of 16.

Each warp runs mma.sync (m16n8k16) products on its own channels, accᵀ (64, BLOCK_H) += Cᵀ (64, 16 rows) · Wᵀ (16
rows, BLOCK_H), both operands in registers:
  - C holds the codes centered, c - 8, exact fp16 values: a thread holds one code word (8 channels) of four rows,
    the words of rows 2 p and 2 p + 1 are interleaved by halves (two prmt), and one shr, lop3 and sub give an A
    register, code a of both rows (quant_matvec.pair_asm, centered). A's rows are the warp's channels in a fixed
    order (_real), written back to their places at the end.
  - W is p · scale, rounded to fp16 once (the fold path's weight), each warp with its own group's scales: with the
    codes centered, a row's Σ_t p_t (c_t s_t + z_t) = Σ_t (p_t s_t)(c_t - 8) + Σ_t p_t (z_t + 8 s_t), the second
    term summed in fp32 by each thread over its own rows and reduced once, after the loop.
  - Operands go through shared memory, copied asynchronously (cp.async) STAGES - 1 steps ahead, and each step's src
    (the rows it gathers) 2 (STAGES - 1) steps ahead, read from shared memory to address its rows' copies: no
    register holds a load in flight, so none waits where ptxas schedules it. A step's p is copied once and read by
    every warp, and so are a row's scale and zero pairs (PAIRS of them over the program's channels). The code words
    are copied 4 bytes a lane, a row's 32 bytes by 8 lanes, into a swizzled ring that gives each thread its 4 rows
    of a word in one 16-byte read, with no bank conflict on the reads or (by Triton's count) the copies' stores.
    Each chunk's words and p have buffers of their own, so Triton's barrier analysis places none between a step's
    chunk copies: two barriers a step beside the loop's own.
  - Window rows (src in [N, N + W)) weigh nothing there (their scale and zero read 0); each thread notes the first
    and last step holding any of its rows, and a second loop weighs those steps' window rows from their exact
    values (fp16; bf16 rows converted, as the fold path does).
Numerics are the fold path's: the same operands rounded the same way, fp32 products, summed in another order.
At most 168 registers a thread and three steps of 54 KB in shared memory (32 heads): three programs an SM.

Speed (XQuant's 8B value latents, 1,024 wide, groups of 128, 32 query heads, rows in order as the graph step reads
them, one H200, L2 flushed; docs/decode.md, "XQuant's weighing: its copies, and the step's row order"): 464.3 us at
32K, batch 32 against the fold path's 676.9, 74.6 against 96.1 at 128K, batch 1, 48.5 against 54.7 at 64K; at 32K,
batch 1 33.1 against 32.8, so fewer than MIN_ROWS rows (batch x S) stay with the fold path.
KVZOO_WEIGH_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel, gluon takes it
at any number of rows.
"""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from kvzoo.kernels.innerq_hopper import _reinterpret
from kvzoo.kernels.outer_hopper import HIGH_HALVES, LOW_HALVES, _is_hopper, barrier
from kvzoo.kernels.quant_matvec import kernel_choice, pair_asm, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_WEIGH_KERNEL")
ENABLED = CHOICE != "triton"
# fewer rows (batch x S) stay with the Triton fold path ("gluon": none fewer). In the graph step's row order (in
# order): at 32K rows 33.1 us against 32.8, at 64K 48.5 against 54.7 (docs/decode.md)
MIN_ROWS = 0 if CHOICE == "gluon" else 65536
N_WARPS, ROWS, CHUNKS, MAX_HEADS = 4, 16, 4, 32
WARP_CHANNELS = 64
CHANNELS = N_WARPS * WARP_CHANNELS            # a program's channels
STEP = CHUNKS * ROWS                          # rows a program weighs a step
STAGES = 3                                    # steps in shared memory: 54 KB a program at 32 heads
PROGRAMS_PER_SM = 3                           # at REGISTERS a thread and STAGES, three programs fit an SM
REGISTERS = 168
WARPS = gl.constexpr(N_WARPS)
NCHUNK = gl.constexpr(CHUNKS)
BLOCK = gl.constexpr(STEP)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[N_WARPS, 1, 1], instr_shape=[1, 16, 8]))
# Triton 3.9 names it async_load, 3.6 async_copy_global_to_shared
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
CENTERED_ASM, CENTERED_CON = (gl.constexpr(part) for part in pair_asm(4, centered=True))
# a step's scale (or zero) pair copies, (4 chunks, PAIRS, 16 rows): one an element at PAIRS = 2, twice at 1
PAIR_COPY = gl.constexpr(gl.BlockedLayout([1, 1, 1], [2, 1, 16], [2, 2, 1], [2, 1, 0]))
# the code words' copies (4 warps, 16 rows, 8 words): lanes 4 g + q copy word g of rows q, 4 + q, 8 + q, 12 + q (a
# copy reads a row's 32 bytes in 8 lanes); with WORD_RING's swizzle a copy's stores meet 32 banks (gl.bank_conflicts;
# Nsight still counts 4 wavefronts a copy, one a row it reads, it seems: docs/decode.md)
WORD_COPY = gl.constexpr(gl.DistributedLinearLayout([[0, 4, 0], [0, 8, 0]],
                                                    [[0, 1, 0], [0, 2, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
                                                    [[1, 0, 0], [2, 0, 0]], [], [N_WARPS, ROWS, WARP_CHANNELS // 8]))
# words in shared memory, rows fastest, each word's four groups of 4 rows permuted by (word // 2) % 4: a thread's
# 4 rows of a word (LW) are one 16-byte read, and no two lanes of a copy share a bank
WORD_RING = gl.constexpr(gl.SwizzledSharedLayout(4, 2, 4, [1, 2, 0]))


@gluon.jit
def _codes(words):
    """Code words (4 warps, 16 rows, 8 words) in _layouts' LW -> Cᵀ (4, 64, 16), the product's A operand: row
    m = g + 8 s + 16 a of warp w's A is code 4 s + a of its word g (_real), column k row _row(k) of the chunk. Rows
    2 p and 2 p + 1 share A's half2 registers, so their words are interleaved by halves first: slots 0-3 of both,
    then 4-7."""
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    even, odd = gl.split(gl.permute(gl.reshape(words, (4, 8, 2, 8)), (0, 1, 3, 2)))     # (4, 8 p, 8 g): rows 2p, +1
    lo = gl.inline_asm_elementwise(LOW_HALVES, "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(HIGH_HALVES, "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=1)
    x = gl.join(lo, hi)                                                            # (4, 8, 8, s): slots 4 s + a
    o = gl.inline_asm_elementwise(CENTERED_ASM, CENTERED_CON, [gl.join(x, x)], dtype=(gl.float16,) * 4,
                                  is_pure=True, pack=2)                            # each (4, 8, 8, s, parity)
    y = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))                           # (..., a0, a1)
    y = gl.reshape(y, (4, 2, 2, 2, 8, 2, 2, 2, 2))                # (4, p2, p1, p0, g, s, par, a0, a1)
    y = gl.reshape(gl.permute(y, (0, 8, 7, 5, 4, 3, 1, 2, 6)), (4, 64, 16))        # (4, a1 a0 s g, p0 p2 p1 par)
    return gl.convert_layout(y, A, assert_trivial=True)


@gluon.jit
def _real(m):
    """A's row m -> its channel in the warp's 64: code 4 ((m // 8) % 2) + m // 16 of word m % 8."""
    return 8 * (m % 8) + 4 * ((m // 8) % 2) + m // 16


@gluon.jit
def _row(k):
    """A's and B's column k -> the row of the chunk's 16 it holds (_codes' and _weights' permutation)."""
    return (k % 2) + 2 * ((k // 8) % 2) + 4 * ((k // 2) % 2) + 8 * ((k // 4) % 2)


@gluon.jit
def _weights(x):
    """(4, 16 rows, BLOCK_H) in _layouts' LP -> the product's B operand, its column k row _row(k)."""
    BL: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    H: gl.constexpr = x.shape[2]
    x = gl.permute(gl.reshape(x, (4, 2, 2, 2, 2, H)), (0, 3, 1, 2, 4, 5))       # rows (r3 r2 r1 r0) -> (r1 r3 r2 r0)
    return gl.convert_layout(gl.reshape(x, (4, 16, H)), BL, assert_trivial=True)


@gluon.jit
def _rows(t, L2: gl.constexpr):
    """Rows t + 16 c + j of a step, (4 chunks, 16) in L2."""
    c = gl.arange(0, NCHUNK, layout=gl.SliceLayout(1, L2))
    j = gl.arange(0, 16, layout=gl.SliceLayout(0, L2))
    return t + c[:, None] * 16 + j[None, :]


@gluon.jit
def _half(pairs, half):
    """The fp16 in half `half` (0: low) of each int32 pair."""
    return (pairs >> (16 * half)).to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _copy_src(src_ptr, t, stop, dst, LC: gl.constexpr):
    """Copy step t's src (4 chunks, 16) into dst, asynchronously (past stop: 0)."""
    i = _rows(t, LC)
    async_load(dst, src_ptr + i, mask=i < stop)


@gluon.jit
def _chunks(src, LS: gl.constexpr):
    """A step's src (4 chunks, 16) in _layouts' LSRC (the chunks in registers) -> its four chunks (16,) in LS."""
    x = gl.permute(gl.reshape(src, (2, 2, 16)), (2, 0, 1))                         # (16, c1, c0)
    even, odd = gl.split(x)                                                        # c0 = 0, 1: (16, c1)
    c0, c2 = gl.split(even)
    c1, c3 = gl.split(odd)
    return (gl.convert_layout(c0.to(gl.int32), LS, assert_trivial=True),
            gl.convert_layout(c1.to(gl.int32), LS, assert_trivial=True),
            gl.convert_layout(c2.to(gl.int32), LS, assert_trivial=True),
            gl.convert_layout(c3.to(gl.int32), LS, assert_trivial=True))


@gluon.jit
def _copy_step(codes_ptr, sc_ptr, ze_ptr, p_ptr, t, stop, src_d, words_d, p_d, sc_d, ze_d, slot, N, R, WORDS, HQ, k0,
               s_ph, GROUP: gl.constexpr, PAIRS: gl.constexpr, HAS_ZERO: gl.constexpr, ALL_H: gl.constexpr,
               LW: gl.constexpr, LPC: gl.constexpr, LSRC: gl.constexpr, MASKED: gl.constexpr):
    """Copy step t's operands into shared memory, asynchronously, given its src (4 chunks, 16) in src_d: each
    chunk's code words (4 warps, 16 rows, 8 words) as LW holds them, at chunk slot * 4 + c; the PAIRS int32 pairs
    holding a row's scales and zeros over the program's channels (0 where a row is not coded), stage slot's
    (4 chunks, PAIRS, 16 rows), one copy each; and p (BLOCK_H, 16), a thread's four rows of a head contiguous (a
    16-byte copy). MASKED: rows past stop copy p as 0."""
    LR: gl.constexpr = gl.SliceLayout(2, WORD_COPY)
    BLOCK_H: gl.constexpr = LPC.shape[0]
    w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, LR))
    u = gl.arange(0, LW.shape[2], layout=gl.SliceLayout(0, gl.SliceLayout(1, WORD_COPY)))
    h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LPC))
    r = gl.arange(0, 16, layout=gl.SliceLayout(0, LPC))
    rows = _chunks(src_d.load(LSRC), gl.SliceLayout(0, LR))
    for c in gl.static_range(NCHUNK):
        row = gl.expand_dims(rows[c], 0)                                           # (1, 16)
        row = gl.where(row < N, row, 0)                                            # row 0 stands in: never weighed
        at = (row * WORDS)[:, :, None] + (w * LW.shape[2])[:, None, None] + u[None, None, :]
        async_load(words_d[c].index(slot), codes_ptr + at)
        i = t + c * 16 + r
        at = p_ptr + (h[:, None] * s_ph + i[None, :])
        if MASKED:
            async_load(p_d[c].index(slot), at, mask=(h < HQ)[:, None] & (i < stop)[None, :])
        elif ALL_H:
            async_load(p_d[c].index(slot), at)
        else:
            async_load(p_d[c].index(slot), at, mask=(h < HQ)[:, None] & (i >= 0)[None, :])
    # the scale and zero pairs: one copy an element (a row's pairs are the same for every warp that reads them)
    row = gl.expand_dims(src_d.load(gl.SliceLayout(1, PAIR_COPY)).to(gl.int32), 1)   # (4 chunks, 1, 16)
    coded = row < N
    pair = gl.arange(0, PAIRS, layout=gl.SliceLayout(0, gl.SliceLayout(2, PAIR_COPY)))[None, :, None]
    pair = (k0 // GROUP) // 2 + pair
    at = gl.where(coded, row, 0) * (R // GROUP // 2) + pair                       # (4, PAIRS, 16)
    coded = gl.reshape(coded & (pair < R // GROUP // 2), [NCHUNK * PAIRS * 16])   # a pair past the row: unread
    async_load(sc_d.index(slot), gl.reshape(sc_ptr + at, [NCHUNK * PAIRS * 16]), mask=coded)
    if HAS_ZERO:
        async_load(ze_d.index(slot), gl.reshape(ze_ptr + at, [NCHUNK * PAIRS * 16]), mask=coded)


@gluon.jit
def _pairs(buf, at, pair, PAIRS: gl.constexpr, LH: gl.constexpr):
    """Chunk `at`'s scale or zero pairs as the warps read them, (4 warps, 16 rows) in LH, from buf's rows at * PAIRS
    + p (16 rows each); pair (4, 1): each warp's p."""
    x = gl.expand_dims(buf.index(at * PAIRS).load(gl.SliceLayout(0, LH)), 0)     # (1, 16)
    if PAIRS == 2:
        y = gl.expand_dims(buf.index(at * PAIRS + 1).load(gl.SliceLayout(0, LH)), 0)
        return gl.where(pair == 1, y, x)
    else:
        return x + gl.zeros_like(pair)


@gluon.jit
def _chunk(words, sc, ze, p, half, acc, zacc, HAS_ZERO: gl.constexpr, LP: gl.constexpr):
    """One chunk's products: accᵀ += Cᵀ · (p s)ᵀ, each warp with its group's scales (sc, ze: (4, 16) int32 pairs,
    half (4, 1) which half is the warp's), p (BLOCK_H, 16) the same in every warp; and each thread's Σ p (z + 8 s)
    over its own rows."""
    H: gl.constexpr = p.shape[0]
    scale = gl.expand_dims(_half(sc, half).to(gl.float32), 1)                      # (4, 1, 16)
    p = gl.expand_dims(p, 0)                                                       # (1, H, 16)
    if HAS_ZERO:
        z = gl.expand_dims(_half(ze, half).to(gl.float32), 1) + 8.0 * scale
        zacc += gl.sum(gl.reshape(p * z, (WARPS, H, 4, 4)), axis=3)
    w = gl.convert_layout(gl.permute((p * scale).to(gl.float16), (0, 2, 1)), LP, assert_trivial=True)
    return mma_v2(_codes(words), _weights(w), acc), zacc


@gluon.jit
def _weigh_kernel(codes_ptr, scale_ptr, zero_ptr, win_ptr, src_ptr, p_ptr, out_ptr, N, W, S, R, WORDS, HQ, PER_SPLIT,
                  s_wb, s_wn, s_pb, s_ph, GROUP: gl.constexpr, PAIRS: gl.constexpr, HAS_ZERO: gl.constexpr,
                  ALL_H: gl.constexpr, BLOCK_H: gl.constexpr, STAGES: gl.constexpr, LW: gl.constexpr, LP: gl.constexpr,
                  LPT: gl.constexpr, LPC: gl.constexpr, LSRC: gl.constexpr):
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    LC: gl.constexpr = gl.SliceLayout(2, LP)                                       # (4 chunks, 16 rows)
    S3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    S1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    D: gl.constexpr = STAGES - 1
    SRC_STAGES: gl.constexpr = 2 * STAGES                        # at least 2 D + 1, a power of two
    k0 = gl.program_id(0) * (WARPS * 8 * LW.shape[2])
    split = gl.program_id(1)
    b = gl.program_id(2).to(gl.int64)
    start = split * PER_SPLIT
    stop = gl.minimum(start + PER_SPLIT, S)
    # the program's batch row and channel block; rows are then int32 offsets (a row's codes below 2^31 words); the
    # scales and zeros are copied as the int32 pairs holding them (R / GROUP even: a row's pairs are whole)
    codes_ptr += b * N * WORDS + k0 // 8
    sc_ptr = (scale_ptr + b * N * (R // GROUP)).to(gl.pointer_type(gl.int32), bitcast=True)
    ze_ptr = (zero_ptr + b * N * (R // GROUP)).to(gl.pointer_type(gl.int32), bitcast=True)
    p_ptr += b * s_pb
    LH: gl.constexpr = gl.SliceLayout(1, LPT)                                      # (4 warps, 16 rows)
    wh = gl.arange(0, WARPS, layout=gl.SliceLayout(1, LH))
    group = (k0 + wh * (8 * LW.shape[2])) // GROUP
    half = gl.expand_dims(group % 2, 1)                                            # (4, 1): each warp's half
    pair = gl.expand_dims(group // 2 - (k0 // GROUP) // 2, 1)                      # and its pair of the PAIRS

    # each chunk's words and p in buffers of their own (stage s at s), which Triton's barrier analysis tells apart:
    # no barrier between a step's chunk copies; the src of a whole step at a time
    words_s = (gl.allocate_shared_memory(gl.int32, [STAGES, WARPS, 16, LW.shape[2]], WORD_RING),
               gl.allocate_shared_memory(gl.int32, [STAGES, WARPS, 16, LW.shape[2]], WORD_RING),
               gl.allocate_shared_memory(gl.int32, [STAGES, WARPS, 16, LW.shape[2]], WORD_RING),
               gl.allocate_shared_memory(gl.int32, [STAGES, WARPS, 16, LW.shape[2]], WORD_RING))
    sc_s = gl.allocate_shared_memory(gl.int32, [STAGES, NCHUNK * PAIRS * 16], S1)   # stage s: (4 chunks, PAIRS, 16)
    ze_s = gl.allocate_shared_memory(gl.int32, [STAGES, NCHUNK * PAIRS * 16], S1)
    sc_r = _reinterpret(sc_s, gl.int32, [STAGES * NCHUNK * PAIRS, 16], S1)         # read 16 rows at a time
    ze_r = _reinterpret(ze_s, gl.int32, [STAGES * NCHUNK * PAIRS, 16], S1)
    p_s = (gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H, 16], S3),
           gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H, 16], S3),
           gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H, 16], S3),
           gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H, 16], S3))
    src_s = gl.allocate_shared_memory(gl.int64, [SRC_STAGES, NCHUNK, 16], S3)

    acc = gl.zeros([WARPS, 64, BLOCK_H], gl.float32, MMA)                          # accᵀ, each warp its channels
    LZ: gl.constexpr = gl.SliceLayout(3, gl.reshape(gl.zeros([WARPS, BLOCK_H, 16], gl.float32, LPT),
                                                    (WARPS, BLOCK_H, 4, 4)).type.layout)
    zacc = gl.zeros([WARPS, BLOCK_H, 4], gl.float32, LZ)
    win_lo = gl.zeros([NCHUNK, 16], gl.int32, LC) + stop    # each row's first and last step that held a window row
    win_hi = gl.zeros([NCHUNK, 16], gl.int32, LC) + start
    steps = gl.cdiv(stop - start, BLOCK)
    full = (stop - start) // BLOCK                          # steps with no row past stop
    # the first D steps' operands (their src copied first, waited for), and the src of steps D .. 2 D - 1
    for k in gl.static_range(D):
        if k < steps:
            _copy_src(src_ptr, start + k * BLOCK, stop, src_s.index(k % SRC_STAGES), LC)
    async_copy.commit_group()
    async_copy.wait_group(0)
    barrier()
    for k in gl.static_range(D):
        if k < steps:
            _copy_step(codes_ptr, sc_ptr, ze_ptr, p_ptr, start + k * BLOCK, stop, src_s.index(k % SRC_STAGES),
                       words_s, p_s, sc_s, ze_s, k % STAGES, N, R, WORDS, HQ, k0, s_ph, GROUP, PAIRS, HAS_ZERO, ALL_H,
                       LW, LPC, LSRC, True)
        if k + D < steps:
            _copy_src(src_ptr, start + (k + D) * BLOCK, stop, src_s.index((k + D) % SRC_STAGES), LC)
        async_copy.commit_group()
    for j in range(steps):
        async_copy.wait_group(D - 1)                    # step j's operands and step j + D's src are in place
        barrier()                                       # and every warp is done with step j - 1's buffers
        t = start + j * BLOCK
        src = src_s.index(j % SRC_STAGES).load(LC).to(gl.int32)
        windowed = (_rows(t, LC) < stop) & (src >= N) & (src < N + W)
        win_lo = gl.where(windowed, gl.minimum(win_lo, t), win_lo)
        win_hi = gl.where(windowed, gl.minimum(t + BLOCK, stop), win_hi)
        n = j + D
        if n < steps:
            if n < full:
                _copy_step(codes_ptr, sc_ptr, ze_ptr, p_ptr, start + n * BLOCK, stop, src_s.index(n % SRC_STAGES),
                           words_s, p_s, sc_s, ze_s, n % STAGES, N, R, WORDS, HQ, k0, s_ph, GROUP, PAIRS, HAS_ZERO,
                           ALL_H, LW, LPC, LSRC, False)
            else:
                _copy_step(codes_ptr, sc_ptr, ze_ptr, p_ptr, start + n * BLOCK, stop, src_s.index(n % SRC_STAGES),
                           words_s, p_s, sc_s, ze_s, n % STAGES, N, R, WORDS, HQ, k0, s_ph, GROUP, PAIRS, HAS_ZERO,
                           ALL_H, LW, LPC, LSRC, True)
        n = j + 2 * D
        if n < steps:
            _copy_src(src_ptr, start + n * BLOCK, stop, src_s.index(n % SRC_STAGES), LC)
        async_copy.commit_group()
        slot = j % STAGES
        for c in gl.static_range(NCHUNK):
            at = slot * NCHUNK + c
            acc, zacc = _chunk(words_s[c].index(slot).load(LW), _pairs(sc_r, at, pair, PAIRS, LH),
                               _pairs(ze_r, at, pair, PAIRS, LH), p_s[c].index(slot).load(gl.SliceLayout(0, LPT)),
                               half, acc, zacc, HAS_ZERO, LP)
    async_copy.wait_group(0)

    # the window rows of the steps that hold any, from their exact values, a chunk of 16 rows at a time
    m = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, A)))
    wa = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, A)))
    channel = k0 + wa[:, None] * 64 + _real(m)[None, :]                          # (4, 64)
    LA: gl.constexpr = gl.SliceLayout(1, A)
    ka = gl.arange(0, 16, layout=gl.SliceLayout(0, LA))
    hp = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, gl.SliceLayout(0, LPT)))
    rp = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(0, LPT)))
    for t in range(gl.min(gl.min(win_lo, axis=1), axis=0), gl.max(gl.max(win_hi, axis=1), axis=0), 16):
        ia = gl.expand_dims(t + _row(ka), 0)                                       # (1, 16): A's column k
        at = gl.load(src_ptr + ia, mask=ia < stop, other=0).to(gl.int32)
        live = (ia < stop) & (at >= N) & (at < N + W)
        exact = gl.load(win_ptr + b * s_wb + gl.where(live, at - N, 0)[:, None, :] * s_wn + channel[:, :, None],
                        mask=live[:, None, :] & (channel < R)[:, :, None], other=0).to(gl.float16)
        ip = t + rp
        sp = gl.load(src_ptr + ip, mask=ip < stop, other=0)
        lp = (ip < stop) & (sp >= N) & (sp < N + W)
        w = gl.load(p_ptr + hp[:, None] * s_ph + ip[None, :], mask=(hp < HQ)[:, None] & lp[None, :], other=0)
        w = gl.expand_dims(w.to(gl.float16), 0) + gl.zeros([WARPS, BLOCK_H, 16], gl.float16, LPT)
        acc = mma_v2(exact, _weights(gl.convert_layout(gl.permute(w, (0, 2, 1)), LP, assert_trivial=True)), acc)

    OL: gl.constexpr = acc.type.layout
    z = gl.convert_layout(gl.sum(zacc, axis=2), gl.SliceLayout(1, OL))             # (4, BLOCK_H)
    out = acc + gl.expand_dims(z, 1)
    # rows in channel order (a relabelling: _real's bits), then 16-byte stores along the channels
    out = gl.reshape(gl.permute(gl.reshape(out, (WARPS, 2, 2, 2, 8, BLOCK_H)), (0, 4, 3, 1, 2, 5)),
                     (WARPS, 64, BLOCK_H))                                         # (4, g s a1 a0, H)
    LO: gl.constexpr = gl.BlockedLayout([1, 4, 1], [1, 16, 2], [WARPS, 1, 1], [1, 2, 0])
    out = gl.convert_layout(out, LO)
    wo = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LO)))
    co = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(2, LO)))
    ho = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, gl.SliceLayout(1, LO)))
    rows = (split * gl.num_programs(2) + b) * BLOCK_H + ho
    at = rows[None, None, :] * R + (k0 + wo[:, None] * 64 + co[None, :])[:, :, None]
    gl.store(out_ptr + at, out)


@functools.cache
def _layouts(block_h: int) -> tuple:
    """(LW, LP, LPT, LPC, LSRC): the code words' (4 warps, 16 rows, 8 words) layout, lanes 4 g + q holding word g
    of rows 4 q .. 4 q + 3 (registers row + 1, + 2; lanes row + 4, + 8), warp w its 8 words of a row; p's (4, 16
    rows, block_h), lanes 4 g + q holding heads g + 8 n (registers) of the same rows; p's transposed (4, block_h,
    16), a thread's four rows of a head in consecutive registers (16-byte reads); p's chunk copies (block_h, 16),
    16 bytes a thread, every warp a share; and a step's src (4 chunks, 16), the chunks in registers and each
    thread's rows as WORD_COPY copies them (_chunks). Unpacked and permuted (_codes, _weights), LW and LP are A's
    and B's registers."""
    heads = [[0, 0, 8 << i] for i in range(block_h.bit_length() - 4)]
    lw = gl.DistributedLinearLayout([[0, 1, 0], [0, 2, 0]], [[0, 4, 0], [0, 8, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
                                    [[1, 0, 0], [2, 0, 0]], [], [N_WARPS, ROWS, WARP_CHANNELS // 8])
    lp = gl.DistributedLinearLayout([[0, 1, 0], [0, 2, 0]] + heads,
                                    [[0, 4, 0], [0, 8, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
                                    [[1, 0, 0], [2, 0, 0]], [], [N_WARPS, ROWS, block_h])
    lpt = gl.DistributedLinearLayout([[0, 0, 1], [0, 0, 2]] + [[0, h, 0] for _, _, h in heads],
                                     [[0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                                     [[1, 0, 0], [2, 0, 0]], [], [N_WARPS, block_h, ROWS])
    warp_heads = [[8 << i, 0] for i in range(block_h.bit_length() - 4)]
    lpc = gl.DistributedLinearLayout([[0, 1], [0, 2]], [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                     (warp_heads + [[0, 0], [0, 0]])[:2], [], [block_h, ROWS])
    lsrc = gl.DistributedLinearLayout([[1, 0], [2, 0], [0, 4], [0, 8]], [[0, 1], [0, 2], [0, 0], [0, 0], [0, 0]],
                                      [[0, 0], [0, 0]], [], [CHUNKS, ROWS])
    return lw, lp, lpt, lpc, lsrc


def pairs(group: int) -> int:
    """The int32 pairs of a row's scales (or zeros) a program's CHANNELS channels reach at most: one where the
    program's channel blocks align with the pairs' 2 * group channels, else two."""
    return 1 if (2 * group) % CHANNELS == 0 else 2


def eligible(bits: int, axis: int, group: int, r: int, heads: int, rows: int, window: Tensor) -> bool:
    """Whether weigh_gather takes this kernel: enabled, an sm_90 GPU with the inline-PTX path (fp16/bf16 rows,
    compiled), 4-bit codes in per-token groups of a multiple of 64 channels, an even number of them a row, r a
    multiple of 256, at most 32 query heads, and at least MIN_ROWS rows (batch x S) to weigh."""
    return (ENABLED and unpacks_in_ptx(window) and _is_hopper(window.device.index or 0) and bits == 4
            and axis == -1 and group % WARP_CHANNELS == 0 and r % CHANNELS == 0 and (r // group) % 2 == 0
            and 0 < heads <= MAX_HEADS and rows >= MIN_ROWS)


def weigh_splits(codes: Tensor, scale: Tensor, zero: Tensor | None, window: Tensor, W: int, src: Tensor, p: Tensor,
                 partials: Tensor, N: int, r: int, group: int, per_split: int) -> None:
    """Launch the kernel into partials (splits, B, BLOCK_H, r) fp32, BLOCK_H = partials.shape[2] (16 or 32, at
    least the heads), over N coded rows and the W window rows of `window` (at least one row, as allocated);
    per_split a multiple of STEP."""
    splits, B, block_h, _ = partials.shape
    lw, lp, lpt, lpc, lsrc = _layouts(block_h)
    heads = p.shape[1]
    _weigh_kernel[(r // CHANNELS, splits, B)](
        codes, scale, zero if zero is not None else scale, window, src, p, partials, N, W, src.numel(),
        r, codes.shape[-1], heads, per_split, window.stride(0), window.stride(1), p.stride(0), p.stride(1),
        GROUP=group, PAIRS=pairs(group), HAS_ZERO=zero is not None, ALL_H=heads == block_h, BLOCK_H=block_h,
        STAGES=STAGES, LW=lw, LP=lp, LPT=lpt, LPC=lpc, LSRC=lsrc, num_warps=N_WARPS, maxnreg=REGISTERS)
