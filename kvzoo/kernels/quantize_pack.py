"""Quantize-and-pack kernel for InnerQ's key layout (per-token groups of 32 channels along head_dim), in the
asymmetric, symmetric or hybrid mode of the unified representation (InnerQ §4.1, Figure 1; Figure 4 compares
the latency of hybrid and symmetric quantization).

    x (..., d) fp16/bf16/fp32, d a power of two >= 32  ->  UnifiedQTensor with
        codes int32 (..., d*b/32)   b-bit codes packed along d (kvzoo.cache.kvquant.pack's bit stream)
        scale fp16  (..., d/32)     one per group of 32 channels
        slot  int32 (..., d/32)     fp32 bits of the zero point (asymmetric) or the 32 sign bits (symmetric)
        sym   bool  (..., d/32)     which mode the group uses

Per group (top = 2^b - 1): asymmetric scale = fp16((max - min) / top), codes round((x - min) / scale);
symmetric scale = fp16(max|x| / top), codes round(|x| / scale) and the signs in the slot; hybrid computes
both reconstructions' squared errors on the loaded values and keeps the symmetric group where its error is
strictly lower. The results equal kvzoo.cache.kvquant.quantize_unified(x, b, axis=-1, mode): IEEE divisions
(div_rn), round-half-to-even (the 1.5 * 2^23 trick), fp16 rounding of the scales, no fused multiply-adds.
The one possible difference is a hybrid flag on a near-tie, where the two errors are equal up to the order
in which the 32 squared errors are summed.

Tiling: a program quantizes BLOCK_T rows (tokens); the tile is loaded as (BLOCK_T, d/32, b, 32/b), i.e.
(row, group, word in the group, code in the word), so group reductions are sums over the last two axes and
packing a word is a sum of shifted codes over the last one.

innerq_flush is the same quantizer for InnerQ's CUDA-graph decode step: one program per (row, KV head) takes
the recent window's oldest 32 tokens and writes them straight into the cache's buffers at a slot read from a
device tensor. Keys are per-token groups as above. Values are per-channel groups: the tile is loaded as
(d, 1, b, 32/b), channels by tokens, and packed along the tokens as they lie (kvquant.pack_tokens: word
[chunk of 32/b tokens, channel]). The symmetric flags become the cache's mask bits.

innerq_aligned_keys and innerq_key_flush are the per-token key work of that step at the paper's windows (keys
leave their window a token at a time, values 32 at a time), in place of some hundred small torch ops. The first
gives the keys of the value window's rows, aligned slot for slot (the first `n_k - n_q` dequantized from the
codes, the rest the key window's exact rows), a program per (row, KV head, 32 rows), before the attention; the
second quantizes the key window's oldest token at slot n_k, a program per (row, KV head, key group of 32 channels),
after it (the static step runs it beside the layers that follow). The key window is a ring
(kvzoo.cache.store.Window.first_row): slot S + j lies in row j mod KW, and no row moves.

group_token_write is kvzoo.cache.kvquant.quantize's asymmetric per-token groups (G channels of one token share
an fp16 scale and zero: KIVI's and SQuat's values, XQuant's X U_v) for the one token a static step quantizes,
written at a device-held slot: one kernel in place of some forty torch ops (quantize, pack, index copies). A
window whose oldest row leaves each step (KIVI's values) is a ring (kvzoo.cache.store.Window.first_row): the
kernel reads the row that slot's token lies in, and no row moves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.cache.kvquant import UnifiedQTensor, quantize_unified
from kvzoo.kernels.quant_matvec import GROUP, check_bits, check_head_dim, check_runnable

MODES = ("asym", "sym", "hybrid")
ROUND = tl.constexpr(12582912.0)   # 1.5 * 2^23: x + ROUND - ROUND rounds |x| < 2^22 to nearest, ties to even


@triton.jit
def _round_clamp(v, TOP: tl.constexpr):
    return tl.minimum(tl.maximum((v + ROUND) - ROUND, 0.0), TOP)


@triton.jit
def _quantize_groups(x, bit, MODE: tl.constexpr, TOP: tl.constexpr):
    """x (ROWS, NG, BITS, CPW) fp32, one group of 32 per (row, g), element index in the group `bit` (BITS, CPW)
    -> (codes as fp32 (ROWS, NG, BITS, CPW), scale fp32 (ROWS, NG), slot int32 (ROWS, NG), sym (ROWS, NG))."""
    negative = x < 0
    signs = tl.sum(tl.sum(negative.to(tl.int32) << bit[None, None, :, :], 3), 2)    # (ROWS, NG)
    if MODE != 1:
        lo = tl.min(tl.min(x, 3), 2)
        scale_a = tl.math.div_rn(tl.max(tl.max(x, 3), 2) - lo, TOP).to(tl.float16).to(tl.float32)
        safe_a = tl.where(scale_a > 0, scale_a, 1.0)
        code_a = _round_clamp(tl.math.div_rn(x - lo[:, :, None, None], safe_a[:, :, None, None]), TOP)
    if MODE != 0:
        magnitude = tl.abs(x)
        scale_s = tl.math.div_rn(tl.max(tl.max(magnitude, 3), 2), TOP).to(tl.float16).to(tl.float32)
        safe_s = tl.where(scale_s > 0, scale_s, 1.0)
        code_s = _round_clamp(tl.math.div_rn(magnitude, safe_s[:, :, None, None]), TOP)
    if MODE == 0:
        sym = tl.zeros(signs.shape, tl.int1)
        codes = code_a
        scale = scale_a
        slot = lo.to(tl.int32, bitcast=True)
    elif MODE == 1:
        sym = tl.full(signs.shape, 1, tl.int1)
        codes = code_s
        scale = scale_s
        slot = signs
    else:
        err_a = code_a * scale_a[:, :, None, None] + lo[:, :, None, None] - x
        err_s = tl.where(negative, -code_s, code_s) * scale_s[:, :, None, None] - x
        sym = tl.sum(tl.sum(err_s * err_s, 3), 2) < tl.sum(tl.sum(err_a * err_a, 3), 2)
        codes = tl.where(sym[:, :, None, None], code_s, code_a)
        scale = tl.where(sym, scale_s, scale_a)
        slot = tl.where(sym, signs, lo.to(tl.int32, bitcast=True))
    return codes, scale, slot, sym


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scale_ptr, slot_ptr, sym_ptr, T,
                     D: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, TOP: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    CPW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = D // 32
    W: tl.constexpr = D * BITS // 32
    first = tl.program_id(0).to(tl.int64) * BLOCK_T                                 # 64-bit tile offsets
    x_ptr += first * D
    codes_ptr += first * W
    scale_ptr += first * NG
    slot_ptr += first * NG
    sym_ptr += first * NG
    t = tl.arange(0, BLOCK_T)                                                        # row in the tile
    live = first + t < T
    g = tl.arange(0, NG)
    wi = tl.arange(0, BITS)
    c = tl.arange(0, CPW)
    bit = wi[:, None] * CPW + c[None, :]                                             # index in the group
    x = tl.load(x_ptr + t[:, None, None, None] * D + g[None, :, None, None] * 32 + bit[None, None, :, :],
                mask=live[:, None, None, None], other=0).to(tl.float32)              # (BLOCK_T, NG, BITS, CPW)
    codes, scale, slot, sym = _quantize_groups(x, bit, MODE, TOP)
    words = tl.sum(codes.to(tl.int32) << (c * BITS)[None, None, None, :], 3)        # (BLOCK_T, NG, BITS)
    tl.store(codes_ptr + t[:, None, None] * W + g[None, :, None] * BITS + wi[None, None, :], words,
             mask=live[:, None, None])
    group = t[:, None] * NG + g[None, :]
    tl.store(scale_ptr + group, scale.to(tl.float16), mask=live[:, None])
    tl.store(slot_ptr + group, slot, mask=live[:, None])
    tl.store(sym_ptr + group, sym, mask=live[:, None])


@triton.jit
def _flush_kernel(kr_ptr, vr_ptr, n_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr,
                  s_res, s_codes, s_kgroups, s_km, s_kmg, s_vgroups, s_vm,
                  D: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, TOP: tl.constexpr, MASK: tl.constexpr):
    """One (batch row, KV head) per program: the first 32 tokens of the recent window (32, D) quantized into
    quantized slots [n, n + 32) of InnerQ's buffers, n read from n_ptr: keys as per-token groups along D,
    values as per-channel groups of the 32 tokens (codes packed along the tokens), and with MASK the
    groups' symmetric flags as one word of mask bits per key group and D/32 words for the values."""
    CPW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = D // 32
    W: tl.constexpr = D * BITS // 32
    head = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr).to(tl.int64)                                                  # quantized tokens so far
    kr_ptr += head * s_res
    vr_ptr += head * s_res
    kc_ptr += head * s_codes + n * W
    vc_ptr += head * s_codes + n * W
    ks_ptr += head * s_kgroups + n * NG
    kz_ptr += head * s_kgroups + n * NG
    vs_ptr += head * s_vgroups + (n // 32) * D
    vz_ptr += head * s_vgroups + (n // 32) * D
    km_ptr += head * s_km + n // 32
    vm_ptr += head * s_vm + (n // 32) * NG
    t = tl.arange(0, 32)                                                             # token
    g = tl.arange(0, NG)
    wi = tl.arange(0, BITS)
    c = tl.arange(0, CPW)
    bit = wi[:, None] * CPW + c[None, :]                                             # index in a group of 32
    # keys: (32 tokens, NG, BITS, CPW), groups along D
    x = tl.load(kr_ptr + t[:, None, None, None] * D + g[None, :, None, None] * 32 + bit[None, None, :, :])
    codes, scale, slot, sym = _quantize_groups(x.to(tl.float32), bit, MODE, TOP)
    words = tl.sum(codes.to(tl.int32) << (c * BITS)[None, None, None, :], 3)        # (32, NG, BITS)
    tl.store(kc_ptr + t[:, None, None] * W + g[None, :, None] * BITS + wi[None, None, :], words)
    tl.store(ks_ptr + t[:, None] * NG + g[None, :], scale.to(tl.float16))
    tl.store(kz_ptr + t[:, None] * NG + g[None, :], slot)
    if MASK:   # bit t of word [g, n // 32]
        tl.store(km_ptr + g * s_kmg, tl.sum(sym.to(tl.int32) << t[:, None], 0))
    # values: (D channels, 1, BITS, CPW) over the 32 tokens, groups along tokens
    ch = tl.arange(0, D)
    x = tl.load(vr_ptr + ch[:, None, None, None] + bit[None, None, :, :] * D)
    codes, scale, slot, sym = _quantize_groups(x.to(tl.float32), bit, MODE, TOP)
    tl.store(vs_ptr + ch, tl.reshape(scale, (D,)).to(tl.float16))
    tl.store(vz_ptr + ch, tl.reshape(slot, (D,)))
    words = tl.sum(codes.to(tl.int32) << (c * BITS)[None, None, None, :], 3)        # (D, 1, BITS)
    tl.store(vc_ptr + wi[None, None, :] * D + ch[:, None, None], words)            # chunk wi, channel by channel
    if MASK:   # bit c % 32 of word [n // 32, c // 32]
        flags = tl.reshape(sym, (NG, 32)).to(tl.int32) << t[None, :]
        tl.store(vm_ptr + g, tl.sum(flags, 1))


def innerq_flush(k_res: Tensor, v_res: Tensor, n_q: Tensor, k_codes: Tensor, k_scale: Tensor, k_slot: Tensor,
                 k_mask: Tensor, v_codes: Tensor, v_scale: Tensor, v_slot: Tensor, v_mask: Tensor, bits: int,
                 mode: str, write_mask: bool) -> None:
    """InnerQ's flush of the recent window in one kernel: its first 32 tokens (k_res, v_res (B, H, >= 32, d)) into
    the cache's full buffers (kvzoo/cache/innerq.py's layout) at quantized slots [n_q, n_q + 32), n_q an int64
    device tensor (1,) (a multiple of 32), as quantize_unified(·, bits, axis, mode) would write them; with
    write_mask the symmetric flags into the mask bits. No host sync, so a CUDA graph can hold it."""
    check_bits(bits)
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; accepted: {', '.join(MODES)}")
    check_runnable(_flush_kernel, k_res.device)
    B, H, _, d = k_res.shape
    check_head_dim(d)
    names = "k_res v_res k_codes k_scale k_slot k_mask v_codes v_scale v_slot v_mask".split()
    for name, t in zip(names, (k_res, v_res, k_codes, k_scale, k_slot, k_mask, v_codes, v_scale, v_slot, v_mask)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the flush writes the cache's own buffers, not views")
    _flush_kernel[(B * H,)](k_res, v_res, n_q, k_codes, k_scale, k_slot, k_mask, v_codes, v_scale, v_slot, v_mask,
                            k_res.stride(1), k_codes.stride(1), k_scale.stride(1), k_mask.stride(1),
                            k_mask.stride(2), v_scale.stride(1), v_mask.stride(1), D=d, BITS=bits,
                            MODE=MODES.index(mode), TOP=float(2 ** bits - 1), MASK=write_mask, num_warps=4,
                            enable_fp_fusion=False)


READS = ("asym", "sym", "mask")


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x in dtype, rounded to nearest even as torch's .to() does; bf16 by integer rounding of the bits (the
    Triton interpreter truncates a bf16 conversion)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)   # how innerq_key_step reads a quantized key group's mode


@triton.jit
def _key_buffers(kc_ptr, ks_ptr, kz_ptr, km_ptr, head, s_codes, s_groups, s_km):
    """The key codec's buffers of one (batch row, KV head)."""
    return kc_ptr + head * s_codes, ks_ptr + head * s_groups, kz_ptr + head * s_groups, km_ptr + head * s_km


@triton.jit
def _aligned_keys_kernel(win_ptr, out_ptr, nk_ptr, nq_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr,
                         s_win, s_out, s_codes, s_groups, s_km, s_kmg, CAPACITY, MASK_UPTO,
                         D: tl.constexpr, BITS: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr,
                         READ: tl.constexpr, CODES: tl.constexpr):
    """Program (batch row x KV head, i): rows [32 i, 32 i + 32) of out (VW, D), row j the key of slot n_q + j,
    dequantized from the codes for j < n_k - n_q, else row (n_q + j) mod KW of the key window win (KW, D), a
    ring."""
    CPW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = D // 32
    W: tl.constexpr = D * BITS // 32
    head = tl.program_id(0).to(tl.int64)
    win_ptr += head * s_win
    out_ptr += head * s_out
    kc_ptr, ks_ptr, kz_ptr, km_ptr = _key_buffers(kc_ptr, ks_ptr, kz_ptr, km_ptr, head, s_codes, s_groups, s_km)
    n_k = tl.load(nk_ptr).to(tl.int32)                                              # keys quantized before the step
    n_q = tl.load(nq_ptr).to(tl.int32)
    delta = n_k - n_q                                                               # of them, values still exact
    d = tl.arange(0, D)
    row = tl.program_id(1) * 32 + tl.arange(0, 32)
    from_win = (row >= delta) & (row < VW)
    src = (n_q + row) % KW
    x = tl.load(win_ptr + src[:, None] * D + d[None, :], mask=from_win[:, None], other=0).to(tl.float32)
    if CODES:                                                                    # (32, D) from the codes
        coded = row < delta
        slot = tl.minimum(n_k - delta + row, CAPACITY - 1)
        word = tl.load(kc_ptr + slot[:, None] * W + (d // CPW)[None, :], mask=coded[:, None], other=0)
        code = ((word >> ((d % CPW) * BITS)[None, :]) & (2 ** BITS - 1)).to(tl.float32)
        group = slot[:, None] * NG + (d // 32)[None, :]
        scale = tl.load(ks_ptr + group, mask=coded[:, None], other=0).to(tl.float32)
        bits = tl.load(kz_ptr + group, mask=coded[:, None], other=0)
        if READ == 0:
            sym = tl.zeros((32, D), tl.int1)
        elif READ == 1:
            sym = tl.full((32, D), 1, tl.int1)
        else:       # bit slot % 32 of word [group, slot // 32]; slots from MASK_UPTO on are symmetric
            has_bit = slot < MASK_UPTO
            mword = tl.load(km_ptr + (d // 32)[None, :] * s_kmg + (slot // 32)[:, None],
                            mask=(coded & has_bit)[:, None], other=0)
            sym = (((mword >> (slot % 32)[:, None]) & 1) != 0) | (~has_bit)[:, None]
        negative = ((bits >> (d % 32)[None, :]) & 1) != 0
        code = tl.where(sym & negative, -code, code)
        zero = tl.where(sym, 0.0, bits.to(tl.float32, bitcast=True))
        x = tl.where(coded[:, None], code * scale + zero, x)
    tl.store(out_ptr + row[:, None] * D + d[None, :], _round_to(x, out_ptr.dtype.element_ty),
             mask=(row < VW)[:, None])


@triton.jit
def _key_flush_kernel(win_ptr, nk_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, s_win, s_codes, s_groups, s_km, s_kmg,
                      D: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr, TOP: tl.constexpr, KW: tl.constexpr,
                      MASK: tl.constexpr):
    """Program (batch row x KV head, key group g): the key window win (KW, D), a ring, its oldest row n_k mod KW,
    group g (channels [32 g, 32 g + 32)), quantized into slot n_k (its mask bit written with MASK)."""
    CPW: tl.constexpr = 32 // BITS
    NG: tl.constexpr = D // 32
    W: tl.constexpr = D * BITS // 32
    head = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    kc_ptr, ks_ptr, kz_ptr, km_ptr = _key_buffers(kc_ptr, ks_ptr, kz_ptr, km_ptr, head, s_codes, s_groups, s_km)
    n_k = tl.load(nk_ptr).to(tl.int32)
    win_ptr += head * s_win + (n_k % KW) * D + g * 32
    wi = tl.arange(0, BITS)
    cw = tl.arange(0, CPW)
    bit = wi[:, None] * CPW + cw[None, :]                                        # index in the group of 32
    oldest = tl.load(win_ptr + bit)[None, None, :, :]                            # (1, 1, BITS, CPW)
    codes, scale, slot, sym = _quantize_groups(oldest.to(tl.float32), bit, MODE, TOP)
    words = tl.sum(codes.to(tl.int32) << (cw * BITS)[None, None, None, :], 3)  # (1, 1, BITS)
    tl.store(kc_ptr + n_k * W + g * BITS + wi[None, None, :], words)
    tl.store(ks_ptr + n_k * NG + g + tl.zeros([1, 1], tl.int32), scale.to(tl.float16))
    tl.store(kz_ptr + n_k * NG + g + tl.zeros([1, 1], tl.int32), slot)
    if MASK:   # bit n_k % 32 of word [g, n_k // 32]
        at = km_ptr + g * s_kmg + n_k // 32
        flag = tl.sum(tl.sum(sym.to(tl.int32), 1), 0) << (n_k % 32)
        tl.store(at, (tl.load(at) & ~(1 << (n_k % 32))) | flag)


def _key_step_checks(win: Tensor, codes: Tensor, scale: Tensor, slot: Tensor, mask: Tensor | None, bits: int,
                     needs_mask: bool) -> tuple[Tensor, int, int]:
    """Refuse what the key kernels cannot take; (the mask words or, with none stored, the codes, never read, and
    their head and group strides)."""
    if needs_mask and mask is None:
        raise ValueError("hybrid groups need the mask bits")
    check_bits(bits)
    check_runnable(_key_flush_kernel, win.device)
    check_head_dim(win.shape[-1])
    for name, t in (("win", win), ("codes", codes), ("scale", scale), ("slot", slot), ("mask", mask)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the step writes the cache's own buffers, not views")
    if mask is not None and mask.numel():
        return mask, mask.stride(1), mask.stride(2)
    return codes, 0, 0


def innerq_aligned_keys(win: Tensor, n_k: Tensor, n_q: Tensor, codes: Tensor, scale: Tensor, slot: Tensor,
                        mask: Tensor | None, rows: int, bits: int, read: str, mask_upto: int) -> Tensor:
    """The keys of the value window's `rows` rows (B, H, rows, d) in win's dtype.

    win (B, H, KW, d) the key window (its token written); n_k, n_q int64 device tensors (1,): keys and values
    held quantized before the step; codes/scale/slot (B, H, capacity, ...) the key codec's buffers, mask its bits
    (B, H, d/32, words) or None. Row j of the result is slot n_q + j's key: the codes' (read as `read`: every group
    "asym", "sym", or by its "mask" bit, slots from mask_upto on symmetric) for j < n_k - n_q, else win's row
    (n_q + j) mod KW (a ring, kvzoo.cache.store.Window.first_row). Equals InnerQCodec.read_at beside the key window
    (kvzoo/cache/innerq.py's torch path)."""
    if read not in READS:
        raise ValueError(f"unknown read mode {read!r}; accepted: {', '.join(READS)}")
    km, s_km, s_kmg = _key_step_checks(win, codes, scale, slot, mask, bits, read == "mask")
    B, H, kw, d = win.shape
    out = torch.empty(B, H, rows, d, dtype=win.dtype, device=win.device)
    capacity = codes.shape[2]
    _aligned_keys_kernel[(B * H, triton.cdiv(rows, 32))](
        win, out, n_k, n_q, codes, scale, slot, km, win.stride(1), out.stride(1), codes.stride(1), scale.stride(1),
        s_km, s_kmg, max(capacity, 1), mask_upto, D=d, BITS=bits, KW=kw, VW=rows, READ=READS.index(read),
        CODES=capacity > 0, num_warps=4, enable_fp_fusion=False)
    return out


def innerq_key_flush(win: Tensor, n_k: Tensor, codes: Tensor, scale: Tensor, slot: Tensor, mask: Tensor | None,
                     bits: int, mode: str) -> None:
    """The key window's oldest token (win (B, H, KW, d), a ring: row n_k mod KW) quantized in `mode` (asym | sym |
    hybrid) into InnerQ's key buffers at slot n_k (an int64 device tensor (1,)), its mask bit written in hybrid
    mode; no row moves. Equals Codec.flush_at of a ring (kvzoo/cache/innerq.py's torch path)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; accepted: {', '.join(MODES)}")
    km, s_km, s_kmg = _key_step_checks(win, codes, scale, slot, mask, bits, mode == "hybrid")
    B, H, kw, d = win.shape
    _key_flush_kernel[(B * H, d // 32)](
        win, n_k, codes, scale, slot, km, win.stride(1), codes.stride(1), scale.stride(1), s_km, s_kmg, D=d, BITS=bits,
        MODE=MODES.index(mode), TOP=float(2 ** bits - 1), KW=kw, MASK=mode == "hybrid", num_warps=4,
        enable_fp_fusion=False)


@triton.jit
def _token_group_kernel(x_ptr, slot_ptr, codes_ptr, scale_ptr, zero_ptr, s_x, s_codes, s_groups, N,
                        NG: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, TOP: tl.constexpr):
    """Program (batch row and head, group g of G channels): row slot mod N's group g as (word, code in word),
    quantized into slot `slot`."""
    CPW: tl.constexpr = 32 // BITS
    WG: tl.constexpr = G // CPW                                                      # words per group
    lead = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    slot = tl.load(slot_ptr).to(tl.int64)
    x_ptr += lead * s_x + (slot % N) * (NG * G) + g * G
    wi = tl.arange(0, WG)
    c = tl.arange(0, CPW)
    x = tl.load(x_ptr + wi[:, None] * CPW + c[None, :]).to(tl.float32)             # (WG, CPW)
    zero = tl.min(tl.min(x, 1), 0).to(tl.float16).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.max(x, 1), 0) - zero, TOP).to(tl.float16).to(tl.float32)
    safe = tl.where(scale > 0, scale, 1.0)
    codes = _round_clamp(tl.math.div_rn(x - zero, safe), TOP)
    words = tl.sum(codes.to(tl.int32) << (c * BITS)[None, :], 1)                    # (WG,)
    tl.store(codes_ptr + lead * s_codes + slot * (NG * WG) + g * WG + wi, words)
    at = lead * s_groups + slot * NG + g
    tl.store(scale_ptr + at, scale.to(tl.float16))
    tl.store(zero_ptr + at, zero.to(tl.float16))


def group_token_write(rows: Tensor, slot: Tensor, codes: Tensor, scale: Tensor, zero: Tensor, bits: int,
                      group: int, ring: bool = False) -> None:
    """One row of rows (*lead, n, width) quantized as kvzoo.cache.kvquant.quantize(row, bits, group) (asymmetric,
    groups of `group` channels, fp16 scale and zero) into a GroupCodec's buffers codes (*lead, capacity, words),
    scale and zero (*lead, capacity, width / group) at slot `slot`, an int64 device tensor (1,). bits 2, 4 or 8,
    `group` a power of two that holds whole code words. n = 1 (one token), or with ring a window of n rows whose
    row slot mod n is the one written (a ring, kvzoo.cache.store.Window.first_row; contiguous)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"group_token_write packs 2-, 4- or 8-bit codes, got {bits}")
    width, n = rows.shape[-1], rows.shape[-2]
    if group & (group - 1) or group % (32 // bits) or width % group:
        raise ValueError(f"group {group} must be a power of two of whole {bits}-bit code words dividing {width}")
    if n != 1 and not ring:
        raise ValueError(f"group_token_write writes one row unless ring=True, got {n}")
    check_runnable(_token_group_kernel, rows.device)
    for name, t in (("codes", codes), ("scale", scale), ("zero", zero)) + ((("rows", rows),) if ring else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous: the write fills the cache's own buffers, not views")
    x = rows.reshape(-1, n * width)                                                  # (prod(lead), n * width)
    ng = width // group
    _token_group_kernel[(x.shape[0], ng)](
        x, slot, codes, scale, zero, x.stride(0), codes.shape[-2] * codes.shape[-1], scale.shape[-2] * scale.shape[-1],
        n, NG=ng, G=group, BITS=bits, TOP=float(2 ** bits - 1), num_warps=2, enable_fp_fusion=False)


def quantize_inner(x: Tensor, bits: int, mode: str = "hybrid", block_t: int | None = None,
                   num_warps: int = 8) -> UnifiedQTensor:
    """InnerQ's key quantizer: groups of 32 along the last dim of x (..., d), packed; equals
    quantize_unified(x, bits, -1, mode). block_t rows per program default to 2048 values per program, which
    with 8 warps keeps the hybrid mode free of register spills on sm_90."""
    check_bits(bits)
    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; accepted: {', '.join(MODES)}")
    if not isinstance(x, Tensor) or x.dim() < 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError("x must be a floating-point tensor (..., d) of fp16, bf16 or fp32")
    check_runnable(_quantize_kernel, x.device)
    d = check_head_dim(x.shape[-1])
    lead = tuple(x.shape[:-1])
    rows = x.contiguous().view(-1, d)
    T = rows.shape[0]
    codes = torch.empty(*lead, d * bits // 32, dtype=torch.int32, device=x.device)
    scale = torch.empty(*lead, d // GROUP, dtype=torch.float16, device=x.device)
    slot = torch.empty(*lead, d // GROUP, dtype=torch.int32, device=x.device)
    sym = torch.empty(*lead, d // GROUP, dtype=torch.bool, device=x.device)
    if T:
        block_t = block_t or max(1, 2048 // d)
        _quantize_kernel[(triton.cdiv(T, block_t),)](
            rows, codes, scale, slot, sym, T, D=d, BITS=bits, MODE=MODES.index(mode), TOP=float(2 ** bits - 1),
            BLOCK_T=block_t, num_warps=num_warps, enable_fp_fusion=False)
    return UnifiedQTensor(codes=codes, scale=scale, slot=slot, sym=sym, bits=bits, axis=-1, shape=tuple(x.shape))


def quantize_inner_ref(x: Tensor, bits: int, mode: str = "hybrid") -> UnifiedQTensor:
    """The reference: kvzoo.cache.kvquant.quantize_unified over per-token groups."""
    return quantize_unified(x, bits, -1, mode)
