"""innerq_attention's split kernel on Hopper (sm_90), in Gluon: 2-bit InnerQ codes (keys in per-token groups of 32
channels, values in per-channel groups of 32 tokens, asymmetric or hybrid sym/asym groups), head_dim 64 or 128, an
fp16/bf16 model. The windows stay with innerq_attention's window kernel (launched before this one, on a second
stream beside it) and its combine kernel, which merges this kernel's (m, l, acc) partials as it merges the Triton
split kernel's.

    grid (B*H, splits): program (kv head, split) attends its rep query rows (ROWS = 8 or 16, padding past rep)
    over the value groups [split * PER_SPLIT, ...) of the live quantized tokens, 128 tokens a step.

Both products run on the tensor cores with the dequantized tile as the wgmma's A operand in registers:
    s    (128 tokens, ROWS) = K (128, d) · qᵀ         A: the keys, a row per token
    accᵀ (d, ROWS)       += Vᵀ (d, 128) · pᵀ         A: the values, a row per channel
A step's codes, scales, slots and mask words reach shared memory by cp.async a step ahead (_copy_step, a ring of
STAGES_* steps), and are read from there in the layout the unpack PTX turns into A's registers (_operand_layouts,
_operand): a thread holds one group per row (its lane's two adjacent code words; four lanes read a token's 32
bytes), so each word takes one scale, one offset and one register of signs. A's columns are logical: column i of
the key operand is channel _place(i, d/16) (the query is loaded in that order), column i of the value operand
token _place(i, 8) of the step, so the key rows are in that token order and the weights p need no reordering; the
output rows are the real channels. The keys' words, scales and slots are copied token by token into token-major
rings whose rows are swizzled for the operand's reads (_token_ring, _token_copy): a copy instruction reads 512
contiguous bytes and writes them without bank conflicts. A step's mask words are copied once (16 a side, not one
a row) and broadcast over the rows that read them. InnerQ's groups make every code word one group's:
  - a key word holds 16 channels of one token's group, a value word 16 tokens of one channel's group (the values
    are packed along the tokens, kvquant.pack_tokens);
  - a slot is the fp32 zero point of an asymmetric group or the 32 sign bits of a symmetric one, whose zero is 0
    (keys' bit i: channel i of the group; values' bit i: token i);
  - the unpack PTX (quant_matvec.two_magic_pair_asm) reads a code c as M + c (M = 4 or 16 by its slot in the
    word, three shifts a word) and applies the scale and an offset zero - M * scale, formed from the group's fp16
    zero (_zero) and rounded once, in one fp16 FMA; a code's sign is XOR-ed into the result; a word's signs are
    one byte permute of its group's slot;
  - which groups are symmetric is read from the cache's packed mask bits: keys' bit n % 32 of word [g, n // 32],
    values' bit c % 32 of word [n // 32, c // 32]; tokens from MASK_UPTO on carry no bit and are symmetric.
The scores' product runs while the values unpack. The row sums stay spread over the threads (each its tokens'
share) until the end, so a step reduces across warps only for the rows' max.
Numerics are the Triton kernel's fast path but for that offset: one fp16 FMA a code (the zero rounded to fp16 as
the Triton kernel rounds it, then zero - M * scale rounded once more on asymmetric groups; exact on symmetric ones),
fp16 operands, fp32 products and softmax, the query times the key normalization in the model dtype, then fp16.

Speed: docs/decode.md, "InnerQ's split kernel in Gluon", "InnerQ's operands in registers", "InnerQ's codes
through shared memory", "KIVI's codes under two magic numbers" (which this kernel's unpack shares) and "InnerQ's
keys copied token by token".
KVZOO_INNERQ_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel.
"""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kvzoo.kernels.outer_hopper import (BLOCK, LQ, N_ROWS, N_WARPS, TILE, TOKENS, WARPS, _is_hopper, _operand,
                                        _place, _query, _store_partials, _unpack_pairs, barrier, mma_layout,
                                        operand_layout, rows_for)
from kvzoo.kernels.quant_matvec import kernel_choice, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_INNERQ_KERNEL")
ENABLED = CHOICE != "triton"
GROUPS_PER_STEP = BLOCK // 32    # value groups of 32 tokens a step
PROGRAMS_PER_SM = 2              # split-K sizing below BUSY_ROWS_PER_SM, as the outer kernel's
BUSY_PROGRAMS_PER_SM = 3         # from BUSY_ROWS_PER_SM: three programs an SM, capped
BUSY_ROWS_PER_SM = 1             # KV rows (B*H) per SM from which an SM takes BUSY_PROGRAMS_PER_SM
# at small batches one wave of PROGRAMS_PER_SM programs an SM (innerq_attention.one_wave) where it holds at least 8
# splits a KV row, uncapped: at 2-4 x 32K and 2 x 128K on Llama-3.1-8B's heads 12-22% faster than whole waves with
# asymmetric groups, and with hybrid ones 11% faster on an H100, 1% faster to 4% slower on an H200. At 4 and 2 splits
# a row (8 and 16 x 32K) whole waves were as fast or faster on an H200 (docs/decode.md, "One wave of splits for
# InnerQ and KIVI*")
WAVE = (PROGRAMS_PER_SM, 8)
REGISTERS_PER_SM = 65536
# the ring's steps, by the groups: one (asymmetric: two) in flight while one is read. A third step made asymmetric
# groups 6% faster at 128K, batch 1 and hybrid ones no faster; four were slower
STAGES_ASYM, STAGES_HYBRID = gl.constexpr(3), gl.constexpr(2)
ROW_OF_TOKEN_BIT = (8, 16, 32, 1, 64, 2, 4)   # the key row n whose token _place(n, 8) is 2^k, k = 0..6
# a token row's bytes -> {token bit k: token bit XOR-ed into it}, so that the rows of one shared load of the operand
# layouts land on distinct banks: lanes 2-4 read token bits 3, 5 and 6, and a 64-bit load (32-byte rows) serves
# lanes 0-15 (token bits 3 and 5) apart from lanes 16-31
SWIZZLES = {32: {0: 5, 1: 3}, 16: {0: 3, 1: 5, 2: 6}, 8: {1: 5, 2: 6}, 4: {0: 5, 1: 6}}
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared   # 3.9 / 3.6
_reinterpret = (getattr(gl.shared_memory_descriptor, "reinterpret", None)              # 3.9 / 3.6
                or gl.shared_memory_descriptor._reinterpret)


@gluon.constexpr_function
def _token_ring(row_bytes, elem_bytes):
    """The shared layout of a (BLOCK, row_bytes / elem_bytes) tile whose row n is token _place(n, 8) of a step:
    token-major, as the cache holds them, so that a step's copy writes what it reads contiguously, with the token
    bits SWIZZLES names XOR-ed into a row's place in its 128 bytes."""
    bases = [[0, 1 << i] for i in range((row_bytes // elem_bytes).bit_length() - 1)]
    swizzle = SWIZZLES[row_bytes]
    for j in range(7):      # offset bit of token bit j: row of token 2^j, and of each token bit that takes j
        bases.append([ROW_OF_TOKEN_BIT[j] + sum(ROW_OF_TOKEN_BIT[k] for k in swizzle if swizzle[k] == j), 0])
    return gl.SharedLinearLayout(bases)


@gluon.jit
def _token_stage(ring, stage, dtype: gl.constexpr, cols: gl.constexpr):
    """Stage `stage` of a (STAGES, BLOCK, words) int32 ring as a (BLOCK, cols) tile of dtype in _token_ring."""
    row_bytes: gl.constexpr = ring.shape[2] * 4
    return _reinterpret(ring.index(stage), dtype, [BLOCK, cols], _token_ring(row_bytes, row_bytes // cols))


@gluon.constexpr_function
def _token_copy(cols):
    """The register layout that copies a (BLOCK, cols) int32 tile of _token_ring: up to 16 bytes a copy, a warp's
    lanes on consecutive tokens, so one copy instruction reads 512 contiguous bytes."""
    per = min(cols, 4)
    regs = [[0, 1 << i] for i in range(per.bit_length() - 1)]
    rest = [[0, 1 << i] for i in range(per.bit_length() - 1, cols.bit_length() - 1)]
    rest += [[ROW_OF_TOKEN_BIT[k], 0] for k in range(7)]
    return gl.DistributedLinearLayout(regs + rest[7:], rest[:5], rest[5:7], [], [TOKENS, cols])


@gluon.constexpr_function
def _key_groups4(ng):
    """_operand_layouts' key groups layout LKG (BLOCK, ng) seen as (n bits 3-6, n bits 1-2, n bit 0, group): n bits
    1-2 are the 32-token block of token _place(n, 8), whose mask word a row's group reads."""
    lanes = [[0, 0, 0, 1], [0, 0, 0, 2]] if ng == 4 else [[0, 0, 0, 0], [0, 0, 0, 1]]
    return gl.DistributedLinearLayout([[1, 0, 0, 0], [8, 0, 0, 0]], lanes + [[0, 0, 1, 0], [0, 1, 0, 0], [0, 2, 0, 0]],
                                      [[2, 0, 0, 0], [4, 0, 0, 0]], [], [16, TOKENS // 32, 2, ng])


@gluon.constexpr_function
def _value_groups3(d):
    """_operand_layouts' value groups layout LVG (d, groups) seen as (channel // 32, channel % 32, group)."""
    return gl.DistributedLinearLayout([[0, 8, 0]] + ([[2, 0, 0]] if d == 128 else []),
                                      [[0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 2, 0], [0, 4, 0]], [[0, 16, 0], [1, 0, 0]],
                                      [], [d // 32, 32, TOKENS // 32])


@gluon.jit
def _key_masks(m_s, LG: gl.constexpr):
    """The step's (GS, NG) key mask words [32-token block, group] (shared) as each key row's group's word, (BLOCK,
    NG) in layout LG: one word a thread, broadcast over its rows."""
    GS: gl.constexpr = m_s.shape[0]
    NG: gl.constexpr = m_s.shape[1]
    L4: gl.constexpr = _key_groups4(NG)
    m = gl.expand_dims(gl.expand_dims(m_s.load(gl.SliceLayout(0, gl.SliceLayout(2, L4))), 0), 2)  # (1, GS, 1, NG)
    m = gl.broadcast(m, gl.zeros([16, GS, 2, NG], gl.int32, L4))[0]
    return gl.convert_layout(gl.reshape(m, (BLOCK, NG)), LG)


@gluon.jit
def _value_masks(m_s, LG: gl.constexpr):
    """The step's (D/32, GS) value mask words [channel // 32, group] (shared) as each value row's, (D, GS) in LG."""
    WORDS: gl.constexpr = m_s.shape[0]
    GS: gl.constexpr = m_s.shape[1]
    L3: gl.constexpr = _value_groups3(WORDS * 32)
    m = gl.expand_dims(m_s.load(gl.SliceLayout(1, L3)), 1)                                    # (D/32, 1, GS)
    m = gl.broadcast(m, gl.zeros([WORDS, 32, GS], gl.int32, L3))[0]
    return gl.convert_layout(gl.reshape(m, (WORDS * 32, GS)), LG)


@gluon.jit
def _zero(slot, sym):
    """A group's zero for the unpack PTX: the slot's fp32 bits rounded to fp16, 0 in a symmetric group."""
    return gl.where(sym, 0.0, slot.to(gl.float32, bitcast=True)).to(gl.float16)


@gluon.jit
def _signs(slot, sym, half):
    """A word's 16 signs as the unpack PTX takes them (bits 0-7 and 16-23), from its group's slot: bytes 0-1 for
    the group's first 16 elements (half 0), 2-3 for the other 16 (half 1); 0 in an asymmetric group."""
    signs = gl.where(sym, slot, 0)
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                     [signs, signs, gl.where(half == 0, 0x0100, 0x0302) + 0 * signs], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _copy_step(rings, stage, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, t, last, MASK_UPTO,
               s_kmg, D: gl.constexpr, HAS_SYM: gl.constexpr):
    """Issue step t's cp.async copies into ring stage `stage`: key words (BLOCK, W), key slots (BLOCK, NG) and
    scales (BLOCK, NG/2 int32: two fp16 a word), row n token _place(n, 8) of the step (_token_ring, copied token by
    token, _token_copy); value words (D, BLOCK/16), value slots (D, GS) and scales (D/2 int32, GS), row c channel c;
    the mask words the step reads, keys' (GS, NG) and values' (D/32, GS). Copies move 4-16 bytes: the scales go as
    int32."""
    W: gl.constexpr = D // 16
    NG: gl.constexpr = D // 32
    GS: gl.constexpr = BLOCK // 32
    CKW: gl.constexpr = _token_copy(W)
    CKG: gl.constexpr = _token_copy(NG)
    CKS: gl.constexpr = _token_copy(NG // 2)
    CM: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [WARPS, 1], [1, 0])
    CVW: gl.constexpr = gl.BlockedLayout([4, 1], [D // 4, 128 // D], [1, WARPS], [0, 1])
    CVG: gl.constexpr = gl.BlockedLayout([D // 32, 1], [32, 1], [1, WARPS], [0, 1])
    CVS: gl.constexpr = gl.BlockedLayout([D // 64, 1], [32, 1], [1, WARPS], [0, 1])
    mask_last = gl.minimum(last // 32, gl.maximum(MASK_UPTO - 1, 0) // 32)   # the last mask word read
    kw_s, ks_s, kz_s, km_s, vw_s, vs_s, vz_s, vm_s = rings
    n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, CKW))
    tw = gl.minimum(t * 32 + _place(n, 8), last)[:, None]                          # (BLOCK, 1)
    _async_load(_token_stage(kw_s, stage, gl.int32, W),
                kc_ptr + tw * W + gl.arange(0, W, layout=gl.SliceLayout(0, CKW))[None, :])
    n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, CKS))
    tg = gl.minimum(t * 32 + _place(n, 8), last)[:, None]
    _async_load(_token_stage(ks_s, stage, gl.int32, NG // 2),
                ks_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + tg * (NG // 2)
                + gl.arange(0, NG // 2, layout=gl.SliceLayout(0, CKS))[None, :])
    n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, CKG))
    tg = gl.minimum(t * 32 + _place(n, 8), last)[:, None]
    g = gl.arange(0, NG, layout=gl.SliceLayout(0, CKG))[None, :]
    _async_load(_token_stage(kz_s, stage, gl.int32, NG), kz_ptr + tg * NG + g)
    if HAS_SYM:
        block = gl.minimum(t + gl.arange(0, GS, layout=gl.SliceLayout(1, CM)), mask_last)[:, None]
        g = gl.arange(0, NG, layout=gl.SliceLayout(0, CM))[None, :]
        _async_load(km_s.index(stage), km_ptr + g * s_kmg + block)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, CVW))[:, None]
    chunk = gl.minimum(t * 2 + gl.arange(0, BLOCK // 16, layout=gl.SliceLayout(0, CVW)), last // 16)[None, :]
    _async_load(vw_s.index(stage), vc_ptr + chunk * D + c)
    c = gl.arange(0, D // 2, layout=gl.SliceLayout(1, CVS))[:, None]
    gv = gl.minimum(t + gl.arange(0, GS, layout=gl.SliceLayout(0, CVS)), last // 32)[None, :]
    _async_load(vs_s.index(stage), vs_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + gv * (D // 2) + c)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, CVG))[:, None]
    gv = gl.minimum(t + gl.arange(0, GS, layout=gl.SliceLayout(0, CVG)), last // 32)[None, :]
    _async_load(vz_s.index(stage), vz_ptr + gv * D + c)
    if HAS_SYM:
        block = gl.minimum(t + gl.arange(0, GS, layout=gl.SliceLayout(0, CM)), mask_last)[None, :]
        word = gl.arange(0, D // 32, layout=gl.SliceLayout(1, CM))[:, None]
        _async_load(vm_s.index(stage), vm_ptr + block * (D // 32) + word)
    async_copy.commit_group()


@gluon.jit
def _per_word(x, L: gl.constexpr):
    """A group's (R, NG) quantity as its two words' (R, 2 NG), in the words' layout L."""
    R: gl.constexpr = x.shape[0]
    NG: gl.constexpr = x.shape[1]
    return gl.convert_layout(gl.reshape(gl.join(x, x), (R, 2 * NG)), L)


@gluon.jit
def _read_step(w_s, s_s, z_s, masks, sym_extra, bit, LW: gl.constexpr, LG: gl.constexpr, HAS_SYM: gl.constexpr):
    """A ring stage's words (R, W) in layout LW and their scale, fp16 zero and signs, from the (R, NG) group
    scales (fp16) and slots, and the groups' mask words (LG): a group is symmetric where its mask word's bit `bit`
    is set or sym_extra."""
    kw = w_s.load(LW)
    scale = s_s.load(LG)
    slot = z_s.load(LG)
    if HAS_SYM:
        sym = (((masks >> bit) & 1) != 0) | sym_extra
        zero = gl.zeros_like(slot)
        signs = gl.join(_signs(slot, sym, zero), _signs(slot, sym, zero + 1))
        signs = gl.convert_layout(gl.reshape(signs, (kw.shape[0], kw.shape[1])), LW)
    else:
        sym = False
        signs = kw                                     # not read without symmetric groups
    return kw, _per_word(scale, LW), _per_word(_zero(slot, sym), LW), signs


@gluon.jit
def _split_kernel(q_ptr, qs_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, m_ptr, l_ptr,
                  acc_ptr, len_ptr, N_TOKENS, PER_SPLIT, N_COLS, MASK_UPTO, qk_scale,
                  s_kc, s_ks, s_kz, s_km, s_kmg, s_vc, s_vs, s_vz, s_vm,
                  D: gl.constexpr, REP: gl.constexpr, ROWS: gl.constexpr, HAS_SYM: gl.constexpr, DYN: gl.constexpr,
                  HAS_QS: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr, LKG: gl.constexpr, LVG: gl.constexpr):
    GS: gl.constexpr = BLOCK // 32
    MMA: gl.constexpr = mma_layout(ROWS)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    W: gl.constexpr = D // 16
    NG: gl.constexpr = D // 32
    LKW: gl.constexpr = gl.SliceLayout(2, LK)                       # key words (BLOCK, W)
    LVW: gl.constexpr = gl.SliceLayout(2, LV)                       # value words (D, BLOCK/16)
    RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])   # row-major: mask words; keys' (_token_stage)
    # values': (channel, column) tiles stored by column, their 16-byte units XOR-swizzled by the column, so that
    # the four lanes of a row read four banks
    VRING: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [0, 1])
    GRING: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 4, [0, 1])
    GRING16: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 4, [0, 1])   # GRING's bytes read as fp16
    STAGES: gl.constexpr = STAGES_HYBRID if HAS_SYM else STAGES_ASYM
    MASKS: gl.constexpr = STAGES if HAS_SYM else 1                       # the mask words' ring (unread: 1)

    kv = gl.program_id(0)                        # b * H + h
    head = kv.to(gl.int64)
    kc_ptr += head * s_kc
    ks_ptr += head * s_ks
    kz_ptr += head * s_kz
    km_ptr += head * s_km
    vc_ptr += head * s_vc
    vs_ptr += head * s_vs
    vz_ptr += head * s_vz
    vm_ptr += head * s_vm
    split = gl.program_id(1)

    dq = _place(gl.arange(0, D, layout=gl.SliceLayout(0, LQ)), W)
    q_s = gl.allocate_shared_memory(gl.float16, [ROWS, D], TILE, _query(q_ptr, qs_ptr, kv, dq, REP, ROWS, HAS_QS))
    p_s = gl.allocate_shared_memory(gl.float16, [ROWS, BLOCK], TILE)
    rings = (gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK, W], RING),            # key words (_token_stage)
             gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK, NG // 2], RING),      # key scales, fp16 pairs
             gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK, NG], RING),           # key slots
             gl.allocate_shared_memory(gl.int32, [MASKS, GS, NG], RING),               # key mask words
             gl.allocate_shared_memory(gl.int32, [STAGES, D, BLOCK // 16], VRING),     # value words
             gl.allocate_shared_memory(gl.int32, [STAGES, D // 2, GS], GRING),         # value scales, fp16 pairs
             gl.allocate_shared_memory(gl.int32, [STAGES, D, GS], GRING),              # value slots
             gl.allocate_shared_memory(gl.int32, [MASKS, D // 32, GS], RING))          # value mask words
    m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l = gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA)              # each thread's tokens' share of the row sums
    acc = gl.zeros([D, ROWS], gl.float32, layout=MMA)                # accᵀ, rows the real channels

    if DYN:
        live = gl.load(len_ptr)
    else:
        live = N_TOKENS
    start = split * PER_SPLIT
    stop = gl.minimum(start + PER_SPLIT, live // 32)
    last = gl.maximum(stop * 32 - 1, 0)
    ns = _place(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA)), 8)              # each score row's token
    nk = _place(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LKG)), 8)              # each key row's token
    cv = gl.arange(0, D, layout=gl.SliceLayout(1, LVG))[:, None]                    # (D, 1): each value row's channel
    gv = gl.arange(0, GS, layout=gl.SliceLayout(0, LVG))[None, :]                   # (1, GS): the step's value groups
    for i in gl.static_range(STAGES - 1):
        _copy_step(rings, i, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, start + i * GS, last,
                   MASK_UPTO, s_kmg, D, HAS_SYM)
    stage = 0
    for t in range(start, stop, GS):
        async_copy.wait_group(STAGES - 2)        # this step's copies
        barrier()                                # every thread's copies landed; the stage refilled below is read
        _copy_step(rings, (stage + STAGES - 1) % STAGES, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr,
                   vm_ptr, t + (STAGES - 1) * GS, last, MASK_UPTO, s_kmg, D, HAS_SYM)
        tk = gl.minimum(t * 32 + nk, last)[:, None]                                  # (BLOCK, 1)
        masks = _key_masks(rings[3].index(stage % MASKS), LKG) if HAS_SYM else tk
        kw, ks, kz, k_signs = _read_step(_token_stage(rings[0], stage, gl.int32, W),
                                         _token_stage(rings[1], stage, gl.float16, NG),
                                         _token_stage(rings[2], stage, gl.int32, NG), masks, tk >= MASK_UPTO, tk % 32,
                                         LKW, LKG, HAS_SYM)
        ka = _operand(_unpack_pairs(kw, LK, k_signs if HAS_SYM else None, ks, kz), A)
        s = warpgroup_mma(ka, q_s.permute((1, 0)), gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA), is_async=True)
        g = gl.minimum(t + gv, last // 32)
        masks = _value_masks(rings[7].index(stage % MASKS), LVG) if HAS_SYM else g
        vw, vs, vz, v_signs = _read_step(rings[4].index(stage),
                                         _reinterpret(rings[5].index(stage), gl.float16, [D, GS], GRING16),
                                         rings[6].index(stage), masks, g * 32 >= MASK_UPTO, cv % 32, LVW, LVG,
                                         HAS_SYM)
        va = _operand(_unpack_pairs(vw, LV, v_signs if HAS_SYM else None, vs, vz), A)
        s = warpgroup_mma_wait(0, deps=[s, ka])[0]                  # the scores, computed as the values unpacked
        s = s * qk_scale + gl.where(t * 32 + ns <= last, 0.0, float("-inf"))[:, None]  # one FMA; masked: -inf
        m_new = gl.maximum(m, gl.max(s, axis=0))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[None, :])
        l = l * alpha[None, :] + p
        m = m_new
        p_s.store(gl.permute(p.to(gl.float16), (1, 0)))
        fence_async_shared()
        if gl.min(alpha, axis=0) < 1.0:                           # a row's max grew: rescale (rare after the start)
            acc = acc * alpha[None, :]
        acc = warpgroup_mma(va, p_s.permute((1, 0)), acc)
        stage = (stage + 1) % STAGES
    async_copy.wait_group(0)
    _store_partials(m_ptr, l_ptr, acc_ptr, m, gl.sum(l, axis=0), acc, kv, split, N_COLS, REP, True)


@functools.cache
def _operand_layouts(d: int) -> tuple[gl.DistributedLinearLayout, ...]:
    """(LK, LV, LKG, LVG): the key words' (BLOCK, d/16, 2) and value words' (d, BLOCK/16, 2) layouts that unpack into
    the wgmma's A operand (outer_hopper.operand_layout; a key row is a token, a value row a channel), and their
    groups' (rows, words/2) layouts (the same threads, one value a group)."""
    def groups(rows, words):
        lanes = [[0, 1], [0, 2]] if words == 8 else [[0, 0], [0, 1]]
        return gl.DistributedLinearLayout([[8, 0]] + ([[64, 0]] if rows == 128 else []),
                                          lanes + [[1, 0], [2, 0], [4, 0]], [[16, 0], [32, 0]], [], [rows, words // 2])
    return (operand_layout(TOKENS, d // 16), operand_layout(d, TOKENS // 16), groups(TOKENS, d // 16),
            groups(d, TOKENS // 16))


def eligible(q: Tensor, bits: int, rep: int) -> bool:
    """Whether innerq_decode_attention's split kernel is this one (where its splits come in whole steps of
    GROUPS_PER_STEP): enabled, an sm_90 GPU with the inline-PTX path (fp16/bf16, compiled), 2-bit codes, head_dim
    64 or 128 and at most 16 query rows a KV head."""
    return (ENABLED and unpacks_in_ptx(q) and _is_hopper(q.device.index or 0) and bits == 2
            and q.shape[-1] in (64, 128) and rep <= N_ROWS)


def programs_per_sm(rows: int, sms: int) -> int:
    """Programs of this kernel an SM runs at once for B*H = rows KV rows: 2 (ptxas's own registers), or 3 under
    register_cap from BUSY_ROWS_PER_SM rows per SM on. A third program hides more of each program's latency and pays
    off once every SM has a row's worth of steps; at batch 1 the extra splits' shorter runs and partials cost more
    than it hides (docs/decode.md, "InnerQ's codes through shared memory")."""
    return BUSY_PROGRAMS_PER_SM if rows >= BUSY_ROWS_PER_SM * sms else PROGRAMS_PER_SM


def register_cap(programs: int) -> int | None:
    """The register cap (ptxas maxnreg, a multiple of 8) that fits `programs` programs of N_WARPS warps in an SM's
    registers; None (no cap) for PROGRAMS_PER_SM."""
    if programs <= PROGRAMS_PER_SM:
        return None
    return REGISTERS_PER_SM // (programs * 32 * N_WARPS) // 8 * 8


def split_partials(q: Tensor, q_scale: Tensor | None, buffers: list[tuple[Tensor, int]], s_kmg: int, m: Tensor,
                   l: Tensor, acc: Tensor, lengths: Tensor | None, n_tokens: int, per_split: int, splits: int,
                   n_cols: int, mask_upto: int, has_sym: bool, qk_scale: float, programs: int) -> None:
    """Write the (m, l, acc) partials of innerq_decode_attention's first `splits` of n_cols columns for q (B, Hq, d)
    contiguous, compiled for `programs` programs an SM (programs_per_sm);
    buffers: its (tensor, head stride) pairs of the key codes, scales, slots and mask, then the values'."""
    B, Hq, d = q.shape
    H = buffers[0][0].shape[1]
    lk, lv, lkg, lvg = _operand_layouts(d)
    _split_kernel[(B * H, splits)](
        q, q if q_scale is None else q_scale, *(t for t, _ in buffers), m, l, acc, m if lengths is None else lengths,
        n_tokens, per_split, n_cols, mask_upto, qk_scale, buffers[0][1], buffers[1][1], buffers[2][1], buffers[3][1],
        s_kmg, *(s for _, s in buffers[4:]), D=d, REP=Hq // H, ROWS=rows_for(Hq // H), HAS_SYM=has_sym,
        DYN=lengths is not None, HAS_QS=q_scale is not None, LK=lk, LV=lv, LKG=lkg, LVG=lvg, num_warps=N_WARPS,
        **({} if register_cap(programs) is None else {"maxnreg": register_cap(programs)}))
