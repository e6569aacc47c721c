"""innerq_attention's split kernel on Hopper (sm_90), in Gluon: 2-bit InnerQ codes (keys in per-token groups of 32
channels, values in per-channel groups of 32 tokens, asymmetric or hybrid sym/asym groups), head_dim 64 or 128, an
fp16/bf16 model. The windows stay with innerq_attention's combine kernel, which merges this kernel's (m, l, acc)
partials as it merges the Triton split kernel's.

    grid (B*H, splits): program (kv head, split) attends its rep query rows (ROWS = 8 or 16, padding past rep)
    over the value groups [split * PER_SPLIT, ...) of the live quantized tokens, 128 tokens a step.

It is outer_hopper's kernel with the two streams' scales exchanged: InnerQ's keys are grouped as KIVI's values
(one scale and slot per token and 32 channels) and its values as KIVI's keys (one per channel and 32 tokens), so
the tiles are unpacked, stored and multiplied as there (same word layout, logical channel order, swizzled tiles,
wgmma from shared memory, asynchronous output product). What differs:
  - a slot is the fp32 zero point of an asymmetric group (rounded to fp16 for the one-FMA dequantization, as the
    Triton kernel does) or the 32 sign bits of a symmetric one, whose zero is 0 (keys' bit i: channel i of the
    group; values' bit i: token i);
  - a code's sign goes into the magic numbers it is unpacked with (quant_matvec.dequant_pair_asm), so a word's PTX
    takes one register of its 16 codes' signs: for a key word one byte permute of its group's slot, for a value
    word bits gathered from 16 channels' slots, four tokens at a time, then masked by the word's symmetric-group
    bits, which also clear those groups' zeros a pair of channels at a time (_values, _sym_zeros);
  - scale and zero are applied in the same PTX (quant_matvec.dequant_pair_asm; the values with each output's own
    scale pair), which keeps ptxas from re-pairing halves around separate FMAs;
  - which groups are symmetric is read from the cache's packed mask bits: keys' bit n % 32 of word [g, n // 32],
    values' bit c % 32 of word [n // 32, c // 32]; tokens from MASK_UPTO on carry no bit and are symmetric.
Numerics are the Triton kernel's fast path: exact fp16 codes, one fp16 FMA with the zero rounded to fp16, fp16
tiles, fp32 products and softmax, the query times the key normalization in the model dtype, then fp16.

Speed (Llama-3.1-8B heads, rep 4, one H100, L2 flushed, the whole operation with the combine kernel; docs/decode.md,
"InnerQ's split kernel in Gluon" and "Eight query rows a program"): hybrid groups at 128K, batch 1 122 us against the
Triton kernel's 185, at 32K, batch 32 832 against 1,331 (the same run); asymmetric 99 and 656 (Triton, another run:
143 and 961).
KVZOO_INNERQ_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel.
"""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from kvzoo.kernels.outer_hopper import (BLOCK, N_ROWS, N_WARPS, _is_hopper, _layouts, _logical_tile, _query,
                                        _softmax_and_output, _start, _store_partials, _unpack, mma_layout, rows_for)
from kvzoo.kernels.quant_matvec import dequant_pair_asm, kernel_choice, sym_zero_asm, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_INNERQ_KERNEL")
ENABLED = CHOICE != "triton"
SLOT_ASM, SLOT_CON = (gl.constexpr(part) for part in dequant_pair_asm(False, per_output=True))
SIGNED_SLOT_ASM, SIGNED_SLOT_CON = (gl.constexpr(part) for part in dequant_pair_asm(True, per_output=True))
ZERO_ASM, ZERO_CON = (gl.constexpr(part) for part in sym_zero_asm())
GROUPS_PER_STEP = BLOCK // 32    # value groups of 32 tokens a step
PROGRAMS_PER_SM = 2              # split-K sizing, as the outer kernel's


@gluon.jit
def _fp16_zero(slot, sym):
    """The fp16 zero point of a group: its slot's fp32 bits rounded, or 0 for a symmetric group."""
    return gl.where(sym, 0.0, slot.to(gl.float32, bitcast=True)).to(gl.float16)


@gluon.jit
def _prmt(a, b, select):
    """PTX prmt: bytes of a (0-3) and b (4-7) picked by the nibbles of select."""
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, select], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, t, last, MASK_UPTO, s_kmg, n, w, D: gl.constexpr,
          HAS_SYM: gl.constexpr):
    """Step t's code words of both streams, and each key word's scale, fp16 zero and signs as _unpack takes them
    (bits 0-7 and 16-23 its codes'; 0 in an asymmetric group), all (BLOCK, W) in the words' layout. Tokens past
    `last` (the last live one) read `last`."""
    W: gl.constexpr = D // 16
    NG: gl.constexpr = D // 32
    tw = gl.minimum(t * 32 + n, last)[:, None]                                       # (BLOCK, 1)
    rows = tw * W + w[None, :]
    at = tw * NG + (w // 2)[None, :]                                                 # word w's group
    slot = gl.load(kz_ptr + at)
    kw = gl.load(kc_ptr + rows)
    vw = gl.load(vc_ptr + rows)
    scale = gl.load(ks_ptr + at)
    if HAS_SYM:
        upto = gl.maximum(MASK_UPTO - 1, 0)
        sym = (((gl.load(km_ptr + (w // 2)[None, :] * s_kmg + gl.minimum(tw, upto) // 32) >> (tw % 32)) & 1) != 0) \
            | (tw >= MASK_UPTO)
        # the group's sign bits of word w's channels (its bytes 0-1 for even w, 2-3 for odd) at bytes 0 and 2
        signs = gl.where(sym, slot, 0)
        signs = _prmt(signs, signs, gl.where(w % 2 == 0, 0x0100, 0x0302)[None, :] + 0 * signs)
    else:
        sym = False
        signs = kw                                     # not read without symmetric groups
    return kw, vw, scale, _fp16_zero(slot, sym), signs


@gluon.jit
def _values(vs_ptr, vz_ptr, vm_ptr, t, last, MASK_UPTO, D: gl.constexpr, HAS_SYM: gl.constexpr,
            LA: gl.constexpr, LT: gl.constexpr, L4: gl.constexpr, LP: gl.constexpr):
    """Step t's value scales and fp16 zeros for each output of the unpack PTX (_per_output), and each value word's
    signs as the PTX takes them (BLOCK, W) in the words' layout (bit a: channel 16 w + a's sign at the word's
    token, bit 16 + a channel 16 w + 8 + a's; 0 in an asymmetric group). Loaded as (GS, 1, W, 8) tiles of a word's
    low channels 16 w + j and high ones 16 w + 8 + j."""
    GS: gl.constexpr = BLOCK // 32
    W: gl.constexpr = D // 16
    P3: gl.constexpr = gl.SliceLayout(3, LA)
    g = gl.minimum(t + gl.arange(0, GS, layout=gl.SliceLayout(1, gl.SliceLayout(2, P3))), last // 32)
    w = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, P3)))
    j = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LA))))
    g = g[:, None, None, None]                                                       # (GS, 1, 1, 1)
    ch = 16 * w[None, None, :, None] + j[None, None, None, :]                        # (1, 1, W, 8) low channels
    slot_lo = gl.load(vz_ptr + g * D + ch)
    slot_hi = gl.load(vz_ptr + g * D + ch + 8)
    scale = gl.join(gl.load(vs_ptr + g * D + ch), gl.load(vs_ptr + g * D + ch + 8))
    # every slot read as an fp32 zero; a symmetric group's (its sign bits) is cleared below (_sym_zeros)
    zero = _per_output(gl.join(_fp16_zero(slot_lo, False), _fp16_zero(slot_hi, False)), L4, LP)
    if HAS_SYM:
        # the word's channels in symmetric groups as bits a and 16 + a (channels 16 w + a and 16 w + 8 + a: the
        # group's mask bits, bytes 0-1 of the mask word for even w, 2-3 for odd); every channel past MASK_UPTO
        w4 = w[None, None, :, None]
        word = gl.load(vm_ptr + gl.minimum(g, gl.maximum(MASK_UPTO - 1, 0) // 32) * (D // 32) + w4 // 2)
        sym = _prmt(word, word, gl.where(w4 % 2 == 0, 0x0100, 0x0302) + 0 * word) \
            | gl.where(g * 32 >= MASK_UPTO, -1, 0)                                   # (GS, 1, W, 1)
        sym = gl.reshape(sym, (GS, W))
        # a thread's tokens are 8 k + l of its warp's group, k < 4, l its lane's: bit 8 k of (sign word >> l) is
        # token 8 k + l's. Channel j of the word's low half goes to bit 8 k + j of lo, of its high half to hi's.
        l = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, P3)))[None, :, None, None]
        lo = gl.sum(((slot_lo >> l) & 0x01010101) << j[None, None, None, :], axis=3)   # (GS, 8, W)
        hi = gl.sum(((slot_hi >> l) & 0x01010101) << j[None, None, None, :], axis=3)
        lo = gl.expand_dims(gl.convert_layout(lo, gl.SliceLayout(1, LT)), 1)        # (GS, 1, 8, W)
        hi = gl.expand_dims(gl.convert_layout(hi, gl.SliceLayout(1, LT)), 1)
        k = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LT))))
        select = (k + 256 * (4 + k))[None, :, None, None] + 0 * lo                   # (GS, 4, 8, W): bytes k, 4 + k
        sym_t = gl.convert_layout(sym, gl.SliceLayout(1, gl.SliceLayout(2, LT)))[:, None, None, :]
        signs = _prmt(lo, hi, select) & sym_t                                         # an asymmetric group's: 0
        signs = gl.convert_layout(gl.reshape(signs, (BLOCK, W)), gl.SliceLayout(2, LP))
        zero = _sym_zeros(zero, _spread(gl.join(sym, sym), L4, LP))
    else:
        signs = gl.zeros([BLOCK, W], gl.int32, gl.SliceLayout(2, LP))
    return _per_output(scale, L4, LP), zero, signs


@gluon.jit
def _sym_zeros(zero, sym):
    """_per_output's zeros with those of symmetric groups 0: sym (BLOCK, W, 2), each word's bits a and 16 + a the
    groups of output a's two channels (quant_matvec.sym_zero_asm)."""
    o = gl.inline_asm_elementwise(ZERO_ASM, ZERO_CON, [zero[0], zero[1], zero[2], zero[3], zero[4], zero[5], zero[6],
                                                       zero[7], sym], dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    return o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]


@gluon.jit
def _spread(x, L4: gl.constexpr, LP: gl.constexpr):
    """(GS, W, 2) per value group -> (BLOCK, W, 2) in the words' pair layout LP, each group's for its 32 tokens."""
    GS: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1]
    x = gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(1, L4)), 1) + gl.zeros([GS, 32, W, 2], x.dtype, L4)
    return gl.convert_layout(gl.reshape(x, (GS * 32, W, 2)), LP)


@gluon.jit
def _per_output(x, L4: gl.constexpr, LP: gl.constexpr):
    """(GS, 1, W, 8, 2) per-channel values, [.., a, b] channel 16 w + a + 8 b -> for each output a of the unpack PTX
    (codes a and a + 8 of a word), its (BLOCK, W, 2) in LP."""
    GS: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[2]
    # (g, w, b, a >> 2, a >> 1 & 1, a & 1)
    x = gl.permute(gl.reshape(x, (GS, W, 2, 2, 2, 2)), (0, 1, 5, 2, 3, 4))
    e, o = gl.split(x)
    e0, e1 = gl.split(e)
    o0, o1 = gl.split(o)
    a0, a4 = gl.split(e0)
    a2, a6 = gl.split(e1)
    a1, a5 = gl.split(o0)
    a3, a7 = gl.split(o1)
    return (_spread(a0, L4, LP), _spread(a1, L4, LP), _spread(a2, L4, LP), _spread(a3, L4, LP),
            _spread(a4, L4, LP), _spread(a5, L4, LP), _spread(a6, L4, LP), _spread(a7, L4, LP))


@gluon.jit
def _dequant_values(words, signs, scale, zero, LP: gl.constexpr, HAS_SYM: gl.constexpr):
    """(R, W) value code words -> (R, 16 W) fp16 values in logical channel order: outer_hopper._unpack with each
    output's own scales and zeros (_per_output's), applied in the same PTX."""
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    pairs = gl.expand_dims(words, 2) + gl.zeros([R, W, 2], gl.int32, LP)
    if HAS_SYM:
        o = gl.inline_asm_elementwise(SIGNED_SLOT_ASM, SIGNED_SLOT_CON,
                                      [pairs, gl.expand_dims(signs, 2) + pairs * 0, scale[0], scale[1], scale[2],
                                       scale[3], scale[4], scale[5], scale[6], scale[7], zero[0], zero[1], zero[2],
                                       zero[3], zero[4], zero[5], zero[6], zero[7]],
                                      dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    else:
        o = gl.inline_asm_elementwise(SLOT_ASM, SLOT_CON,
                                      [pairs, scale[0], scale[1], scale[2], scale[3], scale[4], scale[5], scale[6],
                                       scale[7], zero[0], zero[1], zero[2], zero[3], zero[4], zero[5], zero[6],
                                       zero[7]], dtype=(gl.float16,) * 8, is_pure=True, pack=2)
    return _logical_tile(o)


@gluon.jit
def _split_kernel(q_ptr, qs_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, m_ptr, l_ptr,
                  acc_ptr, len_ptr, N_TOKENS, PER_SPLIT, N_COLS, MASK_UPTO, qk_scale,
                  s_kc, s_ks, s_kz, s_km, s_kmg, s_vc, s_vs, s_vz, s_vm,
                  D: gl.constexpr, REP: gl.constexpr, ROWS: gl.constexpr, HAS_SYM: gl.constexpr, DYN: gl.constexpr,
                  HAS_QS: gl.constexpr, LP: gl.constexpr, LA: gl.constexpr, LT: gl.constexpr, L4: gl.constexpr):
    GS: gl.constexpr = BLOCK // 32
    MMA: gl.constexpr = mma_layout(ROWS)
    W: gl.constexpr = D // 16
    LW: gl.constexpr = gl.SliceLayout(2, LP)                        # words (BLOCK, W)

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

    q_s, k_s, v_s, p_s, m, l, acc = _start(_query(q_ptr, qs_ptr, kv, REP, ROWS, D, HAS_QS))

    if DYN:
        live = gl.load(len_ptr)
    else:
        live = N_TOKENS
    start = split * PER_SPLIT
    stop = gl.minimum(start + PER_SPLIT, live // 32)
    last = gl.maximum(stop * 32 - 1, 0)
    n = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, LW))
    w = gl.arange(0, W, layout=gl.SliceLayout(0, LW))
    ns = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA))
    kw, vw, ks, kz, k_signs = _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, start, last, MASK_UPTO, s_kmg, n, w, D,
                                    HAS_SYM)
    for t in range(start, stop, GS):
        # this step's value scales, first needed after the key product; the next step's codes and key scales
        vs, vz, v_signs = _values(vs_ptr, vz_ptr, vm_ptr, t, last, MASK_UPTO, D, HAS_SYM, LA, LT, L4, LP)
        nxt = _keys(kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, t + GS, last, MASK_UPTO, s_kmg, n, w, D, HAS_SYM)
        if HAS_SYM:
            k_s.store(_unpack(kw, LP, k_signs, ks, kz))
        else:
            k_s.store(_unpack(kw, LP, None, ks, kz))
        fence_async_shared()
        s = warpgroup_mma(k_s, q_s.permute((1, 0)), gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA))
        acc_v = warpgroup_mma_wait(0, deps=[acc])                 # the previous output product: v_s, p_s free
        v_s.store(_dequant_values(vw, v_signs, vs, vz, LP, HAS_SYM))   # stored while the softmax runs
        m, l, acc = _softmax_and_output(s, t * 32 + ns <= last, m, l, acc_v, v_s, p_s, qk_scale)
        kw, vw, ks, kz, k_signs = nxt
    acc = warpgroup_mma_wait(0, deps=[acc])
    _store_partials(m_ptr, l_ptr, acc_ptr, m, l, acc, kv, split, N_COLS, REP, D)


@functools.cache
def _sign_layouts(d: int) -> tuple[gl.DistributedLinearLayout, ...]:
    """(LA, LT, L4) for head_dim d, threads placed as the words' layout LP places them (lanes: token l and the word's
    high bits; warps: the group; registers: the word's low bit at d = 128): LA (GS, 8 l, W, 8 j), a word's channel j
    in registers, for the value scales and signs; LT (GS, 4 k, 8 l, W), token 8 k + l, for the value signs; L4
    (GS, 32 tokens, W, 2 b), LP (BLOCK, W, 2) split by group, for each unpack output's value scales."""
    word = [[1]] if d == 128 else []
    lanes = [[2], [4]] if d == 128 else [[1], [2]]
    la = gl.DistributedLinearLayout([[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]] + [[0, 0, b[0], 0] for b in word],
                                    [[0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]] + [[0, 0, b[0], 0] for b in lanes],
                                    [[1, 0, 0, 0], [2, 0, 0, 0]], [], [BLOCK // 32, 8, d // 16, 8])
    lt = gl.DistributedLinearLayout([[0, 1, 0, 0], [0, 2, 0, 0]] + [[0, 0, 0, b[0]] for b in word],
                                    [[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]] + [[0, 0, 0, b[0]] for b in lanes],
                                    [[1, 0, 0, 0], [2, 0, 0, 0]], [], [BLOCK // 32, 4, 8, d // 16])
    l4 = gl.DistributedLinearLayout([[0, 0, 0, 1]] + [[0, 0, b[0], 0] for b in word] + [[0, 8, 0, 0], [0, 16, 0, 0]],
                                    [[0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]] + [[0, 0, b[0], 0] for b in lanes],
                                    [[1, 0, 0, 0], [2, 0, 0, 0]], [], [BLOCK // 32, 32, d // 16, 2])
    return la, lt, l4


def eligible(q: Tensor, bits: int, rep: int) -> bool:
    """Whether innerq_decode_attention's split kernel is this one (where its splits come in whole steps of
    GROUPS_PER_STEP): enabled, an sm_90 GPU with the inline-PTX path (fp16/bf16, compiled), 2-bit codes, head_dim
    64 or 128 and at most 16 query rows a KV head."""
    return (ENABLED and unpacks_in_ptx(q) and _is_hopper(q.device.index or 0) and bits == 2
            and q.shape[-1] in (64, 128) and rep <= N_ROWS)


def split_partials(q: Tensor, q_scale: Tensor | None, buffers: list[tuple[Tensor, int]], s_kmg: int, m: Tensor,
                   l: Tensor, acc: Tensor, lengths: Tensor | None, n_tokens: int, per_split: int, splits: int,
                   mask_upto: int, has_sym: bool, qk_scale: float) -> None:
    """Write the (m, l, acc) partials of innerq_decode_attention's `splits` columns for q (B, Hq, d) contiguous;
    buffers: its (tensor, head stride) pairs of the key codes, scales, slots and mask, then the values'."""
    B, Hq, d = q.shape
    H = buffers[0][0].shape[1]
    lp, _ = _layouts(d)
    la, lt, l4 = _sign_layouts(d)
    _split_kernel[(B * H, splits)](
        q, q if q_scale is None else q_scale, *(t for t, _ in buffers), m, l, acc, m if lengths is None else lengths,
        n_tokens, per_split, splits, mask_upto, qk_scale, buffers[0][1], buffers[1][1], buffers[2][1], buffers[3][1],
        s_kmg, *(s for _, s in buffers[4:]), D=d, REP=Hq // H, ROWS=rows_for(Hq // H), HAS_SYM=has_sym,
        DYN=lengths is not None, HAS_QS=q_scale is not None, LP=lp, LA=la, LT=lt, L4=l4, num_warps=N_WARPS)
