"""innerq_attention's split kernel on Hopper (sm_90), in Gluon: 2-bit InnerQ codes (keys in per-token groups of 32
channels, values in per-channel groups of 32 tokens, asymmetric or hybrid sym/asym groups), head_dim 64 or 128, an
fp16/bf16 model. The windows stay with innerq_attention's window kernel (launched before this one) and its
combine kernel, which merges this kernel's (m, l, acc) partials as it merges the Triton split kernel's.

    grid (B*H, splits): program (kv head, split) attends its rep query rows (ROWS = 8 or 16, padding past rep)
    over the value groups [split * PER_SPLIT, ...) of the live quantized tokens, 128 tokens a step.

Both products run on the tensor cores with the dequantized tile as the wgmma's A operand in registers, so no
code, key or value passes through shared memory (only the query, stored once, and each step's weights p):
    s    (128 tokens, ROWS) = K (128, d) · qᵀ         A: the keys, a row per token
    accᵀ (d, ROWS)       += Vᵀ (d, 128) · pᵀ         A: the values, a row per channel
The words are loaded in the layout the unpack PTX turns into A's registers (_operand_layouts, _operand): a thread
holds one group per row (its lane's two adjacent code words, one 8-byte load; four lanes read a token's 32 bytes),
so each word takes one scale, one offset and one register of signs. A's columns are logical: column i of the key
operand is channel _place(i, d/16) (the query is loaded in that order), column i of the value operand token
_place(i, 8) of the step, so the key rows are loaded in that token order and the weights p need no reordering;
the output rows are the real channels. InnerQ's groups make every code word one group's:
  - a key word holds 16 channels of one token's group, a value word 16 tokens of one channel's group (the values
    are packed along the tokens, kvquant.pack_tokens);
  - a slot is the fp32 zero point of an asymmetric group or the 32 sign bits of a symmetric one, whose zero is 0
    (keys' bit i: channel i of the group; values' bit i: token i);
  - the unpack PTX (quant_matvec.dequant_pair_asm) reads a code c as 4 + c and applies the scale and an offset,
    zero - 4 * scale rounded to fp16 once a word (_offset), in one fp16 FMA; a code's sign is XOR-ed into the
    result; a word's signs are one byte permute of its group's slot;
  - which groups are symmetric is read from the cache's packed mask bits: keys' bit n % 32 of word [g, n // 32],
    values' bit c % 32 of word [n // 32, c // 32]; tokens from MASK_UPTO on carry no bit and are symmetric.
Numerics are the Triton kernel's fast path but for that offset: one fp16 FMA a code (where the Triton kernel
rounds the zero to fp16, this kernel rounds zero - 4 * scale, within an fp16 ulp of it on asymmetric groups and
the same on symmetric ones), fp16 operands, fp32 products and softmax, the query times the key normalization in
the model dtype, then fp16.

Speed: docs/decode.md, "InnerQ's split kernel in Gluon" and "InnerQ's operands in registers".
KVZOO_INNERQ_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel.
"""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from kvzoo.kernels.outer_hopper import (BLOCK, LQ, N_ROWS, N_WARPS, TILE, TOKENS, _is_hopper, _query, _store_partials,
                                        _unpack_pairs, mma_layout, rows_for)
from kvzoo.kernels.quant_matvec import DEQUANT_MAGIC, kernel_choice, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_INNERQ_KERNEL")
ENABLED = CHOICE != "triton"
GROUPS_PER_STEP = BLOCK // 32    # value groups of 32 tokens a step
PROGRAMS_PER_SM = 2              # split-K sizing below BUSY_ROWS_PER_SM, as the outer kernel's
BUSY_PROGRAMS_PER_SM = 3         # from BUSY_ROWS_PER_SM, asymmetric groups: three programs an SM, capped
BUSY_ROWS_PER_SM = 1             # KV rows (B*H) per SM from which an SM takes BUSY_PROGRAMS_PER_SM
REGISTERS_PER_SM = 65536
MAGIC = gl.constexpr(DEQUANT_MAGIC)


@gluon.jit
def _offset(slot, sym, scale):
    """A group's fp16 offset for the unpack PTX: its zero (the slot's fp32 bits, 0 in a symmetric group) less
    DEQUANT_MAGIC times its fp16 scale, rounded once."""
    return (gl.where(sym, 0.0, slot.to(gl.float32, bitcast=True)) - MAGIC * scale.to(gl.float32)).to(gl.float16)


@gluon.jit
def _signs(slot, sym, half):
    """A word's 16 signs as the unpack PTX takes them (bits 0-7 and 16-23), from its group's slot: bytes 0-1 for
    the group's first 16 elements (half 0), 2-3 for the other 16 (half 1); 0 in an asymmetric group."""
    signs = gl.where(sym, slot, 0)
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                     [signs, signs, gl.where(half == 0, 0x0100, 0x0302) + 0 * signs], dtype=gl.int32,
                                     is_pure=True, pack=1)


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
    """The unpack PTX's 8 outputs, each (R, W, 2) (outer_hopper._unpack_pairs), as the wgmma's A operand (R, 16 W)
    in registers, layout A: column i is place _place(i, W) of its row. The words' layout (_operand_layouts) puts
    every code where A wants it, so the conversion moves no data (assert_trivial)."""
    R: gl.constexpr = o[0].shape[0]
    W: gl.constexpr = o[0].shape[1]
    x = gl.join(gl.join(gl.join(o[0], o[4]), gl.join(o[2], o[6])), gl.join(gl.join(o[1], o[5]), gl.join(o[3], o[7])))
    if W == 8:                                                                 # (R, W, b, a2, a1, a0)
        x = gl.permute(gl.reshape(x, (R, 4, 2, 2, 2, 2, 2)), (0, 2, 4, 5, 6, 1, 3))   # (R, w0, a2, a1, a0, t, b)
    else:
        x = gl.permute(x, (0, 3, 4, 5, 1, 2))                                  # (R, a2, a1, a0, t, b)
    return gl.convert_layout(gl.reshape(x, (R, W * 16)), A, assert_trivial=True)


@gluon.jit
def _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, t, last, MASK_UPTO, s_kmg, n, w, D: gl.constexpr,
          HAS_SYM: gl.constexpr):
    """Step t's key code words (BLOCK, W), row n token _place(n, 8) of the step (the order the value operand's
    tokens take), and each word's scale, fp16 offset (_offset) and signs (0 in an asymmetric group). Tokens past
    `last` (the last live one) read `last`."""
    W: gl.constexpr = D // 16
    NG: gl.constexpr = D // 32
    tw = gl.minimum(t * 32 + _place(n, 8), last)[:, None]                          # (BLOCK, 1)
    at = tw * NG + (w // 2)[None, :]                                                 # word w's group
    slot = gl.load(kz_ptr + at)
    kw = gl.load(kc_ptr + tw * W + w[None, :])
    scale = gl.load(ks_ptr + at)
    if HAS_SYM:
        upto = gl.maximum(MASK_UPTO - 1, 0)
        sym = (((gl.load(km_ptr + (w // 2)[None, :] * s_kmg + gl.minimum(tw, upto) // 32) >> (tw % 32)) & 1) != 0) \
            | (tw >= MASK_UPTO)
        signs = _signs(slot, sym, (w % 2)[None, :])
    else:
        sym = False
        signs = kw                                     # not read without symmetric groups
    return kw, scale, _offset(slot, sym, scale), signs


@gluon.jit
def _chunks(t, last, k):
    """Step t's 16-token chunks k (1, BLOCK/16), two a value group; chunks past the one of `last` (the last live
    token) read that one."""
    return gl.minimum(t * 2 + k, last // 16)[None, :]


@gluon.jit
def _values(vc_ptr, vs_ptr, vz_ptr, vm_ptr, t, last, MASK_UPTO, c, k, D: gl.constexpr, HAS_SYM: gl.constexpr):
    """Step t's value code words (D, BLOCK/16), row c channel c, column k the step's chunk k (kvquant.pack_tokens:
    chunk j's word of channel ch at j * D + ch), and each word's scale, fp16 offset and signs, as _keys."""
    ch = c[:, None]                                                                  # (D, 1)
    chunk = _chunks(t, last, k)
    g = chunk // 2
    vw = gl.load(vc_ptr + chunk * D + ch)
    slot = gl.load(vz_ptr + g * D + ch)
    scale = gl.load(vs_ptr + g * D + ch)
    if HAS_SYM:
        word = gl.load(vm_ptr + gl.minimum(g, gl.maximum(MASK_UPTO - 1, 0) // 32) * (D // 32) + ch // 32)
        sym = (((word >> (ch % 32)) & 1) != 0) | (g * 32 >= MASK_UPTO)
        signs = _signs(slot, sym, chunk % 2)
    else:
        sym = False
        signs = slot                                   # not read without symmetric groups
    return vw, scale, _offset(slot, sym, scale), signs


@gluon.jit
def _split_kernel(q_ptr, qs_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, m_ptr, l_ptr,
                  acc_ptr, len_ptr, N_TOKENS, PER_SPLIT, N_COLS, MASK_UPTO, qk_scale,
                  s_kc, s_ks, s_kz, s_km, s_kmg, s_vc, s_vs, s_vz, s_vm,
                  D: gl.constexpr, REP: gl.constexpr, ROWS: gl.constexpr, HAS_SYM: gl.constexpr, DYN: gl.constexpr,
                  HAS_QS: gl.constexpr, LK: gl.constexpr, LV: gl.constexpr, VALUES_AHEAD: gl.constexpr):
    GS: gl.constexpr = BLOCK // 32
    MMA: gl.constexpr = mma_layout(ROWS)
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    W: gl.constexpr = D // 16
    LKW: gl.constexpr = gl.SliceLayout(2, LK)                       # key words (BLOCK, W)
    LVW: gl.constexpr = gl.SliceLayout(2, LV)                       # value words (D, BLOCK/16)

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
    m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc = gl.zeros([D, ROWS], gl.float32, layout=MMA)                # accᵀ, rows the real channels

    if DYN:
        live = gl.load(len_ptr)
    else:
        live = N_TOKENS
    start = split * PER_SPLIT
    stop = gl.minimum(start + PER_SPLIT, live // 32)
    last = gl.maximum(stop * 32 - 1, 0)
    n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LKW))
    w = gl.arange(0, W, layout=gl.SliceLayout(0, LKW))
    c = gl.arange(0, D, layout=gl.SliceLayout(1, LVW))
    k = gl.arange(0, BLOCK // 16, layout=gl.SliceLayout(0, LVW))
    ns = _place(gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA)), 8)              # each score row's token
    kw, ks, kz, k_signs = _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, start, last, MASK_UPTO, s_kmg, n, w, D, HAS_SYM)
    vw, vs, vz, v_signs = _values(vc_ptr, vs_ptr, vz_ptr, vm_ptr, start, last, MASK_UPTO, c, k, D, HAS_SYM)
    for t in range(start, stop, GS):
        if not VALUES_AHEAD:
            vw, vs, vz, v_signs = _values(vc_ptr, vs_ptr, vz_ptr, vm_ptr, t, last, MASK_UPTO, c, k, D, HAS_SYM)
        nk = _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, t + GS, last, MASK_UPTO, s_kmg, n, w, D, HAS_SYM)
        if VALUES_AHEAD:
            nv = _values(vc_ptr, vs_ptr, vz_ptr, vm_ptr, t + GS, last, MASK_UPTO, c, k, D, HAS_SYM)
        if HAS_SYM:
            ka = _operand(_unpack_pairs(kw, LK, k_signs, ks, kz), A)
        else:
            ka = _operand(_unpack_pairs(kw, LK, None, ks, kz), A)
        s = warpgroup_mma(ka, q_s.permute((1, 0)), gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA))
        if HAS_SYM:
            va = _operand(_unpack_pairs(vw, LV, v_signs, vs, vz), A)
        else:
            va = _operand(_unpack_pairs(vw, LV, None, vs, vz), A)
        s = s * qk_scale + gl.where(t * 32 + ns <= last, 0.0, float("-inf"))[:, None]  # one FMA; masked: -inf
        m_new = gl.maximum(m, gl.max(s, axis=0))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[None, :])
        l = l * alpha + gl.sum(p, axis=0)
        m = m_new
        p_s.store(gl.permute(p.to(gl.float16), (1, 0)))
        fence_async_shared()
        if gl.min(alpha, axis=0) < 1.0:                           # a row's max grew: rescale (rare after the start)
            acc = acc * alpha[None, :]
        acc = warpgroup_mma(va, p_s.permute((1, 0)), acc)
        kw, ks, kz, k_signs = nk
        if VALUES_AHEAD:
            vw, vs, vz, v_signs = nv
    _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, kv, split, N_COLS, REP, True)


@functools.cache
def _operand_layouts(d: int) -> tuple[gl.DistributedLinearLayout, gl.DistributedLinearLayout]:
    """(LK, LV): the key words' (BLOCK, d/16, 2) and value words' (d, BLOCK/16, 2) layouts (row, word, the pair
    axis _unpack_pairs enters each word on) that unpack into the wgmma's A operand (_operand). A thread holds one
    group a row: its lane's word pair 2 t, 2 t + 1 (t = lane % 4; d = 64 keys: word t); registers the pair axis,
    the pair's second word, row + 8 and row + 64 (128 rows); lanes t, then rows + 1, 2, 4; warps rows + 16, 32.
    A key row is a token, a value row a channel."""
    def layout(rows, words):
        pair = [[0, 1, 0]] if words == 8 else []
        lanes = [[0, 2, 0], [0, 4, 0]] if words == 8 else [[0, 1, 0], [0, 2, 0]]
        return gl.DistributedLinearLayout([[0, 0, 1], [8, 0, 0]] + pair + ([[64, 0, 0]] if rows == 128 else []),
                                          lanes + [[1, 0, 0], [2, 0, 0], [4, 0, 0]], [[16, 0, 0], [32, 0, 0]], [],
                                          [rows, words, 2])
    return layout(TOKENS, d // 16), layout(d, TOKENS // 16)


def eligible(q: Tensor, bits: int, rep: int) -> bool:
    """Whether innerq_decode_attention's split kernel is this one (where its splits come in whole steps of
    GROUPS_PER_STEP): enabled, an sm_90 GPU with the inline-PTX path (fp16/bf16, compiled), 2-bit codes, head_dim
    64 or 128 and at most 16 query rows a KV head."""
    return (ENABLED and unpacks_in_ptx(q) and _is_hopper(q.device.index or 0) and bits == 2
            and q.shape[-1] in (64, 128) and rep <= N_ROWS)


def programs_per_sm(rows: int, sms: int, has_sym: bool) -> int:
    """Programs of this kernel an SM runs at once for B*H = rows KV rows: 2 (ptxas's own registers, up to 255 with
    the values loaded a step ahead), or with asymmetric groups only (not has_sym) 3 under register_cap from
    BUSY_ROWS_PER_SM rows per SM on. A third program hides more of each program's load latency and pays off once
    every SM has a row's worth of steps; at batch 1 the extra splits' shorter runs, partials and capped registers
    cost more than it hides. The hybrid loop spills under the cap and runs faster at two programs (docs/decode.md,
    "InnerQ's operands in registers" and "Register spills")."""
    return BUSY_PROGRAMS_PER_SM if not has_sym and rows >= BUSY_ROWS_PER_SM * sms else PROGRAMS_PER_SM


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
    lk, lv = _operand_layouts(d)
    _split_kernel[(B * H, splits)](
        q, q if q_scale is None else q_scale, *(t for t, _ in buffers), m, l, acc, m if lengths is None else lengths,
        n_tokens, per_split, n_cols, mask_upto, qk_scale, buffers[0][1], buffers[1][1], buffers[2][1], buffers[3][1],
        s_kmg, *(s for _, s in buffers[4:]), D=d, REP=Hq // H, ROWS=rows_for(Hq // H), HAS_SYM=has_sym,
        DYN=lengths is not None, HAS_QS=q_scale is not None, LK=lk, LV=lv, VALUES_AHEAD=register_cap(programs) is None,
        num_warps=N_WARPS,
        **({} if register_cap(programs) is None else {"maxnreg": register_cap(programs)}))
