"""The quantized runs of outer_attention's split kernel for KIVI's and SQuat's layout on Hopper (sm_90), in Gluon:
2-bit keys in per-channel groups of 32 tokens, stored after RoPE or before it (KIVI*, SQuat-pre: rotated here),
2-bit values in per-token groups of G channels (G a multiple of 16), head_dim 64 or 128, an fp16/bf16 model. The
sink and the windows stay with the Triton split kernel, which runs the last program; both write the same
(m, l, acc) partials, merged by its combine kernel.

    grid (B*H, splits): program (kv head, split) attends its rep query rows (ROWS = 8 or 16, padding past rep)
    over the groups [split * PER_SPLIT, ...) of the slots quantized in both streams, 128 tokens a step.

Two kernels. Head_dim 128 (KIVI and SQuat on Llama/Mistral, keys stored after RoPE or before it) takes the warp
kernel; head_dim 64 the warpgroup kernel. Bytes read are those of the Triton kernel (outer_attention's module
docstring) in both; what differs is how the dequantized tiles reach the tensor cores.

The warp kernel (_warp_kernel): each of the four warps attends a key group of its own (32 tokens) a step, with its
own online softmax, and the warps merge their (m, l, acc) once, after the loop; the products are mma.sync
(m16n8k16, batched over the warps), both A operands in registers, and the loop holds no barrier and no shared
memory:
  - The scores sᵀ (32 tokens, ROWS) = K · qᵀ: the keys' words unpack into A as in the warpgroup kernel (below), each
    column's scale and offset a half2 pair (slots a, a + 8) formed once a step from the loaded pairs (_column_pairs).
  - The output accᵀ (d, ROWS) += Vᵀ · pᵀ: A = Vᵀ, whose half2 registers hold two tokens of one channel, while a
    value word holds 16 channels of one token. A thread holds one word (16 channels) of 8 tokens, and the words of
    tokens 2 p and 2 p + 1 are interleaved by halves (two prmt), so the unpack PTX's output a is slot a of both
    tokens, dequantized with their two scales as a half2 (_warp_values). mma.sync's A covers every row (channel)
    in each warp, so one thread's rows are a whole word, where the warpgroup MMA's 64-row A gives a thread 4
    channels; that is why this kernel is mma.sync, not wgmma.
  - pᵀ moves from the scores' accumulator layout to the B operand by shuffles (gl.convert_layout within the warp).
  - At 8 rows 168 registers a thread, three programs an SM (the split-K plan: one wave of WAVE's programs at small
    batches, else sized for WARP_PROGRAMS_PER_SM where a program keeps WARP_MIN_GROUPS; 243 registers and two
    programs at 16 rows), a loop of 645 instructions for 128 tokens
    (sm_90 SASS, Triton 3.6), against the warpgroup kernel's 839 at 250 registers, two programs an SM, four barriers
    a step and 37 KB of shared memory.
  - Whole steps first: while a step's 128 slots are all live, its loads take no clamp (a thread's loads of a tensor
    are one address plus immediates: _load_moved) and its scores no mask, and the softmax scale is applied after the
    row max, inside the exponent's FMA. Each step loads the next one's operands before its own work. The rest of a
    split (fewer than four groups, or a group not all live) runs after, one clamped, masked step at a time, in a loop
    of 711 instructions.
  - A split of fewer groups than warps masks the warps past its end.
  - Keys stored before RoPE (ROPE): slot u sits at position n_sink + u = p0 + j, p0 the first position of its key
    group and j < 32; rotations compose, so q · R(p0 + j) k = (R(-p0) q) · R(j) k. A thread holds key words t and
    t + 4 (LKW with rope), so channels c and c + d/2, which RoPE pairs, lie in one thread, and each dequantized key
    is rotated by its offset j in registers: lo cos - hi sin, hi cos + lo sin, one fp16x2 product and FMA a half2
    of a half (_rotate_keys), from a table of the 32 offsets' angles in the order a thread holds them
    (warp_rope_tables, 8 KB, read from L1 each step). Each step each warp rotates the query rows back to its group's
    p0 (fp32, the model's cos and sin rows at p0, then fp16: _warp_query_back), only rep rows padded to a power of
    two, then moved into the B operand. 255 registers, two programs an SM (one wave of them at small batches,
    ROPE_WAVE; else the Triton kernel's split-K plan), a loop of 977 instructions (Triton 3.6).

The warpgroup kernel (_quantized_kernel); Gluon lets the kernel choose every layout (Triton chooses them itself):
  - The keys go to the wgmma as its A operand in registers, s (128 tokens, ROWS) = K · qᵀ: their code words are
    loaded in the layout the unpack PTX turns into A's registers (operand_layout, _operand; the conversion is
    checked trivial at compile time). A thread holds 32 channels (two adjacent words) of four tokens; A's columns
    are a fixed permutation of the channels (_place; the query is loaded in that order), and its rows a permutation
    of the step's tokens (_row_token) that gives each warp one key group, so a thread's four rows share their 32
    per-channel scales and zeros. The values are stored once into NVMMA-swizzled shared memory (128 tokens, d),
    which wgmma reads through a transposed descriptor, accᵀ (d, ROWS) += Vᵀ · pᵀ, their rows in the keys' token
    order, so the weights p need no reordering. The query (ROWS, d) and p, stored transposed (ROWS, 128), are the
    B operands, both K-major. The Triton kernel stores both tiles and loads them back into registers.
  - Codes are read as M + c and dequantized by one fp16 FMA with an offset zero - M * scale, rounded to fp16 once
    a group: a key's scale and offset are its channel's, a value word's its group's, applied in the unpack PTX.
    M is 4 or 16 by the code's slot in its word (quant_matvec.two_magic_pair_asm): each slot is masked where the
    word, shifted by 4 either way or with its bytes swapped, puts it under one of the two, three shifts a word
    where one magic takes seven.
  - ROWS is the wgmma's N: 8 where rep <= 8, else 16. A padded row costs the softmax's work (exp2, the max and sum
    over the tokens, across lanes and warps) as a real one does: at rep 4, 8 rows rather than 16 take the loop from
    1,098 to 993 instructions (sm_90 SASS, with the keys through shared memory).
  - Logical channel order of the values. One lop3 on a word gives code slots a and a + 8 as a half2; the kernel
    keeps that pair as logical channels (2a, 2a + 1) of its word, c' = 16 w + 2 a + b for real channel
    16 w + a + 8 b (_real), so no unpacked register is re-paired; the output channels are written back to their
    real places; a value group of G channels (whole words) keeps its members.
  - Next step's words and scales are loaded before this step's work; the output product runs asynchronously
    while the next keys are unpacked (the scores' product is synchronous: asynchronous, with the key operand's 64
    registers held across the values' unpacking, ptxas serializes every wgmma). Past the live slots a load reads
    the last live slot (its score is masked to -inf, so it adds nothing), and no load is masked.
  - The output is rescaled only in a step where some row's running max grew (the max is the same in every warp,
    so the branch is uniform), rare after the first steps. Each thread keeps the row sums of its own tokens
    (_own_sum), summed across threads once, after the loop; the row max is reduced across warps each step.
Numerics are the Triton kernel's but for that offset (rounded within half an fp16 ulp of zero - M * scale where the
Triton kernel rounds the zero itself) and the order the row sums add in: codes exact, one fp16 FMA a code, fp16
tiles, fp32 products and softmax.

Keys stored before RoPE at head_dim 64 (ROPE). Slot u sits at position n_sink + u = p0 + j, p0 the first
position of its step and j < 128 its offset in the step; rotations compose, so q · R(p0 + j) k = (R(-p0) q) ·
R(j) k. Each step the query rows are rotated back to p0 (fp32, from the model's cos and sin rows at p0, then fp16),
and each key by its offset j, whose cos and sin every step shares: 128 rows of half tables (fp16, 16 KB each,
rope_tables) held in shared memory for the whole run, where the Triton kernel reads each key's own row from global
memory. The scores are two products, (R(-p0) q) · (k cos_j)ᵀ + (its rotate-half partner) · (k sin_j)ᵀ, each key
product rounded once in fp16 as the Triton kernel's four dots take them; the query's angle is rounded apart from
the key's (fp16 each, where the Triton kernel rounds the model's table at p0 + j once). Its keys go through a shared
tile in token order (the rotations' tables are read per token), in the logical channel order of the values
(_real), dequantized after the unpack PTX; a thread holds channels c and c + d/2 of its key words (LPK), which share
a table value.

Speed (Llama-3.1-8B heads, rep 4, one H200, L2 flushed, with the tail beside it; docs/decode.md, "KIVI's warp kernel
in whole steps"): the warp kernel 34.2 us at 32K, batch 1, 76.4 at 128K, batch 1, 351.3 at 32K, batch 32 and 1,253.7
at 128K, batch 32 (`python scripts/bench_kernels.py --floors --cases "SQuat (outer)" --shapes 1x32768 1x131072
32x32768 32x131072`, results/kernels/h200/kivi-full-steps-same). On another H200 (results/kernels/h200/kivi-warp) the
warpgroup kernel took 29.9, 81.2, 482.3 and 1,844.6 and the Triton kernel alone 40.7 and 119.4 at batch 1. Keys
stored before RoPE, in the warp kernel: 31.6 us at 32K, batch 1, 88.2 at 128K, 523.4 at 32K, batch 32 and 1,952.1
at 128K, batch 32, where the warpgroup kernel took 43.7, 135.6, 939.6 and 3,643.3 (`--cases "KIVI*"`,
results/kernels/h200/kivi-pre-warp, kivi-pre-warp-before). Below MIN_GROUP_ROWS of work (KV rows x groups) the
Triton kernel runs alone.
KVZOO_OUTER_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel, gluon takes it
wherever the layout allows.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from kvzoo.kernels.quant_matvec import MAGICS, kernel_choice, pair_asm, two_magic_pair_asm, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_OUTER_KERNEL")
ENABLED = CHOICE != "triton"  # False: every call takes the Triton kernel (comparisons, bisecting)
# fewer (KV rows x groups of 32 slots) are left to the Triton kernel ("gluon": none fewer). The least
# work measured, 8K tokens at batch 1 of Llama-3.1-8B's heads (8 x 252), takes 22.4 us here against its 23.6
MIN_GROUP_ROWS = 0 if CHOICE == "gluon" else 2016
TOKENS, N_WARPS, N_ROWS = 128, 4, 16
WARP_HEAD_DIM = 128     # the head_dim the warp kernel serves (keys after RoPE)
WARP_PROGRAMS_PER_SM = 3   # its programs an SM at 8 rows (168 registers a thread; 243 at 16 rows: two), the
WARP_MIN_GROUPS = 32       # split-K plan's target where a program keeps this many groups (8 steps)
# at small batches, one wave of at most 2.75 programs an SM where it holds 8 splits a KV row or more
# (innerq_attention.one_wave; 363 on 132 SMs: 384, 2.9 an SM, ran 5-10% slower; at 5 splits a row, batch 8 of
# Llama-3.1-8B's heads, the plan for WARP_PROGRAMS_PER_SM was faster)
WAVE = (2.75, 8)
# keys stored before RoPE (two programs an SM): one wave of two an SM from 2 splits a KV row, 1-5% faster than whole
# waves of the Triton kernel's plan at 4-16 x 32K and 2-4 x 128K on Llama-3.1-8B's heads, 3-4% slower at 2 x 32K
ROPE_WAVE = (2, 2)
BLOCK = gl.constexpr(TOKENS)         # tokens a step: four warps, one key group each
WARPS = gl.constexpr(N_WARPS)
LQ = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [N_WARPS, 1], [1, 0]))          # the query rows' load
TILE = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
barrier = getattr(gl, "barrier", None) or gl.thread_barrier      # Triton 3.9 names it barrier, 3.6 thread_barrier


def query_rows(rep: int) -> int:
    """The query rows that keys stored before RoPE rotate back each step: rep padded to a power of two of at least
    4 (each element once over the four warps), at most rows_for(rep); the rows past them are padding."""
    return min(rows_for(rep), max(4, triton.next_power_of_2(rep)))


def rows_for(rep: int) -> int:
    """The query rows a program serves (the wgmma's N, padded past rep): 8 or 16. Every padded row costs its
    softmax work (exp2, reductions over the tokens) as a real one does."""
    return 8 if rep <= 8 else N_ROWS


@gluon.constexpr_function
def mma_layout(rows):
    """The wgmma accumulator's layout for (BLOCK or D, rows) tiles."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[N_WARPS, 1], instr_shape=[16, rows, 16])


PAIR_ASM, PAIR_CON = (gl.constexpr(part) for part in pair_asm(2))
MAGIC_ASM, MAGIC_CON = (gl.constexpr(part) for part in two_magic_pair_asm(scaled=False))
ZERO_ASM, ZERO_CON = (gl.constexpr(part) for part in two_magic_pair_asm())
SIGNED_ZERO_ASM, SIGNED_ZERO_CON = (gl.constexpr(part) for part in two_magic_pair_asm(signed=True))
MAGIC_EVEN, MAGIC_ODD = (gl.constexpr(m) for m in MAGICS)


@gluon.jit
def _unpack(words, LP: gl.constexpr, signs=None, scale=None, zero=None):
    """(R, W) 2-bit code words -> (R, 16 W) exact fp16 codes in logical channel order c' = 16 w + 2 a + b (slot
    a + 8 b of word w): _logical_tile of _unpack_pairs."""
    return _logical_tile(_unpack_pairs(words, LP, signs, scale, zero))


@gluon.jit
def _unpack_pairs(words, LP: gl.constexpr, signs=None, scale=None, zero=None, MAGIC_ONLY: gl.constexpr = False):
    """(R, W) 2-bit code words -> the unpack PTX's 8 outputs, each (R, W, 2) in layout LP: output a holds codes a
    (b = 0) and a + 8 (b = 1) of each word. Each word enters the PTX twice (pack=2 over the pair axis).
    - Neither scale nor MAGIC_ONLY: the codes, exact fp16 (quant_matvec.pair_asm).
    - MAGIC_ONLY: read as M + c, M = MAGIC_EVEN for even a and MAGIC_ODD for odd, for a caller that applies a
      scale and an offset zero - M * scale of its own (quant_matvec.two_magic_pair_asm).
    - scale and zero (R, W) fp16, one each a word: the codes times the scale plus the zero, in the same PTX
      (two_magic_pair_asm); signs (R, W), in the words' layout, with them: each word's signs as that PTX takes
      them."""
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    pairs = gl.expand_dims(words, 2) + gl.zeros([R, W, 2], gl.int32, LP)           # (R, W, 2): the word twice
    if MAGIC_ONLY:
        o = gl.inline_asm_elementwise(MAGIC_ASM, MAGIC_CON, [pairs], dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    elif scale is None:
        o = gl.inline_asm_elementwise(PAIR_ASM, PAIR_CON, [pairs], dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    else:
        halves = gl.zeros([R, W, 2], gl.float16, LP)
        scale = gl.expand_dims(scale, 2) + halves
        zero = gl.expand_dims(zero, 2) + halves
        if signs is None:
            o = gl.inline_asm_elementwise(ZERO_ASM, ZERO_CON, [pairs, scale, zero], dtype=(gl.float16,) * 8,
                                          is_pure=True, pack=2)
        else:
            o = gl.inline_asm_elementwise(SIGNED_ZERO_ASM, SIGNED_ZERO_CON,
                                          [pairs, gl.expand_dims(signs, 2) + pairs * 0, scale, zero],
                                          dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    return o


@gluon.jit
def _logical_tile(o):
    """The 8 outputs of an unpack PTX, each (R, W, 2) (output a: codes a and a + 8 of each word), as one (R, 16 W)
    tile in logical channel order c' = 16 w + 2 a + b."""
    R: gl.constexpr = o[0].shape[0]
    W: gl.constexpr = o[0].shape[1]
    x = gl.join(gl.join(gl.join(o[0], o[4]), gl.join(o[2], o[6])), gl.join(gl.join(o[1], o[5]), gl.join(o[3], o[7])))
    x = gl.permute(x, (0, 1, 3, 4, 5, 2))                                           # (R, W, a2, a1, a0, b)
    return gl.reshape(x, (R, W * 16))


@gluon.jit
def _place(i, W: gl.constexpr):
    """Where logical index i (of a step's tokens, or of the key channels with W = d/16 words a token) lies: i's bits
    are (b, t1 t0, a2 a1 a0, w0) from the lowest, as a thread's operand registers hold them (_operand), and its
    place is slot a + 8 b of word 2 t + w0 (W = 8) or t (W = 4), 16 places a word."""
    word = (i >> 1) & 3
    if W == 8:
        word = word * 2 + (i >> 6)
    return word * 16 + ((i >> 3) & 7) + 8 * (i & 1)


@gluon.jit
def _operand(o, A: gl.constexpr):
    """The unpack PTX's 8 outputs, each (R, W, 2) (_unpack_pairs, words in operand_layout), as the wgmma's A operand
    (R, 16 W) in registers, layout A: column i is place _place(i, W) of its row. operand_layout puts every code
    where A wants it, so the conversion moves no data (assert_trivial)."""
    R: gl.constexpr = o[0].shape[0]
    W: gl.constexpr = o[0].shape[1]
    x = gl.join(gl.join(gl.join(o[0], o[4]), gl.join(o[2], o[6])), gl.join(gl.join(o[1], o[5]), gl.join(o[3], o[7])))
    if W == 8:                                                                 # (R, W, b, a2, a1, a0)
        x = gl.permute(gl.reshape(x, (R, 4, 2, 2, 2, 2, 2)), (0, 2, 4, 5, 6, 1, 3))   # (R, w0, a2, a1, a0, t, b)
    else:
        x = gl.permute(x, (0, 3, 4, 5, 1, 2))                                  # (R, a2, a1, a0, t, b)
    return gl.convert_layout(gl.reshape(x, (R, W * 16)), A, assert_trivial=True)


def operand_layout(rows: int, words: int) -> gl.DistributedLinearLayout:
    """The (rows, words, 2) layout of code words (row, word, the pair axis _unpack_pairs enters each word on) that
    unpack into the wgmma's A operand (_operand), for 128 or 64 rows of 8 or 4 words. A thread holds one 32-code
    run a row: its lane's word pair 2 t, 2 t + 1 (t = lane % 4; 4 words: word t); registers the pair axis, the
    pair's second word, row + 8 and row + 64 (128 rows); lanes t, then rows + 1, 2, 4; warps rows + 16, 32."""
    pair = [[0, 1, 0]] if words == 8 else []
    lanes = [[0, 2, 0], [0, 4, 0]] if words == 8 else [[0, 1, 0], [0, 2, 0]]
    return gl.DistributedLinearLayout([[0, 0, 1], [8, 0, 0]] + pair + ([[64, 0, 0]] if rows == 128 else []),
                                      lanes + [[1, 0, 0], [2, 0, 0], [4, 0, 0]], [[16, 0, 0], [32, 0, 0]], [],
                                      [rows, words, 2])


@gluon.jit
def _row_token(r):
    """The step's token in key row r of the operand (operand_layout): warp w's rows (r bits 4-5), at r and
    r + 64, are key group w's 32 tokens, so a thread's four rows share one group's scales."""
    return (r & 15) + ((r >> 6) << 4) + (((r >> 4) & 3) << 5)


@gluon.jit
def _placed(x, L4: gl.constexpr):
    """(GS, D) per-channel key scales in real order -> columns in _place's order, (1, GS, 1, D) in layout L4 of
    the key operand seen as (row + 64, group, row % 16, D) (the same threads hold them in both layouts: the
    conversion moves registers only)."""
    GS: gl.constexpr = x.shape[0]
    D: gl.constexpr = x.shape[1]
    if D == 128:   # real channel 32 t + 16 w0 + 8 b + a -> place column 64 w0 + 8 a + 2 t + b
        x = gl.permute(gl.reshape(x, (GS, 4, 2, 2, 8)), (0, 2, 4, 1, 3))          # (g, w0, a, t, b)
    else:          # real channel 16 t + 8 b + a -> place column 8 a + 2 t + b
        x = gl.permute(gl.reshape(x, (GS, 4, 2, 8)), (0, 3, 1, 2))                # (g, a, t, b)
    x = gl.convert_layout(gl.reshape(x, (GS, D)), gl.SliceLayout(0, gl.SliceLayout(2, L4)))
    return gl.expand_dims(gl.expand_dims(x, 0), 2)


@gluon.jit
def _real(c):
    """The real channel of logical channel c' = 16 w + 2 a + b: 16 w + a + 8 b."""
    return (c // 16) * 16 + (c % 16) // 2 + 8 * (c % 2)


@gluon.jit
def _logical(x, L3: gl.constexpr):
    """(GS, D) per-channel key scales in real order -> logical order, (GS, 1, D) in the key tile's layout L3 (the
    same threads hold them in both layouts: the conversion moves registers only)."""
    GS: gl.constexpr = x.shape[0]
    D: gl.constexpr = x.shape[1]
    x = gl.reshape(gl.permute(gl.reshape(x, (GS, D // 16, 2, 8)), (0, 1, 3, 2)), (GS, D))
    return gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, L3)), 1)


@gluon.jit
def _query(q_ptr, qs_ptr, kv, dq, REP: gl.constexpr, ROWS: gl.constexpr, HAS_QS: gl.constexpr):
    """The query rows of KV head kv (ROWS, D), column c its channel dq[c] (D,) (the keys' logical channel order,
    in SliceLayout(0, LQ)), padded past REP with zeros; with HAS_QS times qs_ptr's row kv channel by channel in the
    model dtype (InnerQ's key normalization); then fp16 (a bf16 query clamped to the fp16 range, as the Triton
    kernels)."""
    D: gl.constexpr = dq.shape[0]
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(1, LQ))
    q = gl.load(q_ptr + (kv * REP + rq[:, None]) * D + dq[None, :], mask=(rq < REP)[:, None], other=0)
    if HAS_QS:
        q = (q.to(gl.float32) * gl.load(qs_ptr + kv * D + dq).to(gl.float32)[None, :]).to(q.dtype)
    return gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)


@gluon.jit
def _own_sum(p):
    """Scores-shaped p (BLOCK, ROWS) in the MMA layout summed over each thread's own tokens, with no exchange
    between threads: (4, 8, ROWS), indexed by the warp (token bits 4-5) and lane group (bits 0-2) that hold them;
    a token's bits 3 and 6 lie in a thread's registers."""
    ROWS: gl.constexpr = p.shape[1]
    return gl.sum(gl.sum(gl.reshape(p, (2, 4, 2, 8, ROWS)), axis=2), axis=0)      # (bit 6, bits 4-5, bit 3, bits 0-2)


@gluon.jit
def _row_max(s, red_s):
    """gl.max(s, axis=0) for scores s (BLOCK, ROWS) in the MMA layout, with one barrier where the generic cross-warp
    reduction takes two: each warp's max over its tokens (registers, then lanes) stored to red_s (4, ROWS) fp32,
    then every thread reads the four warps' of its rows. Used by the rotating kernel (ROPE), whose loop it makes
    3-8% faster; the other kernel's it made 2-7% slower, so that one keeps gl.max (one H200, the kernel alone at
    32K and 128K, batch 1 and 32)."""
    ROWS: gl.constexpr = s.shape[1]
    x = gl.reshape(s, (2, 4, 2, 8, ROWS))                   # _own_sum's axes
    red_s.store(gl.max(gl.max(gl.max(x, axis=2), axis=0), axis=1))                # (4 warps, ROWS)
    # (4, ROWS), each thread the four warps' maxima of its rows as the MMA layout places them (columns 2 (lane % 4)
    # and + 1, + 8 at ROWS = 16)
    LR: gl.constexpr = gl.DistributedLinearLayout([[1, 0], [2, 0], [0, 1]] + ([[0, 8]] if ROWS == 16 else []),
                                                  [[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]], [[0, 0], [0, 0]], [],
                                                  [4, ROWS])
    return gl.convert_layout(gl.max(red_s.load(LR), axis=0), gl.SliceLayout(0, s.type.layout), assert_trivial=True)


@gluon.jit
def _start(q):
    """A program's shared tiles (the query q (ROWS, D) stored, a step's values (BLOCK, D), its weights transposed
    (ROWS, BLOCK), tokens contiguous as the query's channels) and its empty online-softmax state: running max m
    (ROWS,), each thread's share of the row sums l (_own_sum's (4, 8, ROWS); summed once, at the end) and output
    accᵀ (D, ROWS)."""
    ROWS: gl.constexpr = q.shape[0]
    D: gl.constexpr = q.shape[1]
    MMA: gl.constexpr = mma_layout(ROWS)
    q_s = gl.allocate_shared_memory(gl.float16, [ROWS, D], TILE, q)
    v_s = gl.allocate_shared_memory(gl.float16, [BLOCK, D], TILE)
    p_s = gl.allocate_shared_memory(gl.float16, [ROWS, BLOCK], TILE)
    m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l = _own_sum(gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA))
    return q_s, v_s, p_s, m, l, warpgroup_mma_init(gl.zeros([D, ROWS], gl.float32, layout=MMA))


@gluon.jit
def _softmax_and_output(s, live, m, l, acc_v, vt, p_s, red_s, qk_scale):
    """One step's online softmax in base 2 over scores s (BLOCK, ROWS) (transposed; tokens not `live` masked), with
    the running max m (through _row_max with a scratch red_s, else gl.max) and each thread's share of the sums l
    (_start), and the output product accᵀ += Vᵀ · pᵀ (vt: Vᵀ (D, BLOCK) in shared memory) issued asynchronously on
    acc_v (the previous one, waited for): (m, l, acc)."""
    s = s * qk_scale + gl.where(live, 0.0, float("-inf"))[:, None]            # one FMA; masked: -inf
    if red_s is None:
        m_new = gl.maximum(m, gl.max(s, axis=0))
    else:
        m_new = gl.maximum(m, _row_max(s, red_s))
    alpha = gl.exp2(m - m_new)
    p = gl.exp2(s - m_new[None, :])
    a = gl.convert_layout(alpha, gl.SliceLayout(0, gl.SliceLayout(1, l.type.layout)), assert_trivial=True)
    l = l * a[None, None, :] + _own_sum(p)
    p_s.store(gl.permute(p.to(gl.float16), (1, 0)))
    fence_async_shared()
    if gl.min(alpha, axis=0) < 1.0:                           # a row's max grew: rescale (rare after the start)
        acc_v = acc_v * alpha[None, :]
    return m_new, l, warpgroup_mma(vt, p_s.permute((1, 0)), acc_v, is_async=True)


@gluon.jit
def _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, kv, split, N_COLS, REP: gl.constexpr, REAL: gl.constexpr):
    """Program (kv, split)'s (m, l, acc) partials of its live query rows at column `split` of N_COLS; accᵀ's rows
    are the output channels in logical order (_real puts them back) or, with REAL, in their real order."""
    D: gl.constexpr = acc.shape[0]
    ROWS: gl.constexpr = m.shape[0]
    MMA: gl.constexpr = mma_layout(ROWS)
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    live_r = r < REP
    rows = (kv * REP + r) * N_COLS + split
    gl.store(m_ptr + rows, m, mask=live_r)
    gl.store(l_ptr + rows, l, mask=live_r)
    d = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
    if not REAL:
        d = _real(d)
    gl.store(acc_ptr + rows[None, :] * D + d[:, None], acc, mask=live_r[None, :])


@gluon.jit
def _operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, t, last, nk, wk, n, w, gr, cr, D: gl.constexpr,
              CG: gl.constexpr):
    """Step t's code words (BLOCK, W) (key row i token nk[i], value row i token n[i]), the keys' scales and zeros as
    stored (GS, D) (real channel order, _key_scales lays them out), and the values' scale and zero a word
    (BLOCK, W), as the unpack PTX takes them. Slots past `last` (the last live one) read `last`."""
    W: gl.constexpr = D // 16
    kw = gl.load(kc_ptr + gl.minimum(t * 32 + nk, last)[:, None] * W + wk[None, :])
    at = gl.minimum(t + gr, last // 32)[:, None] * D + cr[None, :]                  # (GS, D), real order
    tv = gl.minimum(t * 32 + n, last)[:, None]
    vw = gl.load(vc_ptr + tv * W + w[None, :])
    atv = tv * (D // CG) + (w * 16 // CG)[None, :]                                  # (BLOCK, W): each word's group
    return kw, gl.load(ks_ptr + at), gl.load(kz_ptr + at), vw, gl.load(vs_ptr + atv), gl.load(vz_ptr + atv)


@gluon.jit
def _magic_offsets(ks, kz):
    """Offsets zero - M * scale from key scales and zeros (1, GS, 1, D) in _place's order (_placed): M = MAGIC_EVEN
    where the column's slot a (bits 3-5 of its place column) is even, else MAGIC_ODD, the magic the unpack reads
    its codes under (MAGIC_ONLY). Bit 3 is a register's (_operand), and a half2 register's two columns (b = 0, 1)
    share a slot: one fp16x2 FMA a register, with the magic an immediate."""
    GS: gl.constexpr = ks.shape[1]
    D: gl.constexpr = ks.shape[3]
    # (group, place column bits 4+, bits 0-2, bit 3)
    s_even, s_odd = gl.split(gl.permute(gl.reshape(ks, (GS, D // 16, 2, 8)), (0, 1, 3, 2)))
    z_even, z_odd = gl.split(gl.permute(gl.reshape(kz, (GS, D // 16, 2, 8)), (0, 1, 3, 2)))
    off = gl.permute(gl.join(z_even - s_even * MAGIC_EVEN, z_odd - s_odd * MAGIC_ODD), (0, 1, 3, 2))
    return gl.convert_layout(gl.reshape(off, ks.shape), ks.type.layout, assert_trivial=True)


@gluon.jit
def _key_scales(ks, kz, L3: gl.constexpr, ROPE: gl.constexpr):
    """Key scales and zeros (GS, D) as stored -> the key tile's layout L3: (GS, 1, D) in logical order with ROPE,
    whose codes are unpacked exact (under the two magics its loop spilled: 1,396 instructions against 1,262), else
    (1, GS, 1, D) in _place's order (_placed), the zeros as offsets (_magic_offsets)."""
    if ROPE:
        ks, kz = _logical(ks, L3), _logical(kz, L3)
    else:
        ks, kz = _placed(ks, L3), _placed(kz, L3)
        kz = _magic_offsets(ks, kz)
    return ks, kz


@gluon.jit
def _rotate_offsets(k, tab_s, LH: gl.constexpr):
    """Keys k (BLOCK, D) times the cos or sin of RoPE's angles at a step's offsets j < BLOCK, rounded once in
    fp16: the table is rope_tables' half rows (BLOCK, D/2) in shared memory, read with LH's 16-byte vectors and
    renamed into k's registers; a rotate-half table repeats its frequencies, so channels c and c + D/2, which
    one thread holds (_layouts' LPK), multiply by the same value."""
    BLOCK: gl.constexpr = k.shape[0]
    D: gl.constexpr = k.shape[1]
    k3 = gl.reshape(k, (BLOCK, 2, D // 2))                                       # (BLOCK, half, D/2)
    h = gl.convert_layout(tab_s.load(LH), gl.SliceLayout(1, k3.type.layout))
    return gl.reshape(k3 * gl.expand_dims(h, 1), (BLOCK, D))


@gluon.jit
def _query_back(q, qr, cos_ptr, sin_ptr, p0):
    """The query rows rotated back to position p0 for q_s's operand, fp16 in logical channel order: R(-p0) q =
    q cos + qr sin and its rotate-half partner [.hi, -.lo] = qr cos - q sin, from q and qr = [q_hi, -q_lo]
    (R, D) fp32 in real channel order and the model's cos and sin rows at p0 (read in the same layout), in fp32,
    clamped to fp16's range as _query's."""
    R: gl.constexpr = q.shape[0]
    D: gl.constexpr = q.shape[1]
    at = p0 * D + gl.arange(0, D, layout=gl.SliceLayout(0, q.type.layout))
    c = gl.load(cos_ptr + at).to(gl.float32)[None, :]
    s = gl.load(sin_ptr + at).to(gl.float32)[None, :]
    back = gl.minimum(gl.maximum(q * c + qr * s, -65504.0), 65504.0).to(gl.float16)
    partner = gl.minimum(gl.maximum(qr * c - q * s, -65504.0), 65504.0).to(gl.float16)
    # real channel 16 w + 8 b + a -> logical 16 w + 2 a + b: the registers renamed, no data moved
    back = gl.reshape(gl.permute(gl.reshape(back, (R, D // 16, 2, 8)), (0, 1, 3, 2)), (R, D))
    partner = gl.reshape(gl.permute(gl.reshape(partner, (R, D // 16, 2, 8)), (0, 1, 3, 2)), (R, D))
    return back, partner


@gluon.jit
def _padded(x, ROWS: gl.constexpr):
    """x (R, D) as (ROWS, D) with rows R .. ROWS - 1 zero (ROWS = R or 2 R)."""
    R: gl.constexpr = x.shape[0]
    if ROWS != R:
        x = gl.reshape(gl.permute(gl.join(x, gl.zeros_like(x)), (2, 0, 1)), (ROWS, x.shape[1]))
    return x


@gluon.jit
def wait_previous():
    """Wait until the kernel before this one on the stream has finished and its writes are visible
    (griddepcontrol.wait). A no-op where this kernel was launched plainly."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def await_tail():
    """The last step of a Gluon kernel launched while the tail's program before it runs (quant_matvec.launches_early):
    wait until that program has finished and its partial is visible, so that the combine after this kernel sees it.
    A no-op where it was launched plainly."""
    wait_previous()


@gluon.jit
def let_next_launch():
    """The first step of a Gluon kernel: the kernel after it, where launched programmatically (outer_attention's
    combine with the tail in it, a 4-bit product of w4a16_hopper), may launch now, while this one runs. A no-op where
    it is launched plainly."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _head_pointers(kv, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, s_kc, s_ks, s_kz, s_vc, s_vs, s_vz):
    """The six buffers' pointers at KV row kv (b * H + h), each moved by its head stride (int64 offsets)."""
    head = kv.to(gl.int64)
    return (kc_ptr + head * s_kc, ks_ptr + head * s_ks, kz_ptr + head * s_kz, vc_ptr + head * s_vc,
            vs_ptr + head * s_vs, vz_ptr + head * s_vz)


@gluon.jit
def _run(len_ptr, split, PER_SPLIT):
    """Split `split`'s run of groups: (the slots quantized in both streams, its first group, the group past its last,
    its last live slot)."""
    n_both = gl.minimum(gl.load(len_ptr), gl.load(len_ptr + 1))
    start = split * PER_SPLIT
    stop = gl.minimum(start + PER_SPLIT, (n_both + 31) // 32)
    return n_both, start, stop, gl.maximum(gl.minimum(n_both, stop * 32) - 1, 0)


@gluon.jit
def _quantized_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, cos_ptr, sin_ptr, off_ptr, m_ptr, l_ptr,
                      acc_ptr, len_ptr, PER_SPLIT, N_COLS, qk_scale, s_kc, s_ks, s_kz, s_vc, s_vs, s_vz,
                      D: gl.constexpr, REP: gl.constexpr, ROWS: gl.constexpr, CG: gl.constexpr, LP: gl.constexpr,
                      KSL: gl.constexpr, LPK: gl.constexpr, LH: gl.constexpr, ROPE: gl.constexpr,
                      QROWS: gl.constexpr):
    GS: gl.constexpr = BLOCK // 32
    MMA: gl.constexpr = mma_layout(ROWS)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    W: gl.constexpr = D // 16
    LW: gl.constexpr = gl.SliceLayout(2, LP)                        # value words (BLOCK, W)
    LWK: gl.constexpr = gl.SliceLayout(2, LPK)                      # key words (BLOCK, W)
    # the layout the unpacked key tile comes in (ROPE: (GS, 32, D); else the operand as (2, GS, 16, D); traced, no
    # code)
    if ROPE:
        L3: gl.constexpr = gl.reshape(_unpack(gl.zeros([BLOCK, W], gl.int32, LWK), LPK), (GS, 32, D)).type.layout
    else:
        L3: gl.constexpr = gl.reshape(_operand(_unpack_pairs(gl.zeros([BLOCK, W], gl.int32, LWK), LPK), A),
                                      (2, GS, 16, D)).type.layout

    kv = gl.program_id(0)                        # b * H + h
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr = _head_pointers(kv, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                                                                    s_kc, s_ks, s_kz, s_vc, s_vs, s_vz)
    split = gl.program_id(1)

    if ROPE:
        dq = _real(gl.arange(0, D, layout=gl.SliceLayout(0, LQ)))
    else:
        dq = _place(gl.arange(0, D, layout=gl.SliceLayout(0, LQ)), W)
    q_s, v_s, p_s, m, l, acc = _start(_query(q_ptr, q_ptr, kv, dq, REP, ROWS, False))
    if ROPE:        # keys stored before RoPE (module docstring): q and qr = [q_hi, -q_lo], fp32, real order
        k_s = gl.allocate_shared_memory(gl.float16, [BLOCK, D], TILE)
        red_s = gl.allocate_shared_memory(gl.float32, [WARPS, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        # (QROWS, D) over the four warps, each element once: rows past QROWS are padding
        SPT: gl.constexpr = QROWS * D // (32 * WARPS)
        LQR: gl.constexpr = gl.BlockedLayout([1, SPT], [32 * SPT // D, D // SPT], [WARPS, 1], [1, 0])
        d = gl.arange(0, D, layout=gl.SliceLayout(0, LQR))                  # real order
        rr = gl.arange(0, QROWS, layout=gl.SliceLayout(1, LQR))
        live_q = (rr < REP)[:, None]
        qf = gl.load(q_ptr + (kv * REP + rr[:, None]) * D + d[None, :], mask=live_q, other=0).to(gl.float32)
        qr = gl.load(q_ptr + (kv * REP + rr[:, None]) * D + ((d + D // 2) % D)[None, :], mask=live_q, other=0)
        qr = gl.where((d < D // 2)[None, :], qr.to(gl.float32), -qr.to(gl.float32))
        n_sink = gl.load(len_ptr + 3)
        jt = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LH))
        et = gl.arange(0, D // 2, layout=gl.SliceLayout(0, LH))
        at = jt[:, None] * (D // 2) + et[None, :]
        HT: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=D if D < 128 else 128, element_bitwidth=16, rank=2)
        cos_s = gl.allocate_shared_memory(gl.float16, [BLOCK, D // 2], HT, gl.load(off_ptr + at))
        sin_s = gl.allocate_shared_memory(gl.float16, [BLOCK, D // 2], HT, gl.load(off_ptr + BLOCK * D // 2 + at))
    else:
        red_s = None

    let_next_launch()
    n_both, start, stop, last = _run(len_ptr, split, PER_SPLIT)
    # each row's token in the step: in order with ROPE, else the key operand's (_row_token), values and scores alike
    n = _tokens(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LW)), ROPE)
    w = gl.arange(0, W, layout=gl.SliceLayout(0, LW))
    nk = _tokens(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LWK)), ROPE)
    wk = gl.arange(0, W, layout=gl.SliceLayout(0, LWK))
    gr = gl.arange(0, GS, layout=gl.SliceLayout(1, KSL))
    cr = gl.arange(0, D, layout=gl.SliceLayout(0, KSL))
    ns = _tokens(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA)), ROPE)
    kw, ks, kz, vw, vs, vz = _operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, start, last, nk, wk, n, w,
                                       gr, cr, D, CG)
    for t in range(start, stop, GS):
        if ROPE:    # this step's key scales (held a step ahead, they spill at D = 128; nxt's loads are dropped unused)
            at_k = gl.minimum(t + gr, last // 32)[:, None] * D + cr[None, :]
            ks, kz = gl.load(ks_ptr + at_k), gl.load(kz_ptr + at_k)
        ks, kz = _key_scales(ks, kz, L3, ROPE)
        nxt = _operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, t + GS, last, nk, wk, n, w, gr, cr, D, CG)
        if ROPE:
            xk = gl.reshape(_unpack(kw, LPK), (GS, 32, D))
            k = gl.reshape(xk * ks + kz, (BLOCK, D))
            # (R(-p0) q) · (k cos_j)ᵀ + (its rotate-half partner) · (k sin_j)ᵀ, p0 the step's first position: both
            # through the same two tiles, one after the other (a second pair of wgmma operands spills at D = 128)
            qb, qb2 = _query_back(qf, qr, cos_ptr, sin_ptr, n_sink + t * 32)
            q_s.store(_padded(qb, ROWS))
            k_s.store(_rotate_offsets(k, cos_s, LH))
            fence_async_shared()
            s = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA))
            q_s.store(_padded(qb2, ROWS))                               # the product above done
            k_s.store(_rotate_offsets(k, sin_s, LH))
            fence_async_shared()
            s = warpgroup_mma(k_s, q_s.permute((1, 0)), s)
            xv = _logical_tile(_unpack_pairs(vw, LP, None, vs, vz))
            acc_v = warpgroup_mma_wait(0, deps=[acc])             # the previous output product: v_s, p_s free
            v_s.store(xv)                                          # stored while the softmax runs
        else:       # the keys dequantized in the wgmma's A registers; the scores' product synchronous (docstring)
            # (row + 64, group, row % 16, D): the codes read as M + c, times the scale plus the offset
            xk = gl.reshape(_operand(_unpack_pairs(kw, LPK, MAGIC_ONLY=True), A), (2, GS, 16, D))
            ka = gl.convert_layout(gl.reshape(xk * ks + kz, (BLOCK, D)), A, assert_trivial=True)
            s = warpgroup_mma(ka, q_s.permute((1, 0)), gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA))
            acc_v = warpgroup_mma_wait(0, deps=[acc])             # the previous output product: v_s, p_s free
            v_s.store(_logical_tile(_unpack_pairs(vw, LP, None, vs, vz)))
        m, l, acc = _softmax_and_output(s, t * 32 + ns < n_both, m, l, acc_v, v_s.permute((1, 0)), p_s, red_s,
                                        qk_scale)
        kw, ks, kz, vw, vs, vz = nxt
    acc = warpgroup_mma_wait(0, deps=[acc])
    l = gl.convert_layout(gl.sum(gl.sum(l, axis=0), axis=0), m.type.layout)
    _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, kv, split, N_COLS, REP, False)
    await_tail()


# The warp kernel (module docstring): keys stored after RoPE, head_dim 128
WARP_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[N_WARPS, 1, 1],
                                                  instr_shape=[1, 16, 8]))
LOW_HALVES = gl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")      # (a.lo, b.lo)
HIGH_HALVES = gl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")     # (a.hi, b.hi)
# x (an fp16 pair) times a scale pair plus an offset pair, each pair an int32 entered twice (pack=2)
FMA_PAIRS = gl.constexpr("fma.rn.f16x2 $0, $1, $2, $4;")
# keys stored before RoPE: channels c and c + d/2 (lo, hi; half2 pairs) rotated by (cos, sin) in fp16, lo cos - hi sin
# and hi cos + lo sin, each an fp16x2 product (rounded) and an FMA
ROTATE_PAIRS = gl.constexpr("{ .reg .b32 t; mul.rn.f16x2 t, $3, $5; neg.f16x2 t, t; fma.rn.f16x2 $0, $2, $4, t; "
                            "mul.rn.f16x2 t, $2, $5; fma.rn.f16x2 $1, $3, $4, t; }")
# two fp32 values as an fp16 pair, each saturated to fp16's finite range (a clamp to +-65504, then rounding)
TO_HALF2 = gl.constexpr("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;")
# zero - M * scale for a pair of real channels (2 i, 2 i + 1), slots of parity 0 and 1: M = 4 and 16
OFFSETS_HALF2 = gl.constexpr("{ .reg .b32 m; mov.b32 m, 0xCC00C400; fma.rn.f16x2 $0, $1, m, $2; }")


@gluon.jit
def _join8(o):
    """The unpack PTX's 8 outputs, each (..., 2), joined: (..., 2, a2, a1, a0), output a = a0 + 2 a1 + 4 a2."""
    return gl.join(gl.join(gl.join(o[0], o[4]), gl.join(o[2], o[6])), gl.join(gl.join(o[1], o[5]), gl.join(o[3], o[7])))


@gluon.jit
def _warp_operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, t, last, LKW: gl.constexpr, KSL: gl.constexpr,
                   LVW: gl.constexpr, D: gl.constexpr, CG: gl.constexpr, CLAMP: gl.constexpr):
    """Step t's operands, warp w's from key group t + w: key words (4, 32, W) in LKW (a thread: two adjacent words
    of four tokens), the group's key scales and zeros (4, D/2) as stored, int32 pairs of real channels (a thread: its
    lane's 32 channels), value words (4, 32, W) in LVW (a thread: word lane / 4 of tokens 2 (lane % 4) + {0, 1, 8, 9,
    16, 17, 24, 25}) and each value word's scale and zero. With CLAMP slots past `last` read `last`; without, every
    slot of the step is read where it lies, so that a thread's loads are one address plus constants."""
    W: gl.constexpr = D // 16
    L3: gl.constexpr = gl.SliceLayout(3, LKW)
    first = t * 32                                                  # the step's first slot: scalar pointers move
    wk = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    jk = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    ck = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    tk = wk[:, None] * 32 + jk[None, :]                             # (4, 32): slots from `first`
    if CLAMP:
        tk = gl.minimum(tk, last - first)
    kw = gl.load(kc_ptr + first * W + (tk[:, :, None] * W + ck[None, None, :]))
    ws = gl.arange(0, WARPS, layout=gl.SliceLayout(1, KSL))
    cs = gl.arange(0, D // 2, layout=gl.SliceLayout(0, KSL))
    if CLAMP:
        ws = gl.minimum(ws, last // 32 - t)
    at = ws[:, None] * (D // 2) + cs[None, :]
    ks_ptr = ks_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + t * (D // 2)
    kz_ptr = kz_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + t * (D // 2)
    wv = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LVW)))
    jv = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LVW)))
    cv = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, LVW)))
    tv = wv[:, None] * 32 + jv[None, :]
    if CLAMP:
        tv = gl.minimum(tv, last - first)
    tv = gl.expand_dims(tv, 2)
    vw = _load_moved(vc_ptr + first * W, tv * W + cv[None, None, :], (1 + 8 + 16) * W, CLAMP)
    atv = tv * (D // CG) + (cv * 16 // CG)[None, None, :]
    vs = _load_moved(vs_ptr + first * (D // CG), atv, (1 + 8 + 16) * (D // CG), CLAMP)
    vz = _load_moved(vz_ptr + first * (D // CG), atv, (1 + 8 + 16) * (D // CG), CLAMP)
    return kw, gl.load(ks_ptr + at), gl.load(kz_ptr + at), vw, vs, vz


@gluon.jit
def _load_moved(ptr, offsets, REGS: gl.constexpr, CLAMP: gl.constexpr):
    """ptr[offsets] for _warp_operands' (4, 32, W) tensors, whose registers hold the offsets' bits in REGS (the
    tokens a thread holds) and its lanes and warps the others. Unclamped, the offsets are split into those two
    parts, so that a thread's loads are one address plus immediates (else each is an address of its own)."""
    if CLAMP:
        return gl.load(ptr + offsets)
    return gl.load((ptr + (offsets & ~REGS)) + (offsets & REGS))


@gluon.jit
def _column_pairs(pairs, XL: gl.constexpr, ROPE: gl.constexpr):
    """Key scales or offsets loaded as int32 half2 pairs of real channels (4, D/2) (a thread: its lane's 16 pairs,
    real channels 32 t .., or with ROPE 16 t .. and 64 + 16 t ..) -> (4, 32, D) int32 in XL, column
    c = b + 2 t + 8 a + 64 w0 holding the pair of real channels (word 2 t + w0, or t + 4 w0) slots a and a + 8, one
    prmt a pair, the same for b = 0 and 1."""
    D: gl.constexpr = 2 * pairs.shape[1]
    if ROPE:
        x = gl.permute(gl.reshape(pairs, (4, 2, 4, 2, 4)), (0, 2, 1, 4, 3))     # (4, t, w0, a // 2, + 8 channels)
    else:
        x = gl.permute(gl.reshape(pairs, (4, 4, 2, 2, 4)), (0, 1, 2, 4, 3))     # (4, t, w0, a // 2, + 8 channels)
    first, second = gl.split(x)                                   # (4, t, w0, a // 2)
    lo = gl.inline_asm_elementwise(LOW_HALVES, "=r,r,r", [first, second], dtype=gl.int32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(HIGH_HALVES, "=r,r,r", [first, second], dtype=gl.int32, is_pure=True, pack=1)
    x = gl.reshape(gl.join(lo, hi), (4, 4, 2, 8))                 # (4, t, w0, a): a even the low halves
    x = gl.reshape(gl.permute(gl.join(x, x), (0, 2, 3, 1, 4)), (4, D))                  # (4, w0, a, t, b)
    x = gl.convert_layout(x, gl.SliceLayout(1, XL))
    return gl.broadcast(gl.expand_dims(x, 1), gl.zeros([4, 32, D], gl.int32, XL))[0]


@gluon.jit
def _warp_keys(kw, ks, kz, LKW: gl.constexpr, XL: gl.constexpr, ROPE: gl.constexpr):
    """Key words (4, 32, W) and their group's scales and zeros (4, D/2), int32 pairs of real channels as stored ->
    the scores' A operand (4, 32, D) in XL (A's registers, converted to A with no data moved): column
    c = b + 2 t + 8 a + 64 w0 is slot a + 8 b of word 2 t + w0 (real channel 32 t + 16 w0 + 8 b + a; _place's
    order), or with ROPE of word t + 4 w0 (real channel 16 t + 64 w0 + 8 b + a: a thread holds channels c and
    c + d/2, which RoPE pairs), read as M + c and dequantized by one fp16x2 FMA with the column's scale and offset
    zero - M * scale (the magic M by a's parity)."""
    D: gl.constexpr = 16 * kw.shape[2]
    pairs = gl.join(kw, kw)                                                        # (4, 32, W, 2): the word twice
    pairs = gl.convert_layout(pairs, LKW, assert_trivial=True)
    o = gl.inline_asm_elementwise(MAGIC_ASM, MAGIC_CON, [pairs], dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    if ROPE:
        x = gl.reshape(_join8(o), (4, 32, 2, 4, 2, 2, 2, 2))                       # (4, 32, w0, t, b, a2, a1, a0)
        x = gl.permute(x, (0, 1, 2, 5, 6, 7, 3, 4))
    else:
        x = gl.reshape(_join8(o), (4, 32, 4, 2, 2, 2, 2, 2))                       # (4, 32, t, w0, b, a2, a1, a0)
        x = gl.permute(x, (0, 1, 3, 5, 6, 7, 2, 4))
    x = gl.convert_layout(gl.reshape(x, (4, 32, D)), XL, assert_trivial=True)      # (w0, a2, a1, a0, t, b)
    # the scales and offsets as half2 pairs of A's registers, (slot a, a + 8) of a word, formed once: the loaded
    # pairs are real channels (2 i, 2 i + 1), whose offsets zero - M * scale take the magics (4, 16) as a half2
    s_pairs = _column_pairs(ks, XL, ROPE)
    z_pairs = _column_pairs(gl.inline_asm_elementwise(OFFSETS_HALF2, "=r,r,r", [ks, kz], dtype=gl.int32,
                                                      is_pure=True, pack=1), XL, ROPE)
    return gl.inline_asm_elementwise(FMA_PAIRS, "=r,r,r,r,r,r", [x, s_pairs, z_pairs], dtype=gl.float16, is_pure=True,
                                     pack=2)


@gluon.jit
def _rotate_keys(k, cos, sin):
    """Keys k (4, 32, D) in XL (_warp_keys' with ROPE: column c + 64 is channel c's RoPE partner, in the same
    thread) rotated by their offsets' angles, cos and sin (4, 32, D/2) (_warp_rope_tables): each pair of
    channels by one fp16x2 product and FMA a half (ROTATE_PAIRS)."""
    D: gl.constexpr = k.shape[2]
    lo, hi = gl.split(gl.permute(gl.reshape(k, (4, 32, 2, D // 2)), (0, 1, 3, 2)))           # (4, 32, D/2)
    cos = gl.convert_layout(cos, lo.type.layout, assert_trivial=True)
    sin = gl.convert_layout(sin, lo.type.layout, assert_trivial=True)
    lo, hi = gl.inline_asm_elementwise(ROTATE_PAIRS, "=r,=r,r,r,r,r", [lo, hi, cos, sin],
                                       dtype=(gl.float16, gl.float16), is_pure=True, pack=2)
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(lo, hi), (0, 1, 3, 2)), (4, 32, D)), k.type.layout,
                             assert_trivial=True)


@gluon.jit
def _warp_values(vw, vs, vz, VL: gl.constexpr, VA: gl.constexpr):
    """Value words (4, 32, W) in _warp_operands' layout and their scales and zeros -> the output product's A operand
    Vᵀ (4, D, 32) in registers: row c = g + 8 h + 16 a is slot a + 8 h of word g (real channel 16 g + a + 8 h). A
    thread's tokens 2 p and 2 p + 1 share a half2 register of A: their words are interleaved by halves first (one
    prmt each: slots 0-7 of both, then slots 8-15), so the unpack PTX's output a holds slot a of both tokens, and
    its FMA takes the two tokens' scales and offsets as a half2."""
    W: gl.constexpr = vw.shape[2]
    D: gl.constexpr = 16 * W
    even, odd = gl.split(gl.permute(gl.reshape(vw, (4, 16, 2, W)), (0, 1, 3, 2)))    # (4, 16 p, W): tokens 2p, +1
    lo = gl.inline_asm_elementwise(LOW_HALVES, "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(HIGH_HALVES, "=r,r,r", [even, odd], dtype=gl.int32, is_pure=True, pack=1)
    h = gl.join(lo, hi)                                                            # (4, 16, W, h)
    pairs = gl.join(h, h)                                                          # (4, 16, W, h, 2): entered twice
    s_e, s_o = gl.split(gl.permute(gl.reshape(vs, (4, 16, 2, W)), (0, 1, 3, 2)))
    z_e, z_o = gl.split(gl.permute(gl.reshape(vz, (4, 16, 2, W)), (0, 1, 3, 2)))
    scale = gl.join(s_e, s_o)                                                      # (4, 16, W, token parity)
    zero = gl.join(z_e, z_o)
    scale = gl.convert_layout(gl.permute(gl.join(scale, scale), (0, 1, 2, 4, 3)), pairs.type.layout)
    zero = gl.convert_layout(gl.permute(gl.join(zero, zero), (0, 1, 2, 4, 3)), pairs.type.layout)
    o = gl.inline_asm_elementwise(ZERO_ASM, ZERO_CON, [pairs, scale, zero], dtype=(gl.float16,) * 8, is_pure=True,
                                  pack=2)
    y = gl.permute(_join8(o), (0, 5, 6, 7, 3, 2, 1, 4))                            # (4, a2, a1, a0, h, g, p, parity)
    y = gl.convert_layout(gl.reshape(y, (4, D, 32)), VL, assert_trivial=True)
    return gl.convert_layout(y, VA, assert_trivial=True)


@gluon.jit
def _warp_step(ops, q, m, l, acc, qk_scale, t, stop, n_both, LKW: gl.constexpr, XL: gl.constexpr, VL: gl.constexpr,
               MASKED: gl.constexpr, rot=None):
    """Step t of the warp kernel: warp w attends key group t + w (ops: _warp_operands') with its own online softmax
    in base 2, on the state (m, l, acc) _warp_kernel holds. MASKED: slots past n_both and groups from `stop` on are
    masked to -inf (a warp may then have no live token yet); else every slot is live. rot, for keys stored before
    RoPE: (cos, sin), the angles of the slots' offsets in their group (_warp_rope_tables), q rotated back to the
    group's first position (_warp_query_back)."""
    ROWS: gl.constexpr = q.shape[2]
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=WARP_MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=WARP_MMA, k_width=2)
    kw, ks, kz, vw, vs, vz = ops
    k = _warp_keys(kw, ks, kz, LKW, XL, rot is not None)
    if rot is not None:
        k = _rotate_keys(k, rot[0], rot[1])
    s = mma_v2(gl.convert_layout(k, A, assert_trivial=True), q, gl.zeros([WARPS, 32, ROWS], gl.float32, WARP_MMA))
    if MASKED:
        js = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, WARP_MMA)))
        ws = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, WARP_MMA)))
        live = ((t + ws)[:, None] * 32 + js[None, :] < n_both) & ((t + ws) < stop)[:, None]     # a warp's group
        s = s * qk_scale + gl.where(live, 0.0, float("-inf"))[:, :, None]
        m_new = gl.maximum(m, gl.max(s, axis=1))
        m_top = gl.where(m_new > float("-inf"), m_new, 0.0)      # a warp with no live token yet: nothing to scale
        alpha = gl.exp2(m - m_top)
        p = gl.exp2(s - gl.expand_dims(m_top, 1))
    else:           # the scale (> 0) taken after the max, and into the exponent's FMA
        m_new = gl.maximum(m, gl.max(s, axis=1) * qk_scale)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    a_l = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, l.type.layout)), 1)
    l = l * a_l + gl.sum(gl.reshape(p, (WARPS, 4, 8, ROWS)), axis=1)
    acc = mma_v2(_warp_values(vw, vs, vz, VL, A), gl.convert_layout(p.to(gl.float16), B),
                 acc * gl.expand_dims(alpha, 1))
    return m_new, l, acc


@gluon.jit
def _warp_rope_tables(off_ptr, LT: gl.constexpr):
    """warp_rope_tables' cos and sin of RoPE's angles at offsets j < 32 in a key group -> two (4, 32, D/2) fp16
    tiles, element (w, j, c) the angle at offset j of column c's real channel (columns c and c + D/2 of XL share
    it: _rotate_keys). Loaded in LT (4, j // 8, j % 8, t, e), a thread's 16 values of a row in consecutive
    registers (16-byte vectors)."""
    L4: gl.constexpr = gl.SliceLayout(0, LT)
    i = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
    e = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    at = ((i[:, None, None, None] * 8 + g[None, :, None, None]) * 4 + t[None, None, :, None]) * 16 \
        + e[None, None, None, :]                                                  # (j // 8, j % 8, t, e)
    at = gl.expand_dims(at, 0) + gl.zeros([WARPS, 4, 8, 4, 16], gl.int32, LT)
    out = ()
    for which in gl.static_range(2):
        x = gl.reshape(gl.load(off_ptr + which * 32 * 64 + at), (WARPS, 4, 8, 4, 8, 2))     # e = 2 a + b
        out = out + (gl.reshape(gl.permute(x, (0, 1, 2, 4, 3, 5)), (WARPS, 32, 64)),)     # column 8 a + 2 t + b
    return out


@gluon.jit
def _warp_query_halves(q_ptr, kv, REP: gl.constexpr, QR: gl.constexpr, D: gl.constexpr, LQC: gl.constexpr):
    """Keys stored before RoPE: KV head kv's query rows as (4, QR, D/2, 2) fp32 in LQC, element (w, r, f, h)
    channel f + h D/2 of row r (every warp the same), rows past REP zero."""
    L3: gl.constexpr = gl.SliceLayout(0, LQC)
    r = gl.arange(0, QR, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))
    f = gl.arange(0, D // 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))
    h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    at = (kv * REP + r[:, None, None]) * D + f[None, :, None] + h[None, None, :] * (D // 2)
    live = gl.expand_dims((r < REP)[:, None, None], 0)
    q = gl.load(q_ptr + gl.expand_dims(at, 0), mask=live, other=0).to(gl.float32)
    return q + gl.zeros([WARPS, QR, D // 2, 2], gl.float32, LQC)


@gluon.jit
def _warp_query_back(q, cos_ptr, sin_ptr, p0, ROWS: gl.constexpr):
    """Keys stored before RoPE: q (_warp_query_halves') rotated back to each warp's position p0 (4,) this step,
    R(-p0) q = [q_lo cos + q_hi sin, q_hi cos - q_lo sin] in fp32 from the model's cos and sin rows at p0, as the
    scores' B operand (4, D, ROWS) fp16 (saturated to its range as warp_query's clamp), column c real channel
    16 t + 64 w0 + 8 b + a (c = b + 2 t + 8 a + 64 w0, _warp_keys' with ROPE), rows past q's zero."""
    QR: gl.constexpr = q.shape[1]
    D: gl.constexpr = 2 * q.shape[2]
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=WARP_MMA, k_width=2)
    L3: gl.constexpr = gl.SliceLayout(3, q.type.layout)
    f = gl.arange(0, D // 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    at = gl.convert_layout(p0, gl.SliceLayout(1, gl.SliceLayout(1, L3)))[:, None] * D + f[None, :]    # (4, D/2)
    c = gl.expand_dims(gl.load(cos_ptr + at).to(gl.float32), 1)
    s = gl.expand_dims(gl.load(sin_ptr + at).to(gl.float32), 1)
    lo, hi = gl.split(q)
    x = gl.join(lo * c + hi * s, hi * c - lo * s)                                  # (4, QR, D/2, h)
    x = gl.inline_asm_elementwise(TO_HALF2, "=r,r,r", [x], dtype=gl.float16, is_pure=True, pack=2)
    x = gl.reshape(gl.permute(x, (0, 1, 3, 2)), (WARPS, QR, D))                   # real channel h D/2 + f
    if ROWS != QR:
        x = gl.reshape(gl.permute(gl.join(x, gl.zeros_like(x)), (0, 3, 1, 2)), (WARPS, ROWS, D))
    x = gl.reshape(x, (WARPS, ROWS, 2, 4, 2, 8))                                  # (w0, t, b, a)
    return gl.convert_layout(gl.reshape(gl.permute(x, (0, 2, 5, 3, 4, 1)), (WARPS, D, ROWS)), B)


@gluon.jit
def _warp_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, cos_ptr, sin_ptr, off_ptr, m_ptr, l_ptr,
                 acc_ptr, len_ptr, PER_SPLIT, N_COLS, qk_scale, s_kc, s_ks, s_kz, s_vc, s_vs, s_vz, D: gl.constexpr,
                 REP: gl.constexpr, ROWS: gl.constexpr, CG: gl.constexpr, LKW: gl.constexpr, KSL: gl.constexpr,
                 LVW: gl.constexpr, XL: gl.constexpr, VL: gl.constexpr, ROPE: gl.constexpr, LT: gl.constexpr,
                 LQC: gl.constexpr, QROWS: gl.constexpr):
    ROW: gl.constexpr = gl.SliceLayout(1, WARP_MMA)                  # (4, ROWS): each warp's rows
    kv = gl.program_id(0)                        # b * H + h
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr = _head_pointers(kv, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                                                                    s_kc, s_ks, s_kz, s_vc, s_vs, s_vz)
    split = gl.program_id(1)
    let_next_launch()
    n_both, start, stop, last = _run(len_ptr, split, PER_SPLIT)

    if ROPE:    # the query's rows, rotated back to each warp's group every step (module docstring)
        q = _warp_query_halves(q_ptr, kv, REP, QROWS, D, LQC)
        n_sink = gl.load(len_ptr + 3)
        w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, ROW))
    else:
        q = warp_query(q_ptr, kv, _place(warp_columns(D), D // 16), REP, ROWS)     # column c: channel _place(c)

    m = gl.full([WARPS, ROWS], float("-inf"), gl.float32, layout=ROW)
    # each thread's share of the row sums: its own tokens' (4, 8 (token bits 0-2), ROWS)
    l = gl.sum(gl.reshape(gl.zeros([WARPS, 32, ROWS], gl.float32, WARP_MMA), (WARPS, 4, 8, ROWS)), axis=1)
    acc = gl.zeros([WARPS, D, ROWS], gl.float32, layout=WARP_MMA)
    # the steps whose 128 slots are all live: loads with no clamp, scores with no mask; the next step's operands
    # are loaded before this step's work (the last full step loads itself again, a hit in the caches)
    full = start + gl.maximum(gl.minimum(stop, n_both // 32) - start, 0) // WARPS * WARPS
    ops = _warp_operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, start, last, LKW, KSL, LVW, D, CG, True)
    for t in range(start, full, WARPS):
        nxt = _warp_operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, gl.minimum(t + WARPS, full - WARPS), last,
                             LKW, KSL, LVW, D, CG, False)
        if ROPE:
            m, l, acc = _warp_step(ops, _warp_query_back(q, cos_ptr, sin_ptr, n_sink + (t + w) * 32, ROWS), m, l,
                                   acc, qk_scale, t, stop, n_both, LKW, XL, VL, False, _warp_rope_tables(off_ptr, LT))
        else:
            m, l, acc = _warp_step(ops, q, m, l, acc, qk_scale, t, stop, n_both, LKW, XL, VL, False)
        ops = nxt
    # the rest (fewer than four groups, or a group not all live): loaded as they are attended, slots clamped
    for t in range(full, stop, WARPS):
        ops = _warp_operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, t, last, LKW, KSL, LVW, D, CG, True)
        if ROPE:    # a warp past the last group rotates to that group's position (its scores are masked)
            qb = _warp_query_back(q, cos_ptr, sin_ptr, n_sink + gl.minimum(t + w, last // 32) * 32, ROWS)
            m, l, acc = _warp_step(ops, qb, m, l, acc, qk_scale, t, stop, n_both, LKW, XL, VL, True,
                                   _warp_rope_tables(off_ptr, LT))
        else:
            m, l, acc = _warp_step(ops, q, m, l, acc, qk_scale, t, stop, n_both, LKW, XL, VL, True)

    m_all, l_all, out, _ = warp_merge(m, l, acc)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, out.type.layout))
    real = 16 * (c % 8) + c // 16 + 8 * ((c // 8) % 2)                                      # row c of Vᵀ
    warp_store(m_ptr, l_ptr, acc_ptr, m_all, l_all, out, real, kv, split, N_COLS, REP)
    await_tail()


@gluon.jit
def warp_columns(D: gl.constexpr):
    """0 .. D - 1 in the layout of the columns of warp_query's query (the rows of the scores' B operand)."""
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=WARP_MMA, k_width=2)
    return gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B)))


@gluon.jit
def warp_query(q_ptr, kv, channels, REP: gl.constexpr, ROWS: gl.constexpr):
    """The query rows of KV head kv as qᵀ (4, D, ROWS), the scores' B operand in a warp kernel, the same in every
    warp: column c is channel channels[c] (warp_columns' layout); padded past REP with zeros; fp16 (a bf16 query
    clamped to the fp16 range, as the Triton kernels)."""
    D: gl.constexpr = channels.shape[0]
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=WARP_MMA, k_width=2)
    rq = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, B)))
    wq = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, B)))
    q = gl.load(q_ptr + (kv * REP + rq[None, None, :]) * D + channels[None, :, None] + 0 * wq[:, None, None],
                mask=(rq < REP)[None, None, :], other=0)
    return gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)


@gluon.jit
def warp_merge(m, l, acc):
    """A warp kernel's four warps' partials, running max m (4, ROWS), each thread's share of the row sums l and accᵀ
    (4, D, ROWS), merged once: (m, l, accᵀ (D, ROWS)) of the program's tokens, and each warp's factor (4, ROWS)."""
    ROW: gl.constexpr = gl.SliceLayout(1, WARP_MMA)
    m_all = gl.max(m, axis=0)
    f = gl.where(m > float("-inf"), gl.exp2(m - gl.expand_dims(m_all, 0)), 0.0)
    l_all = gl.sum(gl.convert_layout(gl.sum(l, axis=1), ROW) * f, axis=0)
    return m_all, l_all, gl.sum(acc * gl.expand_dims(f, 1), axis=0), f


@gluon.jit
def warp_store(m_ptr, l_ptr, acc_ptr, m, l, out, channels, kv, split, N_COLS, REP: gl.constexpr):
    """Store a warp kernel's merged partials (warp_merge) as column `split` of its KV head's REP rows: m, l (ROWS,)
    and accᵀ (D, ROWS), whose row c is channel channels[c]."""
    ROWS: gl.constexpr = m.shape[0]
    D: gl.constexpr = out.shape[0]
    r = gl.arange(0, ROWS, layout=m.type.layout)
    rows = (kv * REP + r) * N_COLS + split
    gl.store(m_ptr + rows, m, mask=r < REP)
    gl.store(l_ptr + rows, gl.convert_layout(l, m.type.layout), mask=r < REP)
    ro = gl.arange(0, ROWS, layout=gl.SliceLayout(0, out.type.layout))
    gl.store(acc_ptr + ((kv * REP + ro) * N_COLS + split)[None, :] * D + channels[:, None], out,
             mask=(ro < REP)[None, :])


@functools.cache
def _warp_layouts(d: int, rope: bool = False) -> tuple:
    """(LKW, KSL, LVW, XL, VL) of the warp kernel, head_dim 128 (W = 8 words a token), four warps, warp w on dim 0:
    LKW, the key words entering the unpack PTX (4, 32 tokens, W, 2): registers the pair axis, word + 1, token + 8,
    + 16; lanes word + 2, + 4 (lane % 4 = t: words 2 t, 2 t + 1), token + 1, + 2, + 4; with rope (keys stored
    before RoPE) word + 4 in the registers and word + 1, + 2 in the lanes (words t, t + 4: channels c and c + d/2);
    KSL, the key scales' (4, d/2) load, int32 pairs: a thread its lane's 32 consecutive channels (16-byte vectors),
    with rope the 16 of each of its two words;
    LVW, the value words (4, 32, W): registers token + 1, + 8, + 16; lanes token + 2, + 4, word + 1, + 2, + 4;
    XL and VL, the A operands' own layouts (the scores' (4, 32, d) and Vᵀ's (4, d, 32)) with their registers in A's
    order, the half2 pairs first, so that an FMA's fp16x2 operands and A's registers are the same pairs."""
    assert d == 128
    warps = [[1, 0, 0], [2, 0, 0]]
    word, words = ([0, 0, 4, 0], [[0, 0, 1, 0], [0, 0, 2, 0]]) if rope else ([0, 0, 1, 0], [[0, 0, 2, 0], [0, 0, 4, 0]])
    lkw = gl.DistributedLinearLayout([[0, 0, 0, 1], word, [0, 8, 0, 0], [0, 16, 0, 0]],
                                     words + [[0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
                                     [[1, 0, 0, 0], [2, 0, 0, 0]], [], [N_WARPS, 32, d // 16, 2])
    pair, pairs = ([0, 32], [[0, 8], [0, 16]]) if rope else ([0, 8], [[0, 16], [0, 32]])
    ksl = gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], pair], pairs + [[0, 0], [0, 0], [0, 0]],
                                     [[1, 0], [2, 0]], [], [N_WARPS, d // 2])
    lvw = gl.DistributedLinearLayout([[0, 1, 0], [0, 8, 0], [0, 16, 0]],
                                     [[0, 2, 0], [0, 4, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]], warps, [],
                                     [N_WARPS, 32, d // 16])
    lanes = [[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    xl = gl.DistributedLinearLayout([[0, 0, 1], [0, 8, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32], [0, 0, 64], [0, 16, 0]],
                                    lanes, warps, [], [N_WARPS, 32, d])
    vl = gl.DistributedLinearLayout([[0, 0, 1], [0, 8, 0], [0, 0, 8], [0, 0, 16], [0, 16, 0], [0, 32, 0], [0, 64, 0]],
                                    lanes, warps, [], [N_WARPS, d, 32])
    return lkw, ksl, lvw, xl, vl


@functools.cache
def _warp_rope_layouts(qrows: int) -> tuple:
    """(LT, LQC) of the warp kernel for keys stored before RoPE (head_dim 128, four warps, warp w on dim 0):
    LT, the offsets' tables (_warp_rope_tables) as (4, j // 8, j % 8, t, e): registers e (a thread's 16 values of
    row j, consecutive), then j + 8, + 16; lanes t, then j + 1, + 2, + 4: XL's threads;
    LQC, the query rows rotated back (_warp_query_back) as (4, qrows, 64 frequencies, 2 halves): registers the half
    (channels f and f + 64, which share an angle), f + 1, + 2, + 4 (16-byte vectors of a table row), rows past 4;
    lanes f + 8, + 16, + 32, rows + 1, + 2: each element of qrows' rows once in a warp."""
    lt = gl.DistributedLinearLayout([[0, 0, 0, 0, 1 << i] for i in range(4)] + [[0, 1, 0, 0, 0], [0, 2, 0, 0, 0]],
                                    [[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0],
                                     [0, 0, 4, 0, 0]], [[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], [],
                                    [N_WARPS, 4, 8, 4, 16])
    rows = [[0, 1 << i, 0, 0] for i in range(2, qrows.bit_length() - 1)]
    lqc = gl.DistributedLinearLayout([[0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]] + rows,
                                     [[0, 0, 8, 0], [0, 0, 16, 0], [0, 0, 32, 0], [0, 1, 0, 0], [0, 2, 0, 0]],
                                     [[1, 0, 0, 0], [2, 0, 0, 0]], [], [N_WARPS, qrows, 64, 2])
    return lt, lqc


def warp_rope_tables(cos: Tensor, sin: Tensor) -> Tensor:
    """The warp kernel's table of RoPE's rotations by offsets 0 .. 31 within a key group: (2, 32, 4, 16) fp16, cos
    then sin, converted as the Triton kernel converts them; [., j, t, e] is the angle at offset j of frequency
    16 t + 8 b + a for e = b + 2 a, the order a thread of XL holds its columns' real channels (_warp_rope_tables).
    Kept as rope_tables keeps its table."""
    freq = [16 * (e // 16) + 8 * (e % 2) + (e % 16) // 2 for e in range(64)]                   # (t, e) flattened
    return _kept_table(_WARP_KEPT, cos, sin, 32, freq, (2, 32, 4, 16))


@gluon.jit
def _tokens(r, ROPE: gl.constexpr):
    """Row r's token in a step: r with keys rotated in the kernel (a shared key tile in token order), else the key
    operand's _row_token(r)."""
    if not ROPE:
        r = _row_token(r)
    return r


@functools.cache
def _layouts(d: int, rope: bool = False) -> tuple:
    """(LP, KSL, LPK, LH) for head_dim d, W = d/16 words a token, four warps:
    LP, the value words' (BLOCK, W, 2) layout: lanes 8 consecutive rows x 4 words (every other word at W = 8),
    registers the pair axis, word + 1 (W = 8: a thread's two words are adjacent, one 8-byte load and one value group
    of 32 channels or more), row + 8 and + 16; warps the four 32-row groups.
    LPK, the key words' layout: operand_layout (the keys go to the wgmma in registers), or for keys rotated in the
    kernel (rope) LP with word + W/2 in the registers, so that a thread holds channels c and c + d/2, which share
    RoPE's angles (W = 4: the lanes take row + 8 for it).
    KSL, the key scales' (4, d) load, in real channel order, the threads of the keys' groups: without rope a warp's
    group, a thread its lane's (lane % 4) 32 consecutive channels (16 at d = 64), the rest of the lanes the same;
    with rope a thread's 16 channels of each of its key words, eight consecutive a vector.
    LH, with rope: the (BLOCK, d/2) half rows of RoPE's tables, LPK's threads, 16 channels in consecutive registers;
    else None."""
    t3 = [[1, 0, 0], [2, 0, 0], [4, 0, 0]]
    warps = [[32, 0, 0], [64, 0, 0]]
    if not rope:
        lp = _layouts(d, True)[0]
        run = d // 4                        # a thread's channels
        ksl = gl.DistributedLinearLayout([[0, 1 << i] for i in range(run.bit_length() - 1)],
                                         [[0, run], [0, 2 * run], [0, 0], [0, 0], [0, 0]], [[1, 0], [2, 0]], [],
                                         [TOKENS // 32, d])
        return lp, ksl, operand_layout(TOKENS, d // 16), None
    if d == 128:
        regs, lanes = [[0, 4, 0], [8, 0, 0], [16, 0, 0]], [[0, 1, 0], [0, 2, 0]]
        value_regs, value_lanes = [[0, 1, 0], [8, 0, 0], [16, 0, 0]], [[0, 2, 0], [0, 4, 0]]
    else:
        regs, lanes = [[0, 2, 0], [16, 0, 0]], [[0, 1, 0], [8, 0, 0]]
        value_regs, value_lanes = [[8, 0, 0], [16, 0, 0]], [[0, 1, 0], [0, 2, 0]]
    lpk = gl.DistributedLinearLayout([[0, 0, 1]] + regs, t3 + lanes, warps, [], [TOKENS, d // 16, 2])
    lp = gl.DistributedLinearLayout([[0, 0, 1]] + value_regs, t3 + value_lanes, warps, [], [TOKENS, d // 16, 2])

    def channels(bases):                   # a word base's channels; a token base's none
        return [[0, 16 * b[1]] for b in bases]

    ksl = gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8]] + [b for b in channels(regs) if b[1]],
                                     [[0, 0]] * 3 + channels(lanes), [[1, 0], [2, 0]], [], [TOKENS // 32, d])

    def half(bases):                        # LPK's bases with channel c + d/2 dropped (the half row's)
        return [[b[0], 16 * b[1]] for b in bases if 16 * b[1] != d // 2]
    lh = gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], [0, 8]] + half(regs), half(t3 + lanes),
                                    [b[:2] for b in warps], [], [TOKENS, d // 2])
    return lp, ksl, lpk, lh


def launch_options(early: bool) -> dict:
    """A Gluon kernel's launch options: launched programmatically where the tail's program before it lets it (early;
    its programs wait for that program before they exit: await_tail)."""
    return dict(launch_pdl=True) if early else {}


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def eligible(q: Tensor, bits: int, v_bits: int, channel: bool, rope, group: int, rep: int, gs: int,
             group_rows: int, qk_scale: float) -> bool:
    """Whether outer_decode_attention's quantized runs take this kernel: enabled, an sm_90 GPU with the inline-PTX
    path (fp16/bf16, compiled), 2-bit keys in per-channel groups (stored after RoPE, or before it: KIVI*) and 2-bit
    values in groups of whole words, head_dim 64 or 128, at most 16 query rows a KV head, steps of four groups
    (any, for the warp kernel: _serves_warp_kernel), and
    at least MIN_GROUP_ROWS (KV rows x groups) of work, the least measured to gain; RoPE's tables, where given,
    hold at least a step's TOKENS positions (rope_tables)."""
    d = q.shape[-1]
    return (ENABLED and unpacks_in_ptx(q) and _is_hopper(q.device.index or 0) and bits == 2 and v_bits == 2
            and channel and d in (64, 128) and group % 16 == 0 and rep <= N_ROWS
            and (gs == TOKENS // 32 or _serves_warp_kernel(d, rope, qk_scale))
            and group_rows >= MIN_GROUP_ROWS and (rope is None or rope[0].shape[0] >= TOKENS))


def takes_warp_kernel(q: Tensor, bits: int, v_bits: int, channel: bool, rope, group: int, rep: int,
                      group_rows: int, qk_scale: float) -> bool:
    """Whether eligible() takes the warp kernel (head_dim 128, a softmax scale above 0: _serves_warp_kernel) with
    keys stored after RoPE and 8 rows (three programs an SM) at any split of the groups, so that the split-K plan
    may size for its WARP_PROGRAMS_PER_SM. Keys stored before RoPE hold two programs an SM (255 registers), the
    Triton kernel's plan."""
    return programs_an_sm(q.shape[-1], rep, rope, qk_scale) == WARP_PROGRAMS_PER_SM and eligible(
        q, bits, v_bits, channel, rope, group, rep, TOKENS // 32, group_rows, qk_scale)


def rotates_in_warp_kernel(q: Tensor, bits: int, v_bits: int, channel: bool, rope, group: int, rep: int,
                           group_rows: int, qk_scale: float) -> bool:
    """Whether eligible() takes the warp kernel with keys stored before RoPE (two programs an SM: ROPE_WAVE at small
    batches, else the Triton kernel's plan)."""
    return rope is not None and _serves_warp_kernel(q.shape[-1], rope, qk_scale) and eligible(
        q, bits, v_bits, channel, rope, group, rep, TOKENS // 32, group_rows, qk_scale)


def programs_an_sm(d: int, rep: int, rope, qk_scale: float) -> int:
    """How many programs of quantized_splits' kernel an SM holds (its registers): the warp kernel's three with keys
    after RoPE and 8 rows, else two."""
    return WARP_PROGRAMS_PER_SM if rope is None and _serves_warp_kernel(d, rope, qk_scale) and rows_for(rep) == 8 \
        else 2


def _serves_warp_kernel(d: int, rope, qk_scale: float) -> bool:
    """Whether quantized_splits launches the warp kernel: head_dim 128 and a softmax scale above 0 (its whole steps
    take the max before the scale); else the warpgroup kernel, whose splits are whole steps."""
    return d == WARP_HEAD_DIM and qk_scale > 0


# the last table each of rope_tables and warp_rope_tables made: {"from": (cos, sin) given, "table": the table made}
_KEPT: dict = {}
_WARP_KEPT: dict = {}


def _kept_table(kept: dict, cos: Tensor, sin: Tensor, rows: int, columns: list[int], shape: tuple) -> Tensor:
    """The model's rotate-half tables' first `rows` rows at `columns`, cos then sin, fp16 as the Triton kernel
    converts them, as `shape`; the table made last is kept in `kept` (a model's decode passes the same tables every
    step: a kept table costs no device work, so none is captured into a step's graph), except while a CUDA graph is
    being captured, where making it is part of the graph."""
    given = kept.get("from")
    if given is not None and given[0] is cos and given[1] is sin:
        return kept["table"]
    columns = torch.tensor(columns, device=cos.device)
    table = torch.stack([cos[:rows, columns], sin[:rows, columns]]).to(torch.float16).reshape(shape).contiguous()
    if not (cos.is_cuda and torch.cuda.is_current_stream_capturing()):
        kept.update({"from": (cos, sin), "table": table})
    return table


def rope_tables(cos: Tensor, sin: Tensor) -> Tensor:
    """The warpgroup kernel's table of RoPE's rotations by offsets 0 .. TOKENS - 1 within a step: (2, TOKENS, d/2)
    fp16, cos then sin, the first TOKENS rows of the model's rotate-half tables (positions, d), their first halves (a
    rotate-half table repeats its frequencies), each row's channels in the keys' logical order (_real). Kept
    (_kept_table)."""
    real = [(c // 16) * 16 + (c % 16) // 2 + 8 * (c % 2) for c in range(cos.shape[1] // 2)]      # _real(c)
    return _kept_table(_KEPT, cos, sin, TOKENS, real, (2, TOKENS, cos.shape[1] // 2))


def quantized_splits(q: Tensor, buffers: list[tuple[Tensor, int]], m: Tensor, l: Tensor, acc: Tensor,
                     lengths: Tensor, per_split: int, splits: int, qk_scale: float, group: int,
                     rope: tuple[Tensor, Tensor] | None = None, early: bool = False) -> None:
    """Write the (m, l, acc) partials of columns [0, splits) of outer_decode_attention's buffers (splits columns,
    or splits + 1 with the sink's and the tail's) for q (B, Hq, d) contiguous; buffers: outer_decode_attention's
    (tensor, head stride) pairs of the key and value codes, scales and zeros, in that order; rope: the (cos, sin)
    tables (positions, d) of keys stored before RoPE (outer_decode_attention's); early: launched while the tail's
    program, just launched on this stream, runs (quant_matvec.launches_early)."""
    B, Hq, d = q.shape
    H = buffers[0][0].shape[1]
    if _serves_warp_kernel(d, rope, qk_scale):
        rep = Hq // H
        cos, sin, offsets = (*rope, warp_rope_tables(*rope)) if rope is not None else (q, q, q)    # q: never read
        layouts = dict(zip(("LKW", "KSL", "LVW", "XL", "VL"), _warp_layouts(d, rope is not None)),
                       **dict(zip(("LT", "LQC"), _warp_rope_layouts(query_rows(rep)))))
        _warp_kernel[(B * H, splits)](q, *(t for t, _ in buffers), cos, sin, offsets, m, l, acc, lengths, per_split,
                                      m.shape[1], qk_scale, *(s for _, s in buffers), D=d, REP=rep, ROWS=rows_for(rep),
                                      CG=group, ROPE=rope is not None, QROWS=query_rows(rep), **layouts,
                                      num_warps=N_WARPS, **launch_options(early))
        return
    lp, ksl, lpk, lh = _layouts(d, rope is not None)
    cos, sin, offsets = (*rope, rope_tables(*rope)) if rope is not None else (q, q, q)     # q: never read
    _quantized_kernel[(B * H, splits)](q, *(t for t, _ in buffers), cos, sin, offsets, m, l, acc, lengths, per_split,
                                       m.shape[1], qk_scale, *(s for _, s in buffers), D=d, REP=Hq // H,
                                       ROWS=rows_for(Hq // H), CG=group, LP=lp, KSL=ksl, LPK=lpk, LH=lh,
                                       ROPE=rope is not None, QROWS=query_rows(Hq // H), num_warps=N_WARPS,
                                       **launch_options(early))
