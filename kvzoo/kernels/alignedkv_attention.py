"""AlignedKV's two decode products (alignedkv.md, kvzoo/cache/alignedkv.py): each element of the fp16 cache is
read at 8, 12 or 16 of its bits, decided inside the kernel from magnitudes only, before its low bits are
loaded. One query token per sequence; Hq = G*H query heads, query head h reading KV head h // G.

    scores = q · k̃ᵀ   aligned_qk   q (B, Hq, d) fp16/bf16/fp32              -> (B, Hq, n_blocks*BT) fp32
    out    = p · ṽ    aligned_pv   p (B, Hq, S) fp32, o_est (B, Hq, d) fp32  -> (B, Hq, d) fp32
Scores are unscaled (no 1/sqrt(d); the static step's are scaled and masked); p is already softmaxed (p < 15.99).
Products run on the tensor cores with fp32 sums: exact for fp16 q, about 22 bits for bf16 / fp32 q and for p
(_split).

Layouts (the cache's buffers, per layer; B rows, H KV heads, d head_dim, BT tokens per key block, NB blocks):
    k_hi  uint8 (B, H, NB, d, BT)         bits 15..8 of every key, channel-major inside a block
    k_mid, k_lo uint8 (B, H, NB, d, BT/2)  bits 7..4 / 3..0, token 2t in the low nibble of byte t
    k_exp int8 (B, H, NB, d)              floor(log2 max|k|) per channel of a block (K_colmax)
    v_hi  uint8 (B, H, N, d)              bits 15..8 of every value, token-major
    v_mid, v_lo uint8 (B, H, N, d/2)       channel 2c in the low nibble of byte c
    v_exp int8 (B, H, N)                  floor(log2 max_c |v|) per token (the row maximum)
An element read at 16 bits is the fp16 value; at 12 bits its low nibble is 0x8, at 8 bits its low byte 0x80
(the middle of what was not read). Reading 8 / 12 / 16 bits reads 1 / 1.5 / 2 bytes of the element.

Decisions, e(x) = floor(log2 |x|) from the fp32 exponent field (0 -> -127), level(diff) = 8 bits once
diff >= DIFF_FOR_8, 12 once diff >= DIFF_FOR_12, else 16, never fewer than min_bits:
    Rule 1 (addend alignment, keys): for block n, a[g, i] = e(q[g, i]) + k_exp[n, i], A[g] = max_i a[g, i],
      bits[n, i] = level(min_g (A[g] - a[g, i])): one decision per (block, channel), shared by its BT tokens.
    Rule 2 (result alignment, values): bits[j, c] = level(min_g (e(o_est[g, c]) - e(p[g, j])) - v_exp[j]).
The minimum over the G query heads of a group gives every head at least the bits it asks for, since they all
share the KV head's bytes.

Tiling. Both kernels rebuild each element's bits from its planes in registers and hand the products to the tensor
cores: the rebuilt values are fp16 values exactly, so an fp16 product against them is exact when the other operand
is fp16 too. The high-byte plane is loaded as uint16 words (two neighbouring high bytes) beside the one mid / lo byte
holding the same two elements' nibbles, so every load is a contiguous row (vectorised) and no byte is unpacked
twice; each pair is rebuilt in int32 (_halves) into an even and an odd element and the two are interleaved back
into order (tl.join, reshape).
    aligned_qk  grid (B*H, programs): a program takes blocks_per_program (default 4) consecutive blocks of
                one KV head. Per block it decides the d channel levels from q and k_exp, loads the k_hi words
                (d, BT/2), then k_mid only for channels at >= 12 bits and k_lo only for channels at 16 bits
                (masked loads, one mask per channel row: a skipped channel issues no memory request), rebuilds
                the keys (d, BT) and multiplies them by the group's G query heads, padded to 16 rows (tl.dot;
                d < 32 is padded to 32 channels: a 16-deep product summed wrong on an H200, Triton 3.6).
                A bf16 or fp32 q enters as the sum of two fp16 parts (_split), two products.
    aligned_pv  grid (B*H, splits), split-K over the tokens: a program walks its tokens BLOCK_N (32) at a time,
                decides the (BLOCK_N, d) levels as even / odd (BLOCK_N, d/2) halves, loads the v_hi words and
                the v_mid / v_lo byte rows, and accumulates p · v (tl.dot, the G heads padded to 16 rows), p
                scaled by P_SCALE and split into two fp16 parts, so that its products keep about 22 bits. By
                default (row_mask) a token's v_mid row is fetched when any of its elements reads >= 12 bits and
                its v_lo row when any reads 16 (the token's least diff over its channels, from min_c e(o_est): one
                decision a row, vector loads); row_mask=False fetches a byte only when one of its two elements
                needs it. Either way each element keeps only the nibbles its own level reads (_read), so the
                result is the same. The partials (B*H, splits, G, d) are summed by torch.
    aligned_token grid (B*H,): the static step's token, one program per KV head: reads the block being filled
                (its key planes channel-major, its value rows), writes the exact tail (B, H, BT, d) with the token's
                own k, v at its slot, then writes the token into the planes (its key nibbles merged into the bytes
                it shares with its neighbour) and, closing a block, the block's colmax exponents: one launch in
                place of the torch reference's (kvzoo.cache.alignedkv.token_tail, store_token) hundred-odd.
    _chunk_topk_kernel grid (B*Hq, chunks): the top k (a power of two) of each TOPK_CHUNK slots of a query head's
                probabilities (tl.topk over int64 keys, the fp32 bits above the slot).
    _estimate_kernel grid (B*Hq,): O_est, one program per query head: the top k of its chunks' candidates, their
                exact values gathered from the planes (slots < NA, all three planes joined) or the exact tail,
                times their probabilities and summed (_estimate_ref: torch's topk and gathers).
aligned_decode writes the tail scores into the aligned scores' buffer (no concatenation) and scales in place.
aligned_decode_static is the same step with fixed shapes for CUDA graphs (the cache's decode_static), in four kernels,
torch's softmax and the sum of aligned_pv's partials: the kernels read the count of complete blocks from a device
tensor (the grid sized by the whole buffer; a program past it does nothing); aligned_qk also scores the block being
filled exactly and writes every stored slot scaled, -inf where not attended; aligned_pv adds the exact tail's rows
in one more split.

Every launcher checks shapes, dtypes and devices and raises ValueError; each has a pure-torch `*_ref` built on
kvzoo.cache.alignedkv's key_levels / value_levels / read_levels. CPU tensors need TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.cache.alignedkv import (DIFF_FOR_8, DIFF_FOR_12, LEVELS, join_planes, key_levels, read_levels, store_token,
                                   token_tail, value_levels)
from kvzoo.kernels.quant_matvec import check_runnable, check_tensor, head_rows, split_groups, target_programs

_D8 = tl.constexpr(DIFF_FOR_8)
_D12 = tl.constexpr(DIFF_FOR_12)
_FAR = tl.constexpr(1 << 20)          # a diff no level threshold reaches: padded query heads never decide
QK_STAGES, PV_STAGES, PV_BLOCK_N = 3, 3, 32   # software pipelining and aligned_pv's tokens a step (a sweep's best)
TOPK_CHUNK = 1024                     # the slots of a program's first top-k pass (a sweep's best at batch 1)
P_SCALE = tl.constexpr(4096.0)       # p times this before its fp16 split: p >= 2^-26 normal, p < 15.99 finite


@triton.jit
def _exponent(x):
    """floor(log2 |x|) as int32 from the fp32 exponent field (0 and fp32 subnormals -> -127)."""
    return ((x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _live(len_ptr, COUNT, DYN: tl.constexpr):
    """How many blocks (tokens) are live: COUNT, or with DYN the device tensor `live` (CUDA graphs)."""
    if DYN:
        return tl.load(len_ptr).to(tl.int32)
    return COUNT


@triton.jit
def _level(diff, MIN_BITS: tl.constexpr):
    bits = tl.where(diff >= _D8, 8, tl.where(diff >= _D12, 12, 16))
    return tl.maximum(bits, MIN_BITS)


@triton.jit
def _fp16(bits16):
    """fp16 bit patterns held in int32 -> fp16."""
    return bits16.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _halves(hw, m, lo):
    """Two neighbouring elements a (even) and b (odd) from their high bytes as one uint16 word hw (a in the low
    byte), their shared middle byte m and low byte lo (a in the low nibbles; int32, 0 where a load skipped them)
    -> (a, b), each its 16 bits as int32."""
    a = ((hw & 0xFF) << 8) | ((m & 0xF) << 4) | (lo & 0xF)
    b = (hw & 0xFF00) | (m & 0xF0) | (lo >> 4)
    return a, b


@triton.jit
def _read(bits16, diff, MIN_BITS: tl.constexpr):
    """An element's 16 bits (int32) as read at the level its diff gives: the low nibble or byte it does not read
    replaced by 100... (_level's thresholds, inlined on the bits)."""
    if MIN_BITS < 16:
        at12 = (bits16 & 0xFFF0) | 0x8
        if MIN_BITS < 12:
            at12 = tl.where(diff >= _D8, (bits16 & 0xFF00) | 0x80, at12)
        bits16 = tl.where(diff >= _D12, at12, bits16)
    return bits16


@triton.jit
def _split(x, scale):
    """fp32 x * scale as the sum of two fp16 tensors (hi, lo), so that two fp16 tensor-core products against
    fp16-exact operands give x's product to about 22 bits (scale keeps small x out of fp16's subnormals)."""
    x = x * scale
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _attended(s, scale, mask_ptrs):
    """Scores (G_P, BT) scaled, and -inf at the slots the mask (BT,) leaves out."""
    return tl.where(tl.load(mask_ptrs).to(tl.int1)[None, :], s * scale, float("-inf"))


@triton.jit
def _qk_kernel(q_ptr, hi_ptr, mid_ptr, lo_ptr, exp_ptr, out_ptr, len_ptr, tk_ptr, mask_ptr, scale, NBLK, NB, H,
               PER_PROG, S_OUT, s_hi, s_mid, s_lo, s_exp, G: tl.constexpr, G_E: tl.constexpr, G_P: tl.constexpr,
               D: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr, MIN_BITS: tl.constexpr, EXACT_Q: tl.constexpr,
               DYN: tl.constexpr, STATIC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                # b*H + KV head
    HT: tl.constexpr = BT // 2                         # token pairs per block
    i = tl.arange(0, DP)                               # channels, padded to the products' least depth
    real = (i < D)[:, None]                            # (DP, 1)
    t = tl.arange(0, HT)
    g_e = tl.arange(0, G_E)                            # the group's heads for the decisions,
    live_e = g_e < G
    e_q = _exponent(tl.load(q_ptr + (row * G + g_e)[:, None] * D + i[None, :], mask=live_e[:, None] & (i < D)[None, :],
                            other=0))
    g = tl.arange(0, G_P)                              # and padded to a tensor-core tile for the products
    live_g = g < G
    heads = row * G + g                                # query rows b*Hq + kv*G + g
    q = tl.load(q_ptr + heads[:, None] * D + i[None, :], mask=live_g[:, None] & (i < D)[None, :], other=0)  # (G_P, DP)
    if EXACT_Q:                                        # fp16 q: exact as it is
        q_hi = q.to(tl.float16)
    else:                                              # bf16 / fp32 q: a high and a low fp16 part
        q_hi, q_lo = _split(q.to(tl.float32), 1.0)
    NBLK = _live(len_ptr, NBLK, DYN)
    first = tl.program_id(1) * PER_PROG
    for b in range(0, PER_PROG):
        n = first + b                                  # block
        j = n * BT + tl.arange(0, BT)                  # its slots
        if n < NBLK:
            # Rule 1, from q and the block's colmax exponents only
            a = e_q + tl.load(exp_ptr + row * s_exp + n * D + i, mask=i < D, other=0).to(tl.int32)[None, :]  # (G_E, DP)
            diff = tl.where(live_e[:, None], tl.max(a, axis=1)[:, None] - a, _FAR)
            bits = _level(tl.min(diff, axis=0), MIN_BITS)[:, None]                                   # (DP, 1)
            pair = n * (D * HT) + i[:, None] * HT + t[None, :]          # (DP, HT): tokens 2t, 2t+1 of channel i
            hw = tl.load(hi_ptr + row * s_hi + pair, mask=real, other=0).to(tl.int32)                 # uint16 words
            m = tl.load(mid_ptr + row * s_mid + pair, mask=real & (bits >= 12), other=0).to(tl.int32)
            lo = tl.load(lo_ptr + row * s_lo + pair, mask=real & (bits == 16), other=0).to(tl.int32)
            fill = tl.where(bits == 8, 0x80, tl.where(bits == 12, 0x8, 0))   # what a skipped nibble reads as
            k_even, k_odd = _halves(hw, m, lo)
            k = tl.join(_fp16(k_even | fill), _fp16(k_odd | fill)).reshape(DP, BT)  # (DP, HT, 2) -> (DP, BT) tokens
            s = tl.dot(q_hi, k)                                                                      # (G_P, BT)
            if not EXACT_Q:
                s = tl.dot(q_lo, k, s)
            if STATIC:
                s = _attended(s, scale, mask_ptr + (row // H) * S_OUT + j)
            tl.store(out_ptr + heads[:, None] * S_OUT + j[None, :], s, mask=live_g[:, None])
        elif STATIC and n < NB:                        # the static step: its exact tail block, then nothing stored
            if n == NBLK:
                kt = tl.load(tk_ptr + (row * BT + tl.arange(0, BT))[:, None] * D + i[None, :], mask=(i < D)[None, :],
                             other=0).to(tl.float32)                                                # (BT, DP)
                s = tl.dot(q.to(tl.float32), tl.trans(kt), input_precision="ieee")                  # (G_P, BT)
            else:
                s = tl.full((G_P, BT), float("-inf"), tl.float32)
            s = _attended(s, scale, mask_ptr + (row // H) * S_OUT + j)
            tl.store(out_ptr + heads[:, None] * S_OUT + j[None, :], s, mask=live_g[:, None])


@triton.jit
def _pv_kernel(p_ptr, o_ptr, hi_ptr, mid_ptr, lo_ptr, exp_ptr, part_ptr, len_ptr, tv_ptr, N, S_P, PER_SPLIT, s_hi,
               s_mid, s_lo, s_exp, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
               MIN_BITS: tl.constexpr, ROW_MASK: tl.constexpr, DYN: tl.constexpr, LIVE_ROWS: tl.constexpr,
               TAIL: tl.constexpr, TAIL_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                # b*H + KV head
    split = tl.program_id(1)
    HD: tl.constexpr = D // 2                          # channel pairs
    g = tl.arange(0, G_P)
    live_g = g < G
    c = tl.arange(0, HD)
    heads = row * G + g                                # query rows b*Hq + kv*G + g
    acc = tl.zeros((G_P, D), dtype=tl.float32)         # p * P_SCALE times the values
    N = _live(len_ptr, N, DYN) * LIVE_ROWS
    if TAIL > 0 and split == tl.num_programs(1) - 1:   # the static step's exact tail: slots N + [0, TAIL)
        t = tl.arange(0, TAIL_P)
        pt = tl.load(p_ptr + heads[:, None] * S_P + (N + t)[None, :], mask=live_g[:, None] & (t < TAIL)[None, :],
                     other=0)                                                                     # (G_P, TAIL_P)
        tv = tl.load(tv_ptr + (row * TAIL + t)[:, None] * D + tl.arange(0, D)[None, :], mask=(t < TAIL)[:, None],
                     other=0).to(tl.float32)                                                      # (TAIL_P, D)
        acc = tl.dot(pt * P_SCALE, tv, input_precision="ieee")
        N = 0                                          # and no stored rows
    for start in range(0, tl.minimum(PER_SPLIT, N - split * PER_SPLIT), BLOCK_N):   # a split past N stores zeros
        j = split * PER_SPLIT + start + tl.arange(0, BLOCK_N)
        live = j < N
        # Rule 2: the least diff over the group's query heads, from o_est, p and the rowmax exponents
        e_v = tl.load(exp_ptr + row * s_exp + j, mask=live, other=0).to(tl.int32)
        e_even = tl.full((BLOCK_N, HD), _FAR, tl.int32)
        e_odd = tl.full((BLOCK_N, HD), _FAR, tl.int32)
        e_row = tl.full((BLOCK_N,), _FAR, tl.int32)    # the least over the token's channels too
        for h in tl.static_range(G):
            r = _exponent(tl.load(p_ptr + (row * G + h) * S_P + j, mask=live, other=0)) + e_v       # (BLOCK_N,)
            e_oe = _exponent(tl.load(o_ptr + (row * G + h) * D + 2 * c))                            # (HD,)
            e_oo = _exponent(tl.load(o_ptr + (row * G + h) * D + 2 * c + 1))
            e_even = tl.minimum(e_even, e_oe[None, :] - r[:, None])
            e_odd = tl.minimum(e_odd, e_oo[None, :] - r[:, None])
            if ROW_MASK:
                e_row = tl.minimum(e_row, tl.minimum(tl.min(e_oe, axis=0), tl.min(e_oo, axis=0)) - r)
        pair = j[:, None] * HD + c[None, :]                           # (BLOCK_N, HD): channels 2c, 2c+1 of token j
        if ROW_MASK:     # a token's whole byte row once any of its bytes is needed: level is monotone in diff
            bits_row = _level(e_row, MIN_BITS)[:, None]                                              # (BLOCK_N, 1)
            need_mid = bits_row >= 12
            need_lo = bits_row == 16
        else:
            need_mid = (_level(e_even, MIN_BITS) >= 12) | (_level(e_odd, MIN_BITS) >= 12)
            need_lo = (_level(e_even, MIN_BITS) == 16) | (_level(e_odd, MIN_BITS) == 16)
        hw = tl.load(hi_ptr + row * s_hi + pair, mask=live[:, None], other=0).to(tl.int32)          # uint16 words
        m = tl.load(mid_ptr + row * s_mid + pair, mask=live[:, None] & need_mid, other=0).to(tl.int32)
        lo = tl.load(lo_ptr + row * s_lo + pair, mask=live[:, None] & need_lo, other=0).to(tl.int32)
        v_even, v_odd = _halves(hw, m, lo)
        v = tl.join(_fp16(_read(v_even, e_even, MIN_BITS)), _fp16(_read(v_odd, e_odd, MIN_BITS)))
        p_hi, p_lo = _split(tl.load(p_ptr + heads[:, None] * S_P + j[None, :], mask=live_g[:, None] & live[None, :],
                                    other=0), P_SCALE)                                              # (G_P, BLOCK_N)
        v = v.reshape(BLOCK_N, D)                               # (BLOCK_N, HD, 2) -> (BLOCK_N, D) channels
        acc = tl.dot(p_lo, v, tl.dot(p_hi, v, acc))
    out = part_ptr + ((row * tl.num_programs(1) + split) * G + g[:, None]) * D + tl.arange(0, D)[None, :]
    tl.store(out, acc * (1.0 / P_SCALE), mask=live_g[:, None])


@triton.jit
def _fp16_of(hi, mid, lo):
    """fp16 values from their high byte and middle and low nibbles (int32)."""
    return ((hi << 8) | (mid << 4) | lo).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _merge_nibble(plane_ptr, at, nibble, odd):
    """Write nibble (int32) into the high (odd) or low half of the bytes at `at`, keeping the other half."""
    old = tl.load(plane_ptr + at).to(tl.int32)
    tl.store(plane_ptr + at, tl.where(odd, (old & 0x0F) | (nibble << 4), (old & 0xF0) | nibble).to(tl.uint8))


@triton.jit
def _token_kernel(k_ptr, v_ptr, khi_ptr, kmid_ptr, klo_ptr, kexp_ptr, vhi_ptr, vmid_ptr, vlo_ptr, vexp_ptr, tk_ptr,
                  tv_ptr, slot_ptr, NB, D: tl.constexpr, BT: tl.constexpr, CLOSE: tl.constexpr):
    bh = tl.program_id(0).to(tl.int64)                 # b*H + KV head
    L = tl.load(slot_ptr).to(tl.int64)
    nb = L // BT                                       # the block being filled
    t = L - nb * BT                                    # the token's place in it
    c = tl.arange(0, D)
    j = tl.arange(0, BT)
    # the block's keys, channel-major (D, BT), and the token's
    krow = (bh * NB + nb) * D + c                                                     # (D,) the block's rows
    half = krow[:, None] * (BT // 2) + (j // 2)[None, :]
    shift = ((j % 2) * 4)[None, :]                                                    # token 2i: the low nibble
    keys = _fp16_of(tl.load(khi_ptr + krow[:, None] * BT + j[None, :]).to(tl.int32),
                    (tl.load(kmid_ptr + half).to(tl.int32) >> shift) & 0xF,
                    (tl.load(klo_ptr + half).to(tl.int32) >> shift) & 0xF)             # (D, BT)
    k = tl.load(k_ptr + bh * D + c)                                                   # (D,) the model's dtype
    k16 = k.to(tl.float16)
    at_t = (j == t)[None, :]
    tl.store(tk_ptr + (bh * BT + j[None, :]) * D + c[:, None], tl.where(at_t, k[:, None], keys.to(k.dtype)))
    # the block's values, token-major (BT, D): stored before the token, the token's own, zero after
    vrow = bh * NB * BT + nb * BT + j                                                 # (BT,) value rows
    vhalf = vrow[:, None] * (D // 2) + (c // 2)[None, :]
    vshift = ((c % 2) * 4)[None, :]                                                   # channel 2i: the low nibble
    values = _fp16_of(tl.load(vhi_ptr + vrow[:, None] * D + c[None, :]).to(tl.int32),
                      (tl.load(vmid_ptr + vhalf).to(tl.int32) >> vshift) & 0xF,
                      (tl.load(vlo_ptr + vhalf).to(tl.int32) >> vshift) & 0xF)         # (BT, D)
    v = tl.load(v_ptr + bh * D + c)
    tail_v = tl.where((j < t)[:, None], values.to(v.dtype), tl.where((j == t)[:, None], v[None, :], 0))
    tl.store(tv_ptr + (bh * BT + j[:, None]) * D + c[None, :], tail_v)
    if CLOSE:                                          # the token completes the block: its colmax exponents
        colmax = tl.max(tl.where(at_t, tl.abs(k16.to(tl.float32))[:, None], tl.abs(keys.to(tl.float32))), 1)
        tl.store(kexp_ptr + krow, _exponent(colmax).to(tl.int8))
    tl.debug_barrier()                                 # every byte the block shares is read before it changes
    # the token into the planes
    kb = k16.to(tl.uint16, bitcast=True).to(tl.int32)                                 # (D,)
    tl.store(khi_ptr + krow * BT + t, (kb >> 8).to(tl.uint8))
    odd = t % 2 == 1
    _merge_nibble(kmid_ptr, krow * (BT // 2) + t // 2, (kb >> 4) & 0xF, odd)
    _merge_nibble(klo_ptr, krow * (BT // 2) + t // 2, kb & 0xF, odd)
    row = bh * NB * BT + L
    v16 = v.to(tl.float16)
    tl.store(vhi_ptr + row * D + c, (v16.to(tl.uint16, bitcast=True).to(tl.int32) >> 8).to(tl.uint8))
    c2 = tl.arange(0, D // 2)
    e = tl.arange(0, 2)
    pair = tl.load(v_ptr + bh * D + 2 * c2[:, None] + e[None, :]).to(tl.float16)    # (D/2, 2) channels 2i, 2i+1
    pb = pair.to(tl.uint16, bitcast=True).to(tl.int32)
    tl.store(vmid_ptr + row * (D // 2) + c2, tl.sum(((pb >> 4) & 0xF) << (4 * e)[None, :], 1).to(tl.uint8))
    tl.store(vlo_ptr + row * (D // 2) + c2, tl.sum((pb & 0xF) << (4 * e)[None, :], 1).to(tl.uint8))
    tl.store(vexp_ptr + row, _exponent(tl.max(tl.abs(v16.to(tl.float32)), 0)).to(tl.int8))


def aligned_token(planes: tuple[Tensor, ...], k: Tensor, v: Tensor, slot: Tensor, close: bool) -> tuple[Tensor, Tensor]:
    """The static step's token k, v (B, H, 1, d) at slot `slot` (a device tensor (1,) int64) into the planes
    (k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp, in place; close: the token completes its block, whose
    colmax exponents are recorded), and the exact tail of the block it lands in, (B, H, BT, d) each in k's and v's
    dtype (kvzoo.cache.alignedkv.token_tail). One launch; aligned_token_ref is the torch reference."""
    k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp = planes
    B, H, NB, d, BT = k_hi.shape
    dev = k_hi.device
    check_runnable(_token_kernel, dev)
    for name, t in (("k", k), ("v", v)):
        check_tensor(t, name, (B, H, 1, d), (torch.float16, torch.bfloat16, torch.float32), dev)
    check_tensor(slot, "slot", (1,), (torch.int64,), dev)
    if d & (d - 1) or BT & (BT - 1) or BT < 2:
        raise ValueError(f"aligned_token needs a power-of-two head_dim and block, got {d} and {BT}")
    for name, t, shape, dtype in (("k_hi", k_hi, (B, H, NB, d, BT), torch.uint8),
                                  ("k_mid", k_mid, (B, H, NB, d, BT // 2), torch.uint8),
                                  ("k_lo", k_lo, (B, H, NB, d, BT // 2), torch.uint8),
                                  ("k_exp", k_exp, (B, H, NB, d), torch.int8),
                                  ("v_hi", v_hi, (B, H, NB * BT, d), torch.uint8),
                                  ("v_mid", v_mid, (B, H, NB * BT, d // 2), torch.uint8),
                                  ("v_lo", v_lo, (B, H, NB * BT, d // 2), torch.uint8),
                                  ("v_exp", v_exp, (B, H, NB * BT), torch.int8)):
        check_tensor(t, name, shape, (dtype,), dev)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the planes are written in place)")
    tail_k = torch.empty(B, H, BT, d, dtype=k.dtype, device=dev)
    tail_v = torch.empty(B, H, BT, d, dtype=v.dtype, device=dev)
    _token_kernel[(B * H,)](k.contiguous(), v.contiguous(), k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp,
                            tail_k, tail_v, slot, NB, D=d, BT=BT, CLOSE=close)
    return tail_k, tail_v


def aligned_token_ref(planes: tuple[Tensor, ...], k: Tensor, v: Tensor, slot: Tensor,
                      close: bool) -> tuple[Tensor, Tensor]:
    """aligned_token in torch: the tail read before the token is stored (kvzoo.cache.alignedkv)."""
    tail = token_tail(planes, k, v, slot)
    store_token(planes, k, v, slot, close)
    return tail


def _check_common(name: str, t: Tensor, dims: int, min_bits: int) -> None:
    if min_bits not in LEVELS:
        raise ValueError(f"min_bits must be one of {LEVELS}, got {min_bits}")
    if not isinstance(t, Tensor) or t.dim() != dims:
        raise ValueError(f"{name} must be a tensor with {dims} dims")


def _check_dim(name: str, n: int, least: int = 16) -> None:
    if n < least or n & (n - 1):
        raise ValueError(f"the kernels need {name} a power of two >= {least}, got {n}")


def _group(Hq: int, H: int) -> tuple[int, int]:
    """(G, G_P): query heads per KV head and the rows of the tensor-core products that hold them (a power of two,
    at least 16)."""
    if H == 0 or Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    G = Hq // H
    return G, max(16, triton.next_power_of_2(G))


def _words(t: Tensor) -> Tensor:
    """A uint8 plane viewed as uint16 words (two neighbouring bytes of its last dim in one load)."""
    try:
        return t.view(torch.uint16)
    except RuntimeError:                              # an odd offset or stride: copy
        return t.contiguous().view(torch.uint16)


def aligned_qk(q: Tensor, k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, k_exp: Tensor, n_blocks: int,
               min_bits: int, blocks_per_program: int | None = None, out: Tensor | None = None,
               num_warps: int = 4, live: Tensor | None = None, tail_k: Tensor | None = None,
               mask: Tensor | None = None, scale: float = 1.0) -> Tensor:
    """Unscaled scores q · k̃ᵀ (B, Hq, n_blocks*BT) fp32 over the first n_blocks key blocks, each key channel of
    each block read at the bits Rule 1 gives it. q (B, Hq, d) fp16/bf16/fp32; the planes may hold NB >= n_blocks
    blocks (the cache's whole buffers). blocks_per_program defaults to filling the device; `out`, a contiguous
    fp32 (B, Hq, S >= n_blocks*BT), takes the scores in its first n_blocks*BT slots (and is returned whole).
    live, an int32 or int64 device tensor (1,) <= n_blocks, is read by the kernel as the number of blocks to score,
    n_blocks then only sizing the grid (CUDA graphs: no host sync); the slots of the other blocks are left unwritten.
    The static step (aligned_decode_static) gives with live the exact tail_k (B, H, BT, d) of block `live`, which
    the kernel scores exactly (fp32), a mask (B, S) of the slots attended and a scale: every slot of `out` is then
    written, scaled, -inf where the mask is False."""
    _check_common("k_hi", k_hi, 5, min_bits)
    B, H, NB, d, BT = k_hi.shape
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor (B, Hq, d)")
    dev = q.device
    check_runnable(_qk_kernel, dev)
    _check_dim("head_dim", d)
    _check_dim("block tokens BT", BT)
    Hq = q.shape[1]
    G, G_P = _group(Hq, H)
    check_tensor(q, "q", (B, Hq, d), (torch.float16, torch.bfloat16, torch.float32), dev)
    for name, t, shape, dtype in (("k_hi", k_hi, (B, H, NB, d, BT), torch.uint8),
                                  ("k_mid", k_mid, (B, H, NB, d, BT // 2), torch.uint8),
                                  ("k_lo", k_lo, (B, H, NB, d, BT // 2), torch.uint8),
                                  ("k_exp", k_exp, (B, H, NB, d), torch.int8)):
        check_tensor(t, name, shape, (dtype,), dev)
    if not 0 <= n_blocks <= NB:
        raise ValueError(f"n_blocks = {n_blocks} is outside the {NB} stored blocks")
    if live is not None:
        check_tensor(live, "live", (1,), (torch.int32, torch.int64), dev)
    static = tail_k is not None
    if static and (live is None or mask is None or out is None or out.shape[-1] != NB * BT):
        raise ValueError("tail_k (the static step) needs live, a mask and out spanning every stored slot")
    if out is None:
        out = torch.empty(B, Hq, n_blocks * BT, dtype=torch.float32, device=dev)
    elif (not isinstance(out, Tensor) or out.dim() != 3 or out.shape[:2] != (B, Hq) or out.shape[2] < n_blocks * BT
          or out.dtype != torch.float32 or out.device != dev or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous fp32 tensor ({B}, {Hq}, >= {n_blocks * BT}) on {dev}")
    if B == 0 or n_blocks == 0:
        return out
    if blocks_per_program is None:                    # 4 blocks a program (a sweep's best) while the device stays full
        blocks_per_program = max(1, min(4, n_blocks * B * H // target_programs(dev)))
    progs, per_prog = split_groups(n_blocks, B * H, dev, -(-n_blocks // blocks_per_program))
    (hi, s_hi), (mid, s_mid), (lo, s_lo), (ex, s_exp) = map(head_rows, (_words(k_hi), k_mid, k_lo, k_exp))
    if static:
        check_tensor(tail_k, "tail_k", (B, H, BT, d), (torch.float16, torch.bfloat16, torch.float32), dev)
        check_tensor(mask, "mask", (B, NB * BT), (torch.bool,), dev)
    _qk_kernel[(B * H, progs)](q.contiguous(), hi, mid, lo, ex, out, out if live is None else live,
                               tail_k.contiguous() if static else out, mask.contiguous() if static else out, scale,
                               n_blocks, NB, H, per_prog, out.shape[2], s_hi, s_mid, s_lo, s_exp, G=G,
                               G_E=triton.next_power_of_2(G), G_P=G_P, D=d, DP=max(d, 32), BT=BT, MIN_BITS=min_bits,
                               EXACT_Q=q.dtype == torch.float16, DYN=live is not None, STATIC=static,
                               num_warps=num_warps, num_stages=QK_STAGES)
    return out


def aligned_qk_ref(q: Tensor, k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, k_exp: Tensor, n_blocks: int,
                   min_bits: int) -> Tensor:
    """The torch reference: key_levels, join_planes, read_levels, fp32 einsum."""
    B, Hq, d = q.shape
    H, BT = k_hi.shape[1], k_hi.shape[-1]
    blocks = slice(0, n_blocks)
    keys = join_planes(k_hi[:, :, blocks], k_mid[:, :, blocks], k_lo[:, :, blocks])      # (B, H, n, d, BT) fp16
    bits = key_levels(q[:, :, None], k_exp[:, :, blocks], min_bits)[:, :, 0]            # (B, H, n, d)
    k = read_levels(keys, bits[..., None])                                              # (B, H, n, d, BT) fp32
    scores = torch.einsum("bhgi,bhnit->bhgnt", q.float().view(B, H, Hq // H, d), k)     # (B, H, G, n, BT)
    return scores.reshape(B, Hq, n_blocks * BT)


def aligned_pv(p: Tensor, o_est: Tensor, v_hi: Tensor, v_mid: Tensor, v_lo: Tensor, v_exp: Tensor, n_tokens: int,
               min_bits: int, block_n: int = PV_BLOCK_N, num_splits: int | None = None, row_mask: bool = True,
               num_warps: int = 4, live: Tensor | None = None, live_rows: int = 1,
               tail_v: Tensor | None = None) -> Tensor:
    """p · ṽ (B, Hq, d) fp32 over the first n_tokens value rows, each element read at the bits Rule 2 gives it.
    p (B, Hq, S) fp32 probabilities, S >= n_tokens (only the first n_tokens are read); o_est (B, Hq, d) fp32;
    the planes may hold N >= n_tokens rows. num_splits (split-K over tokens) defaults to filling the device.
    row_mask fetches a token's whole v_mid / v_lo row once any of its bytes is needed (vector loads; the same
    result, since each element still keeps only the nibbles its own level reads). live, an int32 or int64 device
    tensor (1,), is read by the kernel: it sums live * live_rows <= n_tokens rows, n_tokens then only sizing the grid
    (CUDA graphs: no host sync). With live, tail_v (B, H, W, d), the static step's exact tail, adds p's slots
    live * live_rows + [0, W) times its rows (fp32), in one more split."""
    _check_common("v_hi", v_hi, 4, min_bits)
    B, H, N, d = v_hi.shape
    if not isinstance(p, Tensor) or p.dim() != 3:
        raise ValueError("p must be a tensor (B, Hq, S)")
    dev = p.device
    check_runnable(_pv_kernel, dev)
    _check_dim("head_dim", d)
    _check_dim("block_n", block_n, 32)       # 16 (a 16-deep product) summed wrong on an H200 (Triton 3.6)
    Hq, S = p.shape[1], p.shape[2]
    G, G_P = _group(Hq, H)
    check_tensor(p, "p", (B, Hq, S), (torch.float32,), dev)
    check_tensor(o_est, "o_est", (B, Hq, d), (torch.float32,), dev)
    for name, t, shape, dtype in (("v_hi", v_hi, (B, H, N, d), torch.uint8),
                                  ("v_mid", v_mid, (B, H, N, d // 2), torch.uint8),
                                  ("v_lo", v_lo, (B, H, N, d // 2), torch.uint8),
                                  ("v_exp", v_exp, (B, H, N), torch.int8)):
        check_tensor(t, name, shape, (dtype,), dev)
    if not 0 <= n_tokens <= min(N, S):
        raise ValueError(f"n_tokens = {n_tokens} exceeds the {N} stored values or the {S} probabilities")
    if live is not None:
        check_tensor(live, "live", (1,), (torch.int32, torch.int64), dev)
    if not isinstance(live_rows, int) or live_rows < 1:
        raise ValueError(f"live_rows must be a positive int (rows per unit of live), got {live_rows!r}")
    W = 0
    if tail_v is not None:
        if live is None:
            raise ValueError("tail_v (the static step) needs live")
        W = tail_v.shape[2] if isinstance(tail_v, Tensor) and tail_v.dim() == 4 else 0
        check_tensor(tail_v, "tail_v", (B, H, W, d), (torch.float16, torch.bfloat16, torch.float32), dev)
    if B == 0 or n_tokens == 0:
        return torch.zeros(B, Hq, d, dtype=torch.float32, device=dev)
    splits, per_split = split_groups(triton.cdiv(n_tokens, block_n), B * H, dev, num_splits)
    partials = torch.empty(B * H, splits + (W > 0), G, d, dtype=torch.float32, device=dev)
    p = p.contiguous()
    (hi, s_hi), (mid, s_mid), (lo, s_lo), (ex, s_exp) = map(head_rows, (_words(v_hi), v_mid, v_lo, v_exp))
    _pv_kernel[(B * H, partials.shape[1])](p, o_est.contiguous(), hi, mid, lo, ex, partials,
                                           partials if live is None else live,
                                           tail_v.contiguous() if W else partials, n_tokens, S, per_split * block_n,
                                           s_hi, s_mid, s_lo, s_exp, G=G, G_P=G_P, D=d, BLOCK_N=block_n,
                                           MIN_BITS=min_bits, ROW_MASK=row_mask, DYN=live is not None,
                                           LIVE_ROWS=live_rows, TAIL=W, TAIL_P=max(32, triton.next_power_of_2(W or 1)),
                                           num_warps=num_warps, num_stages=PV_STAGES)
    return partials.sum(1).view(B, Hq, d)                                       # (B*H, G, d) -> (B, Hq, d)


def aligned_pv_ref(p: Tensor, o_est: Tensor, v_hi: Tensor, v_mid: Tensor, v_lo: Tensor, v_exp: Tensor,
                   n_tokens: int, min_bits: int) -> Tensor:
    """The torch reference: value_levels, join_planes, read_levels, fp32 einsum."""
    B, Hq, d = o_est.shape
    H = v_hi.shape[1]
    p = p[..., :n_tokens]                                                               # (B, Hq, n)
    values = join_planes(v_hi[:, :, :n_tokens], v_mid[:, :, :n_tokens], v_lo[:, :, :n_tokens])   # (B, H, n, d)
    bits = value_levels(p[:, :, None], o_est[:, :, None], v_exp[:, :, :n_tokens], min_bits)[:, :, 0]  # (B, H, n, d)
    out = torch.einsum("bhgj,bhjc->bhgc", p.view(B, H, Hq // H, n_tokens), read_levels(values, bits))
    return out.reshape(B, Hq, d)


def aligned_decode(q: Tensor, k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, k_exp: Tensor, v_hi: Tensor, v_mid: Tensor,
                   v_lo: Tensor, v_exp: Tensor, n_blocks: int, tail_k: Tensor, tail_v: Tensor, topk: int,
                   min_bits: int) -> Tensor:
    """One decode step of AlignedKV attention, as kvzoo.cache.alignedkv runs it on CUDA: q (B, Hq, d) over the
    first n_blocks complete blocks (read aligned by the two kernels) and an exact tail (B, H, W, d) of the
    tokens after them (the block being filled and the new token). Returns (B, Hq, d) fp32.

    scores = [aligned_qk | q·tail] / sqrt(d); p = softmax (fp32); O_est = the top-k probabilities times
    their exact values (gathered from the planes or the tail); out = aligned_pv(p, O_est) + p_tail·tail."""
    B, Hq, d = q.shape
    H = tail_k.shape[1]
    G, NA = Hq // H, n_blocks * k_hi.shape[-1]
    scores = torch.empty(B, Hq, NA + tail_k.shape[2], dtype=torch.float32, device=q.device)
    aligned_qk(q, k_hi, k_mid, k_lo, k_exp, n_blocks, min_bits, out=scores)           # slots < NA
    scores[..., NA:] = torch.einsum("bhgd,bhwd->bhgw", q.float().view(B, H, G, d), tail_k.float()).reshape(B, Hq, -1)
    p = scores.mul_(d ** -0.5).softmax(-1)                                            # (B, Hq, S)
    o_est = _estimate(p, v_hi, v_mid, v_lo, tail_v, NA, topk)
    out = aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, NA, min_bits)
    return out + torch.einsum("bhgw,bhwd->bhgd", p[..., NA:].view(B, H, G, -1), tail_v.float()).reshape(B, Hq, d)


def aligned_decode_static(q: Tensor, k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, k_exp: Tensor, v_hi: Tensor,
                          v_mid: Tensor, v_lo: Tensor, v_exp: Tensor, n_full: Tensor, tail_k: Tensor, tail_v: Tensor,
                          mask: Tensor, topk: int, min_bits: int) -> Tensor:
    """aligned_decode with fixed shapes and no host sync, so that a CUDA graph holds it (kvzoo/graphs.py): the scores
    span every stored slot (S = NB*BT), and the kernels cover every block, reading how many are complete from
    n_full, a device tensor (1,) int64. tail_k, tail_v (B, H, BT, d): the block being filled (slots n_full*BT +
    [0, BT)) read exact, its rows past the new token finite (they get p = 0); mask (B, S) booleans: the slots
    attended (the tail's unwritten slots and every later one masked out). Returns (B, Hq, d) fp32."""
    B, Hq, d = q.shape
    H, NB, BT = k_hi.shape[1], k_hi.shape[2], k_hi.shape[-1]
    S = NB * BT
    dev = q.device
    check_tensor(n_full, "n_full", (1,), (torch.int64,), dev)
    check_tensor(mask, "mask", (B, S), (torch.bool,), dev)
    for name, t in (("tail_k", tail_k), ("tail_v", tail_v)):
        check_tensor(t, name, (B, H, BT, d), (torch.float16, torch.bfloat16, torch.float32), dev)
    scores = torch.empty(B, Hq, S, dtype=torch.float32, device=dev)
    aligned_qk(q, k_hi, k_mid, k_lo, k_exp, NB, min_bits, out=scores, live=n_full, tail_k=tail_k, mask=mask,
               scale=d ** -0.5)                                                    # every slot, scaled and masked
    p = scores.softmax(-1)                                                         # (B, Hq, S)
    o_est = _estimate(p, v_hi, v_mid, v_lo, tail_v, n_full, topk, na_rows=BT)
    return aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, S, min_bits, live=n_full, live_rows=BT, tail_v=tail_v)


@triton.jit
def _keys(p, j):
    """Top-k sort keys of probabilities p >= 0 at slots j: the fp32 bits above (non-negative, so ordered as
    integers), the slot below (of equal p, the later slot ranks first)."""
    return (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | j.to(tl.int64)


@triton.jit
def _chunk_topk_kernel(p_ptr, cand_ptr, S, C: tl.constexpr, K_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                # b*Hq + query head
    chunk = tl.program_id(1)
    j = chunk * C + tl.arange(0, C)
    p = tl.load(p_ptr + row * S + j, mask=j < S, other=0)
    keys = tl.where(j < S, _keys(p, j), -1)                                            # (C,) past S: below all
    tl.store(cand_ptr + (row * tl.num_programs(1) + chunk) * K_P + tl.arange(0, K_P), tl.topk(keys, K_P))


@triton.jit
def _estimate_kernel(cand_ptr, vhi_ptr, vmid_ptr, vlo_ptr, tail_ptr, na_ptr, out_ptr, N, W, NC,
                     G: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr, NC_P: tl.constexpr, D: tl.constexpr,
                     NA_ROWS: tl.constexpr, SELECT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                # b*Hq + query head
    kv = row // G                                      # b*H + its KV head
    n = tl.arange(0, NC_P)
    top = tl.load(cand_ptr + row * NC + n, mask=n < NC, other=-1)                     # (NC_P,) candidate keys
    if SELECT:
        top = tl.topk(top, K_P)                        # (K_P,) the row's top keys
    live = tl.arange(0, K_P) < K
    p = tl.where(live, (top >> 32).to(tl.int32).to(tl.float32, bitcast=True), 0)      # (K_P,) fp32
    idx = top & 0xFFFFFFFF                                                             # (K_P,) slots
    NA = tl.load(na_ptr).to(tl.int64) * NA_ROWS        # the slots stored in the planes
    c = tl.arange(0, D)
    in_planes = (live & (idx < NA))[:, None]           # (K_P, 1): a stored slot, else the tail's
    rows = kv * N + tl.maximum(tl.minimum(idx, NA - 1), 0)                            # stored slots: planes
    half = rows[:, None] * (D // 2) + (c // 2)[None, :]
    shift = ((c % 2) * 4)[None, :]
    stored = _fp16_of(tl.load(vhi_ptr + rows[:, None] * D + c[None, :], mask=in_planes, other=0).to(tl.int32),
                      (tl.load(vmid_ptr + half, mask=in_planes, other=0).to(tl.int32) >> shift) & 0xF,
                      (tl.load(vlo_ptr + half, mask=in_planes, other=0).to(tl.int32) >> shift) & 0xF
                      ).to(tl.float32)                                                 # (K_P, D)
    tail = kv * W + tl.maximum(tl.minimum(idx - NA, W - 1), 0)                        # the exact tail's rows
    exact = tl.load(tail_ptr + tail[:, None] * D + c[None, :], mask=live[:, None] & ~in_planes,
                    other=0).to(tl.float32)
    vals = tl.where((idx < NA)[:, None], stored, exact)
    tl.store(out_ptr + row * D + c, tl.sum(p[:, None] * vals, 0))


def _estimate(p: Tensor, v_hi: Tensor, v_mid: Tensor, v_lo: Tensor, tail_v: Tensor, NA: int | Tensor,
              topk: int, na_rows: int = 1, chunked: bool | None = None) -> Tensor:
    """_estimate_ref in two kernels: each chunk of TOPK_CHUNK slots its top k (_chunk_topk_kernel), then per query
    head the top k of those, their exact values gathered and weighted (_estimate_kernel). NA, an int or a device
    tensor (1,), counts the stored slots in units of na_rows. chunked=False takes the top k from torch.topk (the
    default on CPU, where the interpreter runs tl.topk's sorting network a thousand times slower)."""
    B, Hq, S = p.shape
    H, W, d = tail_v.shape[1], tail_v.shape[2], tail_v.shape[-1]
    K = min(topk, S)
    K_P = triton.next_power_of_2(K)
    p = p.contiguous()
    if chunked is None:
        chunked = p.is_cuda
    if chunked:
        C = min(max(TOPK_CHUNK, K_P), triton.next_power_of_2(S))                      # slots a chunk, >= K_P
        chunks = triton.cdiv(S, C)
        cand = torch.empty(B * Hq, chunks * K_P, dtype=torch.int64, device=p.device)
        _chunk_topk_kernel[(B * Hq, chunks)](p, cand, S, C=C, K_P=K_P, num_warps=4 if C <= 4096 else 8)
    else:
        top_p, idx = p.view(B * Hq, S).topk(K, dim=-1)                                # (B*Hq, K) sorted
        cand = (top_p.view(torch.int32).long() << 32) | idx                           # _keys
    NC = cand.shape[1]
    out = torch.empty(B, Hq, d, dtype=torch.float32, device=p.device)
    na = NA if isinstance(NA, Tensor) else torch.full((1,), NA, dtype=torch.int64, device=p.device)
    v_hi, v_mid, v_lo = (t.contiguous() for t in (v_hi, v_mid, v_lo))                # (B, H, N, .) rows
    _estimate_kernel[(B * Hq,)](cand, v_hi, v_mid, v_lo, tail_v.contiguous(), na, out, v_hi.shape[2], W, NC,
                                G=Hq // H, K=K, K_P=K_P, NC_P=triton.next_power_of_2(NC), D=d, NA_ROWS=na_rows,
                                SELECT=chunked, num_warps=4 if NC <= 4096 else 8)
    return out


def _estimate_ref(p: Tensor, v_hi: Tensor, v_mid: Tensor, v_lo: Tensor, tail_v: Tensor, NA: int | Tensor,
                  topk: int) -> Tensor:
    """O_est (B, Hq, d): each head's top-k probabilities times their exact values, gathered from the planes
    (slots < NA) or the exact tail (slots NA + [0, W)), without copying the cache. NA is an int or a device tensor
    (1,); a slot past the tail (p = 0, picked only where fewer than topk slots are attended) reads its last row."""
    B, Hq, S = p.shape
    H, W, d = tail_v.shape[1], tail_v.shape[2], tail_v.shape[-1]
    G = Hq // H
    top_p, idx = p.topk(min(topk, S), dim=-1)                                         # (B, Hq, k)
    b = torch.arange(B, device=p.device)[:, None, None]
    h = (torch.arange(Hq, device=p.device) // G)[None, :, None]                       # each query head's KV head
    planes = idx.clamp(max=NA - 1).clamp_min(0)
    stored = join_planes(v_hi[b, h, planes], v_mid[b, h, planes], v_lo[b, h, planes]).float()   # (B, Hq, k, d)
    vals = torch.where((idx < NA)[..., None], stored, tail_v[b, h, (idx - NA).clamp(0, W - 1)].float())
    return (top_p.view(B, H, G, -1, 1) * vals.view(B, H, G, -1, d)).sum(3).view(B, Hq, d)
