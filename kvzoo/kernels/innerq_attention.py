"""Fused decode attention over an InnerQ cache: one new query token per sequence against N quantized tokens
(inner layout, unified sym/asym groups) plus W exact window tokens (sink + recent), flash-decoding style.

    out (B, Hq, d) = softmax(q · [dequant(K) ; K_win]ᵀ * sm_scale) · [dequant(V) ; V_win]

Inputs (H KV heads, Hq = n_rep * H query heads, GQA: query head h*n_rep + r reads KV head h; b = bits in {2, 4};
W_d = d*b/32 code words per token; N a multiple of 32, possibly 0):
    q       (B, Hq, d)       fp16 / bf16 / fp32, the model dtype
    k_codes int32 (B, H, N, W_d)  k_scale fp16, k_slot int32, k_sym bool|None (B, H, N, d/32)  per-token groups
    v_codes int32 (B, H, N, W_d)  v_scale fp16, v_slot int32, v_sym bool|None (B, H, N/32, d)  per-channel groups,
            codes packed along the tokens (kvzoo.cache.kvquant.pack_tokens: word [chunk of 32/b tokens, channel])
    k_win, v_win (B, H, W, d)  in q's dtype, W >= 0 (W + N > 0)
Groups decode as in quant_matvec.py: asymmetric code*scale + zero (the slot's fp32 bits), symmetric
code*scale with the sign in bit j of the slot; sym None means all groups asymmetric (sign path compiled out).
q is the query as the cache attends with it (after RoPE, times InnerQ's key-normalization factors). There is
no mask: every quantized and window token is attended, as for one decode token of an unpadded sequence.

Three kernels:
  1. split: grid (B*H, splits). A program owns one KV head and a contiguous run of 32-token groups, and
     serves all n_rep query heads of that KV head (rows padded to REP_P = max(16, pow2(n_rep)) for the tensor
     cores), so every code is read from memory exactly once. Each step takes GS groups (BLOCK_N = 32*GS
     tokens; up to 256): it unpacks the key codes (BLOCK_N, W_d, 32/b), applies per-(token, group)
     scale/zero/sign, and computes the scores (REP_P, BLOCK_N) with one tl.dot in the model dtype (fp32
     accumulation); an online softmax in base 2 keeps running max m, sum l and the output transposed, accᵀ
     (d, REP_P); the value words of the step (d, GS*b) unpack to Vᵀ (d, BLOCK_N), each channel's tokens in
     order and a scale and slot per (channel, group), as the keys' tiles with the roles of tokens and channels
     exchanged, and accᵀ += Vᵀ · pᵀ is one tl.dot. fp16 and bf16 models on a GPU take a fast path: code
     words are unpacked two at a time into half2 registers with inline PTX (quant_matvec.unpack_asm: prmt,
     lop3 into the mantissa of 1024.0, sub.f16x2), then code * scale + zero is one fp16 fused multiply-add
     (the fp32 zero point rounded to fp16 first), and the dots run in fp16 (a bf16 query is converted); a
     symmetric group's sign bits are XOR-ed into its fp16 codes (keys and values alike). The generic
     path (fp32, the interpreter) keeps one group per step for fp32 or sym groups at d >= 128
     (_split_kernel_g1: scale and zero of the values after the dot). Symmetric flags are read from the cache's
     packed mask bits. It writes (m, l, acc) per split; with device lengths, a split past the live tokens
     writes an empty partial (m = -inf). On an H100, 2-bit codes with head_dim 64 or 128 and at most 16 query
     rows a KV head take the same split in Gluon instead (kvzoo/kernels/innerq_hopper.py), 128 tokens a step.
  2. windows: grid (B*H, blocks). The exact window tokens, a block of 32 a program (tl.dot against k_win/v_win),
     with the same online softmax, one more partial a block (the last columns). On a GPU (WINDOWS_BESIDE) it runs
     on the attention's second stream (side_stream TAIL), launched before the split kernel and beside it, after
     the current stream's work and whatever the caller issued on that stream (the token's window rows:
     StaticStep.tail), so that neither it nor those writes sit on the step's path.
  3. combine: grid (B*H, d/32), 32 channels a program. Merges every column's partial (combine, shared with
     outer_attention), every split in one step where its tile fits, divides by l and writes (B, Hq, d) in q's dtype.
fp32 inputs use exact fp32 dots (input_precision "ieee"); fp16/bf16 round the dequantized keys and the
softmax weights to fp16 (fast path) or the model dtype before the dots, as flash attention does.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.cache.base import TAIL, side_stream
from kvzoo.cache.kvquant import unpack_sym_mask
from kvzoo.kernels.quant_matvec import (GROUP, check_bits, check_head_dim, check_runnable, check_tensor, dequant_inner,
                                        head_rows, join_codes, sm_count, split_groups, unpack_asm,
                                        unpack_codes, unpacks_in_ptx)

try:
    from kvzoo.kernels import innerq_hopper
except ImportError:          # a Triton without Gluon's Hopper API (older releases): the Triton kernel serves all
    innerq_hopper = None

LOG2E = 1.4426950408889634
BLOCK_W = 32                 # window tokens per step of the window kernel
FAST_PATH = True             # fp16/bf16 models on a GPU: unpack/dequant codes as half2 in inline PTX
WINDOWS_BESIDE = True        # on a GPU the window kernel runs on a second stream, beside the split kernel
MAX_GS = None                # value groups (of 32 tokens) per step of the split kernel; None: by GQA ratio
PROGRAMS_PER_SM = None       # split-K sizing: programs per SM of the device; None: by GQA ratio
COMBINE_CHANNELS = 32        # the combine kernel's channels a program (a KV head's rows take d / 32 programs) ...
MIN_COMBINE_CHANNELS = 8     # ... down to 8 (a 32-byte sector of fp32) where every split then fits one step
COMBINE_TILE = 8192          # the most acc elements (rows x splits x channels) one of its steps loads
SPLIT_STAGES = None          # software-pipelining depth of the split kernel's token loop; None: by GQA ratio
SPLIT_WARPS = None           # warps of the split kernel; None: by GQA ratio


def _split_config(rep: int, fast: bool, has_sym: bool) -> tuple[int, int, int, int]:
    """(max groups per step, programs per SM, num_stages, num_warps) of the multi-group split kernel, tuned on
    an H100 (N = 16K-128K, 2-bit). Fast path: 4 warps; 2 programs per SM with several query heads per KV head,
    4 with one; asymmetric groups 256 tokens per step and 2 stages, groups with symmetric ones 128 tokens and
    3 stages (Llama-3.1-8B shape, hybrid groups, the kernel alone: 128K at batch 1 in 197 us against 229 with
    one stage, 32K at batch 64 in 2.7 ms against 3.2). Generic path (fp32, or the interpreter): 128 tokens per
    step with several query heads per KV head, 64 with one."""
    if fast:
        per_sm = 2 if rep >= 4 else 4
        cfg = (4, per_sm, 3, 4) if has_sym else (8, per_sm, 2, 4)
    else:
        cfg = (4, 2, 2, 4) if rep >= 4 else (2, 8, 3, 4)
    return (MAX_GS or cfg[0], PROGRAMS_PER_SM or cfg[1], SPLIT_STAGES or cfg[2], SPLIT_WARPS or cfg[3])


def whole_waves(rows: int, slots: int, limit: int) -> int:
    """Splits per row (at most `limit`) for a split kernel whose rows * splits programs, each 1 / splits of a row's
    work, run `slots` at a time: of the counts up to twice one wave's (+4), the one whose time in whole waves,
    ceil(rows * splits / slots) / splits, is least; ties keep the count nearest one wave's. 384 KV rows (batch 48
    of 8 heads) on an H100's 264 slots: 2 splits, three full waves, rather than 1, a wave and a half that takes two
    waves' time (the outer kernel at 32K: 1.18 against 1.60 ms)."""
    first = max(1, -(-slots // rows))                      # enough programs for one wave; ties keep the nearest
    best, best_time = 1, math.inf
    for splits in [*range(first, 2 * first + 5), *range(first - 1, 0, -1)]:
        if splits > max(limit, 1):
            continue
        time = math.ceil(rows * splits / slots) / splits
        if time < best_time - 1e-12:
            best, best_time = splits, time
    return best


def one_wave(n_groups: int, rows: int, sms: int, programs_per_sm: float, max_gs: int,
             min_splits: int) -> tuple[int, int, int] | None:
    """(splits, groups per split, GS) of the most splits whose rows * splits programs fit one wave of
    programs_per_sm (a fraction: fewer than the SMs hold) on `sms` SMs, each split whole steps of GS groups; None
    where fewer than min_splits a row fit (larger batches: whole_waves plans them). At small batches one wave beats
    twice as many half-length splits in two (docs/decode.md, "One wave of splits at small batches")."""
    most = int(programs_per_sm * sms) // max(rows, 1)
    if most < min_splits:
        return None
    per_split = -(-n_groups // most)
    gs = min(max_gs, triton.next_power_of_2(per_split))
    per_split = -(-per_split // gs) * gs
    return -(-n_groups // per_split), per_split, gs


def wave_plan(n_groups: int, rows: int, device: torch.device, num_splits: int | None, max_gs: int,
              wave: tuple[float, int]) -> tuple[int, int, int] | None:
    """one_wave's plan for a Gluon kernel on `device` at its (programs an SM, least splits a row), or None: splits
    given, or too many rows."""
    if num_splits is not None:
        return None
    programs_per_sm, min_splits = wave
    return one_wave(n_groups, rows, sm_count(device), programs_per_sm, max_gs, min_splits)


def _plan_splits(n_groups: int, rows: int, device: torch.device, num_splits: int | None, max_gs: int,
                 programs_per_sm: int) -> tuple[int, int, int]:
    """(splits, groups per split, groups per step GS) for the split kernel: GS a power of two <= max_gs that
    divides the groups per split; by default enough programs for programs_per_sm per SM."""
    if num_splits is None:
        target = programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 4
        num_splits = whole_waves(rows, target, n_groups)
    num_splits = max(1, min(num_splits, n_groups))
    per_split = -(-n_groups // num_splits)
    gs = min(max_gs, triton.next_power_of_2(per_split))
    per_split = -(-per_split // gs) * gs
    return -(-n_groups // per_split), per_split, gs


@triton.jit
def _dot_dtype(q):
    """A tile in the dtype of the kernels' dots: fp32 stays fp32, fp16 and bf16 become fp16 (the cache's scales
    and zeros are fp16, so its dequantized keys and values are fp16 values; bf16 values past the fp16 range
    are clamped)."""
    if q.dtype != tl.float32:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def softmax_step(s, m, l):
    """One step of the online softmax in base 2 over scores s (R, BLOCK), already scaled and masked (-inf), with the
    running max m and sum l (R,): (m_new, l_new, alpha, p), alpha rescaling the earlier output and p the step's
    weights."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _live(len_ptr, COUNT, i: tl.constexpr, DYN: tl.constexpr):
    """How many entries are live: COUNT, or with DYN entry i of the device tensor `lengths` (CUDA graphs)."""
    if DYN:
        return tl.load(len_ptr + i)
    return COUNT


@triton.jit
def _key_sym(km_ptr, s_kmg, n, w, live, MASK_UPTO, BITS: tl.constexpr):
    """(tokens, words) symmetric flags of the key groups behind code words w of tokens n, from the packed mask
    (D/32 rows, one bit per token): bit n % 32 of word [group, n // 32]; tokens >= MASK_UPTO have no bit and
    are symmetric (hybrid_prefill's decoded groups)."""
    has_bit = n < MASK_UPTO
    word = tl.load(km_ptr + (w // BITS)[None, :] * s_kmg + (n // 32)[:, None], mask=(live & has_bit)[:, None],
                   other=0)
    return (((word >> (n % 32)[:, None]) & 1) != 0) | (~has_bit)[:, None]


@triton.jit
def _value_sym(vm_ptr, vg, ch, live, MASK_UPTO, D: tl.constexpr):
    """Symmetric flags of value groups vg (32 tokens each) at channels ch (broadcast together), from the packed
    mask (one row of D/32 words per value group): bit ch % 32 of word [vg, ch // 32]."""
    has_bit = vg * 32 < MASK_UPTO
    word = tl.load(vm_ptr + vg * (D // 32) + ch // 32, mask=live & has_bit, other=0)
    return (((word >> (ch % 32)) & 1) != 0) | ~has_bit


@triton.jit
def _split_kernel(q_ptr, qs_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, m_ptr, l_ptr, acc_ptr,
                  len_ptr, N_GROUPS, PER_SPLIT, N_COLS, MASK_UPTO, qk_scale,
                  s_kc, s_ks, s_kz, s_km, s_kmg, s_vc, s_vs, s_vz, s_vm,
                  D: tl.constexpr, BITS: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr,
                  HAS_SYM: tl.constexpr, DYN: tl.constexpr, HAS_QS: tl.constexpr, GS: tl.constexpr,
                  FAST: tl.constexpr, ASM: tl.constexpr, CON: tl.constexpr):
    CPW: tl.constexpr = 32 // BITS               # codes per word
    NG: tl.constexpr = D // 32                   # key groups per token
    W: tl.constexpr = D * BITS // 32             # words per token
    BLOCK_N: tl.constexpr = GS * 32              # tokens per step: GS value groups
    KC: tl.constexpr = GS * BITS                 # value chunks of CPW tokens per step
    kv = tl.program_id(0)                        # b * H + h
    head = kv.to(tl.int64)                       # 64-bit offsets of the head's rows
    kc_ptr += head * s_kc
    ks_ptr += head * s_ks
    kz_ptr += head * s_kz
    km_ptr += head * s_km
    vc_ptr += head * s_vc
    vs_ptr += head * s_vs
    vz_ptr += head * s_vz
    vm_ptr += head * s_vm
    split = tl.program_id(1)
    r = tl.arange(0, REP_P)
    live_r = r < REP
    d = tl.arange(0, D)
    i = tl.arange(0, 32)                         # element within a group: a key's channel, a value's token
    j = tl.arange(0, BLOCK_N)                    # token within the step
    g = tl.arange(0, GS)                         # value group within the step
    kk = tl.arange(0, KC)                        # value chunk of CPW tokens within the step
    w = tl.arange(0, W)
    kg = tl.arange(0, NG)                        # key group within a token
    c = tl.arange(0, CPW)
    shifts = (c * BITS)[None, None, :]
    bit = (w % BITS)[:, None] * CPW + c[None, :]                                     # key: index in its group
    q = tl.load(q_ptr + (kv * REP + r[:, None]) * D + d[None, :], mask=live_r[:, None], other=0)   # (REP_P, D)
    if HAS_QS:                                   # InnerQ's key normalization, folded into the query
        q = (q.to(tl.float32) * tl.load(qs_ptr + kv * D + d).to(tl.float32)[None, :]).to(q.dtype)
    q = _dot_dtype(q)
    m = tl.full((REP_P,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((REP_P,), dtype=tl.float32)
    acc = tl.zeros((D, REP_P), dtype=tl.float32)    # the output transposed, as the value tiles
    start = split * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, _live(len_ptr, N_GROUPS, 0, DYN) // 32)
    stop_tok = stop * 32
    for t in range(start, stop, GS):
        n = t * 32 + j
        live = n < stop_tok
        # keys: (BLOCK_N tokens, W, CPW) codes, one scale/slot per (token, group of 32 channels)
        kw = tl.load(kc_ptr + n[:, None] * W + w[None, :], mask=live[:, None], other=0)
        per_word = n[:, None] * NG + (w // BITS)[None, :]                            # (BLOCK_N, W)
        if FAST:   # codes unpacked as half2 in PTX, signs XOR-ed in; scale and zero applied in one fp16 FMA
            o = tl.inline_asm_elementwise(ASM, CON, [kw], dtype=(tl.float16,) * CPW, is_pure=True, pack=2)
            x = tl.reshape(join_codes(o, BITS), (BLOCK_N, NG, 32), can_reorder=False)   # fp16 codes
            per_group = n[:, None] * NG + kg[None, :]                                   # (BLOCK_N, NG)
            scale = tl.load(ks_ptr + per_group, mask=live[:, None], other=0)[:, :, None]
            slot = tl.load(kz_ptr + per_group, mask=live[:, None], other=0)
            zero = slot.to(tl.float32, bitcast=True).to(tl.float16)[:, :, None]
            if HAS_SYM:   # a symmetric group: no zero, and bit i of its slot, channel i's sign, XOR-ed into the code
                sym = _key_sym(km_ptr, s_kmg, n, kg * BITS, live, MASK_UPTO, BITS)
                flip = ((tl.where(sym, slot, 0)[:, :, None] >> i[None, None, :]) << 15).to(tl.int16)   # bit 15
                x = (x.to(tl.int16, bitcast=True) ^ flip).to(tl.float16, bitcast=True)
                zero = tl.where(sym[:, :, None], 0.0, zero).to(tl.float16)
            k = tl.reshape(x * scale + zero, (BLOCK_N, D), can_reorder=False).to(q.dtype)
        else:
            x = unpack_codes(kw[:, :, None], shifts, BITS)
            scale = tl.load(ks_ptr + per_word, mask=live[:, None], other=0).to(tl.float32)[:, :, None]
            slot = tl.load(kz_ptr + per_word, mask=live[:, None], other=0)
            zero = slot.to(tl.float32, bitcast=True)[:, :, None]
            if HAS_SYM:
                sym = _key_sym(km_ptr, s_kmg, n, w, live, MASK_UPTO, BITS)[:, :, None]
                negative = ((slot[:, :, None] >> bit[None, :, :]) & 1) != 0
                x = tl.where(sym & negative, -x, x)
                zero = tl.where(sym, 0.0, zero)
            k = tl.reshape(x * scale + zero, (BLOCK_N, D), can_reorder=False).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale                # (REP_P, BLOCK_N), base 2
        m, l, alpha, p = softmax_step(tl.where(live[None, :], s, float("-inf")), m, l)
        # values as Vᵀ: codes packed along tokens, so a channel's words of the step (D, KC) unpack to its BLOCK_N
        # tokens in order, GS groups of 32 per channel, each with one scale and slot, as the keys' groups
        vg = t + g                                                                   # (GS,)
        live_g = (vg < stop)[None, :]
        vw = tl.load(vc_ptr + t * 32 * W + kk[None, :] * D + d[:, None], mask=(t + kk // BITS < stop)[None, :],
                     other=0)                                                        # (D, KC)
        per_ch = vg[None, :] * D + d[:, None]                                        # (D, GS)
        if FAST:
            o = tl.inline_asm_elementwise(ASM, CON, [vw], dtype=(tl.float16,) * CPW, is_pure=True, pack=2)
            vx = tl.reshape(join_codes(o, BITS), (D, GS, 32), can_reorder=False)
            v_scale = tl.load(vs_ptr + per_ch, mask=live_g, other=0)[:, :, None]
            v_slot = tl.load(vz_ptr + per_ch, mask=live_g, other=0)
            v_zero = v_slot.to(tl.float32, bitcast=True).to(tl.float16)[:, :, None]
            if HAS_SYM:   # bit i of a symmetric group's slot: token i's sign
                v_sym = _value_sym(vm_ptr, vg[None, :], d[:, None], live_g, MASK_UPTO, D)
                flip = ((tl.where(v_sym, v_slot, 0)[:, :, None] >> i[None, None, :]) << 15).to(tl.int16)
                vx = (vx.to(tl.int16, bitcast=True) ^ flip).to(tl.float16, bitcast=True)
                v_zero = tl.where(v_sym[:, :, None], 0.0, v_zero).to(tl.float16)
        else:
            vx = tl.reshape(unpack_codes(vw[:, :, None], shifts, BITS), (D, GS, 32), can_reorder=False)
            v_scale = tl.load(vs_ptr + per_ch, mask=live_g, other=0).to(tl.float32)[:, :, None]
            v_slot = tl.load(vz_ptr + per_ch, mask=live_g, other=0)
            v_zero = v_slot.to(tl.float32, bitcast=True)[:, :, None]
            if HAS_SYM:
                v_sym = _value_sym(vm_ptr, vg[None, :], d[:, None], live_g, MASK_UPTO, D)[:, :, None]
                negative = ((v_slot[:, :, None] >> i[None, None, :]) & 1) != 0
                vx = tl.where(v_sym & negative, -vx, vx)
                v_zero = tl.where(v_sym, 0.0, v_zero)
        v = tl.reshape(vx * v_scale + v_zero, (D, BLOCK_N), can_reorder=False)     # Vᵀ
        acc = acc * alpha[None, :] + tl.dot(v.to(q.dtype), tl.trans(p.to(q.dtype)), input_precision="ieee")
    rows = (kv * REP + r) * N_COLS + split
    tl.store(m_ptr + rows, m, mask=live_r)
    tl.store(l_ptr + rows, l, mask=live_r)
    tl.store(acc_ptr + rows[None, :] * D + d[:, None], acc, mask=live_r[None, :])


@triton.jit
def _split_kernel_g1(q_ptr, qs_ptr, kc_ptr, ks_ptr, kz_ptr, km_ptr, vc_ptr, vs_ptr, vz_ptr, vm_ptr, m_ptr, l_ptr, acc_ptr,
                     len_ptr, N_GROUPS, PER_SPLIT, N_COLS, MASK_UPTO, qk_scale,
                     s_kc, s_ks, s_kz, s_km, s_kmg, s_vc, s_vs, s_vz, s_vm,
                     D: tl.constexpr, BITS: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr,
                     HAS_SYM: tl.constexpr, DYN: tl.constexpr, HAS_QS: tl.constexpr):
    CPW: tl.constexpr = 32 // BITS               # codes per word
    NG: tl.constexpr = D // 32                   # key groups per token
    W: tl.constexpr = D * BITS // 32             # words per token
    kv = tl.program_id(0)                        # b * H + h
    head = kv.to(tl.int64)                       # 64-bit offsets of the head's rows
    kc_ptr += head * s_kc
    ks_ptr += head * s_ks
    kz_ptr += head * s_kz
    km_ptr += head * s_km
    vc_ptr += head * s_vc
    vs_ptr += head * s_vs
    vz_ptr += head * s_vz
    vm_ptr += head * s_vm
    split = tl.program_id(1)
    r = tl.arange(0, REP_P)
    live_r = r < REP
    d = tl.arange(0, D)
    i = tl.arange(0, 32)                         # element within a group: a key's channel, a value's token
    w = tl.arange(0, W)
    c = tl.arange(0, CPW)
    shifts = (c * BITS)[None, None, :]
    kb = tl.arange(0, BITS)                      # value chunk of CPW tokens within the group
    bit = (w % BITS)[:, None] * CPW + c[None, :]                                     # key: index in its group
    q = tl.load(q_ptr + (kv * REP + r[:, None]) * D + d[None, :], mask=live_r[:, None], other=0)   # (REP_P, D)
    if HAS_QS:
        q = (q.to(tl.float32) * tl.load(qs_ptr + kv * D + d).to(tl.float32)[None, :]).to(q.dtype)
    q = _dot_dtype(q)
    m = tl.full((REP_P,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((REP_P,), dtype=tl.float32)
    acc = tl.zeros((REP_P, D), dtype=tl.float32)
    start = split * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, _live(len_ptr, N_GROUPS, 0, DYN) // 32)
    for t in range(start, stop):
        n = t * 32 + i
        # keys: (32 tokens, W, CPW) codes, one scale/slot per (token, group of 32 channels)
        x = unpack_codes(tl.load(kc_ptr + n[:, None] * W + w[None, :])[:, :, None], shifts, BITS)
        per_word = n[:, None] * NG + (w // BITS)[None, :]                            # (32, W)
        scale = tl.load(ks_ptr + per_word).to(tl.float32)[:, :, None]
        slot = tl.load(kz_ptr + per_word)
        zero = slot.to(tl.float32, bitcast=True)[:, :, None]
        if HAS_SYM:
            sym = _key_sym(km_ptr, s_kmg, n, w, n >= 0, MASK_UPTO, BITS)[:, :, None]
            negative = ((slot[:, :, None] >> bit[None, :, :]) & 1) != 0
            x = tl.where(sym & negative, -x, x)
            zero = tl.where(sym, 0.0, zero)
        k = tl.reshape(x * scale + zero, (32, D), can_reorder=False).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale                # (REP_P, 32), base 2
        m, l, alpha, p = softmax_step(s, m, l)
        p_sum = tl.sum(p, 1)
        # values: the 32 tokens are one group per channel; scale/zero apply after the dot
        vw = tl.load(vc_ptr + t * 32 * W + kb[None, :] * D + d[:, None])           # (D, BITS): a channel's 32 tokens
        vx = tl.reshape(unpack_codes(vw[:, :, None], shifts, BITS), (D, 32), can_reorder=False)   # Vᵀ codes
        v_slot = tl.load(vz_ptr + t * D + d)                                         # (D,)
        v_zero = v_slot.to(tl.float32, bitcast=True)
        if HAS_SYM:
            v_sym = _value_sym(vm_ptr, t + 0 * d, d, d >= 0, MASK_UPTO, D)
            negative = ((v_slot[:, None] >> i[None, :]) & 1) != 0                     # bit i: token i's sign
            vx = tl.where(v_sym[:, None] & negative, -vx, vx)
            v_zero = tl.where(v_sym, 0.0, v_zero)
        pc = tl.dot(p.to(q.dtype), tl.trans(vx.to(q.dtype)), input_precision="ieee")
        v_scale = tl.load(vs_ptr + t * D + d).to(tl.float32)
        acc = acc * alpha[:, None] + pc * v_scale[None, :] + p_sum[:, None] * v_zero[None, :]
    rows = (kv * REP + r) * N_COLS + split
    tl.store(m_ptr + rows, m, mask=live_r)
    tl.store(l_ptr + rows, l, mask=live_r)
    tl.store(acc_ptr + rows[:, None] * D + d[None, :], acc, mask=live_r[:, None])


@triton.jit
def _attend_window(q, kw_ptr, vw_ptr, WIN, m, l, acc, qk_scale, D: tl.constexpr, BLOCK: tl.constexpr):
    """The online softmax (m, l, acc) over WIN exact tokens (WIN, D) of one KV head, BLOCK at a time (dots in
    the split kernels' dtype)."""
    d = tl.arange(0, D)
    j = tl.arange(0, BLOCK)
    for w0 in range(0, WIN, BLOCK):
        live_w = w0 + j < WIN
        window = (w0 + j)[:, None] * D + d[None, :]
        k = _dot_dtype(tl.load(kw_ptr + window, mask=live_w[:, None], other=0))
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        m, l, alpha, p = softmax_step(tl.where(live_w[None, :], s, float("-inf")), m, l)
        v = _dot_dtype(tl.load(vw_ptr + window, mask=live_w[:, None], other=0))
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m, l, acc


@triton.jit
def _attend_ring_block(q, lag_ptr, ring_ptr, vw_ptr, j0, n, n_q, delta, KW, m, l, acc, qk_scale, D: tl.constexpr,
                       BLOCK: tl.constexpr):
    """The online softmax over rows j0 .. j0 + n - 1 (n <= BLOCK) of a window whose row j's value is row j of vw_ptr
    (from j0) and whose key is row j of lag_ptr for j < delta, else row (n_q + j) mod KW of the key ring (InnerQ's
    keys beside its value window)."""
    d = tl.arange(0, D)
    r = tl.arange(0, BLOCK)
    j = j0 + r
    live = r < n
    lag = j < delta
    rows = tl.where(lag, lag_ptr + j * D, ring_ptr + ((n_q + j) % KW) * D)               # (BLOCK,) row pointers
    k = _dot_dtype(tl.load(rows[:, None] + d[None, :], mask=live[:, None], other=0))
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    m, l, alpha, p = softmax_step(tl.where(live[None, :], s, float("-inf")), m, l)
    v = _dot_dtype(tl.load(vw_ptr + r[:, None] * D + d[None, :], mask=live[:, None], other=0))
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m, l, acc


@triton.jit
def merge_splits(m_ptr, l_ptr, acc_ptr, heads, live_r, SPLITS, d, D: tl.constexpr, CHUNK: tl.constexpr):
    """The split kernels' partials (m, l, acc) of query rows `heads` (REP_P,) merged into one online-softmax state,
    acc's channels d (DC,) of D, CHUNK splits per step (their loads issued together: a step is one memory round trip,
    which bounds this loop); rows not live read as empty."""
    REP_P: tl.constexpr = heads.shape[0]
    DC: tl.constexpr = d.shape[0]
    c = tl.arange(0, CHUNK)
    m = tl.full((REP_P,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((REP_P,), dtype=tl.float32)
    acc = tl.zeros((REP_P, DC), dtype=tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        rows = heads[:, None] * SPLITS + (s0 + c)[None, :]                            # (REP_P, CHUNK)
        live = live_r[:, None] & (s0 + c < SPLITS)[None, :]
        m_s = tl.load(m_ptr + rows, mask=live, other=float("-inf"))
        m_s = tl.where(live_r[:, None], m_s, 0.0)                     # padded rows stay finite
        l_s = tl.load(l_ptr + rows, mask=live, other=0.0)
        a_s = tl.load(acc_ptr + rows[:, :, None] * D + d[None, None, :], mask=live[:, :, None], other=0.0)
        m_new = tl.maximum(m, tl.max(m_s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)        # splits past the live tokens hold nothing
        alpha = tl.math.exp2(m - m_ref)
        beta = tl.math.exp2(m_s - m_ref[:, None])                    # (REP_P, CHUNK)
        l = l * alpha + tl.sum(l_s * beta, 1)
        acc = acc * alpha[:, None] + tl.sum(a_s * beta[:, :, None], 1)
        m = m_new
    return m, l, acc


@triton.jit
def _window_kernel(q_ptr, qs_ptr, kw_ptr, vw_ptr, kw2_ptr, vw2_ptr, kr_ptr, m_ptr, l_ptr, acc_ptr, len_ptr, COL,
                   N_COLS, WIN, WIN2, KW, qk_scale, s_kw, s_vw, s_kw2, s_vw2, s_kr,
                   D: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, BLOCK: tl.constexpr,
                   DYN: tl.constexpr, HAS_QS: tl.constexpr, RING: tl.constexpr):
    """Program (KV head, i): the (m, l, acc) partial of the head's query rows over block i of BLOCK exact tokens
    of the windows (the first window's blocks, then the second's), at column COL + i; an empty block (past the
    live tokens) writes m = -inf. RING: the second window's keys from kw2 (rows j < delta) or the key ring kr
    (_attend_ring_block), n_q and delta entries 0 and 3 of the lengths."""
    kv = tl.program_id(0)
    head = kv.to(tl.int64)
    i = tl.program_id(1)
    r = tl.arange(0, REP_P)
    live_r = r < REP
    d = tl.arange(0, D)
    heads = kv * REP + r
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=live_r[:, None], other=0)
    if HAS_QS:
        q = (q.to(tl.float32) * tl.load(qs_ptr + kv * D + d).to(tl.float32)[None, :]).to(q.dtype)
    q = _dot_dtype(q)
    m = tl.full((REP_P,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((REP_P,), dtype=tl.float32)
    acc = tl.zeros((REP_P, D), dtype=tl.float32)
    first = tl.cdiv(WIN, BLOCK)                                 # the first window's blocks
    if i < first:
        m, l, acc = _attend_window(q, kw_ptr + head * s_kw + i * BLOCK * D, vw_ptr + head * s_vw + i * BLOCK * D,
                                   tl.minimum(_live(len_ptr, WIN, 1, DYN) - i * BLOCK, BLOCK), m, l, acc, qk_scale,
                                   D, BLOCK)
    else:
        j = i - first
        n = tl.minimum(_live(len_ptr, WIN2, 2, DYN) - j * BLOCK, BLOCK)
        if RING:
            if n > 0:
                m, l, acc = _attend_ring_block(q, kw2_ptr + head * s_kw2, kr_ptr + head * s_kr,
                                               vw2_ptr + head * s_vw2 + j * BLOCK * D, j * BLOCK, n, tl.load(len_ptr),
                                               tl.load(len_ptr + 3), KW, m, l, acc, qk_scale, D, BLOCK)
        else:
            m, l, acc = _attend_window(q, kw2_ptr + head * s_kw2 + j * BLOCK * D,
                                       vw2_ptr + head * s_vw2 + j * BLOCK * D, n, m, l, acc, qk_scale, D, BLOCK)
    rows = heads * N_COLS + COL + i
    tl.store(m_ptr + rows, m, mask=live_r)
    tl.store(l_ptr + rows, l, mask=live_r)
    tl.store(acc_ptr + rows[:, None] * D + d[None, :], acc, mask=live_r[:, None])


@triton.jit
def combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, q_ptr, kt_ptr, vt_ptr, SPLITS, qk_scale, s_kt, s_vt,
                   D: tl.constexpr, DC: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr, CHUNK: tl.constexpr,
                   TOKEN: tl.constexpr):
    """grid (B*H, D/DC): a KV head's query rows' SPLITS partials merged over channels [j DC, (j + 1) DC), with TOKEN
    then the token given apart (its key and value, one row each, at kt_ptr and vt_ptr + head * s_kt, s_vt) attended
    in fp32 from the dots' dtypes, divided by l and written in out's dtype."""
    kv = tl.program_id(0)
    r = tl.arange(0, REP_P)
    live_r = r < REP
    d = tl.program_id(1) * DC + tl.arange(0, DC)
    heads = kv * REP + r
    m, l, acc = merge_splits(m_ptr, l_ptr, acc_ptr, heads, live_r, SPLITS, d, D, CHUNK)
    combine_output(m, l, acc, out_ptr, q_ptr, kt_ptr, vt_ptr, kv, heads, live_r, d, qk_scale, s_kt, s_vt, D, TOKEN)


@triton.jit
def combine_output(m, l, acc, out_ptr, q_ptr, kt_ptr, vt_ptr, kv, heads, live_r, d, qk_scale, s_kt, s_vt,
                   D: tl.constexpr, TOKEN: tl.constexpr):
    """The end of a combine: the merged state (m, l, acc) of query rows `heads`, channels d, with TOKEN then the
    token given apart attended (combine_kernel's docstring), divided by l and written to out."""
    if TOKEN:
        head = kv.to(tl.int64)
        e = tl.arange(0, D)                                            # the token's score takes every channel
        q = _dot_dtype(tl.load(q_ptr + heads[:, None] * D + e[None, :], mask=live_r[:, None], other=0))
        k = _dot_dtype(tl.load(kt_ptr + head * s_kt + e))
        v = _dot_dtype(tl.load(vt_ptr + head * s_vt + d))
        s = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1, keep_dims=True) * qk_scale   # (REP_P, 1)
        m, l, alpha, p = softmax_step(s, m, l)
        acc = acc * alpha[:, None] + p * v.to(tl.float32)[None, :]
    out = acc / tl.where(live_r, l, 1.0)[:, None]                 # padded rows: l = 0
    tl.store(out_ptr + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live_r[:, None])


def combine_plan(columns: int, rows: int, d: int) -> tuple[int, int]:
    """(channels a combine program takes, columns a step of its merge loads) for `columns` partials of `rows`
    (a power of two) query rows: every split in one step (one memory round trip) where its acc tile fits
    COMBINE_TILE elements, with fewer channels a program (more programs) for many splits."""
    columns, dc = triton.next_power_of_2(columns), min(d, COMBINE_CHANNELS)
    while dc > MIN_COMBINE_CHANNELS and rows * columns * dc > COMBINE_TILE:
        dc //= 2
    return dc, max(1, min(columns, COMBINE_TILE // (rows * dc)))


def combine(m: Tensor, l: Tensor, acc: Tensor, out: Tensor, kv_rows: int, rep: int, num_warps: int,
            token: tuple | None = None) -> None:
    """out (B, Hq, d) from the partials m, l (B*Hq, columns), acc (B*Hq, columns, d): every split's, and the tail's or
    the window blocks'; token: (q (B, Hq, d) contiguous, (k_token, head stride), (v_token, head stride), qk_scale),
    the token being decoded attended after them (outer_decode_attention's k_token and v_token)."""
    rows = triton.next_power_of_2(rep)                             # no dots: rows pad to a power of two only
    q, (kt, s_kt), (vt, s_vt), qk_scale = token if token is not None else (out, (out, 0), (out, 0), 1.0)
    d = out.shape[-1]
    dc, chunk = combine_plan(m.shape[1], rows, d)
    combine_kernel[(kv_rows, d // dc)](m, l, acc, out, q, kt, vt, m.shape[1], qk_scale, s_kt, s_vt, D=d, DC=dc,
                                       REP=rep, REP_P=rows, CHUNK=chunk, TOKEN=token is not None, num_warps=num_warps)


def _check_window(k: Tensor, v: Tensor, name: str, q: Tensor, B: int, H: int, lagging: bool = False) -> int:
    """The window's rows W, v's; k holds as many, or with `lagging` any (the keys before a ring, k_ring2)."""
    if not isinstance(k, Tensor) or k.dim() != 4 or not isinstance(v, Tensor) or v.dim() != 4:
        raise ValueError(f"k_{name} and v_{name} must be tensors (B, H, W, d)")
    W = v.shape[2]
    check_tensor(k, f"k_{name}", (B, H, k.shape[2] if lagging else W, q.shape[-1]), (q.dtype,), q.device)
    check_tensor(v, f"v_{name}", (B, H, W, q.shape[-1]), (q.dtype,), q.device)
    return W


def _check_masks(k_mask: Tensor | None, v_mask: Tensor | None, B: int, H: int, N: int, d: int, mask_upto: int,
                 dev: torch.device) -> None:
    if (k_mask is None) != (v_mask is None):
        raise ValueError("give both k_mask and v_mask, or neither (all groups asymmetric)")
    if k_mask is None:
        return
    cols = -(-min(mask_upto, N) // GROUP)                  # mask words needed along tokens
    for name, t, shape in (("k_mask", k_mask, (B, H, d // GROUP)), ("v_mask", v_mask, (B, H))):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.dtype != torch.int32 or t.device != dev:
            raise ValueError(f"{name} must be an int32 tensor of 4 dims on {dev} (packed symmetric-group bits)")
    if tuple(k_mask.shape[:3]) != (B, H, d // GROUP) or k_mask.shape[3] < cols:
        raise ValueError(f"k_mask has shape {tuple(k_mask.shape)}, expected ({B}, {H}, {d // GROUP}, >= {cols})")
    if tuple(v_mask.shape[:2]) != (B, H) or v_mask.shape[2] < cols or v_mask.shape[3] != d // GROUP:
        raise ValueError(f"v_mask has shape {tuple(v_mask.shape)}, expected ({B}, {H}, >= {cols}, {d // GROUP})")


def innerq_decode_attention(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_slot: Tensor, k_mask: Tensor | None,
                            v_codes: Tensor, v_scale: Tensor, v_slot: Tensor, v_mask: Tensor | None,
                            k_win: Tensor, v_win: Tensor, bits: int, *, k_win2: Tensor | None = None,
                            v_win2: Tensor | None = None, lengths: Tensor | None = None, mask_upto: int | None = None,
                            q_scale: Tensor | None = None, sm_scale: float | None = None,
                            num_splits: int | None = None, num_warps: int = 4,
                            k_ring2: Tensor | None = None) -> Tensor:
    """Decode attention (B, Hq, d) in q's dtype of one query token per sequence over an InnerQ cache: the N
    quantized tokens (inner layout) and the exact tokens of one or two windows (sink and recent).

    k_mask / v_mask are the cache's packed symmetric-group bits (None: every group asymmetric): int32
    (B, H, d/32, >= N/32), bit n % 32 of word [g, n // 32] for token n's key group g, and (B, H, >= N/32, d/32),
    bit c % 32 of word [n // 32, c // 32] for channel c's value group of tokens n // 32; tokens from mask_upto
    on (default N) carry no bit and are symmetric. lengths, an int32 device tensor (3,), makes the live counts
    device data, for CUDA graphs: [quantized tokens (a multiple of 32, <= N), window tokens (<= W), window-2
    tokens (<= W2)]; the buffers behind them are sized for the most tokens, the grid by N. q_scale (B, H, d),
    in q's dtype, multiplies the query of every head of a KV head channel-wise first (InnerQ's key
    normalization). sm_scale defaults to 1/sqrt(d); num_splits (split-K over the quantized tokens) to enough
    programs to fill the device. k_ring2 (B, H, KW, d): the second window's keys lie in a ring (InnerQ's key window
    beside its value window, kvzoo/cache/store.py's Window.first_row): row j's key is k_win2's row j for j < delta
    (keys quantized before their values: k_win2 holds those, dequantized), else k_ring2's row (n + j) mod KW, n the
    quantized tokens; lengths is then (4,) [.., delta]."""
    check_bits(bits)
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor (B, Hq, d)")
    if not isinstance(k_codes, Tensor) or k_codes.dim() != 4:
        raise ValueError("k_codes must be a tensor (B, H, N, d*bits/32)")
    B, Hq, d = q.shape
    H, N = k_codes.shape[1], k_codes.shape[2]
    dev = q.device
    check_runnable(_split_kernel, dev)
    check_head_dim(d)
    check_tensor(q, "q", (B, Hq, d), (torch.float16, torch.bfloat16, torch.float32), dev)
    if H == 0 or Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    if N % GROUP:
        raise ValueError(f"k_codes holds {N} tokens; quantized tokens come in whole groups of {GROUP}")
    words = d * bits // 32
    for name, t, shape, dtype in (("k_codes", k_codes, (B, H, N, words), torch.int32),
                                  ("k_scale", k_scale, (B, H, N, d // GROUP), torch.float16),
                                  ("k_slot", k_slot, (B, H, N, d // GROUP), torch.int32),
                                  ("v_codes", v_codes, (B, H, N, words), torch.int32),
                                  ("v_scale", v_scale, (B, H, N // GROUP, d), torch.float16),
                                  ("v_slot", v_slot, (B, H, N // GROUP, d), torch.int32)):
        check_tensor(t, name, shape, (dtype,), dev)
    W = _check_window(k_win, v_win, "win", q, B, H)
    if (k_win2 is None) != (v_win2 is None):
        raise ValueError("give both k_win2 and v_win2, or neither")
    W2 = 0 if k_win2 is None else _check_window(k_win2, v_win2, "win2", q, B, H, lagging=k_ring2 is not None)
    mask_upto = N if mask_upto is None else mask_upto
    _check_masks(k_mask, v_mask, B, H, N, d, mask_upto, dev)
    if q_scale is not None:
        check_tensor(q_scale, "q_scale", (B, H, d), (q.dtype,), dev)
        q_scale = q_scale.contiguous()
    if k_ring2 is not None:
        if lengths is None or k_win2 is None:
            raise ValueError("k_ring2 needs k_win2 (the keys quantized before their values) and lengths (4,)")
        check_tensor(k_ring2, "k_ring2", (B, H, k_ring2.shape[2], d), (k_win2.dtype,), dev)
    if lengths is not None:
        check_tensor(lengths, "lengths", (3 + (k_ring2 is not None),), (torch.int32,), dev)
    elif N + W + W2 == 0:
        raise ValueError("nothing to attend to: no quantized and no window tokens")
    rep = Hq // H
    rep_p = max(16, triton.next_power_of_2(rep))
    qk_scale = (1 / math.sqrt(d) if sm_scale is None else sm_scale) * LOG2E
    q = q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    has_sym = k_mask is not None
    dyn = lengths is not None
    fast = FAST_PATH and unpacks_in_ptx(q)
    # the generic path (fp32, or the interpreter) keeps the one-group-per-step kernel at d >= 128 for fp32 or
    # sym groups: their fp32 tiles and sign masks take too many registers for multi-group steps
    heavy = not fast and d >= 128 and (q.dtype == torch.float32 or has_sym)
    gluon = False            # the split kernel in Gluon (kvzoo/kernels/innerq_hopper.py: an H100, 2-bit codes)
    if heavy:
        splits, per_split = split_groups(N // GROUP, B * H, dev, num_splits) if N else (0, 0)
    else:
        max_gs, programs_per_sm, stages, split_warps = _split_config(rep, fast, has_sym)
        splits, per_split, gs = _plan_splits(N // GROUP, B * H, dev, num_splits, max_gs, programs_per_sm) \
            if N else (0, 0, 1)
        if N and innerq_hopper is not None and innerq_hopper.eligible(q, bits, rep):
            # one wave at small batches, else whole waves of the programs an SM holds at this batch
            per_sm = innerq_hopper.WAVE[0]
            plan = wave_plan(N // GROUP, B * H, dev, num_splits, innerq_hopper.GROUPS_PER_STEP, innerq_hopper.WAVE)
            if plan is None:
                per_sm = innerq_hopper.programs_per_sm(B * H, sm_count(dev))
                plan = _plan_splits(N // GROUP, B * H, dev, num_splits, innerq_hopper.GROUPS_PER_STEP, per_sm)
            gluon = plan[2] == innerq_hopper.GROUPS_PER_STEP         # splits of whole steps, else the Triton plan
            if gluon:
                splits, per_split, gs = plan
    blocks = triton.cdiv(W, BLOCK_W) + triton.cdiv(W2, BLOCK_W)       # of window tokens, a program each
    cols = splits + max(blocks, 1)      # a partial per split, then one per block of window tokens
    m = torch.empty(B * Hq, cols, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(B * Hq, cols, d, dtype=torch.float32, device=dev)
    len_ptr = lengths if dyn else m
    # an empty window may have no storage: pass q, never read, rather than a null pointer
    (kw, s_kw), (vw, s_vw) = (head_rows(k_win), head_rows(v_win)) if W else ((q, 0), (q, 0))
    (kw2, s_kw2), (vw2, s_vw2) = (head_rows(k_win2), head_rows(v_win2)) if W2 else ((q, 0), (q, 0))
    (kr, s_kr), kw_rows = (head_rows(k_ring2), k_ring2.shape[2]) if k_ring2 is not None else ((q, 0), 1)
    main, side = (torch.cuda.current_stream(dev), side_stream(dev, TAIL)) if WINDOWS_BESIDE and q.is_cuda \
        else (None, None)
    if side is not None:             # after the current stream's work and what the caller issued on `side`
        side.wait_stream(main)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        _window_kernel[(B * H, max(blocks, 1))](
            q, q if q_scale is None else q_scale, kw, vw, kw2, vw2, kr, m, l, acc, len_ptr, splits, cols, W, W2,
            kw_rows, qk_scale, s_kw, s_vw, s_kw2, s_vw2, s_kr, D=d, REP=rep, REP_P=rep_p, BLOCK=BLOCK_W, DYN=dyn,
            HAS_QS=q_scale is not None, RING=k_ring2 is not None, num_warps=num_warps, enable_fp_fusion=True)

    def split_columns() -> None:
        (kc, s_kc), (ks, s_ks), (kz, s_kz), (vc, s_vc), (vs, s_vs), (vz, s_vz) = map(
            head_rows, (k_codes, k_scale, k_slot, v_codes, v_scale, v_slot))
        # an empty mask (no bit ever stored: all symmetric) has no storage: pass the codes, never read
        (km, s_km), (vm, s_vm) = (head_rows(k_mask), head_rows(v_mask)) if has_sym and k_mask.numel() \
            else ((kc, 0), (kc, 0))
        s_kmg = km.stride(2) if km is not kc else 0
        common = (q, q if q_scale is None else q_scale, kc, ks, kz, km, vc, vs, vz, vm, m, l, acc, len_ptr, N,
                  per_split, cols, mask_upto, qk_scale, s_kc, s_ks, s_kz, s_km, s_kmg, s_vc, s_vs, s_vz, s_vm)
        if gluon:
            innerq_hopper.split_partials(q, q_scale, [(kc, s_kc), (ks, s_ks), (kz, s_kz), (km, s_km), (vc, s_vc),
                                                      (vs, s_vs), (vz, s_vz), (vm, s_vm)], s_kmg, m, l, acc, lengths,
                                         N, per_split, splits, cols, mask_upto, has_sym, qk_scale, per_sm)
        elif heavy:
            _split_kernel_g1[(B * H, splits)](*common, D=d, BITS=bits, REP=rep, REP_P=rep_p, HAS_SYM=has_sym,
                                              DYN=dyn, HAS_QS=q_scale is not None, num_warps=num_warps,
                                              enable_fp_fusion=True)
        else:
            _split_kernel[(B * H, splits)](
                *common, D=d, BITS=bits, REP=rep, REP_P=rep_p, HAS_SYM=has_sym, DYN=dyn, HAS_QS=q_scale is not None,
                GS=gs, FAST=fast, ASM=unpack_asm(bits)[0], CON=unpack_asm(bits)[1], num_warps=split_warps,
                num_stages=stages, enable_fp_fusion=True)

    try:
        if splits:
            split_columns()
    finally:                         # also on an error: a graph capture must not end with work left apart
        if side is not None:
            main.wait_stream(side)
    combine(m, l, acc, out, B * H, rep, num_warps)
    return out


def innerq_decode_attention_ref(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_slot: Tensor, k_mask: Tensor | None,
                                v_codes: Tensor, v_scale: Tensor, v_slot: Tensor, v_mask: Tensor | None,
                                k_win: Tensor, v_win: Tensor, bits: int, *, k_win2: Tensor | None = None,
                                v_win2: Tensor | None = None, lengths: Tensor | None = None,
                                mask_upto: int | None = None, q_scale: Tensor | None = None,
                                sm_scale: float | None = None, k_ring2: Tensor | None = None) -> Tensor:
    """Torch attention over the dequantized cache (fp32) concatenated with the windows, fp32 softmax."""
    B, Hq, d = q.shape
    H, N = k_codes.shape[1], k_codes.shape[2]
    n, w, w2 = lengths.tolist()[:3] if lengths is not None else \
        (N, k_win.shape[2], 0 if k_win2 is None else k_win2.shape[2])
    if k_ring2 is not None:                  # row j: k_win2's for j < delta, else the ring's row (n + j) mod KW
        rows = torch.arange(v_win2.shape[2], device=q.device)
        ring = k_ring2.index_select(2, (n + rows) % k_ring2.shape[2])
        lag = k_win2.index_select(2, rows.clamp_max(k_win2.shape[2] - 1))
        k_win2 = torch.where((rows < lengths[3].item())[:, None], lag, ring)
    upto = N if mask_upto is None else mask_upto
    k_sym, v_sym = (None, None) if k_mask is None else \
        (unpack_sym_mask(k_mask, -1, n, upto, d), unpack_sym_mask(v_mask, -2, n, upto, d))
    k_win2, v_win2 = (k_win[:, :, :0], v_win[:, :, :0]) if k_win2 is None else (k_win2, v_win2)
    keys = torch.cat([dequant_inner(k_codes[:, :, :n], k_scale[:, :, :n], k_slot[:, :, :n], k_sym, bits, -1),
                      k_win[:, :, :w].float(), k_win2[:, :, :w2].float()], dim=2)
    values = torch.cat([dequant_inner(v_codes[:, :, :n], v_scale[:, :, :n // GROUP], v_slot[:, :, :n // GROUP], v_sym,
                                      bits, -2), v_win[:, :, :w].float(), v_win2[:, :, :w2].float()], dim=2)
    scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    qh = q.view(B, H, Hq // H, d)
    qh = (qh if q_scale is None else qh * q_scale[:, :, None]).float()
    weights = torch.softmax(torch.einsum("bhrd,bhnd->bhrn", qh, keys) * scale, dim=-1)
    return torch.einsum("bhrn,bhnd->bhrd", weights, values).reshape(B, Hq, d).to(q.dtype)
