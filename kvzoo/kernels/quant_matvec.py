"""Fused dequantize-and-multiply kernels for the two vector-matrix products of a decode step (InnerQ §4.4,
§5.3, Tables 3-4): one query vector per (batch, KV head) against the quantized keys, and one weight vector
against the quantized values, each in the inner-grouped layout (InnerQ) and the outer-grouped one (KIVI).

    scores = q · dequant(K)ᵀ     q (B, H, d) fp16/bf16/fp32      ->  (B, H, N) fp32
    out    = p · dequant(V)      p (B, H, N) fp16/bf16/fp32      ->  (B, H, d) fp32

Codes are b-bit (b in {2, 4}) integers packed along the last dim (head_dim d) into int32 words as one
little-endian bit stream (kvzoo.cache.kvquant.pack): channel j of a token sits at bits (j*b) % 32 of word
(j*b) // 32, so a token's codes are W = d*b/32 words and a group of 32 channels is exactly b words. Groups
hold G = 32 values. InnerQ's values are packed along the tokens instead (below). Per KV head (N quantized
tokens, N a multiple of 32):

  inner layout (InnerQ; unified groups of kvzoo.cache.kvquant.quantize_unified)
    keys, per-token groups along d        k_codes int32 (B, H, N, W)  k_scale fp16 (B, H, N, d/32)
                                          k_slot int32 (B, H, N, d/32)  k_sym bool (B, H, N, d/32) or None
    values, per-channel groups of tokens  v_codes int32 (B, H, N, W)  v_scale fp16 (B, H, N/32, d)
                                          v_slot int32 (B, H, N/32, d)  v_sym bool (B, H, N/32, d) or None
                                          codes packed along tokens (kvquant.pack_tokens): the 32/b tokens of
                                          a chunk hold one word per channel, in the chunk's own rows
    an asymmetric group decodes to code*scale + zero (zero = the slot's bits read as fp32); a symmetric
    one to code*scale, negated where bit j of the slot is set (j = the element's index in its group).
    sym=None means every group is asymmetric (the sign path is compiled out).
  outer layout (KIVI; plain asymmetric kvzoo.cache.kvquant.quantize)
    keys, per-channel groups of tokens    k_codes int32 (B, H, N, W)  k_scale, k_zero fp16 (B, H, N/32, d)
    values, per-token groups along d      v_codes int32 (B, H, N, W)  v_scale, v_zero fp16 (B, H, N, d/32)

Tiling. Codes are unpacked in registers: a tile of words, broadcast against the per-code shifts, masked,
and turned into exact fp32 by OR-ing 0x4B000000 (2^23 + code) and subtracting 2^23 (no int-to-float
conversion). Inner-grouped products reduce each group of 32 first and apply its scale (and zero, through
the sum of the other operand over the group) once per group, which is what makes the inner layout cheap:
    q·Kᵀ inner   a program scores BLOCK_N tokens of one head: codes (BLOCK_N, d/32, b, 32/b), q (d/32, b, 32/b)
    q·Kᵀ outer   a program scores GROUPS groups of 32 tokens of one KV head for all its query rows, a group at a
                 time: its keys dequantized once (32, d), multiplied by the rows (padded to 16) in one tl.dot
    p·V inner    split-K over token groups: a program loops over GROUPS groups of 32 tokens at a time,
                 codes (GROUPS, b chunks, d, 32/b), and applies scale/zero per (group, channel) after the sum
                 over the group's 32 tokens
    p·V outer    split-K over tokens, a program per (KV head, split) for all its query rows: each tile of
                 values dequantized once (BLOCK_N, d), weighted by the rows' p (padded to 16) in one tl.dot
The split-K partials (B*H, splits, d) are summed by torch when there is more than one split. The outer
kernels also take GQA queries, q or p (B, Hq, ·) with Hq = rep * H (query head h*rep + j reads KV head h), all
rep rows of a KV head in one program, so KIVI's decode reads each code once and launches each kernel once per
layer. Their tile products run on tensor cores as three tf32 products (tf32x3): fp32 to within rounding.

Every launcher checks bits, shapes, dtypes and devices and raises ValueError; each has a pure-torch
`*_ref` built on kvzoo.cache.kvquant's dequantizers. CPU tensors need TRITON_INTERPRET=1 (set before triton
is imported). The helpers at the top (checks, and the codes' unpacking: unpack_codes, and unpack_asm / join_codes
for the inline-PTX fast paths) are shared with innerq_attention.py, outer_attention.py, w4a16.py and
quantize_pack.py.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from kvzoo.cache.kvquant import QTensor, UnifiedQTensor, dequantize, dequantize_unified

GROUP = 32
KERNEL_BITS = (2, 4)
PRECISION: tl.constexpr = tl.constexpr("tf32x3")   # the outer kernels' tile products: fp32 to within rounding


# ----------------------------------------------------------------------------------------------------
# Launcher checks, shared by the kernel modules
# ----------------------------------------------------------------------------------------------------
def check_bits(bits: int) -> int:
    if bits not in KERNEL_BITS:
        raise ValueError(f"the kernels support bits in {KERNEL_BITS} (codes that never straddle an int32 word "
                         f"and a power-of-two count per word), got {bits}")
    return bits


def check_head_dim(d: int) -> int:
    if d < GROUP or d & (d - 1):
        raise ValueError(f"the kernels need a head dimension that is a power of two >= {GROUP}, got {d}")
    return d


def check_tensor(t: Tensor, name: str, shape: tuple, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")


def check_runnable(kernel, device: torch.device) -> None:
    """Triton runs CUDA tensors, or any tensor under the interpreter."""
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise ValueError(f"tensors on {device} need a CUDA device, or TRITON_INTERPRET=1 set before triton "
                         f"is imported (the interpreter, for tests)")


def kernels_run_on(device: torch.device) -> bool:
    """Whether the kernels can run tensors on `device`: CUDA, or anything under the interpreter."""
    return device.type == "cuda" or isinstance(_qk_inner_kernel, InterpretedFunction)


def head_rows(t: Tensor) -> tuple[Tensor, int]:
    """(t, stride between consecutive (batch, head) rows) for t (B, H, *inner): no copy when the inner dims
    are packed and the batch stride is H head strides, as for a cache buffer sliced along its token dim."""
    packed = t.stride(-1) == 1 and all(t.stride(i) == t.stride(i + 1) * t.shape[i + 1] for i in range(2, t.dim() - 1))
    if not packed or (t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1)):
        t = t.contiguous()
    return t, t.stride(1)


def sym_flags(sym: Tensor | None, name: str, shape: tuple, device: torch.device) -> tuple[Tensor | None, int]:
    """Dense per-group symmetric flags (bool or uint8) as uint8 rows, or (None, 0) for all-asymmetric."""
    if sym is None:
        return None, 0
    check_tensor(sym, name, shape, (torch.bool, torch.uint8), device)
    return head_rows(sym.view(torch.uint8) if sym.dtype == torch.bool else sym)


@functools.lru_cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (1 elsewhere: the interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def target_programs(device: torch.device) -> int:
    """Programs that fill the device a few times over (split-K sizing); a handful under the interpreter."""
    return 8 * sm_count(device) if device.type == "cuda" else 4


def split_groups(n_groups: int, rows: int, device: torch.device, num_splits: int | None,
                 min_groups: int = 4) -> tuple[int, int]:
    """(splits, groups per split) for a split-K over n_groups token groups of `rows` independent rows: enough
    programs to fill the device, each with at least min_groups groups unless num_splits says otherwise."""
    if num_splits is None:
        num_splits = min(-(-n_groups // min_groups), -(-target_programs(device) // rows))
    num_splits = max(1, min(num_splits, n_groups))
    per_split = -(-n_groups // num_splits)
    return -(-n_groups // per_split), per_split


@triton.jit
def unpack_codes(words, shifts, BITS: tl.constexpr):
    """int32 words broadcast against per-code bit offsets -> the codes as exact fp32 values: the code is OR-ed
    into the mantissa of 2^23 and 2^23 subtracted, cheaper than an int-to-float conversion."""
    codes = (words >> shifts) & ((1 << BITS) - 1)
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


KERNELS = ("auto", "triton", "gluon")


def setting(variable: str, accepted: tuple[str, ...]) -> str:
    """An environment variable's value, the first of `accepted` where unset; any other value is refused."""
    value = os.environ.get(variable, accepted[0])
    if value not in accepted:
        raise ValueError(f"{variable} must be one of {accepted}, got {value!r}")
    return value


def kernel_choice(variable: str) -> str:
    """The Gluon kernel choice an environment variable (KVZOO_OUTER_KERNEL, KVZOO_INNERQ_KERNEL, KVZOO_TOKEN_KERNEL,
    KVZOO_W4A16_KERNEL, KVZOO_WEIGH_KERNEL) holds, default auto: triton never takes the Gluon kernel, gluon takes it
    wherever its layout allows."""
    return setting(variable, KERNELS)


def early_launch_setting() -> bool:
    """KVZOO_EARLY_LAUNCH, "1" (default) or "0": whether launches_early may hold (0: the tail's program always on a
    second stream, for comparisons)."""
    return setting("KVZOO_EARLY_LAUNCH", ("1", "0")) == "1"


EARLY_LAUNCH = early_launch_setting()


@functools.cache
def launches_early(device: torch.device) -> bool:
    """Whether outer_attention's Gluon kernel launches while the tail's program, launched before it on the same
    stream, runs (programmatic dependent launch, sm_90 on): that program lets it launch at its start
    (griddepcontrol.launch_dependents), and the Gluon kernel's programs wait for it to finish before they exit
    (griddepcontrol.wait), so that the combine after them sees both. A compiled CUDA run only (the interpreter runs
    no PTX)."""
    return EARLY_LAUNCH and device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") \
        and torch.cuda.get_device_capability(device)[0] >= 9


def unpacks_in_ptx(t: Tensor) -> bool:
    """Whether kernels on t may take their inline-PTX fast path (unpack_asm): fp16/bf16 on a compiled CUDA run
    (the interpreter runs no PTX)."""
    return t.dtype in (torch.float16, torch.bfloat16) and t.device.type == "cuda" \
        and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


@functools.lru_cache
def unpack_asm(bits: int, bf16: bool = False, centered: bool = False) -> tuple[str, str]:
    """PTX for tl.inline_asm_elementwise (pack=2): two int32 code words in, 32/bits outputs of codes as exact
    fp16 (bf16 when bf16) values (output k: code k of each word). Codes k and k + cpw/2 sit in the low and high
    halves of a word: the two words' low (high) halves are gathered into one register, a code is masked into
    the mantissa of 1024.0 (fp16 0x6400; bf16 128.0, 0x4300) and that power of two subtracted. bf16's mantissa
    has 7 bits, so its codes have at most 4 (8-bit codes would reach its exponent). centered (fp16): code -
    2^(bits-1), the subtraction taking 1024 + 2^(bits-1) instead."""
    if bf16 and bits > 4:
        raise ValueError(f"the bf16 unpack holds codes of at most 4 bits (a bf16 mantissa has 7), got {bits}")
    if bf16 and centered:
        raise ValueError("the centered unpack is fp16's")
    cpw, half = 32 // bits, 16 // bits
    mask = ((1 << bits) - 1) * 0x00010001
    a, b = f"${cpw}", f"${cpw + 1}"
    magic = "0x43004300" if bf16 else "0x64006400"
    lines = ["{", ".reg .b32 lo, hi, t, magic, one, neg, base;", f"mov.b32 magic, {magic};"]
    base = 0x6400 + (1 << (bits - 1)) if centered else 0x6400                 # fp16 1024 (+ 2^(bits-1)): ulp 1
    lines.append(f"mov.b32 base, {base * 0x10001:#010x};")
    if bf16:
        lines += ["mov.b32 one, 0x3F803F80;", "mov.b32 neg, 0xC300C300;"]      # 1.0 and -128.0, twice
    lines += [f"prmt.b32 lo, {a}, {b}, 0x5410;", f"prmt.b32 hi, {a}, {b}, 0x7632;"]
    for k in range(cpw):
        src, shift = ("lo", k * bits) if k < half else ("hi", (k - half) * bits)
        lines.append(f"shr.b32 t, {src}, {shift};" if shift else f"mov.b32 t, {src};")
        lines.append(f"lop3.b32 t, t, {mask}, magic, 0xEA;")
        # bf16: t * 1 - 128 (fma.bf16x2 runs on sm_80; sub.bf16x2 needs sm_90)
        lines.append(f"fma.rn.bf16x2 ${k}, t, one, neg;" if bf16 else f"sub.f16x2 ${k}, t, base;")
    lines.append("}")
    return "\n".join(lines), ",".join(["=r"] * cpw + ["r"] * 2)


@functools.lru_cache
def pair_asm(bits: int, centered: bool = False) -> tuple[str, str]:
    """PTX for inline_asm_elementwise (pack=2, one int32 code word entered twice; the Gluon kernels'): output a
    (0 .. 16/bits - 1) holds codes a and a + 16/bits of the word (its bits a*bits and 16 + a*bits) as an exact
    half2, masked into the mantissa of 1024.0 (fp16 0x6400), which is then subtracted. centered: code -
    2^(bits-1), the subtraction taking 1024 + 2^(bits-1) instead."""
    half = 16 // bits
    mask = ((1 << bits) - 1) * 0x00010001
    base = (0x6400 + (1 << (bits - 1)) if centered else 0x6400) * 0x10001
    lines = ["{", ".reg .b32 t, magic, base;", "mov.b32 magic, 0x64006400;", f"mov.b32 base, {base:#010x};"]
    for a in range(half):
        lines += [f"shr.b32 t, ${half}, {a * bits};" if a else f"mov.b32 t, ${half};",
                  f"lop3.b32 t, t, {mask:#010x}, magic, 0xEA;", f"sub.f16x2 ${a}, t, base;"]
    lines.append("}")
    return "\n".join(lines), ",".join(["=r"] * half + ["r"] * 2)


MAGICS = (4.0, 16.0)             # two_magic_pair_asm reads output a's codes c as MAGICS[a % 2] + c


@functools.lru_cache
def two_magic_pair_asm(scaled: bool = True, signed: bool = False) -> tuple[str, str]:
    """(PTX, constraints): pair_asm(2)'s outputs (output a: codes a and a + 8 of a 2-bit word, an fp16 pair) read
    under magic numbers and dequantized in the same PTX, one fp16x2 FMA an output, for the Gluon kernels.
    - Three shifts a word. Output a's codes, at bits 2a and 16 + 2a, are masked where they already lie at mantissa
      bits 8-9 under the magic 4.0 (a even) or bits 6-7 under 16.0 (a odd): in the word itself (a = 3, 4), the word
      shifted left 4 (a = 1, 2) or right 4 (a = 5, 6), or with each half's bytes swapped (a = 0, 7; one prmt). A
      code then reads M_a + c exactly, M_a = MAGICS[a % 2]; one magic would take seven shifts.
    - pack=2: the word, entered twice; with `signed` its signs register, twice (bit a code a's sign, bit 16 + a code
      a + 8's, XOR-ed into the result's sign bit: two more instructions an output); with `scaled` the word's scale
      and zero as half2 registers.
    - scaled: the PTX forms both offsets zero - M * scale, each rounded once to fp16 (exact where the zero is 0, a
      symmetric group's), and output a leaves as round((M_a + c) * scale + offset_a): no subtraction of the magic,
      and within an fp16 ulp of c * scale + zero (a magic this small keeps the offset within half an ulp of
      |zero - M scale|).
    - Not scaled (unsigned): the outputs M_a + c, for a caller whose scales and offsets zero - M_a * scale differ
      within a word."""
    assert scaled or not signed
    scale, zero = ("$12", "$13") if signed else ("$10", "$11")
    lines = ["{", ".reg .b32 sw, l4, r4, t, m, o4, o16;", "prmt.b32 sw, $8, 0, 0x2301;", "shl.b32 l4, $8, 4;",
             "shr.b32 r4, $8, 4;"]
    if scaled:
        lines += ["mov.b32 o4, 0xC400C400;", f"fma.rn.f16x2 o4, {scale}, o4, {zero};",       # -4 and -16, twice
                  "mov.b32 o16, 0xCC00CC00;", f"fma.rn.f16x2 o16, {scale}, o16, {zero};"]
    for a, src in enumerate(("sw", "l4", "l4", "$8", "$8", "r4", "r4", "sw")):
        mask, magic, offset = ("0x03000300", "0x44004400", "o4") if a % 2 == 0 else ("0x00C000C0", "0x4C004C00", "o16")
        lines.append(f"lop3.b32 {'t' if scaled else f'${a}'}, {src}, {mask}, {magic}, 0xEA;")
        if signed:
            lines += [f"fma.rn.f16x2 t, t, {scale}, {offset};", f"shl.b32 m, $10, {15 - a};",
                      f"lop3.b32 ${a}, t, m, 0x80008000, 0x78;"]
        elif scaled:
            lines.append(f"fma.rn.f16x2 ${a}, t, {scale}, {offset};")
    lines.append("}")
    return "\n".join(lines), ",".join(["=r"] * 8 + ["r"] * ((4 if signed else 2) + (2 if scaled else 0)))


@triton.jit
def join_codes(o, BITS: tl.constexpr):
    """The 32/BITS outputs of the unpack asm, each (R, W), as (R, W * 32/BITS) codes in channel order."""
    if BITS == 2:
        a0 = tl.join(o[0], o[8])
        a1 = tl.join(o[1], o[9])
        a2 = tl.join(o[2], o[10])
        a3 = tl.join(o[3], o[11])
        a4 = tl.join(o[4], o[12])
        a5 = tl.join(o[5], o[13])
        a6 = tl.join(o[6], o[14])
        a7 = tl.join(o[7], o[15])
        b0 = tl.join(a0, a4)
        b1 = tl.join(a1, a5)
        b2 = tl.join(a2, a6)
        b3 = tl.join(a3, a7)
        x = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    elif BITS == 4:
        b0 = tl.join(o[0], o[4])
        b1 = tl.join(o[1], o[5])
        b2 = tl.join(o[2], o[6])
        b3 = tl.join(o[3], o[7])
        x = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    else:
        x = tl.join(tl.join(o[0], o[2]), tl.join(o[1], o[3]))
    R: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    return tl.reshape(x, (R, W * (32 // BITS)), can_reorder=False)


# ----------------------------------------------------------------------------------------------------
# q · Kᵀ
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _qk_inner_kernel(q_ptr, codes_ptr, scale_ptr, slot_ptr, sym_ptr, out_ptr, N,
                     s_q, s_codes, s_scale, s_slot, s_sym, s_out,
                     D: tl.constexpr, BITS: tl.constexpr, HAS_SYM: tl.constexpr, BLOCK_N: tl.constexpr):
    CPW: tl.constexpr = 32 // BITS               # codes per word
    NG: tl.constexpr = D // 32                   # groups per token
    W: tl.constexpr = D * BITS // 32             # words per token
    row = tl.program_id(0).to(tl.int64)          # b * H + h; 64-bit row offsets
    q_ptr += row * s_q
    codes_ptr += row * s_codes
    scale_ptr += row * s_scale
    slot_ptr += row * s_slot
    sym_ptr += row * s_sym
    out_ptr += row * s_out
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < N
    g = tl.arange(0, NG)
    wi = tl.arange(0, BITS)                      # word within a group (a group of 32 codes is BITS words)
    c = tl.arange(0, CPW)                        # code within a word
    q = tl.load(q_ptr + g[:, None, None] * 32 + wi[None, :, None] * CPW + c[None, None, :]).to(tl.float32)
    q_sum = tl.sum(tl.sum(q, 2), 1)                                                  # (NG,)
    words = tl.load(codes_ptr + n[:, None, None] * W + g[None, :, None] * BITS + wi[None, None, :],
                    mask=live[:, None, None], other=0)                               # (BLOCK_N, NG, BITS)
    x = unpack_codes(words[:, :, :, None], (c * BITS)[None, None, None, :], BITS)   # (BLOCK_N, NG, BITS, CPW)
    group = n[:, None] * NG + g[None, :]
    scale = tl.load(scale_ptr + group, mask=live[:, None], other=0).to(tl.float32)
    slot = tl.load(slot_ptr + group, mask=live[:, None], other=0)
    zero = slot.to(tl.float32, bitcast=True)
    if HAS_SYM:
        sym = tl.load(sym_ptr + group, mask=live[:, None], other=0) != 0
        bit = wi[:, None] * CPW + c[None, :]                                         # index in the group
        negative = ((slot[:, :, None, None] >> bit[None, None, :, :]) & 1) != 0
        x = tl.where(negative & sym[:, :, None, None], -x, x)
        zero = tl.where(sym, 0.0, zero)
    dots = tl.sum(tl.sum(x * q[None, :, :, :], 3), 2)                                # (BLOCK_N, NG)
    tl.store(out_ptr + n, tl.sum(scale * dots + zero * q_sum[None, :], 1), mask=live)


@triton.jit
def _half(x):
    """fp32 x rounded to fp16 for a tensor-core dot (fp32 accumulation), clamped to fp16's range."""
    return tl.clamp(x, -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _outer_rows(codes_ptr, n, live, D: tl.constexpr, BITS: tl.constexpr):
    """Codes of tokens n (BLOCK_N,) as exact fp32 (BLOCK_N, D), channel j at column j; dead tokens read 0."""
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = D * BITS // 32
    w = tl.arange(0, W)
    c = tl.arange(0, CPW)
    words = tl.load(codes_ptr + n[:, None] * W + w[None, :], mask=live[:, None], other=0)      # (BLOCK_N, W)
    x = unpack_codes(words[:, :, None], (c * BITS)[None, None, :], BITS)                        # (BLOCK_N, W, CPW)
    return tl.reshape(x, (n.shape[0], D))


@triton.jit
def _qk_outer_kernel(q_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, N,
                     s_q, s_codes, s_scale, s_zero, s_out,
                     D: tl.constexpr, BITS: tl.constexpr, GROUPS: tl.constexpr, REP: tl.constexpr,
                     ROWS: tl.constexpr, HALF: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)                   # b * H + h: its REP query rows are head*REP + j
    codes_ptr += head * s_codes
    scale_ptr += head * s_scale
    zero_ptr += head * s_zero
    r = tl.arange(0, ROWS)                                 # query rows, padded to a tile (ROWS >= 16)
    ch = tl.arange(0, D)
    rows = head * REP + r
    q = tl.load(q_ptr + rows[:, None] * s_q + ch[None, :], mask=(r < REP)[:, None], other=0).to(tl.float32)
    for t in range(tl.program_id(1) * GROUPS, tl.minimum((tl.program_id(1) + 1) * GROUPS, N // 32)):
        n = t * 32 + tl.arange(0, 32)                      # a group: 32 tokens sharing each channel's scale
        scale = tl.load(scale_ptr + t * D + ch).to(tl.float32)
        zero = tl.load(zero_ptr + t * D + ch).to(tl.float32)
        k = _outer_rows(codes_ptr, n, n < N, D, BITS) * scale[None, :] + zero[None, :]   # (32, D)
        if HALF:
            scores = tl.dot(_half(q), tl.trans(_half(k)))                                  # (ROWS, 32)
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * s_out + n[None, :], scores, mask=(r < REP)[:, None])


def _check_codes(codes: Tensor, bits: int, name: str) -> tuple[int, int, int, int]:
    """(B, H, N, d) of a packed code tensor, validated."""
    check_bits(bits)
    if not isinstance(codes, Tensor) or codes.dim() != 4 or codes.dtype != torch.int32:
        raise ValueError(f"{name} must be an int32 tensor (B, H, N, d*bits/32)")
    B, H, N, words = codes.shape
    d = check_head_dim(words * 32 // bits)
    if N % GROUP:
        raise ValueError(f"{name} holds {N} tokens; quantized tokens come in whole groups of {GROUP}")
    return B, H, N, d


def _check_vector(x: Tensor, name: str, shape: tuple, device: torch.device) -> Tensor:
    check_tensor(x, name, shape, (torch.float16, torch.bfloat16, torch.float32), device)
    return x.contiguous()


def qk_inner(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_slot: Tensor, k_sym: Tensor | None, bits: int,
             block_n: int = 64, num_warps: int = 4) -> Tensor:
    """scores (B, H, N) fp32 = q (B, H, d) · dequant(K)ᵀ for InnerQ's per-token key groups."""
    B, H, N, d = _check_codes(k_codes, bits, "k_codes")
    dev = k_codes.device
    check_runnable(_qk_inner_kernel, dev)
    q = _check_vector(q, "q", (B, H, d), dev)
    check_tensor(k_scale, "k_scale", (B, H, N, d // GROUP), (torch.float16,), dev)
    check_tensor(k_slot, "k_slot", (B, H, N, d // GROUP), (torch.int32,), dev)
    sym, s_sym = sym_flags(k_sym, "k_sym", (B, H, N, d // GROUP), dev)
    (codes, s_codes), (scale, s_scale), (slot, s_slot) = map(head_rows, (k_codes, k_scale, k_slot))
    out = torch.empty(B, H, N, dtype=torch.float32, device=dev)
    if B * H * N:
        _qk_inner_kernel[(B * H, triton.cdiv(N, block_n))](
            q, codes, scale, slot, slot if sym is None else sym, out, N, d, s_codes, s_scale, s_slot, s_sym, N,
            D=d, BITS=bits, HAS_SYM=sym is not None, BLOCK_N=block_n, num_warps=num_warps, enable_fp_fusion=True)
    return out


def _query_heads(x: Tensor, name: str, B: int, H: int, last: int) -> int:
    """Query heads Hq of x (B, Hq, last), a multiple of the H KV heads (GQA: query head h*rep + j reads KV
    head h)."""
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != B or x.shape[2] != last or x.shape[1] % H:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} has shape {shape}, expected ({B}, a multiple of {H}, {last})")
    return x.shape[1]


def qk_outer(q: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor, bits: int,
             groups: int = 4, num_warps: int = 4, half: bool = False) -> Tensor:
    """scores (B, Hq, N) fp32 = q (B, Hq, d) · dequant(K)ᵀ for KIVI's per-channel key groups; Hq = rep * H
    query heads, query head h*rep + j against KV head h. A program takes BLOCK_N tokens of one KV head for all
    its query rows (`groups` groups of 32 tokens, one at a time): each group's codes are read and dequantized once,
    then one tile product (rows padded to 16): tf32x3, or with `half` (an fp16/bf16 model's) q and the
    dequantized keys rounded to fp16, as flash attention's dots take them."""
    B, H, N, d = _check_codes(k_codes, bits, "k_codes")
    dev = k_codes.device
    check_runnable(_qk_outer_kernel, dev)
    Hq = _query_heads(q, "q", B, H, d)
    q = _check_vector(q, "q", (B, Hq, d), dev)
    check_tensor(k_scale, "k_scale", (B, H, N // GROUP, d), (torch.float16,), dev)
    check_tensor(k_zero, "k_zero", (B, H, N // GROUP, d), (torch.float16,), dev)
    (codes, s_codes), (scale, s_scale), (zero, s_zero) = map(head_rows, (k_codes, k_scale, k_zero))
    out = torch.empty(B, Hq, N, dtype=torch.float32, device=dev)
    if B * H * N:
        _qk_outer_kernel[(B * H, triton.cdiv(N // GROUP, groups))](
            q, codes, scale, zero, out, N, d, s_codes, s_scale, s_zero, N,
            D=d, BITS=bits, GROUPS=groups, REP=Hq // H, ROWS=query_tile(Hq // H), HALF=half, num_warps=num_warps,
            enable_fp_fusion=True)
    return out


def query_tile(rep: int) -> int:
    """Rows of a tile product holding rep query rows: a power of two, at least 16 (the smallest tl.dot)."""
    return max(16, triton.next_power_of_2(rep))


# ----------------------------------------------------------------------------------------------------
# p · V
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _pv_inner_kernel(p_ptr, codes_ptr, scale_ptr, slot_ptr, sym_ptr, out_ptr, N_GROUPS, PER_SPLIT,
                     s_p, s_codes, s_scale, s_slot, s_sym,
                     D: tl.constexpr, BITS: tl.constexpr, HAS_SYM: tl.constexpr, GROUPS: tl.constexpr):
    CPW: tl.constexpr = 32 // BITS
    row = tl.program_id(0).to(tl.int64)
    p_ptr += row * s_p
    codes_ptr += row * s_codes
    scale_ptr += row * s_scale
    slot_ptr += row * s_slot
    sym_ptr += row * s_sym
    split = tl.program_id(1)
    k = tl.arange(0, BITS)                                                           # chunk of CPW tokens
    c = tl.arange(0, CPW)
    d = tl.arange(0, D)
    tok = k[:, None] * CPW + c[None, :]                                              # (BITS, CPW) token in its group
    start = split * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, N_GROUPS)
    acc = tl.zeros((D,), dtype=tl.float32)
    for t0 in range(start, stop, GROUPS):
        t = t0 + tl.arange(0, GROUPS)
        live = t < stop
        p = tl.load(p_ptr + t[:, None, None] * 32 + tok[None, :, :], mask=live[:, None, None],
                    other=0).to(tl.float32)                                          # (GROUPS, BITS, CPW)
        # a group's 32 tokens are BITS chunks, each one word per channel (codes packed along tokens)
        words = tl.load(codes_ptr + t[:, None, None] * (D * BITS) + k[None, :, None] * D
                        + d[None, None, :], mask=live[:, None, None], other=0)      # (GROUPS, BITS, D)
        x = unpack_codes(words[:, :, :, None], (c * BITS)[None, None, None, :], BITS)   # (GROUPS, BITS, D, CPW)
        per_group = t[:, None] * D + d[None, :]                                      # (GROUPS, D)
        scale = tl.load(scale_ptr + per_group, mask=live[:, None], other=0).to(tl.float32)
        slot = tl.load(slot_ptr + per_group, mask=live[:, None], other=0)
        zero = slot.to(tl.float32, bitcast=True)
        if HAS_SYM:
            sym = tl.load(sym_ptr + per_group, mask=live[:, None], other=0) != 0
            negative = ((slot[:, None, :, None] >> tok[None, :, None, :]) & 1) != 0   # bit i: token i's sign
            x = tl.where(negative & sym[:, None, :, None], -x, x)
            zero = tl.where(sym, 0.0, zero)
        px = tl.sum(tl.sum(x * p[:, :, None, :], 3), 1)                              # (GROUPS, D)
        acc += tl.sum(scale * px + zero * tl.sum(tl.sum(p, 2), 1)[:, None], 0)
    tl.store(out_ptr + (row * tl.num_programs(1) + split) * D + d, acc)


@triton.jit
def _pv_outer_kernel(p_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, N, PER_SPLIT,
                     s_p, s_codes, s_scale, s_zero,
                     D: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, REP: tl.constexpr,
                     ROWS: tl.constexpr, HALF: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)                   # b * H + h: its REP query rows are head*REP + j
    split = tl.program_id(1)
    codes_ptr += head * s_codes
    scale_ptr += head * s_scale
    zero_ptr += head * s_zero
    r = tl.arange(0, ROWS)
    ch = tl.arange(0, D)
    rows = head * REP + r
    start = split * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, N)
    acc = tl.zeros((ROWS, D), dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < stop
        p = tl.load(p_ptr + rows[:, None] * s_p + n[None, :], mask=(r < REP)[:, None] & live[None, :],
                    other=0).to(tl.float32)                                          # (ROWS, BLOCK_N)
        per_group = n[:, None] * (D // 32) + tl.arange(0, D // 32)[None, :]          # 32 channels of a token
        scale = tl.load(scale_ptr + per_group, mask=live[:, None], other=0).to(tl.float32)
        zero = tl.load(zero_ptr + per_group, mask=live[:, None], other=0).to(tl.float32)
        x = tl.reshape(_outer_rows(codes_ptr, n, live, D, BITS), (BLOCK_N, D // 32, 32))
        v = tl.reshape(x * scale[:, :, None] + zero[:, :, None], (BLOCK_N, D))          # (BLOCK_N, D)
        if HALF:
            acc += tl.dot(p.to(tl.float16), _half(v))
        else:
            acc += tl.dot(p, v, input_precision=PRECISION)
    tl.store(out_ptr + (rows[:, None] * tl.num_programs(1) + split) * D + ch[None, :], acc, mask=(r < REP)[:, None])


def _finish_splits(partial: Tensor, B: int, H: int) -> Tensor:
    """(B*H, splits, d) partial sums -> (B, H, d)."""
    out = partial[:, 0] if partial.shape[1] == 1 else partial.sum(1)
    return out.view(B, H, -1)


def pv_inner(p: Tensor, v_codes: Tensor, v_scale: Tensor, v_slot: Tensor, v_sym: Tensor | None, bits: int,
             groups: int = 2, num_splits: int | None = None, num_warps: int = 4) -> Tensor:
    """out (B, H, d) fp32 = p (B, H, N) · dequant(V) for InnerQ's per-channel value groups (32 tokens)."""
    B, H, N, d = _check_codes(v_codes, bits, "v_codes")
    dev = v_codes.device
    check_runnable(_pv_inner_kernel, dev)
    p = _check_vector(p, "p", (B, H, N), dev)
    check_tensor(v_scale, "v_scale", (B, H, N // GROUP, d), (torch.float16,), dev)
    check_tensor(v_slot, "v_slot", (B, H, N // GROUP, d), (torch.int32,), dev)
    sym, s_sym = sym_flags(v_sym, "v_sym", (B, H, N // GROUP, d), dev)
    if B * H == 0 or N == 0:
        return torch.zeros(B, H, d, dtype=torch.float32, device=dev)
    (codes, s_codes), (scale, s_scale), (slot, s_slot) = map(head_rows, (v_codes, v_scale, v_slot))
    splits, per_split = split_groups(N // GROUP, B * H, dev, num_splits)
    partial = torch.empty(B * H, splits, d, dtype=torch.float32, device=dev)
    _pv_inner_kernel[(B * H, splits)](
        p, codes, scale, slot, slot if sym is None else sym, partial, N // GROUP, per_split,
        N, s_codes, s_scale, s_slot, s_sym,
        D=d, BITS=bits, HAS_SYM=sym is not None, GROUPS=groups, num_warps=num_warps, enable_fp_fusion=True)
    return _finish_splits(partial, B, H)


def pv_outer(p: Tensor, v_codes: Tensor, v_scale: Tensor, v_zero: Tensor, bits: int,
             block_n: int = 32, num_splits: int | None = None, num_warps: int = 4, half: bool = False) -> Tensor:
    """out (B, Hq, d) fp32 = p (B, Hq, N) · dequant(V) for KIVI's per-token value groups (32 channels);
    Hq = rep * H query heads as in qk_outer (`half`: p and the dequantized values rounded to fp16 for the dots)."""
    B, H, N, d = _check_codes(v_codes, bits, "v_codes")
    dev = v_codes.device
    check_runnable(_pv_outer_kernel, dev)
    Hq = _query_heads(p, "p", B, H, N)
    p = _check_vector(p, "p", (B, Hq, N), dev)
    check_tensor(v_scale, "v_scale", (B, H, N, d // GROUP), (torch.float16,), dev)
    check_tensor(v_zero, "v_zero", (B, H, N, d // GROUP), (torch.float16,), dev)
    if B * H == 0 or N == 0:
        return torch.zeros(B, Hq, d, dtype=torch.float32, device=dev)
    (codes, s_codes), (scale, s_scale), (zero, s_zero) = map(head_rows, (v_codes, v_scale, v_zero))
    splits, per_split = split_groups(N // GROUP, B * H, dev, num_splits)
    partial = torch.empty(B * Hq, splits, d, dtype=torch.float32, device=dev)
    _pv_outer_kernel[(B * H, splits)](
        p, codes, scale, zero, partial, N, per_split * GROUP, N, s_codes, s_scale, s_zero,
        D=d, BITS=bits, BLOCK_N=block_n, REP=Hq // H, ROWS=query_tile(Hq // H), HALF=half, num_warps=num_warps,
        enable_fp_fusion=True)
    return _finish_splits(partial, B, Hq)


# ----------------------------------------------------------------------------------------------------
# References (pure torch, on kvzoo.cache.kvquant's dequantizers)
# ----------------------------------------------------------------------------------------------------
def dequant_inner(codes: Tensor, scale: Tensor, slot: Tensor, sym: Tensor | None, bits: int, axis: int) -> Tensor:
    """(B, H, N, d) fp32 of an inner-layout tensor; axis -1: per-token groups (keys), -2: per-channel groups
    of tokens (values); sym None: every group asymmetric."""
    B, H, N, words = codes.shape
    flags = torch.zeros(scale.shape, dtype=torch.bool, device=scale.device) if sym is None else sym.bool()
    return dequantize_unified(UnifiedQTensor(codes, scale, slot, flags, bits, axis, (B, H, N, words * 32 // bits)))


def dequant_outer(codes: Tensor, scale: Tensor, zero: Tensor, bits: int, axis: int) -> Tensor:
    """(B, H, N, d) fp32 of an outer-layout tensor; axis -2: per-channel groups of tokens (keys), -1: per-token
    groups (values)."""
    B, H, N, words = codes.shape
    return dequantize(QTensor(codes, scale, zero, bits, GROUP, axis, (B, H, N, words * 32 // bits)))


def qk_inner_ref(q, k_codes, k_scale, k_slot, k_sym, bits):
    return torch.einsum("bhd,bhnd->bhn", q.float(), dequant_inner(k_codes, k_scale, k_slot, k_sym, bits, -1))


def qk_outer_ref(q, k_codes, k_scale, k_zero, bits):
    k = dequant_outer(k_codes, k_scale, k_zero, bits, -2).repeat_interleave(q.shape[1] // k_codes.shape[1], dim=1)
    return torch.einsum("bhd,bhnd->bhn", q.float(), k)


def pv_inner_ref(p, v_codes, v_scale, v_slot, v_sym, bits):
    return torch.einsum("bhn,bhnd->bhd", p.float(), dequant_inner(v_codes, v_scale, v_slot, v_sym, bits, -2))


def pv_outer_ref(p, v_codes, v_scale, v_zero, bits):
    v = dequant_outer(v_codes, v_scale, v_zero, bits, -1).repeat_interleave(p.shape[1] // v_codes.shape[1], dim=1)
    return torch.einsum("bhn,bhnd->bhd", p.float(), v)
