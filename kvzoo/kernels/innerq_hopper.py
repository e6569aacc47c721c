"""innerq_attention's split kernel on Hopper (sm_90), in Gluon: 2-bit InnerQ codes (keys in per-token groups of 32
channels, values in per-channel groups of 32 tokens, asymmetric or hybrid sym/asym groups), head_dim 64 or 128, an
fp16/bf16 model. The windows stay with innerq_attention's window kernel (launched before this one) and its
combine kernel, which merges this kernel's (m, l, acc) partials as it merges the Triton split kernel's.

    grid (B*H, splits): program (kv head, split) attends its rep query rows (ROWS = 8 or 16, padding past rep)
    over the value groups [split * PER_SPLIT, ...) of the live quantized tokens, 128 tokens a step.

It is outer_hopper's kernel (unpack PTX, logical order within a word, swizzled tiles, wgmma from shared memory,
asynchronous output product) with InnerQ's groups, which make every code word one group's:
  - a key word holds 16 channels of one token's group, a value word 16 tokens of one channel's group (the values
    are packed along the tokens, kvquant.pack_tokens), so each word takes one scale, one zero and one register of
    signs, both streams alike (_keys, _value_groups). The value words are unpacked as Vᵀ (d, 128), a row per
    channel, and stored as the output product's A operand; its tokens come out in the unpack's logical order
    (token 16 c + a + 8 b at 16 c + 2 a + b, outer_hopper._real), so the key rows are loaded in that order too;
  - a slot is the fp32 zero point of an asymmetric group or the 32 sign bits of a symmetric one, whose zero is 0
    (keys' bit i: channel i of the group; values' bit i: token i);
  - the unpack PTX (quant_matvec.dequant_pair_asm) reads a code c as 4 + c and applies the scale and an offset,
    zero - 4 * scale rounded to fp16 once a word (_offset), in one fp16 FMA; a code's sign is XOR-ed into the
    result; a word's signs are one byte permute of its group's slot;
  - which groups are symmetric is read from the cache's packed mask bits: keys' bit n % 32 of word [g, n // 32],
    values' bit c % 32 of word [n // 32, c // 32]; tokens from MASK_UPTO on carry no bit and are symmetric.
Numerics are the Triton kernel's fast path but for that offset: one fp16 FMA a code (where the Triton kernel
rounds the zero to fp16, this kernel rounds zero - 4 * scale, within an fp16 ulp of it on asymmetric groups and
the same on symmetric ones), fp16 tiles, fp32 products and softmax, the query times the key normalization in the model dtype, then fp16.

Speed: docs/decode.md, "InnerQ's split kernel in Gluon".
KVZOO_INNERQ_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel.
"""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kvzoo.kernels.outer_hopper import (BLOCK, N_ROWS, N_WARPS, TOKENS, _is_hopper, _layouts, _query, _real,
                                        _softmax_and_output, _start, _store_partials, _unpack, mma_layout, rows_for)
from kvzoo.kernels.quant_matvec import DEQUANT_MAGIC, kernel_choice, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_INNERQ_KERNEL")
ENABLED = CHOICE != "triton"
GROUPS_PER_STEP = BLOCK // 32    # value groups of 32 tokens a step
PROGRAMS_PER_SM = 2              # split-K sizing below BUSY_ROWS_PER_SM, as the outer kernel's
BUSY_PROGRAMS_PER_SM = 3         # from BUSY_ROWS_PER_SM: three programs an SM, under a register cap
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
def _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, t, last, MASK_UPTO, s_kmg, n, w, D: gl.constexpr,
          HAS_SYM: gl.constexpr):
    """Step t's key code words (BLOCK, W), row n token _real(n) of the step (the order the value tile's tokens come
    out in), and each word's scale, fp16 offset (_offset) and signs (0 in an asymmetric group). Tokens past `last` (the last
    live one) read `last`."""
    W: gl.constexpr = D // 16
    NG: gl.constexpr = D // 32
    tw = gl.minimum(t * 32 + _real(n), last)[:, None]                                # (BLOCK, 1)
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
def _value_words(vc_ptr, t, last, c, k, D: gl.constexpr):
    """Step t's value code words (D, BLOCK/16): row c channel _real(c) (the query's channel order), column k the
    step's chunk k (kvquant.pack_tokens: chunk j's word of channel ch at j * D + ch)."""
    return gl.load(vc_ptr + _chunks(t, last, k) * D + _real(c)[:, None])


@gluon.jit
def _value_groups(vs_ptr, vz_ptr, vm_ptr, t, last, MASK_UPTO, c, k, D: gl.constexpr, HAS_SYM: gl.constexpr):
    """Each of step t's value words' (_value_words) scale, fp16 offset and signs, as _keys."""
    ch = _real(c)[:, None]                                                           # (D, 1)
    chunk = _chunks(t, last, k)
    g = chunk // 2
    slot = gl.load(vz_ptr + g * D + ch)
    scale = gl.load(vs_ptr + g * D + ch)
    if HAS_SYM:
        word = gl.load(vm_ptr + gl.minimum(g, gl.maximum(MASK_UPTO - 1, 0) // 32) * (D // 32) + ch // 32)
        sym = (((word >> (ch % 32)) & 1) != 0) | (g * 32 >= MASK_UPTO)
        signs = _signs(slot, sym, chunk % 2)
    else:
        sym = False
        signs = slot                                   # not read without symmetric groups
    return scale, _offset(slot, sym, scale), signs


@gluon.jit
def _split_kernel(q_ptr, qs_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, m_ptr, l_ptr,
                  acc_ptr, len_ptr, N_TOKENS, PER_SPLIT, N_COLS, MASK_UPTO, qk_scale,
                  s_kc, s_ks, s_kz, s_km, s_kmg, s_vc, s_vs, s_vz, s_vm,
                  D: gl.constexpr, REP: gl.constexpr, ROWS: gl.constexpr, HAS_SYM: gl.constexpr, DYN: gl.constexpr,
                  HAS_QS: gl.constexpr, LP: gl.constexpr, LV: gl.constexpr):
    GS: gl.constexpr = BLOCK // 32
    MMA: gl.constexpr = mma_layout(ROWS)
    W: gl.constexpr = D // 16
    LW: gl.constexpr = gl.SliceLayout(2, LP)                        # key words (BLOCK, W)
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

    q_s, k_s, vt_s, p_s, m, l, acc = _start(_query(q_ptr, qs_ptr, kv, REP, ROWS, D, HAS_QS), True)

    if DYN:
        live = gl.load(len_ptr)
    else:
        live = N_TOKENS
    start = split * PER_SPLIT
    stop = gl.minimum(start + PER_SPLIT, live // 32)
    last = gl.maximum(stop * 32 - 1, 0)
    n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LW))
    w = gl.arange(0, W, layout=gl.SliceLayout(0, LW))
    c = gl.arange(0, D, layout=gl.SliceLayout(1, LVW))
    k = gl.arange(0, BLOCK // 16, layout=gl.SliceLayout(0, LVW))
    # a step's tokens are live or not by whole groups, so the score rows need not be put in token order for the mask
    ns = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA))
    kw, ks, kz, k_signs = _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, start, last, MASK_UPTO, s_kmg, n, w, D, HAS_SYM)
    vw = _value_words(vc_ptr, start, last, c, k, D)
    for t in range(start, stop, GS):
        # this step's value scales, first needed after the key product; the next step's codes and key scales
        vs, vz, v_signs = _value_groups(vs_ptr, vz_ptr, vm_ptr, t, last, MASK_UPTO, c, k, D, HAS_SYM)
        nk = _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, t + GS, last, MASK_UPTO, s_kmg, n, w, D, HAS_SYM)
        nvw = _value_words(vc_ptr, t + GS, last, c, k, D)
        if HAS_SYM:
            k_s.store(_unpack(kw, LP, k_signs, ks, kz))
        else:
            k_s.store(_unpack(kw, LP, None, ks, kz))
        fence_async_shared()
        s = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA))
        acc_v = warpgroup_mma_wait(0, deps=[acc])                 # the previous output product: vt_s, p_s free
        if HAS_SYM:                                               # stored while the softmax runs
            vt_s.store(_unpack(vw, LV, v_signs, vs, vz))
        else:
            vt_s.store(_unpack(vw, LV, None, vs, vz))
        m, l, acc = _softmax_and_output(s, t * 32 + ns <= last, m, l, acc_v, vt_s, p_s, qk_scale)
        kw, ks, kz, k_signs = nk
        vw = nvw
    acc = warpgroup_mma_wait(0, deps=[acc])
    _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, kv, split, N_COLS, REP, D)


@functools.cache
def _value_layout(d: int) -> gl.DistributedLinearLayout:
    """The value words' (d, 8, 2) layout (channel, 16-token chunk, the pair axis _unpack enters each word on), the
    key words' (_layouts) over channels: lanes 8 consecutive channels x 4 chunks (every other one), registers the
    pair axis, chunk + 1 (the same group's: one scale and slot for both) and channel + 8 (and + 16 at d = 128),
    warps the rest of the channels."""
    regs = [[0, 0, 1], [0, 1, 0], [8, 0, 0]] + ([[16, 0, 0]] if d == 128 else [])
    return gl.DistributedLinearLayout(regs, [[1, 0, 0], [2, 0, 0], [4, 0, 0], [0, 2, 0], [0, 4, 0]],
                                      [[d // 4, 0, 0], [d // 2, 0, 0]], [], [d, TOKENS // 16, 2])


def eligible(q: Tensor, bits: int, rep: int) -> bool:
    """Whether innerq_decode_attention's split kernel is this one (where its splits come in whole steps of
    GROUPS_PER_STEP): enabled, an sm_90 GPU with the inline-PTX path (fp16/bf16, compiled), 2-bit codes, head_dim
    64 or 128 and at most 16 query rows a KV head."""
    return (ENABLED and unpacks_in_ptx(q) and _is_hopper(q.device.index or 0) and bits == 2
            and q.shape[-1] in (64, 128) and rep <= N_ROWS)


def programs_per_sm(rows: int, sms: int) -> int:
    """Programs of this kernel an SM runs at once for B*H = rows KV rows: 2 (ptxas's own registers, 243-255 at
    head_dim 128) while the rows are fewer than BUSY_ROWS_PER_SM per SM, else 3 under register_cap. A third program
    hides more of each program's load and shared-memory latency, and pays off once every SM has a row's worth of
    steps; at batch 1 the extra splits' shorter runs, partials and capped registers cost more than it hides
    (docs/decode.md, "Three programs an SM at large batches")."""
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
    lp, _ = _layouts(d)
    _split_kernel[(B * H, splits)](
        q, q if q_scale is None else q_scale, *(t for t, _ in buffers), m, l, acc, m if lengths is None else lengths,
        n_tokens, per_split, n_cols, mask_upto, qk_scale, buffers[0][1], buffers[1][1], buffers[2][1], buffers[3][1],
        s_kmg, *(s for _, s in buffers[4:]), D=d, REP=Hq // H, ROWS=rows_for(Hq // H), HAS_SYM=has_sym,
        DYN=lengths is not None, HAS_QS=q_scale is not None, LP=lp, LV=_value_layout(d), num_warps=N_WARPS,
        **({} if register_cap(programs) is None else {"maxnreg": register_cap(programs)}))
