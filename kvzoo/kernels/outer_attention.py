"""Fused decode attention over the outer-grouped layout (KIVI, SQuat), and over keys and values both grouped per
token (KV Pareto's token granularity, int8: `key_groups="token"`): one new query token per sequence against the
quantized history, the exact sink and the recent windows, flash-decoding style, all query rows of a KV head in one
program.

    out (B, Hq, d) = softmax(q · [K_sink ; K_tail]ᵀ * sm_scale) · [V_sink ; V_tail]

The tail is every slot after the sink, u = 0, 1, ... n_tail - 1 (the token being decoded last). Keys and values
leave their recent windows at their own pace (KIVI's authors' windows: keys R at a time, values one at a time), so
each stream has its own count of quantized slots, n_k and n_v: slot u's key is quantized when u < n_k, else row
(k_row + u - n_k) mod KW of the key window (KW rows); its value is quantized when u < n_v, else row
(v_row + u - n_v) mod VW of the value window. A window a token leaves at every step is a ring, so that no row moves
(kvzoo/cache/store.py, Window.first_row); k_row and v_row are the rows of its oldest slots.

Inputs (H KV heads, Hq = rep * H query heads, GQA: query head h*rep + j reads KV head h; b = bits in {2, 4, 8},
the keys' and the values' each; W = d*b/32 code words per token; N_k, N_v the buffers' slots; G the channels of a
per-token group, 32 by default, any power of two dividing d):
    q          (B, Hq, d)               fp16 / bf16 / fp32, after RoPE
    k_codes    int32 (B, H, N_k, W)     k_scale, k_zero fp16 (B, H, N_k/32, d)   per-channel groups of 32 tokens
                                        (N_k a multiple of 32); key_groups="token": (B, H, N_k, d/G), per token
    v_codes    int32 (B, H, N_v, W)     v_scale, v_zero fp16 (B, H, N_v, d/G)    per-token groups of G channels
    k_recent, v_recent (B, H, ., d)     the windows' rows, in q's dtype (None: no window)
    k_sink, v_sink     (B, H, ., d)     the sink's rows (may hold none)
    lengths    int32 (6,) on the device: [n_k, n_v, n_tail, n_sink, k_row, v_row] (CUDA graphs read them at
                                        replay)
    k_token, v_token   (B, H, 1, d)     optional: the token being decoded, attended after every stored slot
                                        (its key after RoPE), so that a step can store it beside the attention
A group decodes to code * scale + zero (kvzoo.cache.kvquant's asymmetric quantizer). Every slot counted by
`lengths` is attended: there is no mask (unpadded rows, no sliding window).

Bytes read per token per layer and KV head: the codes, d*b/8 per stream, and the scales and zeros, 4*d/32 per token
for per-channel keys and 4*d/G per per-token stream: 48 bytes at d = 64, b = 2, G = 32 (fp16: 256); int8 (b = 8,
G = d) 2*(d + 4).

Two kernels:
  1. split: grid (B*H, splits + 1). A program owns a run of 32-token groups of one KV head, the slots quantized in
     both streams (u < min(n_k, n_v)), and serves its rep query rows (padded to REP_P >= 16 for the tensor cores).
     A step takes GS groups (32*GS tokens): key codes unpacked and scaled per (group, channel) (per (token, group
     of G channels) with key_groups="token"), one tl.dot for the scores, an online softmax in base 2 (running max
     m, sum l, output acc), value codes scaled per (token, group of G channels), one tl.dot for the output. The
     dequantized tiles are the dots' first operand, keys (32*GS, d) · qᵀ and valuesᵀ (d, 32*GS) · pᵀ: their 32*GS
     or d rows fill the tensor-core tile where the REP_P query rows, mostly padding, do not (faster on an H100 at
     32K-128K than q · keysᵀ and p · values, docs/decode.md; keys stored before RoPE keep that orientation, faster
     for them).
     On a GPU with an fp16/bf16 model the codes are unpacked into half2 registers by inline PTX
     (quant_matvec.unpack_asm) and scale and zero (fp16, as stored) applied in fp16 by one fused multiply-add,
     rounded once; the dots take fp16 (a bf16 query is converted), as flash attention's do. fp32 models (and the
     interpreter) use fp32 codes and exact fp32 dots. The last program of each KV head takes the sink, then the
     tail's slots past the quantized ones 32 at a time, each slot's key and value read from its codes or its window
     by the rule above. Every program writes its (m, l, acc).
     On an H100, KIVI's and SQuat's 2-bit layout (per-channel keys, stored after RoPE or before it) with enough
     work runs its quantized columns in the Gluon kernels of kvzoo/kernels/outer_hopper.py, and 8-bit per-token groups
     (int8's, KV Pareto k8v8's) in the one of kvzoo/kernels/token_hopper.py; this kernel then runs only the last
     program (SPLIT0: the first column this launch owns), beside the Gluon kernel, so that it reads its windows while
     the Gluon kernel computes; the combine waits for both. Both go on the current stream: this program first,
     letting the Gluon kernel launch at its start, and the Gluon kernel's programs wait for it before they exit
     (programmatic dependent launch, quant_matvec.launches_early), which a graph replays 0.4-2.6 us faster than a
     second stream's fork and join (docs/decode.md). The Gluon kernel launches once the last of those programs (a KV
     row each) has started, so this order is kept to KV rows that fit the GPU at once (TAIL_PROGRAMS_PER_SM); more
     rows, or KVZOO_EARLY_LAUNCH=0, put this program on a second stream (TAIL_BESIDE). Beside the per-token kernel at
     a KV row an SM or more, that program is compiled alone (TAIL_ONLY) under a register cap (TAIL_REGISTERS), so
     that it shares an SM with the Gluon kernel's programs. With neither a sink nor a window (every stored slot
     quantized: KV Pareto's and int8's graph step) there is no last program: the Gluon kernel and the combine are the
     whole attention. Where the combine's programs (one an SM at most) find room beside the Gluon kernel's (its
     programs an SM, outer_hopper.programs_an_sm, times the SMs, less the programs it launches: small batches), and
     the last program would run at TAIL_WARPS (not int8's 8), there is no last program either: the Gluon kernel
     goes first and lets the combine launch at its start (griddepcontrol.launch_dependents), and the combine
     attends the sink and the tail (below).
  2. combine: grid (B*H, d/32). Merges the partials, attends the token given apart (k_token, v_token: its score and
     weight in fp32), divides by l and writes (B, Hq, d) in q's dtype (innerq_attention.combine, shared with
     InnerQ's kernels). With the sink and the tail in it (_tail_combine_kernel), each program first attends them as
     the last program would (every channel, the same in each of a KV head's programs) while the Gluon kernel runs,
     then waits for that kernel (griddepcontrol.wait) and merges its partials: at 32K, batch 1 of the 8B heads, 2.1
     us less a call for KV Pareto k8v8 and 0.5 for KIVI-2 (H200, docs/decode.md). The token is the combine's, not
     the split kernel's last program's: a second pass there made the whole split kernel slower at 8 warps
     (docs/decode.md, "int8's kernel at 8 warps"), and int8 on Llama's heads runs it at 8 (split_kernel_warps).
Keys stored before RoPE (KIVI*, `rope=(cos, sin)`): every key, quantized or exact (the sink, the key window), is
rotated to its position in the kernel: sink row i to position i, tail slot u to n_sink + u. The kernel unpacks
each key's two channel halves as separate tiles and never forms the rotated key [lo cos - hi sin, hi cos + lo sin]
(rotate-half style): its four products, each rounded once in the keys' dtype, go to four dots of d/2 channels
summed in fp32, so no key is unpacked twice or moved between halves; it reads the first half of each cos/sin row (a
rotate-half table repeats its frequencies). The Gluon kernel rotates the query back to each step's first position
instead and the keys by their offsets in the step (outer_hopper's docstring).

Scales. On an H100 the split kernel's busiest unit is the L1/shared-memory pipe, not DRAM: the unpacked tiles reach
the tensor cores through shared memory. With per-channel keys and no RoPE (KIVI, SQuat) each step's scales and zeros
are loaded in the rank of the code tiles they multiply, (GS, 1, d) for keys and (32*GS, d/G, 1) for values: loaded
as (GS, d) and (32*GS, d/G) and broadcast, Triton moves them into the tiles' layout through shared memory every
step, about a third of the kernel's shared-memory traffic (128K batch 1: 131 -> 118 us; 32K batch 32: 911 -> 799
us; docs/decode.md). KV Pareto, int8 and KIVI* keep the broadcast loads, which compile to a faster kernel for them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.cache.base import TAIL, side_stream
from kvzoo.cache.kvquant import QTensor, dequantize
from kvzoo.kernels.innerq_attention import (BLOCK_W, LOG2E, _attend_window, _dot_dtype, _plan_splits, combine,
                                            combine_output, combine_plan, merge_splits, softmax_step, wave_plan)
from kvzoo.kernels.quant_matvec import (GROUP, check_head_dim, check_runnable, check_tensor,
                                        dequant_outer, head_rows, join_codes, launches_early, setting, sm_count,
                                        unpack_asm, unpack_codes, unpacks_in_ptx)

try:
    from kvzoo.kernels import outer_hopper, token_hopper
except ImportError:          # a Triton without Gluon's Hopper API (older releases): the Triton kernel serves all
    outer_hopper = token_hopper = None

GROUPS_PER_STEP = 4          # groups of 32 tokens per step of the split kernel (128 tokens)
PROGRAMS_PER_SM = 2          # split-K sizing: programs per SM of the device
SPLIT_WARPS = None           # warps of the split kernel; None: num_warps
WHOLE_TOKEN_WARPS = 8        # ... where a group is a token's d >= 128 channels (int8): faster (docs/decode.md)
SPLIT_STAGES = 3             # software-pipelining depth of the split kernel's token loop
ROPE_GROUPS_PER_STEP = 4     # the same two settings where the kernel rotates keys stored before RoPE (KIVI*)
ROPE_STAGES = 2
FAST_PATH = True             # fp16/bf16 models on a GPU: codes unpacked as half2 in inline PTX
TAIL_BESIDE = True           # the tail's program on a second stream where it does not go first (module docstring)
TAIL_PROGRAMS_PER_SM = 2     # the tail's programs an SM holds: two of the whole kernel's at up to 255 registers
TAIL_WARPS, TAIL_REGISTERS = 4, 168     # beside the per-token kernel, a KV row an SM or more: the tail's program
                                        # compiled alone, under a register cap that fits it beside two of its programs
OUTER_BITS = (2, 4, 8)       # code widths of either stream
# KVZOO_TAIL_IN_COMBINE: where the sink and the tail are attended in the combine (module docstring). auto: beside a
# Gluon kernel whose KV rows' combine programs fit the SMs, one an SM; never: always in the split kernel's last program
# (comparisons); always: also after the Triton kernel (tests)
TAIL_IN_COMBINE = setting("KVZOO_TAIL_IN_COMBINE", ("auto", "never", "always"))


@triton.jit
def _words(c_ptr, n, live, D: tl.constexpr, BITS: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr):
    """Code words of tokens n (BLOCK,) holding channel part PART of PARTS equal parts (PARTS = 1: every channel;
    2: RoPE's rotate-half halves): (BLOCK, W / PARTS), W = D * BITS / 32 words a token."""
    W: tl.constexpr = D * BITS // 32
    WP: tl.constexpr = W // PARTS
    return tl.load(c_ptr + n[:, None] * W + PART * WP + tl.arange(0, WP)[None, :], mask=live[:, None], other=0)


@triton.jit
def _exact_codes(c_ptr, n, live, D: tl.constexpr, BITS: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr):
    """Codes of tokens n (BLOCK,), channel part PART of PARTS, as exact fp32 values (BLOCK, D / PARTS)."""
    c = tl.arange(0, 32 // BITS)
    x = unpack_codes(_words(c_ptr, n, live, D, BITS, PART, PARTS)[:, :, None], (c * BITS)[None, None, :], BITS)
    return tl.reshape(x, (n.shape[0], D // PARTS))


@triton.jit
def _codes(c_ptr, n, live, D: tl.constexpr, BITS: tl.constexpr, FAST: tl.constexpr, ASM: tl.constexpr,
           CON: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr):
    """Codes of tokens n (BLOCK,), channel part PART of PARTS, as exact values (BLOCK, D / PARTS) in channel order:
    fp16 unpacked by inline PTX (FAST), or fp32."""
    CPW: tl.constexpr = 32 // BITS
    if FAST:
        o = tl.inline_asm_elementwise(ASM, CON, [_words(c_ptr, n, live, D, BITS, PART, PARTS)],
                                      dtype=(tl.float16,) * CPW, is_pure=True, pack=2)
        x = join_codes(o, BITS)
    else:
        x = _exact_codes(c_ptr, n, live, D, BITS, PART, PARTS)
    return x


@triton.jit
def _rotated_scores(q_lo, q_hi, k_lo, k_hi, cos_ptr, sin_ptr, pos, live, D: tl.constexpr):
    """Scores (REP_P, BLOCK) of the query rows against keys rotated by RoPE (rotate-half) to positions pos (BLOCK,),
    from the queries' and the keys' channel halves (., D/2) each. The rotated key [lo cos - hi sin, hi cos + lo sin]
    is never formed: its four products, each rounded once in the keys' dtype (fp16 on the fast path), are four dots
    summed in fp32, q_lo · (lo cos) + q_hi · (hi cos) + q_hi · (lo sin) - q_lo · (hi sin). A rotate-half table
    repeats its frequencies in both halves, so only the first half of each cos, sin row (positions, D) is read."""
    E: tl.constexpr = D // 2
    at = pos[:, None] * D + tl.arange(0, E)[None, :]
    cos = tl.load(cos_ptr + at, mask=live[:, None], other=0).to(k_lo.dtype)
    sin = tl.load(sin_ptr + at, mask=live[:, None], other=0).to(k_lo.dtype)
    s = tl.dot(q_lo, tl.trans((k_lo * cos).to(q_lo.dtype)), input_precision="ieee")
    s = tl.dot(q_hi, tl.trans((k_hi * cos).to(q_lo.dtype)), s, input_precision="ieee")
    s = tl.dot(q_hi, tl.trans((k_lo * sin).to(q_lo.dtype)), s, input_precision="ieee")
    return tl.dot(-q_lo, tl.trans((k_hi * sin).to(q_lo.dtype)), s, input_precision="ieee")


@triton.jit
def _halves(x, D: tl.constexpr):
    """x (R, D) as its channel halves (R, D/2) each."""
    R: tl.constexpr = x.shape[0]
    return tl.split(tl.permute(tl.reshape(x, (R, 2, D // 2), can_reorder=False), (0, 2, 1)))


@triton.jit
def _group_keys(kc_ptr, ks_ptr, kz_ptr, t, n, live, stop, D: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                FAST: tl.constexpr, ASM: tl.constexpr, CON: tl.constexpr, KT: tl.constexpr, CG: tl.constexpr,
                PART: tl.constexpr, PARTS: tl.constexpr, IN_RANK: tl.constexpr = False):
    """Keys of the GS whole groups of 32 tokens from group t (tokens n), one scale and zero per (group, channel),
    or with KT per (token, group of CG channels, PARTS = 1): (32*GS, D / PARTS) in the codes' dtype, channel part
    PART of PARTS."""
    BLOCK_N: tl.constexpr = GS * 32
    C: tl.constexpr = D // PARTS
    if KT:
        k = _values(_codes(kc_ptr, n, live, D, BITS, FAST, ASM, CON, 0, 1), ks_ptr, kz_ptr, n, live, D, CG, IN_RANK)
    else:
        g = tl.arange(0, GS)
        per_ch = (t + g)[:, None] * D + PART * C + tl.arange(0, C)[None, :]           # (GS, C)
        live_g = (t + g < stop)[:, None]
        x = tl.reshape(_codes(kc_ptr, n, live, D, BITS, FAST, ASM, CON, PART, PARTS), (GS, 32, C),
                       can_reorder=False)
        if IN_RANK:   # loaded as (GS, 1, C), in the codes' rank (module docstring, Scales)
            scale = tl.load(ks_ptr + per_ch[:, None, :], mask=live_g[:, None, :], other=0).to(x.dtype)
            zero = tl.load(kz_ptr + per_ch[:, None, :], mask=live_g[:, None, :], other=0).to(x.dtype)
        else:
            scale = tl.load(ks_ptr + per_ch, mask=live_g, other=0).to(x.dtype)[:, None, :]
            zero = tl.load(kz_ptr + per_ch, mask=live_g, other=0).to(x.dtype)[:, None, :]
        k = tl.reshape(x * scale + zero, (BLOCK_N, C), can_reorder=False)
    return k


@triton.jit
def _token_keys(kc_ptr, ks_ptr, kz_ptr, u, live, D: tl.constexpr, BITS: tl.constexpr, KT: tl.constexpr,
                CG: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr):
    """Keys of tokens u (BLOCK,), any slots, each with its group's scale and zero (KT: per token, PARTS = 1):
    (BLOCK, D / PARTS) fp32, channel part PART of PARTS."""
    C: tl.constexpr = D // PARTS
    if KT:
        k = _values(_exact_codes(kc_ptr, u, live, D, BITS, 0, 1), ks_ptr, kz_ptr, u, live, D, CG)
    else:
        per_ch = (u // 32)[:, None] * D + PART * C + tl.arange(0, C)[None, :]
        scale = tl.load(ks_ptr + per_ch, mask=live[:, None], other=0).to(tl.float32)
        zero = tl.load(kz_ptr + per_ch, mask=live[:, None], other=0).to(tl.float32)
        k = _exact_codes(kc_ptr, u, live, D, BITS, PART, PARTS) * scale + zero
    return k


@triton.jit
def _values(codes, vs_ptr, vz_ptr, n, live, D: tl.constexpr, CG: tl.constexpr, IN_RANK: tl.constexpr = False):
    """Codes (BLOCK, D) of tokens n (BLOCK,) dequantized: (BLOCK, D) in the codes' dtype, each token's channels in
    groups of CG sharing a scale and zero; dead tokens 0. IN_RANK: scales loaded in the codes' rank (module
    docstring, Scales)."""
    BLOCK: tl.constexpr = n.shape[0]
    x = tl.reshape(codes, (BLOCK, D // CG, CG), can_reorder=False)
    per_group = n[:, None] * (D // CG) + tl.arange(0, D // CG)[None, :]                  # (BLOCK, D/CG)
    if IN_RANK:
        scale = tl.load(vs_ptr + per_group[:, :, None], mask=live[:, None, None], other=0).to(x.dtype)
        zero = tl.load(vz_ptr + per_group[:, :, None], mask=live[:, None, None], other=0).to(x.dtype)
    else:
        scale = tl.load(vs_ptr + per_group, mask=live[:, None], other=0).to(x.dtype)[:, :, None]
        zero = tl.load(vz_ptr + per_group, mask=live[:, None], other=0).to(x.dtype)[:, :, None]
    return tl.reshape(x * scale + zero, (BLOCK, D), can_reorder=False)


@triton.jit
def _online_scores(s, v, live, m, l, acc):
    """One step of the online softmax in base 2: scores s (REP_P, BLOCK) already scaled, values v (BLOCK, D) in
    the dots' dtype, dead tokens masked out of the scores."""
    m, l, alpha, p = softmax_step(tl.where(live[None, :], s, float("-inf")), m, l)
    return m, l, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")


@triton.jit
def _online_scores_t(s, v, live, m, l, acc):
    """_online_scores with the values (BLOCK, D) as the dot's first operand: accᵀ (D, REP_P) += vᵀ · pᵀ."""
    m, l, alpha, p = softmax_step(tl.where(live[None, :], s, float("-inf")), m, l)
    pv = tl.dot(tl.trans(v), tl.trans(p.to(v.dtype)), input_precision="ieee")
    return m, l, acc * alpha[:, None] + tl.trans(pv)


@triton.jit
def _online(q, k, v, live, m, l, acc, qk_scale):
    """_online_scores with the scores of q (REP_P, D) against keys k (BLOCK, D)."""
    return _online_scores(tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale, v, live, m, l, acc)


@triton.jit
def _quantized(q, q_lo, q_hi, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, cos_ptr, sin_ptr, len_ptr, start,
               PER_SPLIT, m, l, acc, qk_scale, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
               GS: tl.constexpr, FAST: tl.constexpr, AK: tl.constexpr, CK: tl.constexpr, AV: tl.constexpr,
               CV: tl.constexpr, ROPE: tl.constexpr, KT: tl.constexpr, CG: tl.constexpr):
    """The online softmax over the groups [start, start + PER_SPLIT) of the slots quantized in both streams."""
    BLOCK_N: tl.constexpr = GS * 32
    IN_RANK: tl.constexpr = not (ROPE or KT)     # per-channel keys, no RoPE: scales in the codes' rank (Scales)
    n_both = tl.minimum(tl.load(len_ptr), tl.load(len_ptr + 1))
    stop = tl.minimum(start + PER_SPLIT, (n_both + 31) // 32)              # every step's first token is live
    for t in range(start, stop, GS):
        n = t * 32 + tl.arange(0, BLOCK_N)
        live = n < n_both
        if ROPE:                                 # keys stored before RoPE: slot u sits at position n_sink + u
            k_lo = _group_keys(kc_ptr, ks_ptr, kz_ptr, t, n, live, stop, D, KB, GS, FAST, AK, CK, KT, CG, 0, 2)
            k_hi = _group_keys(kc_ptr, ks_ptr, kz_ptr, t, n, live, stop, D, KB, GS, FAST, AK, CK, KT, CG, 1, 2)
            s = _rotated_scores(q_lo, q_hi, k_lo, k_hi, cos_ptr, sin_ptr, tl.load(len_ptr + 3) + n, live, D)
        else:
            k = _group_keys(kc_ptr, ks_ptr, kz_ptr, t, n, live, stop, D, KB, GS, FAST, AK, CK, KT, CG, 0, 1,
                            IN_RANK)
            # the dequantized tile as the first operand, (32*GS, D) · (D, REP_P): 32*GS rows fill the tensor-core
            # tile where REP_P (mostly padding) does not
            k = k.to(q.dtype) if FAST else _dot_dtype(k.to(q.dtype))      # FAST: fp16 already, nothing to clamp
            s = tl.trans(tl.dot(k, tl.trans(q), input_precision="ieee"))
        v = _values(_codes(vc_ptr, n, live, D, VB, FAST, AV, CV, 0, 1), vs_ptr, vz_ptr, n, live, D, CG, IN_RANK)
        if ROPE:
            m, l, acc = _online_scores(s * qk_scale, v.to(q.dtype), live, m, l, acc)
        else:
            m, l, acc = _online_scores_t(s * qk_scale, v.to(q.dtype), live, m, l, acc)
    return m, l, acc


@triton.jit
def _rotated_sink(q_lo, q_hi, kw_ptr, vw_ptr, n_sink, cos_ptr, sin_ptr, m, l, acc, qk_scale, D: tl.constexpr,
                  BLOCK: tl.constexpr):
    """The online softmax over the sink's n_sink exact rows, keys stored before RoPE and rotated to positions
    0 .. n_sink - 1 (KIVI*'s sink; _attend_window for keys stored rotated)."""
    E: tl.constexpr = D // 2
    e = tl.arange(0, E)
    for w0 in range(0, n_sink, BLOCK):
        w = w0 + tl.arange(0, BLOCK)
        live = w < n_sink
        k_lo = tl.load(kw_ptr + w[:, None] * D + e[None, :], mask=live[:, None], other=0).to(tl.float32)
        k_hi = tl.load(kw_ptr + w[:, None] * D + E + e[None, :], mask=live[:, None], other=0).to(tl.float32)
        s = _rotated_scores(q_lo, q_hi, k_lo, k_hi, cos_ptr, sin_ptr, w, live, D)
        v = _dot_dtype(tl.load(vw_ptr + w[:, None] * D + tl.arange(0, D)[None, :], mask=live[:, None], other=0))
        m, l, acc = _online_scores(s * qk_scale, v, live, m, l, acc)
    return m, l, acc


@triton.jit
def _tail_key_part(kc_ptr, ks_ptr, kz_ptr, kr_ptr, u, n_k, k_row, KW, live, coded, D: tl.constexpr,
                   KB: tl.constexpr, KT: tl.constexpr, CG: tl.constexpr, PART: tl.constexpr, PARTS: tl.constexpr):
    """Keys of tail slots u (BLOCK,), channel part PART of PARTS, fp32: from the codes where `coded`, else row
    (k_row + u - n_k) mod KW of the key window."""
    C: tl.constexpr = D // PARTS
    k = _token_keys(kc_ptr, ks_ptr, kz_ptr, u, coded, D, KB, KT, CG, PART, PARTS)
    at = ((k_row + u - n_k) % KW)[:, None] * D + PART * C + tl.arange(0, C)[None, :]
    exact = tl.load(kr_ptr + at, mask=(live & ~coded)[:, None], other=0)
    return tl.where(coded[:, None], k, exact.to(tl.float32))


@triton.jit
def _tail(q, q_lo, q_hi, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr, kw_ptr, vw_ptr, cos_ptr,
          sin_ptr, len_ptr, KW, VW, m, l, acc, qk_scale, D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr,
          BLOCK: tl.constexpr, ROPE: tl.constexpr, KT: tl.constexpr, CG: tl.constexpr):
    """The online softmax over the sink, then over the tail's slots past those quantized in both streams, BLOCK
    at a time, each slot's key and value from its codes or its window (module docstring)."""
    d = tl.arange(0, D)
    n_k = tl.load(len_ptr)
    n_v = tl.load(len_ptr + 1)
    n_tail = tl.load(len_ptr + 2)
    n_sink = tl.load(len_ptr + 3)
    k_row = tl.load(len_ptr + 4)                 # the windows' rows of tail slots n_k and n_v (rings)
    v_row = tl.load(len_ptr + 5)
    if ROPE:
        m, l, acc = _rotated_sink(q_lo, q_hi, kw_ptr, vw_ptr, n_sink, cos_ptr, sin_ptr, m, l, acc, qk_scale, D,
                                  BLOCK)
    else:
        m, l, acc = _attend_window(q, kw_ptr, vw_ptr, n_sink, m, l, acc, qk_scale, D, BLOCK)
    for u0 in range(tl.minimum(n_k, n_v), n_tail, BLOCK):
        u = u0 + tl.arange(0, BLOCK)
        live = u < n_tail
        coded = live & (u < n_k)                                   # key from its codes, else from the key window
        if ROPE:                                                   # slot u at position n_sink + u
            k_lo = _tail_key_part(kc_ptr, ks_ptr, kz_ptr, kr_ptr, u, n_k, k_row, KW, live, coded, D, KB, KT, CG, 0, 2)
            k_hi = _tail_key_part(kc_ptr, ks_ptr, kz_ptr, kr_ptr, u, n_k, k_row, KW, live, coded, D, KB, KT, CG, 1, 2)
            s = _rotated_scores(q_lo, q_hi, k_lo, k_hi, cos_ptr, sin_ptr, n_sink + u, live, D)
        else:
            k = _tail_key_part(kc_ptr, ks_ptr, kz_ptr, kr_ptr, u, n_k, k_row, KW, live, coded, D, KB, KT, CG, 0, 1)
            s = tl.dot(q, tl.trans(_dot_dtype(k.to(q.dtype))), input_precision="ieee")
        coded = live & (u < n_v)                                   # value from its codes, else the value window
        v = _values(_exact_codes(vc_ptr, u, coded, D, VB, 0, 1), vs_ptr, vz_ptr, u, coded, D, CG)
        exact = tl.load(vr_ptr + ((v_row + u - n_v) % VW)[:, None] * D + d[None, :], mask=(live & ~coded)[:, None],
                        other=0)
        v = _dot_dtype(tl.where(coded[:, None], v, exact.to(tl.float32)).to(q.dtype))
        m, l, acc = _online_scores(s * qk_scale, v, live, m, l, acc)
    return m, l, acc


@triton.jit
def _split_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr, kw_ptr, vw_ptr, cos_ptr,
                  sin_ptr, m_ptr, l_ptr, acc_ptr, len_ptr, KW, VW, PER_SPLIT, SPLIT0, qk_scale,
                  s_kc, s_ks, s_kz, s_vc, s_vs, s_vz, s_kr, s_vr, s_kw, s_vw,
                  D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, REP: tl.constexpr, REP_P: tl.constexpr,
                  GS: tl.constexpr, BLOCK: tl.constexpr, FAST: tl.constexpr, AK: tl.constexpr, CK: tl.constexpr,
                  AV: tl.constexpr, CV: tl.constexpr, ROPE: tl.constexpr, KT: tl.constexpr, CG: tl.constexpr,
                  TAIL: tl.constexpr, TAIL_ONLY: tl.constexpr, EARLY: tl.constexpr):
    if EARLY:                                    # the split kernel after it may launch (launches_early)
        tl.extra.cuda.gdc_launch_dependents()
    kv = tl.program_id(0)                        # b * H + h
    head = kv.to(tl.int64)
    kc_ptr += head * s_kc
    ks_ptr += head * s_ks
    kz_ptr += head * s_kz
    vc_ptr += head * s_vc
    vs_ptr += head * s_vs
    vz_ptr += head * s_vz
    split = tl.program_id(1) + SPLIT0            # SPLIT0 > 0: the quantized columns are another kernel's
    n_cols = tl.num_programs(1) + SPLIT0
    r = tl.arange(0, REP_P)
    live_r = r < REP
    d = tl.arange(0, D)
    q = _dot_dtype(tl.load(q_ptr + (kv * REP + r[:, None]) * D + d[None, :], mask=live_r[:, None], other=0))
    q_lo, q_hi = _halves(q, D)                   # read only by ROPE's rotated scores
    m = tl.full((REP_P,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((REP_P,), dtype=tl.float32)
    acc = tl.zeros((REP_P, D), dtype=tl.float32)
    if TAIL_ONLY or TAIL and split == n_cols - 1:     # the last program: the sink and the tail
        m, l, acc = _tail(q, q_lo, q_hi, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kr_ptr + head * s_kr,
                          vr_ptr + head * s_vr, kw_ptr + head * s_kw, vw_ptr + head * s_vw, cos_ptr, sin_ptr, len_ptr,
                          KW, VW, m, l, acc, qk_scale, D, KB, VB, BLOCK, ROPE, KT, CG)
    else:
        m, l, acc = _quantized(q, q_lo, q_hi, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, cos_ptr, sin_ptr,
                               len_ptr, split * PER_SPLIT, PER_SPLIT, m, l, acc, qk_scale, D, KB, VB, GS, FAST, AK,
                               CK, AV, CV, ROPE, KT, CG)
    rows = (kv * REP + r) * n_cols + split
    tl.store(m_ptr + rows, m, mask=live_r)
    tl.store(l_ptr + rows, l, mask=live_r)
    tl.store(acc_ptr + rows[:, None] * D + d[None, :], acc, mask=live_r[:, None])


@triton.jit
def _first_rows(x, ROWS: tl.constexpr):
    """x (REP_P, C) -> its first ROWS rows (ROWS a power of two dividing REP_P)."""
    REP_P: tl.constexpr = x.shape[0]
    i = tl.arange(0, REP_P // ROWS)
    return tl.sum(tl.where(i[:, None, None] == 0, tl.reshape(x, (REP_P // ROWS, ROWS, x.shape[1])), 0.0), 0)


@triton.jit
def _tail_combine_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kr_ptr, vr_ptr, kw_ptr, vw_ptr,
                         cos_ptr, sin_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, kt_ptr, vt_ptr, len_ptr, KW, VW, SPLITS,
                         qk_scale, s_kc, s_ks, s_kz, s_vc, s_vs, s_vz, s_kr, s_vr, s_kw, s_vw, s_kt, s_vt,
                         D: tl.constexpr, KB: tl.constexpr, VB: tl.constexpr, REP: tl.constexpr,
                         REP_P: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr,
                         KT: tl.constexpr, CG: tl.constexpr, DC: tl.constexpr, CHUNK: tl.constexpr,
                         TOKEN: tl.constexpr, WAIT: tl.constexpr):
    """grid (B*H, D/DC): the combine with the sink and the tail attended in it. A program first attends its KV
    head's sink and tail (_tail: every channel, the same in each of the head's programs), then, WAIT, waits for the
    quantized columns' kernel launched before it (it was launched while that kernel runs: griddepcontrol), merges
    that kernel's SPLITS partials over channels [j DC, (j + 1) DC), the tail's last as combine_kernel merges the
    tail's column, and ends as combine_kernel (the token given apart, out)."""
    kv = tl.program_id(0)
    head = kv.to(tl.int64)
    r = tl.arange(0, REP_P)
    e = tl.arange(0, D)
    q = _dot_dtype(tl.load(q_ptr + (kv * REP + r[:, None]) * D + e[None, :], mask=(r < REP)[:, None], other=0))
    q_lo, q_hi = _halves(q, D)                   # read only by ROPE's rotated scores
    m_t, l_t, acc_t = _tail(q, q_lo, q_hi, kc_ptr + head * s_kc, ks_ptr + head * s_ks, kz_ptr + head * s_kz,
                            vc_ptr + head * s_vc, vs_ptr + head * s_vs, vz_ptr + head * s_vz, kr_ptr + head * s_kr,
                            vr_ptr + head * s_vr, kw_ptr + head * s_kw, vw_ptr + head * s_vw, cos_ptr, sin_ptr,
                            len_ptr, KW, VW, tl.full((REP_P,), float("-inf"), dtype=tl.float32),
                            tl.zeros((REP_P,), dtype=tl.float32), tl.zeros((REP_P, D), dtype=tl.float32), qk_scale,
                            D, KB, VB, BLOCK, ROPE, KT, CG)
    j = tl.program_id(1)
    c = tl.arange(0, D // DC)
    acc_t = tl.sum(tl.where(c[None, :, None] == j, tl.reshape(_first_rows(acc_t, ROWS), (ROWS, D // DC, DC)), 0.0), 1)
    m_t = tl.reshape(_first_rows(m_t[:, None], ROWS), (ROWS,))
    l_t = tl.reshape(_first_rows(l_t[:, None], ROWS), (ROWS,))
    if WAIT:
        tl.extra.cuda.gdc_wait()
    rows = tl.arange(0, ROWS)
    live_r = rows < REP
    heads = kv * REP + rows
    d = j * DC + tl.arange(0, DC)
    m, l, acc = merge_splits(m_ptr, l_ptr, acc_ptr, heads, live_r, SPLITS, d, D, CHUNK)
    m_new = tl.maximum(m, m_t)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m - m_ref)
    beta = tl.math.exp2(m_t - m_ref)
    combine_output(m_new, l * alpha + l_t * beta, acc * alpha[:, None] + acc_t * beta[:, None], out_ptr, q_ptr, kt_ptr,
                   vt_ptr, kv, heads, live_r, d, qk_scale, s_kt, s_vt, D, TOKEN)


def split_kernel_warps(key_groups: str, group: int, d: int, num_warps: int) -> int:
    """Warps of the split kernel: WHOLE_TOKEN_WARPS where keys and values are grouped per token of d >= 128
    channels (int8 on Llama's heads), else SPLIT_WARPS or num_warps."""
    if key_groups == "token" and group == d >= 128:
        return WHOLE_TOKEN_WARPS
    return SPLIT_WARPS or num_warps


def _check_rows(t: Tensor | None, name: str, B: int, H: int, d: int, q: Tensor) -> int:
    """Rows held by a window buffer (B, H, rows, d) in q's dtype; None holds none."""
    if t is None:
        return 0
    if not isinstance(t, Tensor) or t.dim() != 4:
        raise ValueError(f"{name} must be a tensor (B, H, rows, d)")
    check_tensor(t, name, (B, H, t.shape[2], d), (q.dtype,), q.device)
    return t.shape[2]


def outer_decode_attention(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                           v_scale: Tensor, v_zero: Tensor, bits: int, k_recent: Tensor, v_recent: Tensor,
                           lengths: Tensor | tuple[int, int, int, int], *, k_sink: Tensor | None = None,
                           v_sink: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                           sm_scale: float | None = None, num_splits: int | None = None, num_warps: int = 4,
                           v_bits: int | None = None, key_groups: str = "channel", group: int = GROUP,
                           k_token: Tensor | None = None, v_token: Tensor | None = None) -> Tensor:
    """Decode attention (B, Hq, d) in q's dtype of one query token per sequence over an outer-layout cache (module
    docstring); with k_token and v_token (B, H, 1, d), also over that token (its key after RoPE), after the slots
    `lengths` counts. bits: the keys' (and the values', unless v_bits); key_groups "token" for keys grouped like
    the values, per token (KV Pareto, int8); group: channels per per-token group. lengths: [n_k, n_v, n_tail,
    n_sink], an int32 device tensor (4,) (CUDA graphs) or four ints, with n_k <= N_k, n_v <= N_v, the tail's
    window slots within the windows' rows and n_sink within the sink's; or six, with [.., k_row, v_row]: the rows
    of k_recent and v_recent holding tail slots n_k and n_v, the windows then rings (slot u >= n_k's key in row
    (k_row + u - n_k) mod the window's rows, kvzoo.cache.store.Window.first_row); four ints mean rows 0.
    rope: (cos, sin) tables (P, d) in q's dtype (row p: position p, rotate-half layout) for keys quantized before
    RoPE (KIVI*): every key is rotated in the kernel, sink row i to position i and tail slot u to n_sink + u,
    P >= n_sink + n_tail; the sink's and the key window's rows are given before RoPE, as stored.
    sm_scale defaults to 1/sqrt(d); num_splits (split-K over the slots quantized in both streams) to enough
    programs to fill the device."""
    v_bits = bits if v_bits is None else v_bits
    for name, b in (("bits", bits), ("v_bits", v_bits)):
        if b not in OUTER_BITS:
            raise ValueError(f"{name} must be one of {OUTER_BITS} (codes that never straddle an int32 word), got {b}")
    if key_groups not in ("channel", "token"):
        raise ValueError(f"key_groups must be 'channel' or 'token', got {key_groups!r}")
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor (B, Hq, d)")
    B, Hq, d = q.shape
    dev = q.device
    check_runnable(_split_kernel, dev)
    check_head_dim(d)
    check_tensor(q, "q", (B, Hq, d), (torch.float16, torch.bfloat16, torch.float32), dev)
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a tensor (B, H, N, d*bits/32)")
    H, N_k, N_v = k_codes.shape[1], k_codes.shape[2], v_codes.shape[2]
    if H == 0 or Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    if group < 1 or group & (group - 1) or d % group:
        raise ValueError(f"group must be a power of two dividing head_dim {d}, got {group}")
    channel = key_groups == "channel"
    if channel and N_k % GROUP:
        raise ValueError(f"the key code buffer holds {N_k} slots; per-channel groups come in whole groups of {GROUP}")
    k_groups = (N_k // GROUP, d) if channel else (N_k, d // group)
    for name, t, shape, dtype in (("k_codes", k_codes, (B, H, N_k, d * bits // 32), torch.int32),
                                  ("k_scale", k_scale, (B, H, *k_groups), torch.float16),
                                  ("k_zero", k_zero, (B, H, *k_groups), torch.float16),
                                  ("v_codes", v_codes, (B, H, N_v, d * v_bits // 32), torch.int32),
                                  ("v_scale", v_scale, (B, H, N_v, d // group), torch.float16),
                                  ("v_zero", v_zero, (B, H, N_v, d // group), torch.float16)):
        check_tensor(t, name, shape, (dtype,), dev)
    k_rows = _check_rows(k_recent, "k_recent", B, H, d, q)
    v_rows = _check_rows(v_recent, "v_recent", B, H, d, q)
    if (k_sink is None) != (v_sink is None):
        raise ValueError("give both k_sink and v_sink, or neither")
    sink_rows = _check_rows(k_sink, "k_sink", B, H, d, q)
    _check_rows(v_sink, "v_sink", B, H, d, q)
    if (k_token is None) != (v_token is None):
        raise ValueError("give both k_token and v_token, or neither")
    for name, t in (("k_token", k_token), ("v_token", v_token)):
        if t is not None and _check_rows(t, name, B, H, d, q) != 1:
            raise ValueError(f"{name} must hold one token, (B, H, 1, d)")
    if rope is not None:
        if not channel:
            raise ValueError("rope (keys rotated in the kernel) needs key_groups='channel'")
        if not isinstance(rope, (tuple, list)) or len(rope) != 2 or not isinstance(rope[0], Tensor) \
                or rope[0].dim() != 2:
            raise ValueError("rope must be a pair of tables (cos, sin), each (positions, d)")
        for name, t in zip(("rope cos", "rope sin"), rope):
            check_tensor(t, name, (rope[0].shape[0], d), (q.dtype,), dev)
        if not isinstance(lengths, Tensor) and lengths[3] + lengths[2] > rope[0].shape[0]:
            raise ValueError(f"rope tables hold {rope[0].shape[0]} positions; the keys need {lengths[3] + lengths[2]}")
    if not isinstance(lengths, Tensor):
        if len(lengths) not in (4, 6) or lengths[0] > N_k or lengths[1] > N_v:
            raise ValueError(f"lengths must be [n_k <= {N_k}, n_v <= {N_v}, n_tail, n_sink] and optionally "
                             f"[k_row, v_row], got {lengths}")
        if lengths[3] > sink_rows or lengths[2] - min(lengths[0], lengths[1]) > max(k_rows, v_rows):
            raise ValueError(f"lengths {list(lengths)} attend {lengths[3]} sink rows and "
                             f"{lengths[2] - min(lengths[0], lengths[1])} tail slots past those quantized in both "
                             f"streams; the sink holds {sink_rows} rows and the larger window {max(k_rows, v_rows)}")
        lengths = torch.tensor((*lengths, 0, 0)[:6], dtype=torch.int32, device=dev)
    if isinstance(lengths, Tensor) and lengths.shape == (4,):       # windows in slot order: their rows from 0
        lengths = torch.cat([lengths, lengths.new_zeros(2)])
    check_tensor(lengths, "lengths", (6,), (torch.int32,), dev)
    rep = Hq // H
    rep_p = max(16, triton.next_power_of_2(rep))
    qk_scale = (1 / math.sqrt(d) if sm_scale is None else sm_scale) * LOG2E
    q = q.contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    fast = FAST_PATH and unpacks_in_ptx(q)
    n_groups = -(-min(N_k, N_v) // GROUP)                  # runs of 32 slots; a partial last run is masked
    max_gs, stages = (ROPE_GROUPS_PER_STEP, ROPE_STAGES) if rope is not None else (GROUPS_PER_STEP, SPLIT_STAGES)
    splits, per_split, gs = _plan_splits(n_groups, B * H, dev, num_splits, max_gs, PROGRAMS_PER_SM) \
        if n_groups else (0, 0, 1)
    if n_groups and outer_hopper is not None and outer_hopper.takes_warp_kernel(q, bits, v_bits, channel, rope, group,
                                                                                rep, B * H * n_groups, qk_scale):
        # the warp kernel holds more programs an SM: at small batches one wave of them, else sized for them where
        # each keeps a run of steps
        plan = wave_plan(n_groups, B * H, dev, num_splits, max_gs, outer_hopper.WAVE)
        if plan is not None:
            splits, per_split, gs = plan
        else:
            plan = _plan_splits(n_groups, B * H, dev, num_splits, max_gs, outer_hopper.WARP_PROGRAMS_PER_SM)
            if plan[1] >= outer_hopper.WARP_MIN_GROUPS:
                splits, per_split, gs = plan
    elif n_groups and outer_hopper is not None and outer_hopper.rotates_in_warp_kernel(
            q, bits, v_bits, channel, rope, group, rep, B * H * n_groups, qk_scale):
        plan = wave_plan(n_groups, B * H, dev, num_splits, max_gs, outer_hopper.ROPE_WAVE)
        if plan is not None:
            splits, per_split, gs = plan
    # 8-bit per-token groups (int8, KV Pareto k8v8): their kernel takes splits of any number of groups
    by_token = bool(n_groups) and token_hopper is not None and token_hopper.eligible(q, bits, v_bits, channel, rope,
                                                                                     group, rep, B * H * n_groups)
    if by_token:
        plan = wave_plan(n_groups, B * H, dev, num_splits, max_gs, token_hopper.wave(group, d))
        if plan is not None:
            splits, per_split, gs = plan
        else:
            splits, per_split, gs = _plan_splits(n_groups, B * H, dev, num_splits, max_gs,
                                                 token_hopper.PROGRAMS_PER_SM)
            if per_split < token_hopper.MIN_GROUPS:       # short runs: fewer, longer splits
                splits, per_split, gs = _plan_splits(n_groups, B * H, dev, num_splits, max_gs,
                                                     token_hopper.SHORT_PROGRAMS_PER_SM)
    gluon = bool(splits) and (by_token or outer_hopper is not None and outer_hopper.eligible(
        q, bits, v_bits, channel, rope, group, rep, gs, B * H * n_groups, qk_scale))
    split0 = splits if gluon else 0              # with the Gluon kernel, the Triton kernel runs the last column only
    # ... and beside the per-token kernel at a KV row an SM or more, compiled alone under a register cap so that it
    # shares an SM with that kernel's programs (the whole kernel's, up to 255 registers and 104 KB of shared memory,
    # was 10% slower at batch 32; at batch 1, and beside the other Gluon kernels, the slim one was no faster)
    slim = gluon and by_token and B * H >= sm_count(dev)
    # one partial per split over the quantized slots, and the last for the sink and the tail; no last column with
    # the tail in the combine, or with the Gluon kernel and neither a sink nor a window (every stored slot
    # quantized: no Triton launch)
    windows = bool(sink_rows or k_rows or v_rows)
    # the sink and the tail attended in the combine, launched while the Gluon kernel runs, where the combine's
    # programs, one an SM at most, find room beside that kernel's and the tail's program would take the combine's
    # TAIL_WARPS (int8's, at 8 warps, was 0.5 us slower there: docs/decode.md) (module docstring)
    rows = triton.next_power_of_2(rep)
    dc, chunk = combine_plan(splits, rows, d)
    in_combine = windows and (TAIL_IN_COMBINE == "always" or TAIL_IN_COMBINE == "auto" and gluon and launches_early(dev)
                              and split_kernel_warps(key_groups, group, d, num_warps) == TAIL_WARPS
                              and B * H * (d // dc) <= min(sm_count(dev), sm_count(dev) * (
                                  token_hopper.PROGRAMS_PER_SM if by_token else
                                  outer_hopper.programs_an_sm(d, rep, rope, qk_scale)) - B * H * splits))
    tail = 0 if in_combine or gluon and not windows else 1
    m = torch.empty(B * Hq, splits + tail, dtype=torch.float32, device=dev)
    l = torch.empty_like(m)
    acc = torch.empty(B * Hq, splits + tail, d, dtype=torch.float32, device=dev)
    # an empty buffer may have no storage: pass one element of its dtype, never read, rather than a null pointer
    # (allocated, not filled: a fill is a kernel launch ahead of the attention's, 2-3 us at batch 1)
    buffers = [head_rows(t) if t is not None and t.numel() else
               (torch.empty(1, dtype=q.dtype if t is None else t.dtype, device=dev), 0)
               for t in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_recent, v_recent, k_sink, v_sink)]
    cos, sin = (t.contiguous() for t in rope) if rope is not None else (q, q)       # q: never read

    # the tail's program first and the Gluon kernel launched while it runs, on one stream (module docstring), where
    # the tail's programs (a KV row each) fit the GPU at once: the Gluon kernel launches once the last has started
    early = gluon and bool(tail) and B * H <= TAIL_PROGRAMS_PER_SM * sm_count(dev) and launches_early(dev)

    def triton_columns():
        _split_kernel[(B * H, splits + tail - split0)](
            q, *(t for t, _ in buffers), cos, sin, m, l, acc, lengths, max(k_rows, 1), max(v_rows, 1), per_split,
            split0, qk_scale,
            *(s for _, s in buffers), D=d, KB=bits, VB=v_bits, REP=rep, REP_P=rep_p, GS=gs, BLOCK=BLOCK_W, FAST=fast,
            AK=unpack_asm(bits)[0], CK=unpack_asm(bits)[1], AV=unpack_asm(v_bits)[0], CV=unpack_asm(v_bits)[1],
            ROPE=rope is not None, KT=not channel, CG=group, TAIL=bool(tail), TAIL_ONLY=slim, EARLY=early,
            enable_fp_fusion=True,
            **(dict(num_warps=TAIL_WARPS, num_stages=1, maxnreg=TAIL_REGISTERS) if slim else
               dict(num_warps=split_kernel_warps(key_groups, group, d, num_warps), num_stages=stages)))

    def quantized_splits():
        if by_token:
            token_hopper.quantized_splits(q, buffers[:6], m, l, acc, lengths, per_split, splits, qk_scale, group,
                                          early)
        else:
            outer_hopper.quantized_splits(q, buffers[:6], m, l, acc, lengths, per_split, splits, qk_scale, group,
                                         rope, early)

    if not gluon:
        if splits + tail:
            triton_columns()
    elif not tail:
        quantized_splits()
    elif early:
        triton_columns()
        quantized_splits()
    elif TAIL_BESIDE:                            # the tail reads its windows while the Gluon kernel computes
        main, side = torch.cuda.current_stream(dev), side_stream(dev, TAIL)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            triton_columns()
        quantized_splits()
        main.wait_stream(side)
    else:
        quantized_splits()
        triton_columns()
    token = (q, head_rows(k_token), head_rows(v_token), qk_scale) if k_token is not None else None
    if not in_combine:
        combine(m, l, acc, out, B * H, rep, num_warps, token)
        return out
    (kt, s_kt), (vt, s_vt) = token[1:3] if token is not None else ((out, 0), (out, 0))
    _tail_combine_kernel[(B * H, d // dc)](
        q, *(t for t, _ in buffers), cos, sin, m, l, acc, out, kt, vt, lengths, max(k_rows, 1), max(v_rows, 1), splits,
        qk_scale, *(s for _, s in buffers), s_kt, s_vt, D=d, KB=bits, VB=v_bits, REP=rep, REP_P=rep_p, ROWS=rows,
        BLOCK=BLOCK_W, ROPE=rope is not None, KT=not channel, CG=group, DC=dc, CHUNK=chunk, TOKEN=token is not None,
        WAIT=gluon, num_warps=TAIL_WARPS, num_stages=1, maxnreg=TAIL_REGISTERS,
        **(dict(launch_pdl=True) if gluon else {}))
    return out


def outer_decode_attention_ref(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, v_codes: Tensor,
                               v_scale: Tensor, v_zero: Tensor, bits: int, k_recent: Tensor, v_recent: Tensor,
                               lengths: Tensor | tuple[int, int, int, int], *, k_sink: Tensor | None = None,
                               v_sink: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                               sm_scale: float | None = None, v_bits: int | None = None, key_groups: str = "channel",
                               group: int = GROUP, k_token: Tensor | None = None,
                               v_token: Tensor | None = None) -> Tensor:
    """Torch attention over the sink and the tail, each slot's key and value dequantized (and rotated, with rope)
    or read from its window (module docstring), then the token if given, fp32 softmax."""
    B, Hq, d = q.shape
    H = k_codes.shape[1]
    n_k, n_v, n_tail, n_sink, k_row, v_row = (*(lengths.tolist() if isinstance(lengths, Tensor) else lengths), 0, 0)[:6]

    def window(rows, first, n):            # n rows of a ring from row `first`, in slot order (None: no window)
        none = q.new_zeros(B, H, 0, d, dtype=torch.float32)
        return none if rows is None else rows.roll(-first, dims=2)[:, :, :n].float()

    def per_token(codes, scale, zero, b, n):                 # (B, H, n, d) fp32, groups of `group` channels
        return dequantize(QTensor(codes[:, :, :n], scale[:, :, :n], zero[:, :, :n], b, group, -1, (B, H, n, d)))

    if key_groups == "channel":
        k_q = dequant_outer(k_codes[:, :, :n_k], k_scale[:, :, :n_k // GROUP], k_zero[:, :, :n_k // GROUP], bits, -2)
    else:
        k_q = per_token(k_codes, k_scale, k_zero, bits, n_k)
    v_q = per_token(v_codes, v_scale, v_zero, bits if v_bits is None else v_bits, n_v)
    sink = [] if k_sink is None else [(k_sink[:, :, :n_sink].float(), v_sink[:, :, :n_sink].float())]
    keys = torch.cat([s[0] for s in sink] + [k_q, window(k_recent, k_row, n_tail - n_k)], dim=2)
    if rope is not None:                       # key i (sink rows, then the tail's slots) at position i, rotate-half
        cos, sin = (t[:keys.shape[2]].float() for t in rope)
        keys = keys * cos + torch.cat([-keys[..., d // 2:], keys[..., :d // 2]], dim=-1) * sin
    values = torch.cat([s[1] for s in sink] + [v_q, window(v_recent, v_row, n_tail - n_v)], dim=2)
    if k_token is not None:
        keys, values = torch.cat([keys, k_token.float()], dim=2), torch.cat([values, v_token.float()], dim=2)
    scale = 1 / math.sqrt(d) if sm_scale is None else sm_scale
    qh = q.view(B, H, Hq // H, d).float()
    weights = torch.softmax(torch.einsum("bhrd,bhnd->bhrn", qh, keys) * scale, dim=-1)
    return torch.einsum("bhrn,bhnd->bhrd", weights, values).reshape(B, Hq, d).to(q.dtype)
