"""The quantized runs of outer_attention's split kernel for 8-bit codes in per-token groups on Hopper (sm_90), in
Gluon: int8's layout (each token's head vector one group) and KV Pareto's k8v8 (groups of 32 or 64 channels), keys
and values as 8-bit codes with an fp16 scale and zero a group, keys stored after RoPE, head_dim 128, at most 8 query
rows a KV head, an fp16/bf16 model. The tail (and sink) stay with the Triton split kernel, which runs the last
program; both write the same (m, l, acc) partials, merged by its combine kernel.

    grid (B*H, splits): program (kv head, split) attends its rep query rows (8, padding past rep) over the groups
    [split * PER_SPLIT, ...) of the slots quantized in both streams, 128 tokens a step: warp w the 32 of group t + w.

As outer_hopper's warp kernel, each of the four warps keeps its own online softmax (m, l, accᵀ) and the warps merge
once, after the loop; both products are mma.sync (m16n8k16, batched over the warps) with the codes in A's registers,
and the loop holds no barrier and no shared memory. A split runs its whole steps (128 live slots) first, unclamped
and unmasked, then the rest.
  - A code c is read as 1024 + c: one prmt puts two bytes under the magic 0x64 (an fp16 pair), one fp16 subtraction
    takes 1024 off the pair, exactly.
  - Keys, A = K (32 tokens, d): a thread's rows are tokens g, g + 8, g + 16, g + 24 (g = lane / 4) and its columns
    channels 32 t .. 32 t + 31 (t = lane % 4), eight words a token, two 16-byte loads. A's column i is channel
    _key_channel(i), the order the query is loaded in.
  - Values, A = Vᵀ (d, 32 tokens): a thread's rows are channels 16 g .. 16 g + 15 (_value_channel: four words of
    a token, one 16-byte load) and its columns tokens 2 t + {0, 1, 8, 9, 16, 17, 24, 25}: the words of tokens 2 p and
    2 p + 1 are interleaved by bytes (two prmt), so that one register holds a channel of both tokens.
Where the scales go:
  - A group of the whole head (int8): A holds the codes themselves (exact in fp16), and each token's scale and zero
    are applied in fp32 around the products, once a token rather than once a code; the weights p times each token's
    value scale reach the B operand in fp16, as flash attention rounds p:
        s    = scale_k * (K_c · qᵀ) + zero_k * Σ_c q_c                  (32 tokens, 8 rows) a warp
        accᵀ += V_cᵀ · (p * scale_v)ᵀ,   z += Σ_tokens p * zero_v       z: the zeros' share, every channel's
  - Groups of G = 32 or 64 channels (KV Pareto): a product's columns span groups, so each code is taken to
    c * scale + zero in fp16 before the product, one fp16x2 FMA a register with its group's scale and zero as half2
    pairs: a key's (scale, scale) (a thread's 32 channels lie in one group), a value's (scale of token 2 p, of 2 p + 1)
    (its 16 channels lie in one group).
Registers and loops (sm_90 SASS, Triton 3.6; `python scripts/compile_sm90.py --cases int8-gluon kvpareto-gluon`):
int8 loads a step's keys and values a step ahead, 168 registers, a whole step's loop of 623 instructions; KV Pareto
its keys only (with its values, 231 registers: two programs an SM), 168 registers, 755 instructions. Both fit three
programs an SM. The split-K plan: at small batches one wave of programs (WAVE, WHOLE_HEAD_WAVE); at larger ones
PROGRAMS_PER_SM, or SHORT_PROGRAMS_PER_SM where that leaves a split short.
Numerics: int8, the codes and their products exact, the scales and zeros applied in fp32; KV Pareto, each code *
scale + zero rounded to fp16 (the Triton kernel's rounding); fp16 query and weights, fp32 softmax.
Bytes read: the Triton kernel's, 2 (d + 4 d / G) a token and KV head.

Speed (Llama-3.1-8B heads, rep 4, one H200, L2 flushed; docs/decode.md, "8-bit per-token groups in one warp kernel:
KV Pareto (H200)"): at 32K batch 1, 128K batch 1, 32K batch 32 and 128K batch 32, int8 43.0, 101.6, 597.1 and
2,228.5 us (64-87% of the read floor), KV Pareto 46.2, 107.7, 647.6 and 2,454.8 (63-86%) against the Triton
kernel's 50.8, 141.4, 988.8 and 3,884.5 (`python scripts/bench_kernels.py --floors --cases int8 "KV Pareto" --shapes
1x32768 1x131072 32x32768 32x131072`, results/kernels/h200/token-groups-plan).
KVZOO_TOKEN_KERNEL=triton|gluon|auto (default) overrides the choice: triton never takes this kernel.
"""

from __future__ import annotations

import functools

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvzoo.kernels.outer_hopper import (N_WARPS, WARP_MMA, WARPS, _head_pointers, _is_hopper, _load_moved, _run,
                                        await_tail, launch_options, let_next_launch, warp_query, warp_columns,
                                        warp_merge, warp_store)
from kvzoo.kernels.quant_matvec import kernel_choice, unpacks_in_ptx

CHOICE = kernel_choice("KVZOO_TOKEN_KERNEL")
ENABLED = CHOICE != "triton"
HEAD_DIM, ROWS_MAX = 128, 8
GROUPS = (32, 64, HEAD_DIM)      # channels a group: a thread's key channels (32) and value channels (16) lie in one
PROGRAMS_PER_SM = 3      # the split-K plan's programs an SM
# ... unless its splits would keep fewer than MIN_GROUPS groups of 32 slots: then SHORT_PROGRAMS_PER_SM. For 8 KV rows
# of 32K (Llama-3.1-8B's heads) three programs an SM plan 85 splits of 12 groups a KV head, in two waves: 53.9 us for
# int8 and 56.5 for KV Pareto, against 42.7 and 47.3 with two (32 splits of 32 groups)
MIN_GROUPS, SHORT_PROGRAMS_PER_SM = 32, 2
# at small batches, one wave of at most this many programs an SM where it holds 4 splits a KV row or more
# (innerq_attention.one_wave; at 2 splits a row the plans above were faster): KV Pareto's groups of 32 channels ran
# fastest near three an SM (64 plan the same, not measured); int8's whole-head groups, whose programs load keys and
# values a step ahead, at two less the tail's programs (256 on 132 SMs)
WAVE, WHOLE_HEAD_WAVE = (2.85, 4), (1.94, 4)
# the least work (KV rows x groups of 32 slots) this kernel takes ("gluon": any): outer_hopper's. The least measured,
# 32K at batch 1 of Llama-3.1-8B's heads (8 x 1,024), takes 42.7 us here for int8 and 47.3 for KV Pareto against the
# Triton kernel's 55.7 and 50.6
MIN_GROUP_ROWS = 0 if CHOICE == "gluon" else 2016
TOKEN_REGS = gl.constexpr(8 + 16)      # the bits of a slot's offset in its step that a thread's registers hold
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
# groups of G < d channels: each code taken to c * scale + zero in fp16 after the exact subtraction, one FMA a pair
# (the Triton kernel's rounding), with the pair's scales and zeros as half2 registers
SCALED_KEY_ASM = gl.constexpr("{ .reg .b32 m, k; mov.b32 m, 0x64646464; mov.b32 k, 0x64006400; "
                              "prmt.b32 $0, $2, m, 0x4140; prmt.b32 $1, $2, m, 0x4342; "
                              "sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; "
                              "fma.rn.f16x2 $0, $0, $4, $6; fma.rn.f16x2 $1, $1, $4, $6; }")
SCALED_KEY_CON = gl.constexpr("=r,=r,r,r,r,r,r,r")
SCALED_VALUE_ASM = gl.constexpr("{ .reg .b32 lo, hi, m, k; mov.b32 m, 0x64646464; mov.b32 k, 0x64006400; "
                                "prmt.b32 lo, $4, $6, 0x5140; prmt.b32 hi, $4, $6, 0x7362; "
                                "prmt.b32 $0, lo, m, 0x4140; prmt.b32 $1, lo, m, 0x4342; "
                                "prmt.b32 $2, hi, m, 0x4140; prmt.b32 $3, hi, m, 0x4342; "
                                "sub.f16x2 $0, $0, k; sub.f16x2 $1, $1, k; sub.f16x2 $2, $2, k; sub.f16x2 $3, $3, k; "
                                "fma.rn.f16x2 $0, $0, $8, $10; fma.rn.f16x2 $1, $1, $8, $10; "
                                "fma.rn.f16x2 $2, $2, $8, $10; fma.rn.f16x2 $3, $3, $8, $10; }")
SCALED_VALUE_CON = gl.constexpr("=r,=r,=r,=r,r,r,r,r,r,r,r,r")


def wave(group: int, d: int) -> tuple[float, int]:
    """one_wave's (programs an SM, least splits a KV row) for this kernel's whole-head groups (int8) or groups of
    fewer channels."""
    return WHOLE_HEAD_WAVE if group >= d else WAVE


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
def _slots(L: gl.constexpr, first, last, CLAMP: gl.constexpr):
    """Warp w's 32 slots of step `first` (4, 32) in the 2-D layout L, from `first`; with CLAMP those past `last`
    read `last`."""
    ts = gl.arange(0, WARPS, layout=gl.SliceLayout(1, L))[:, None] * 32 + \
        gl.arange(0, 32, layout=gl.SliceLayout(0, L))[None, :]
    if CLAMP:
        ts = gl.minimum(ts, last - first)
    return ts


@gluon.jit
def _words(ptr, first, last, W: gl.constexpr, L: gl.constexpr, CLAMP: gl.constexpr):
    """A step's code words (4, 32, A, B) in L [warp, token, a, b]: element (a, b) is word a B + b of the token's W,
    warp w's slots 32 w .. from `first` (clamped to `last` with CLAMP)."""
    A: gl.constexpr = L.shape[2]
    B: gl.constexpr = L.shape[3]
    ts = gl.expand_dims(gl.expand_dims(_slots(gl.SliceLayout(2, gl.SliceLayout(3, L)), first, last, CLAMP), 2), 3)
    return gl.load(ptr + first * W + (ts * W + _arange(A, 2, L) * B + _arange(B, 3, L)))


@gluon.jit
def _token_scales(s_ptr, z_ptr, first, last, CLAMP: gl.constexpr):
    """The scales and zeros of a step's tokens, one a token (a group of the whole head): (4, 32) fp32 in the scores'
    layout, slots from `first` (clamped to `last` with CLAMP)."""
    ts = _slots(gl.SliceLayout(2, WARP_MMA), first, last, CLAMP)
    return (_load_moved(s_ptr + first, ts, TOKEN_REGS, CLAMP).to(gl.float32),
            _load_moved(z_ptr + first, ts, TOKEN_REGS, CLAMP).to(gl.float32))


@gluon.jit
def _key_operands(kc_ptr, ks_ptr, kz_ptr, t, last, LK: gl.constexpr, LK5: gl.constexpr, D: gl.constexpr,
                  CG: gl.constexpr, CLAMP: gl.constexpr):
    """Step t's keys, warp w's from group t + w: the words (4, 32, 4, 8) [warp, token, t, k] in LK (word 8 t + k of
    the token) and the tokens' scales and zeros: groups of the whole head (CG = D), (4, 32) fp32 in the scores'
    layout; else (scale, scale) half2 pairs (4, 32, 4) [warp, token, t] as the unpack PTX takes them (channels
    32 t .. lie in one group). With CLAMP slots past `last` read `last`; without, every slot of the step is read
    where it lies (a thread's loads of a tensor are one address plus constants: outer_hopper's _load_moved)."""
    W: gl.constexpr = D // 4
    NG: gl.constexpr = D // CG
    first = t * 32                                   # the step's first slot: scalar pointers move
    kw = _words(kc_ptr, first, last, W, LK, CLAMP)
    if CG == D:
        ks, kz = _token_scales(ks_ptr, kz_ptr, first, last, CLAMP)
    else:
        KS: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, LK5))                 # (4, 32, 4) [warp, token, t]
        ts = gl.expand_dims(_slots(gl.SliceLayout(2, KS), first, last, CLAMP), 2)
        at = ts * NG + gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, KS)))[None, None, :] * 32 // CG
        ks = _load_moved(ks_ptr + first * NG, at, TOKEN_REGS * NG, CLAMP)
        kz = _load_moved(kz_ptr + first * NG, at, TOKEN_REGS * NG, CLAMP)
        ks, kz = _half2(ks, ks), _half2(kz, kz)
    return kw, ks, kz


@gluon.jit
def _value_operands(vc_ptr, vs_ptr, vz_ptr, t, last, LV: gl.constexpr, LV5: gl.constexpr, D: gl.constexpr,
                    CG: gl.constexpr, CLAMP: gl.constexpr):
    """Step t's values as _key_operands' keys: the words (4, 32, 8, 4) [warp, token, g, y] in LV (word 4 g + y) and
    the tokens' scales and zeros, (4, 32) fp32 (CG = D) or two tokens' (scale of 2 p, of 2 p + 1) half2 pairs
    (4, 16, 8) [warp, p, g] (channels 16 g .. lie in one group)."""
    W: gl.constexpr = D // 4
    NG: gl.constexpr = D // CG
    first = t * 32
    vw = _words(vc_ptr, first, last, W, LV, CLAMP)
    if CG == D:
        vs, vz = _token_scales(vs_ptr, vz_ptr, first, last, CLAMP)
    else:
        VS: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, LV5))                 # (4, 16, 8) [warp, p, g]
        p2 = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, VS)))[:, None] * 32 + \
            gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, VS)))[None, :] * 2   # (4, 16): token 2 p
        te, to = p2, p2 + 1
        if CLAMP:
            te = gl.minimum(te, last - first)
            to = gl.minimum(to, last - first)
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, VS)))[None, None, :] * 16 // CG
        at_e = gl.expand_dims(te, 2) * NG + g
        at_o = gl.expand_dims(to, 2) * NG + g
        REGS: gl.constexpr = TOKEN_REGS * NG
        vs = _half2(_load_moved(vs_ptr + first * NG, at_e, REGS, CLAMP),
                    _load_moved(vs_ptr + first * NG, at_o, REGS, CLAMP))
        vz = _half2(_load_moved(vz_ptr + first * NG, at_e, REGS, CLAMP),
                    _load_moved(vz_ptr + first * NG, at_o, REGS, CLAMP))
    return vw, vs, vz


@gluon.jit
def _half2(lo, hi):
    """fp16 tensors -> int32 half2 registers {lo, hi}."""
    return gl.inline_asm_elementwise("mov.b32 $0, {$1, $2};", "=r,h,h", [lo, hi], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _keys(kw, ks, kz, SCALED: gl.constexpr, LK5: gl.constexpr, KA: gl.constexpr):
    """Key words (4, 32, 4, 8) -> the scores' A operand (4, 32, D): column b + 2 t + 8 h + 16 k is byte 2 h + b of
    word 8 t + k, the code itself in fp16, or (SCALED) code * scale + zero with _key_operands' half2 pairs ks, kz."""
    pairs = gl.convert_layout(gl.join(kw, kw), LK5, assert_trivial=True)    # (4, 32, 4, 8, 2): the pair axis first
    if SCALED:
        lo, hi = gl.inline_asm_elementwise(SCALED_KEY_ASM, SCALED_KEY_CON, [pairs, ks[:, :, :, None, None],
                                           kz[:, :, :, None, None]], dtype=(gl.float16,) * 2, is_pure=True, pack=2)
    else:
        lo, hi = gl.inline_asm_elementwise(KEY_ASM, KEY_CON, [pairs], dtype=(gl.float16,) * 2, is_pure=True, pack=2)
    x = gl.permute(gl.join(lo, hi), (0, 1, 3, 5, 2, 4))                             # (4, 32, k, h, t, b)
    return gl.convert_layout(gl.reshape(x, (WARPS, 32, 4 * kw.shape[2] * kw.shape[3])), KA)


@gluon.jit
def _values(vw, vs, vz, SCALED: gl.constexpr, LV5: gl.constexpr, VA: gl.constexpr):
    """Value words (4, 32, 8, 4) [warp, token, g, y] -> the output product's A operand Vᵀ (4, D, 32): row
    g + 8 x + 16 y' is channel 16 g + 2 y' + x (_value_channel), column the token, the code itself in fp16, or
    (SCALED) code * scale + zero with _value_operands' half2 pairs vs, vz."""
    G: gl.constexpr = vw.shape[2]
    Y: gl.constexpr = vw.shape[3]
    even, odd = gl.split(gl.permute(gl.reshape(vw, (WARPS, 16, 2, G, Y)), (0, 1, 3, 4, 2)))   # tokens 2 p, 2 p + 1
    # each word entered twice, the pair axis a thread's first register (pack=2 takes a register's neighbours)
    even = gl.convert_layout(gl.join(even, even), LV5, assert_trivial=True)
    odd = gl.convert_layout(gl.join(odd, odd), LV5, assert_trivial=True)
    if SCALED:
        scales = [vs[:, :, :, None, None], vz[:, :, :, None, None]]       # broadcast over y and the pair axis
        o0, o1, o2, o3 = gl.inline_asm_elementwise(SCALED_VALUE_ASM, SCALED_VALUE_CON, [even, odd] + scales,
                                                   dtype=(gl.float16,) * 4, is_pure=True, pack=2)
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(VALUE_ASM, VALUE_CON, [even, odd], dtype=(gl.float16,) * 4,
                                                   is_pure=True, pack=2)
    x = gl.join(gl.join(o0, o1), gl.join(o2, o3))                    # (4, 16 p, g, y, parity, byte bit 0, bit 1)
    x = gl.permute(x, (0, 3, 6, 5, 2, 1, 4))                         # (4, y, bit 1, bit 0, g, p, parity)
    return gl.convert_layout(gl.reshape(x, (WARPS, 4 * G * Y, 32)), VA)


@gluon.jit
def _step(keys, values, q, qsum, m, l, z, acc, qk_scale, t, stop, n_both, D: gl.constexpr, CG: gl.constexpr,
          LK5: gl.constexpr, LV5: gl.constexpr, MASKED: gl.constexpr):
    """Step t: warp w attends group t + w (keys, values: _key_operands', _value_operands') with its own online
    softmax in base 2, on the state (m, l, z, acc) _token_kernel holds. MASKED: slots past n_both and groups from
    `stop` on are masked to -inf (a warp may then have no live token yet); else every slot is live."""
    ROWS: gl.constexpr = q.shape[2]
    EXACT: gl.constexpr = CG == D                # the codes in the products, the scales and zeros around them
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=WARP_MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=WARP_MMA, k_width=2)
    kw, ks, kz = keys
    vw, vs, vz = values
    s = mma_v2(_keys(kw, ks, kz, not EXACT, LK5, A), q, gl.zeros([WARPS, 32, ROWS], gl.float32, WARP_MMA))
    if EXACT:       # the token's scale and zero around the product, the softmax scale with them
        s = s * gl.expand_dims(ks * qk_scale, 2) + gl.expand_dims(kz * qk_scale, 2) * gl.expand_dims(qsum, 1)
    else:
        s = s * qk_scale
    if MASKED:
        js = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, WARP_MMA)))
        ws = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, WARP_MMA)))
        live = ((t + ws)[:, None] * 32 + js[None, :] < n_both) & ((t + ws) < stop)[:, None]     # a warp's group
        s = s + gl.where(live, 0.0, float("-inf"))[:, :, None]
    m_new = gl.maximum(m, gl.max(s, axis=1))
    m_top = gl.where(m_new > float("-inf"), m_new, 0.0)      # a warp with no live token yet: nothing to scale
    alpha = gl.exp2(m - m_top)
    p = gl.exp2(s - gl.expand_dims(m_top, 1))
    a_l = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, l.type.layout)), 1)
    l = l * a_l + gl.sum(gl.reshape(p, (WARPS, 4, 8, ROWS)), axis=1)
    if EXACT:
        z = z * a_l + gl.sum(gl.reshape(p * gl.expand_dims(vz, 2), (WARPS, 4, 8, ROWS)), axis=1)
        p = p * gl.expand_dims(vs, 2)
    acc = mma_v2(_values(vw, vs, vz, not EXACT, LV5, A), gl.convert_layout(p.to(gl.float16), B),
                 acc * gl.expand_dims(alpha, 1))
    return m_new, l, z, acc


@gluon.jit
def _token_kernel(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, m_ptr, l_ptr, acc_ptr, len_ptr, PER_SPLIT,
                  N_COLS, qk_scale, s_kc, s_ks, s_kz, s_vc, s_vs, s_vz, D: gl.constexpr, REP: gl.constexpr,
                  ROWS: gl.constexpr, CG: gl.constexpr, LK: gl.constexpr, LK5: gl.constexpr, LV: gl.constexpr,
                  LV5: gl.constexpr):
    ROW: gl.constexpr = gl.SliceLayout(1, WARP_MMA)                  # (4, ROWS): each warp's rows
    kv = gl.program_id(0)                        # b * H + h
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr = _head_pointers(kv, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                                                                    s_kc, s_ks, s_kz, s_vc, s_vs, s_vz)
    split = gl.program_id(1)
    let_next_launch()
    n_both, start, stop, last = _run(len_ptr, split, PER_SPLIT)

    # the query qᵀ (4, D, ROWS), column c channel _key_channel(c); its sum over the channels (fp32, of the fp16 query
    # the product takes) carries the keys' zeros where they are applied around the product (CG = D)
    q = warp_query(q_ptr, kv, _key_channel(warp_columns(D)), REP, ROWS)
    qsum = gl.convert_layout(gl.sum(q.to(gl.float32), axis=1), ROW)

    m = gl.full([WARPS, ROWS], float("-inf"), gl.float32, layout=ROW)
    # each thread's share of the row sums and of the zeros' share: its own tokens' (4, 8 (token bits 0-2), ROWS)
    l = gl.sum(gl.reshape(gl.zeros([WARPS, 32, ROWS], gl.float32, WARP_MMA), (WARPS, 4, 8, ROWS)), axis=1)
    z = l
    acc = gl.zeros([WARPS, D, ROWS], gl.float32, layout=WARP_MMA)
    # the steps whose 128 slots are all live: loads with no clamp, scores with no mask. The next step's keys are
    # loaded before this step's work (the last full step loads itself again, a hit in the caches), and so are its
    # values where a group is the whole head; groups of G < D channels load their values in their step, which keeps
    # three programs an SM (their half2 scales and the FMA take registers)
    full = start + gl.maximum(gl.minimum(stop, n_both // 32) - start, 0) // WARPS * WARPS
    keys = _key_operands(kc_ptr, ks_ptr, kz_ptr, start, last, LK, LK5, D, CG, True)
    if CG == D:
        values = _value_operands(vc_ptr, vs_ptr, vz_ptr, start, last, LV, LV5, D, CG, True)
    for t in range(start, full, WARPS):
        ahead = gl.minimum(t + WARPS, full - WARPS)
        next_keys = _key_operands(kc_ptr, ks_ptr, kz_ptr, ahead, last, LK, LK5, D, CG, False)
        if CG == D:
            next_values = _value_operands(vc_ptr, vs_ptr, vz_ptr, ahead, last, LV, LV5, D, CG, False)
        else:
            values = _value_operands(vc_ptr, vs_ptr, vz_ptr, t, last, LV, LV5, D, CG, False)
        m, l, z, acc = _step(keys, values, q, qsum, m, l, z, acc, qk_scale, t, stop, n_both, D, CG, LK5, LV5, False)
        keys = next_keys
        if CG == D:
            values = next_values
    # the rest (fewer than four groups, or a group not all live): loaded as they are attended, slots clamped
    for t in range(full, stop, WARPS):
        keys = _key_operands(kc_ptr, ks_ptr, kz_ptr, t, last, LK, LK5, D, CG, True)
        values = _value_operands(vc_ptr, vs_ptr, vz_ptr, t, last, LV, LV5, D, CG, True)
        m, l, z, acc = _step(keys, values, q, qsum, m, l, z, acc, qk_scale, t, stop, n_both, D, CG, LK5, LV5, True)

    # the four warps' partials merged once; the zeros' share (CG = D) added to every channel: (m, l, acc + z)
    m_all, l_all, out, f = warp_merge(m, l, acc)
    if CG == D:
        z_all = gl.sum(gl.convert_layout(gl.sum(z, axis=1), ROW) * f, axis=0)
        out = out + gl.expand_dims(gl.convert_layout(z_all, gl.SliceLayout(0, out.type.layout)), 0)
    c = gl.arange(0, D, layout=gl.SliceLayout(1, out.type.layout))
    warp_store(m_ptr, l_ptr, acc_ptr, m_all, l_all, out, _value_channel(c), kv, split, N_COLS, REP)
    await_tail()


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
            and not channel and rope is None and d == HEAD_DIM and group in GROUPS and rep <= ROWS_MAX
            and group_rows >= MIN_GROUP_ROWS)


def quantized_splits(q: Tensor, buffers: list[tuple[Tensor, int]], m: Tensor, l: Tensor, acc: Tensor,
                     lengths: Tensor, per_split: int, splits: int, qk_scale: float, group: int,
                     early: bool = False) -> None:
    """Write the (m, l, acc) partials of columns [0, splits) of outer_decode_attention's buffers (splits columns,
    or splits + 1 with the sink's and the tail's) for q (B, Hq, d) contiguous; buffers: outer_decode_attention's
    (tensor, head stride) pairs of the key and value codes, scales and zeros, in that order; early: launched while
    the tail's program, just launched on this stream, runs (quant_matvec.launches_early)."""
    B, Hq, d = q.shape
    H = buffers[0][0].shape[1]
    lk, lk5, lv, lv5 = _layouts(d)
    _token_kernel[(B * H, splits)](q, *(t for t, _ in buffers), m, l, acc, lengths, per_split, m.shape[1], qk_scale,
                                   *(s for _, s in buffers), D=d, REP=Hq // H, ROWS=ROWS_MAX, CG=group, LK=lk, LK5=lk5,
                                   LV=lv, LV5=lv5, num_warps=N_WARPS, **launch_options(early))
