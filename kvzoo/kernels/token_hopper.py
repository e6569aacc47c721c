"""The quantized runs of outer_attention's split kernel for int8's layout on Hopper (sm_90), in Gluon: keys and
values as 8-bit codes, each token's head vector one group (one scale and zero a token and stream, stored after
RoPE), head_dim 128, at most 8 query rows a KV head, an fp16/bf16 model. The tail (and sink) stay with the Triton
split kernel, which runs the last program; both write the same (m, l, acc) partials, merged by its combine kernel.

    grid (B*H, splits): program (kv head, split) attends its rep query rows (8, padding past rep) over the groups
    [split * PER_SPLIT, ...) of the slots quantized in both streams, 128 tokens a step: warp w the 32 of group t + w.

As outer_hopper's warp kernel, each of the four warps keeps its own online softmax (m, l, accᵀ) and the warps merge
once, after the loop; both products are mma.sync (m16n8k16, batched over the warps) with the codes in A's registers,
and the loop holds no barrier and no shared memory. What differs is where the scales go: a group is a whole token,
so A holds the codes themselves (exact in fp16) and each token's scale and zero are applied in fp32 around the
products, once a token rather than once a code:
    s    = scale_k * (K_c · qᵀ) + zero_k * Σ_c q_c                      (32 tokens, 8 rows) a warp
    accᵀ += V_cᵀ · (p * scale_v)ᵀ,   z += Σ_tokens p * zero_v           z: the zeros' share, every channel's
  - A code c is read as 1024 + c: one prmt puts two bytes under the magic 0x64 (an fp16 pair), one fp16 subtraction
    takes 1024 off the pair, exactly.
  - Keys, A = K_c (32 tokens, d): a thread's rows are tokens g, g + 8, g + 16, g + 24 (g = lane / 4) and its columns
    channels 32 t .. 32 t + 31 (t = lane % 4), eight words a token, two 16-byte loads. A's column i is channel
    _key_channel(i), the order the query is loaded in.
  - Values, A = V_cᵀ (d, 32 tokens): a thread's rows are channels 16 g .. 16 g + 15 (_value_channel: four words of
    a token, one 16-byte load) and its columns tokens 2 t + {0, 1, 8, 9, 16, 17, 24, 25}: the words of tokens 2 p and
    2 p + 1 are interleaved by bytes (two prmt), so that one register holds a channel of both tokens.
  - The weights p times each token's value scale reach the B operand in fp16, as flash attention rounds p.
  - Each step loads the next one's operands before its own work: 165 registers a thread, three programs an SM
    (PROGRAMS_PER_SM, the split-K plan's), a loop of 665 instructions for 128 tokens (sm_90 SASS, Triton 3.6).
Numerics: the codes and their products exact, the scales and zeros applied in fp32 (the Triton kernel rounds each
code * scale + zero to fp16), fp16 query and weights, fp32 softmax.
Bytes read: the Triton kernel's, 2 (d + 4) a token and KV head.

Speed (Llama-3.1-8B heads, rep 4, one H200, L2 flushed; docs/decode.md, "int8 in four independent warps (H200)"):
53.8 us at 32K, batch 1, 102.0 at 128K, batch 1, 607.4 at 32K, batch 32 and 2,295.5 at 128K, batch 32, 51-87% of
the read floor, against the Triton kernel's 55.7, 152.8, 1,080.2 and 4,242.0 (`python scripts/bench_kernels.py
--floors --cases int8 --shapes 1x32768 1x131072 32x32768 32x131072`, results/kernels/h200/int8-warps).
KVZOO_TOKEN_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel.
"""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvzoo.kernels.outer_hopper import (N_WARPS, WARP_MMA, WARPS, _head_pointers, _is_hopper, _run, warp_query,
                                        warp_columns, warp_merge, warp_store)
from kvzoo.kernels.quant_matvec import kernel_choice, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_TOKEN_KERNEL")
ENABLED = CHOICE != "triton"
HEAD_DIM, ROWS_MAX = 128, 8
PROGRAMS_PER_SM = 3      # the split-K plan's programs an SM
# the least work (KV rows x groups of 32 slots) this kernel takes ("gluon": any): outer_hopper's. The least measured,
# 32K at batch 1 of Llama-3.1-8B's heads (8 x 1,024), takes 53.8 us here against the Triton kernel's 55.7
MIN_GROUP_ROWS = 0 if CHOICE == "gluon" else 2016
# an int32 word's bytes under the magic 0x64 as fp16 pairs 1024 + c, 1024 taken off: bytes (0, 1) and (2, 3)
KEY_ASM = gl.constexpr("{ .reg .b32 m, k; mov.b32 m, 0x64646464; mov.b32 k, 0x64006400; "
                       "prmt.b32 $0, $2, m, 0x4140; prmt.b32 $1, $2, m, 0x4342; "
                       "sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; }")
KEY_CON = gl.constexpr("=r,=r,r,r")
# two tokens' words (even, odd) -> four fp16 pairs, pair j: byte j of both tokens, exact codes
VALUE_ASM = gl.constexpr("{ .reg .b32 lo, hi, m, k; mov.b32 m, 0x64646464; mov.b32 k, 0x64006400; "
                         "prmt.b32 lo, $4, $6, 0x5140; prmt.b32 hi, $4, $6, 0x7362; "
                         "prmt.b32 $0, lo, m, 0x4140; prmt.b32 $1, lo, m, 0x4342; "
                         "prmt.b32 $2, hi, m, 0x4140; prmt.b32 $3, hi, m, 0x4342; "
                         "sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; sub.f16x2 $2, $2, k; sub.f16x2 $3, $3, k; }")
VALUE_CON = gl.constexpr("=r,=r,=r,=r,r,r,r,r")


@gluon.jit
def _key_channel(i):
    """The real channel of the key operand's column i = b + 2 t + 8 h + 16 k: byte 2 h + b of word 8 t + k."""
    return 32 * ((i >> 1) & 3) + 4 * (i >> 4) + 2 * ((i >> 3) & 1) + (i & 1)


@gluon.jit
def _value_channel(r):
    """The real channel of the value operand's row r = g + 8 x + 16 y: 16 g + 2 y + x (byte 2 (y % 2) + x of word
    4 g + y // 2)."""
    return 16 * (r & 7) + 2 * (r >> 4) + ((r >> 3) & 1)


@gluon.jit
def _arange(n: gl.constexpr, DIM: gl.constexpr, L: gl.constexpr):
    """0 .. n - 1 along dim DIM of the 4-D layout L, broadcastable over its other dims."""
    if DIM == 0:
        x = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))[:, None, None, None]
    elif DIM == 1:
        x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))[None, :, None, None]
    elif DIM == 2:
        x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))[None, None, :, None]
    else:
        x = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))[None, None, None, :]
    return x


@gluon.jit
def _operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, t, last, LK: gl.constexpr, LV: gl.constexpr,
              D: gl.constexpr):
    """Step t's operands, warp w's from group t + w, slots past `last` reading `last`: key words (4, 32, 4, 8)
    [warp, token, t, k] in LK (word 8 t + k of the token), value words (4, 32, 8, 4) [warp, token, g, y] in LV (word
    4 g + y), and the tokens' key and value scales and zeros (4, 32) fp32 in the scores' layout."""
    W: gl.constexpr = D // 4
    first = t * 32                                                   # the step's first slot: scalar pointers move
    tk = gl.minimum(_arange(WARPS, 0, LK) * 32 + _arange(32, 1, LK), last - first)
    kw = gl.load(kc_ptr + first * W + (tk * W + _arange(4, 2, LK) * 8 + _arange(8, 3, LK)))
    tv = gl.minimum(_arange(WARPS, 0, LV) * 32 + _arange(32, 1, LV), last - first)
    vw = gl.load(vc_ptr + first * W + (tv * W + _arange(8, 2, LV) * 4 + _arange(4, 3, LV)))
    S: gl.constexpr = gl.SliceLayout(2, WARP_MMA)
    ts = gl.arange(0, WARPS, layout=gl.SliceLayout(1, S))[:, None] * 32 + \
        gl.arange(0, 32, layout=gl.SliceLayout(0, S))[None, :]                     # (4, 32): slots from `first`
    ts = first + gl.minimum(ts, last - first)
    return (kw, vw, gl.load(ks_ptr + ts).to(gl.float32), gl.load(kz_ptr + ts).to(gl.float32),
            gl.load(vs_ptr + ts).to(gl.float32), gl.load(vz_ptr + ts).to(gl.float32))


@gluon.jit
def _keys(kw, LK5: gl.constexpr, KA: gl.constexpr):
    """Key words (4, 32, 4, 8) -> the scores' A operand (4, 32, D): column b + 2 t + 8 h + 16 k is byte 2 h + b of
    word 8 t + k, the code itself in fp16."""
    pairs = gl.convert_layout(gl.join(kw, kw), LK5, assert_trivial=True)    # (4, 32, 4, 8, 2): the pair axis first
    lo, hi = gl.inline_asm_elementwise(KEY_ASM, KEY_CON, [pairs], dtype=(gl.float16,) * 2, is_pure=True, pack=2)
    x = gl.permute(gl.join(lo, hi), (0, 1, 3, 5, 2, 4))                             # (4, 32, k, h, t, b)
    return gl.convert_layout(gl.reshape(x, (WARPS, 32, 4 * kw.shape[2] * kw.shape[3])), KA)


@gluon.jit
def _values(vw, LV5: gl.constexpr, VA: gl.constexpr):
    """Value words (4, 32, 8, 4) [warp, token, g, y] -> the output product's A operand Vᵀ (4, D, 32): row
    g + 8 x + 16 y' is channel 16 g + 2 y' + x (_value_channel), column the token, the code itself in fp16."""
    G: gl.constexpr = vw.shape[2]
    Y: gl.constexpr = vw.shape[3]
    even, odd = gl.split(gl.permute(gl.reshape(vw, (WARPS, 16, 2, G, Y)), (0, 1, 3, 4, 2)))   # tokens 2 p, 2 p + 1
    # each word entered twice, the pair axis a thread's first register (pack=2 takes a register's neighbours)
    even = gl.convert_layout(gl.join(even, even), LV5, assert_trivial=True)
    odd = gl.convert_layout(gl.join(odd, odd), LV5, assert_trivial=True)
    o0, o1, o2, o3 = gl.inline_asm_elementwise(VALUE_ASM, VALUE_CON, [even, odd], dtype=(gl.float16,) * 4,
                                               is_pure=True, pack=2)
    x = gl.join(gl.join(o0, o1), gl.join(o2, o3))                    # (4, 16 p, g, y, parity, byte bit 0, bit 1)
    x = gl.permute(x, (0, 3, 6, 5, 2, 1, 4))                         # (4, y, bit 1, bit 0, g, p, parity)
    return gl.convert_layout(gl.reshape(x, (WARPS, 4 * G * Y, 32)), VA)


@gluon.jit
def _step(ops, q, qsum, m, l, z, acc, qk_scale, t, stop, n_both, LK5: gl.constexpr, LV5: gl.constexpr):
    """Step t: warp w attends group t + w (ops: _operands') with its own online softmax in base 2, on the state
    (m, l, z, acc) _token_kernel holds; slots past n_both and groups from `stop` on are masked to -inf."""
    ROWS: gl.constexpr = q.shape[2]
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=WARP_MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=WARP_MMA, k_width=2)
    kw, vw, ks, kz, vs, vz = ops
    s = mma_v2(_keys(kw, LK5, A), q, gl.zeros([WARPS, 32, ROWS], gl.float32, WARP_MMA))
    js = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, WARP_MMA)))
    ws = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, WARP_MMA)))
    live = ((t + ws)[:, None] * 32 + js[None, :] < n_both) & ((t + ws) < stop)[:, None]     # a warp's group
    # the token's scale and zero around the product, the softmax scale with them; masked: -inf
    s = s * gl.expand_dims(ks * qk_scale, 2) + (gl.expand_dims(kz * qk_scale, 2) * gl.expand_dims(qsum, 1)
                                                + gl.where(live, 0.0, float("-inf"))[:, :, None])
    m_new = gl.maximum(m, gl.max(s, axis=1))
    m_top = gl.where(m_new > float("-inf"), m_new, 0.0)      # a warp with no live token yet: nothing to scale
    alpha = gl.exp2(m - m_top)
    p = gl.exp2(s - gl.expand_dims(m_top, 1))
    a_l = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, l.type.layout)), 1)
    l = l * a_l + gl.sum(gl.reshape(p, (WARPS, 4, 8, ROWS)), axis=1)
    z = z * a_l + gl.sum(gl.reshape(p * gl.expand_dims(vz, 2), (WARPS, 4, 8, ROWS)), axis=1)
    pv = gl.convert_layout((p * gl.expand_dims(vs, 2)).to(gl.float16), B)
    acc = mma_v2(_values(vw, LV5, A), pv, acc * gl.expand_dims(alpha, 1))
    return m_new, l, z, acc


@gluon.jit
def _token_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, m_ptr, l_ptr, acc_ptr, len_ptr, PER_SPLIT,
                  N_COLS, qk_scale, s_kc, s_ks, s_kz, s_vc, s_vs, s_vz, D: gl.constexpr, REP: gl.constexpr,
                  ROWS: gl.constexpr, LK: gl.constexpr, LK5: gl.constexpr, LV: gl.constexpr, LV5: gl.constexpr):
    ROW: gl.constexpr = gl.SliceLayout(1, WARP_MMA)                  # (4, ROWS): each warp's rows
    kv = gl.program_id(0)                        # b * H + h
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr = _head_pointers(kv, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                                                                    s_kc, s_ks, s_kz, s_vc, s_vs, s_vz)
    split = gl.program_id(1)
    n_both, start, stop, last = _run(len_ptr, split, PER_SPLIT)

    # the query qᵀ (4, D, ROWS), column c channel _key_channel(c); its sum over the channels (fp32, of the fp16 query
    # the product takes) carries the keys' zeros
    q = warp_query(q_ptr, kv, _key_channel(warp_columns(D)), REP, ROWS)
    qsum = gl.convert_layout(gl.sum(q.to(gl.float32), axis=1), ROW)

    m = gl.full([WARPS, ROWS], float("-inf"), gl.float32, layout=ROW)
    # each thread's share of the row sums and of the zeros' share: its own tokens' (4, 8 (token bits 0-2), ROWS)
    l = gl.sum(gl.reshape(gl.zeros([WARPS, 32, ROWS], gl.float32, WARP_MMA), (WARPS, 4, 8, ROWS)), axis=1)
    z = l
    acc = gl.zeros([WARPS, D, ROWS], gl.float32, layout=WARP_MMA)
    # each step's operands are loaded a step ahead (past the run: its last slot again, a hit in the caches)
    ops = _operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, start, last, LK, LV, D)
    for t in range(start, stop, WARPS):
        nxt = _operands(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, t + WARPS, last, LK, LV, D)
        m, l, z, acc = _step(ops, q, qsum, m, l, z, acc, qk_scale, t, stop, n_both, LK5, LV5)
        ops = nxt

    # the four warps' partials merged once, the zeros' share added to every channel: (m, l, acc + z)
    m_all, l_all, out, f = warp_merge(m, l, acc)
    z_all = gl.sum(gl.convert_layout(gl.sum(z, axis=1), ROW) * f, axis=0)
    out = out + gl.expand_dims(gl.convert_layout(z_all, gl.SliceLayout(0, out.type.layout)), 0)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, out.type.layout))
    warp_store(m_ptr, l_ptr, acc_ptr, m_all, l_all, out, _value_channel(c), kv, split, N_COLS, REP)


@functools.cache
def _layouts(d: int) -> tuple:
    """(LK, LK5, LV, LV5) for head_dim 128, four warps, warp w on dim 0:
    LK, the key words (4, 32 tokens, 4 t, 8 k): registers k (eight consecutive words), token + 8, + 16; lanes t,
    then token + 1, + 2, + 4; LK5 the same with the pair axis the unpack PTX enters each word on, first;
    LV, the value words (4, 32 tokens, 8 g, 4 y): registers y (four consecutive words), token + 1, + 8, + 16; lanes
    token + 2, + 4, then g; LV5 the even or odd tokens' words (4, 16 pairs p, 8 g, 4 y) the unpack PTX enters on its
    pair axis, first."""
    assert d == HEAD_DIM
    warps4 = [[1, 0, 0, 0], [2, 0, 0, 0]]
    lk = gl.DistributedLinearLayout([[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 8, 0, 0], [0, 16, 0, 0]],
                                    [[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]], warps4, [],
                                    [N_WARPS, 32, 4, 8])
    lk5 = gl.DistributedLinearLayout([[0, 0, 0, 0, 1]] + [b + [0] for b in lk.reg_bases],
                                     [b + [0] for b in lk.lane_bases], [b + [0] for b in lk.warp_bases], [],
                                     [N_WARPS, 32, 4, 8, 2])
    lv = gl.DistributedLinearLayout([[0, 0, 0, 1], [0, 0, 0, 2], [0, 1, 0, 0], [0, 8, 0, 0], [0, 16, 0, 0]],
                                    [[0, 2, 0, 0], [0, 4, 0, 0], [0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0]], warps4, [],
                                    [N_WARPS, 32, 8, 4])
    # a pair p is tokens 2 p, 2 p + 1: LV's token + 2, + 4 (lanes) and + 8, + 16 (registers) are p + 1, + 2, + 4, + 8
    lv5 = gl.DistributedLinearLayout(
        [[0, 0, 0, 0, 1], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [0, 4, 0, 0, 0], [0, 8, 0, 0, 0]],
        [[0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 0, 4, 0, 0]],
        [[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], [], [N_WARPS, 16, 8, 4, 2])
    return lk, lk5, lv, lv5


def eligible(q: Tensor, bits: int, v_bits: int, channel: bool, rope, group: int, rep: int, group_rows: int) -> bool:
    """Whether outer_decode_attention's quantized runs take this kernel: enabled, an sm_90 GPU with the inline-PTX
    path (fp16/bf16, compiled), 8-bit keys and values grouped per token, a group of the whole head (int8), keys
    stored after RoPE, head_dim 128, at most 8 query rows a KV head, and at least MIN_GROUP_ROWS (KV rows x groups)
    of work."""
    d = q.shape[-1]
    return (ENABLED and unpacks_in_ptx(q) and _is_hopper(q.device.index or 0) and bits == 8 and v_bits == 8
            and not channel and rope is None and d == HEAD_DIM and group == d and rep <= ROWS_MAX
            and group_rows >= MIN_GROUP_ROWS)


def quantized_splits(q: Tensor, buffers: list[tuple[Tensor, int]], m: Tensor, l: Tensor, acc: Tensor,
                     lengths: Tensor, per_split: int, splits: int, qk_scale: float) -> None:
    """Write the (m, l, acc) partials of columns [0, splits) (outer_decode_attention's buffers, splits + 1 columns)
    for q (B, Hq, d) contiguous; buffers: outer_decode_attention's (tensor, head stride) pairs of the key and value
    codes, scales and zeros, in that order."""
    B, Hq, d = q.shape
    H = buffers[0][0].shape[1]
    lk, lk5, lv, lv5 = _layouts(d)
    _token_kernel[(B * H, splits)](q, *(t for t, _ in buffers), m, l, acc, lengths, per_split, splits + 1, qk_scale,
                                   *(s for _, s in buffers), D=d, REP=Hq // H, ROWS=ROWS_MAX, LK=lk, LK5=lk5, LV=lv,
                                   LV5=lv5, num_warps=N_WARPS)
