"""Group-wise uniform quantization and bit-packing, shared by every quantized cache strategy.

A tensor is cut into groups of `group_size` consecutive entries along one axis; each group gets its own
scale (and zero point), and every entry becomes a `bits`-bit integer code:

    asymmetric  scale = (max - min) / (2^b - 1),  zero = min,  code = round((x - zero) / scale) in [0, 2^b - 1]
                x' = code * scale + zero
    symmetric   scale = absmax / (2^(b-1) - 1),                code = round(x / scale) in [-qmax, qmax]
                x' = code * scale          (stored as code + 2^(b-1), so it packs like an unsigned code)

The axis decides the flavour used by KV-cache papers: groups along the head dimension of one token are
"per-token" quantization (KIVI's values); groups along the tokens of one channel are "per-channel"
(KIVI's keys, whose outlier channels would otherwise blow up every token's scale).

Codes are bit-packed along the last dimension into int32 words as one continuous bit stream: code i
occupies bits [i*b, (i+1)*b) of the stream, so 2-, 4- and 8-bit codes sit 16, 8 and 4 to a word and
3-bit codes take exactly 3 words per 32 codes (some straddle two words). Storage is therefore exactly
b bits per code, padding aside (the last dimension is padded to a whole block of codes).

pack_tokens packs (..., n, d) codes along the tokens instead, for groups that run along them (InnerQ's values):
each chunk of block_codes(b) tokens keeps, channel by channel, the words of its codes along those tokens, so a
word holds one channel's codes (16 tokens at 2 bits) and shares its group's scale; the chunk's words fill its own
rows of an (..., n, d*b/32) buffer, so whole chunks can be written and sliced by token as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 3, 4, 8)


def check_bits(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported bit width {bits}; accepted: {', '.join(map(str, SUPPORTED_BITS))}")
    return bits


# ----------------------------------------------------------------------------------------------------
# Bit-packing
# ----------------------------------------------------------------------------------------------------
def block_codes(bits: int) -> int:
    """Codes per packing block: the fewest codes that fill whole int32 words (16 for 2-bit, 32 for 3-bit)."""
    return 32 // math.gcd(32, bits)


def packed_words(n: int, bits: int) -> int:
    """int32 words that hold n codes of `bits` bits."""
    block = block_codes(bits)
    return -(-n // block) * block * bits // 32


def _layout(n_padded: int, bits: int, device) -> tuple[Tensor, Tensor]:
    """For each code: the word its lowest bit falls in, and the bit offset there."""
    start = torch.arange(n_padded, device=device) * bits
    return start // 32, start % 32


def pack(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes in [0, 2^bits) along the last dim: (..., n) -> int32 (..., packed_words(n))."""
    n = codes.shape[-1]
    n_padded = -(-n // block_codes(bits)) * block_codes(bits)
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, n_padded - n))      # (..., n_padded)
    word, offset = _layout(n_padded, bits, codes.device)
    shifted = c << offset                                                       # up to 39 bits
    words = torch.zeros(*c.shape[:-1], n_padded * bits // 32 + 1, dtype=torch.int64, device=codes.device)
    words.index_add_(-1, word, shifted & 0xFFFFFFFF)          # bits that stay in the code's first word
    words.index_add_(-1, word + 1, shifted >> 32)             # bits that spill into the next word
    words = words[..., :-1]                                   # the spill word past the end is always 0
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)   # as signed int32 bits


def unpack(words: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of pack: int32 (..., packed_words(n)) -> uint8 codes (..., n)."""
    return unpack_int(words, bits, n).to(torch.uint8)


def unpack_int(words: Tensor, bits: int, n: int) -> Tensor:
    """unpack's codes as integers (int32; uint8 for 8 bits, int64 for 3), saving a conversion where they go on into
    arithmetic.

    8-bit codes are the words' little-endian bytes, read in place; other widths that divide 32 shift each word by
    every code offset at once; 3-bit blocks (32 codes in 3 words) are read as two 64-bit windows, bits [0, 64)
    holding codes 0..20 and bits [32, 96) codes 21..31."""
    mask = (1 << bits) - 1
    if bits == 8:
        return (words if words.stride(-1) == 1 else words.contiguous()).view(torch.uint8)[..., :n]
    if 32 % bits == 0:
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
        codes = (words.unsqueeze(-1) >> shifts).bitwise_and_(mask)             # (..., words, 32 / bits)
        return codes.flatten(-2)[..., :n]
    assert bits == 3, f"no unpacking for {bits}-bit codes"
    w = words.unflatten(-1, (-1, 3)).to(torch.int64) & 0xFFFFFFFF               # (..., blocks, 3) unsigned
    low = w[..., 0] | (w[..., 1] << 32)                                          # bits [0, 64) of each block
    high = w[..., 1] | (w[..., 2] << 32)                                         # bits [32, 96)
    first = (low.unsqueeze(-1) >> torch.arange(0, 63, 3, device=words.device)) & mask            # codes 0..20
    rest = (high.unsqueeze(-1) >> torch.arange(31, 64, 3, device=words.device)) & mask           # codes 21..31
    return torch.cat([first, rest], dim=-1).flatten(-2)[..., :n]


def pack_tokens(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes (..., n, d) along the tokens, n a multiple of block_codes(bits): int32 (..., n, d*b/32),
    chunk k's words (block_codes(bits) tokens) channel after channel in its own rows."""
    block, (n, d) = block_codes(bits), codes.shape[-2:]
    x = codes.unflatten(-2, (n // block, block)).transpose(-1, -2)               # (..., n/block, d, block)
    return pack(x, bits).reshape(*codes.shape[:-2], n, d * bits // 32)          # (..., n/block, d, words) -> rows


def unpack_tokens(words: Tensor, bits: int) -> Tensor:
    """Inverse of pack_tokens: int32 (..., n, W) -> integer codes (..., n, 32 W / b), as unpack_int returns them."""
    block, (n, width) = block_codes(bits), words.shape[-2:]
    d = width * 32 // bits
    chunks = words.reshape(*words.shape[:-2], n // block, d, block * bits // 32)  # (..., n/block, d, words)
    return unpack_int(chunks, bits, block).transpose(-1, -2).flatten(-3, -2)     # (..., n/block, block, d) -> n


def unpack_float(words: Tensor, bits: int, n: int, signs: Tensor | None = None) -> Tensor:
    """unpack(words, bits, n) as fp32 codes (..., n). signs: int32 words of one bit per code in the codes' own
    order (InnerQ's symmetric groups along the packed axis): codes whose bit is set come back negated."""
    codes = unpack_int(words, bits, n).float()
    if signs is not None:        # each sign bit moved to bit 31 (an fp32's sign) and flipped into the code
        shifts = torch.arange(32, dtype=torch.int32, device=signs.device)
        flip = (signs.unsqueeze(-1) >> shifts).bitwise_left_shift_(31).flatten(-2)[..., :n]
        codes.view(torch.int32).bitwise_xor_(flip)
    return codes


# ----------------------------------------------------------------------------------------------------
# Quantize / dequantize
# ----------------------------------------------------------------------------------------------------
@dataclass
class QTensor:
    """A quantized tensor: packed codes plus one scale (and zero) per group."""

    codes: Tensor            # int32, the original shape with its last dim packed
    scale: Tensor            # the original shape with the group axis reduced to n_groups
    zero: Tensor | None      # like scale (asymmetric only)
    bits: int
    group_size: int
    axis: int                # the (negative) axis along which groups run
    shape: tuple[int, ...]

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scale, self.zero) if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(self, dtype)


def _grouped(x: Tensor, axis: int, group_size: int) -> Tensor:
    """Split `axis` into (n_groups, group_size) and move group_size last: (..., n_groups, ..., group_size)."""
    size = x.shape[axis]
    if size % group_size:
        raise ValueError(f"group size {group_size} does not divide the quantized dimension {size}")
    x = x.unflatten(axis, (size // group_size, group_size))
    return x.movedim(axis, -1) if axis != -1 else x


def _ungrouped(x: Tensor, axis: int) -> Tensor:
    """Inverse of _grouped."""
    if axis != -1:
        x = x.movedim(-1, axis)
    return x.flatten(axis - 1, axis) if axis != -1 else x.flatten(-2)


def _codes(x: Tensor, bits: int, group_size: int, axis: int, symmetric: bool, scale_dtype: torch.dtype,
           limits: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """quantize's arithmetic: the codes (x's shape, fp32 integers, symmetric ones offset by 2^(bits-1)) and each
    group's scale and zero (x's shape with `axis` reduced to its groups, rounded to scale_dtype, held in fp32)."""
    check_bits(bits)
    assert axis < 0, "axis counts from the end so that leading batch dims do not matter"
    g = _grouped(x.float(), axis, group_size)                                   # (..., group_size)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = (g.abs().amax(-1, keepdim=True) / qmax).to(scale_dtype).float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))            # all-zero group: codes 0
        codes = (g / safe).round().clamp(-qmax, qmax) + 2 ** (bits - 1)
        zero = None
    else:
        lo, hi = (g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)) if limits is None else limits
        zero = lo.to(scale_dtype).float()
        scale = ((hi - zero) / (2 ** bits - 1)).to(scale_dtype).float()
        # min == max (e.g. a one-token per-channel group): scale 0 would divide by zero; every code is 0
        # and x' = zero, exact up to the zero's own rounding.
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = ((g - zero) / safe).round().clamp(0, 2 ** bits - 1)
    return _ungrouped(codes, axis), scale.squeeze(-1), None if zero is None else zero.squeeze(-1)


def quantize(x: Tensor, bits: int, group_size: int, axis: int = -1, symmetric: bool = False,
             scale_dtype: torch.dtype = torch.float16, limits: tuple[Tensor, Tensor] | None = None) -> QTensor:
    """Quantize x in groups of `group_size` along `axis` (negative). Scales (and zeros) are rounded to
    scale_dtype before the codes are computed, so dequantization uses exactly what is stored.
    limits (asymmetric): each group's (min, max) given instead of measured, broadcastable to the grouped
    shape (..., n_groups, ..., 1); values outside are clamped (a range shared beyond one group)."""
    codes, scale, zero = _codes(x, bits, group_size, axis, symmetric, scale_dtype, limits)
    return QTensor(codes=pack(codes, bits), scale=scale.to(scale_dtype),
                   zero=None if zero is None else zero.to(scale_dtype),
                   bits=bits, group_size=group_size, axis=axis, shape=tuple(x.shape))


def fake_quantize(x: Tensor, bits: int, group_size: int, axis: int = -1, symmetric: bool = False,
                  scale_dtype: torch.dtype = torch.float16, limits: tuple[Tensor, Tensor] | None = None,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """dequantize(quantize(x, ...), dtype), bit for bit, without packing and unpacking the codes: for searches that
    need only the values a quantizer gives (AWQ's scales, SQuat's key updates)."""
    codes, scale, zero = _codes(x, bits, group_size, axis, symmetric, scale_dtype, limits)
    return _values(codes, bits, scale, zero, group_size, axis).to(dtype)


def scale_codes_(codes: Tensor, scale: Tensor, zero: Tensor | None, group_size: int, axis: int) -> Tensor:
    """codes * scale + zero in place: fp32 codes (x's shape) become the values they encode, (scale, zero) per group
    of `group_size` along `axis` (shaped like x with that axis reduced to the groups; zero None: symmetric, the
    codes already centred). One pass over the codes and no second tensor of their size: a decode step reads its
    quantized history through this and one matmul."""
    g = codes.unflatten(axis, (-1, group_size))                                 # the group axis split in two
    g.mul_(scale.float().unsqueeze(axis))
    if zero is not None:
        g.add_(zero.float().unsqueeze(axis))
    return codes


def _values(codes: Tensor, bits: int, scale: Tensor, zero: Tensor | None, group_size: int, axis: int) -> Tensor:
    """fp32 codes (a tensor of their own, x's shape) made in place into the values they encode: symmetric ones
    (zero None) centred first."""
    if zero is None:
        codes.sub_(2 ** (bits - 1))
    return scale_codes_(codes, scale, zero, group_size, axis)


def dequantize(q: QTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    codes = unpack_int(q.codes, q.bits, q.shape[-1]).float()                    # q.shape, a new fp32 tensor
    return _values(codes, q.bits, q.scale, q.zero, q.group_size, q.axis).to(dtype)


# ----------------------------------------------------------------------------------------------------
# InnerQ's unified sym/asym representation
# ----------------------------------------------------------------------------------------------------
UNIFIED_MODES = ("asym", "sym", "hybrid")


@dataclass
class UnifiedQTensor:
    """Groups of 32 that are each asymmetric or symmetric (sign + magnitude), in one layout:

        codes  int32, b-bit codes (asym: (x - zero) / scale; sym: |x| / scale) packed along their groups' axis:
               along d (pack) for axis -1, along the tokens (pack_tokens) for axis -2
        scale  fp16 per group
        slot   int32 per group: the fp32 bits of the zero point (asym) or the 32 sign bits (sym)
        sym    bool per group: which mode the group uses (InnerQ's mask M^sym)
    """

    codes: Tensor
    scale: Tensor
    slot: Tensor
    sym: Tensor
    bits: int
    axis: int
    shape: tuple[int, ...]


def quantize_unified(x: Tensor, bits: int, axis: int, mode: str) -> UnifiedQTensor:
    """InnerQ's quantizer over groups of 32 along `axis`: asymmetric (eqs. 10-12), symmetric with
    scale = max|x| / (2^b - 1) and a separate sign bit (eq. 13), or hybrid: per group, whichever of
    the two reconstructs the group with the lower squared error."""
    check_bits(bits)
    if mode not in UNIFIED_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; accepted: {', '.join(UNIFIED_MODES)}")
    if axis not in (-1, -2):
        raise ValueError(f"groups run along the last axis (-1, per token) or the tokens (-2), got axis {axis}")
    G, top = 32, 2 ** bits - 1
    g = _grouped(x.float(), axis, G)                                            # (..., 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale_a = ((hi - lo) / top).half().float()
    code_a = ((g - lo) / torch.where(scale_a > 0, scale_a, 1.0)).round().clamp(0, top)
    scale_s = (g.abs().amax(-1, keepdim=True) / top).half().float()
    code_s = (g.abs() / torch.where(scale_s > 0, scale_s, 1.0)).round().clamp(0, top)
    negative = g < 0
    if mode == "hybrid":
        err_a = (code_a * scale_a + lo - g).square().sum(-1, keepdim=True)
        err_s = (torch.where(negative, -code_s, code_s) * scale_s - g).square().sum(-1, keepdim=True)
        sym = err_s < err_a
    else:
        sym = torch.full_like(lo, mode == "sym", dtype=torch.bool)
    codes = torch.where(sym, code_s, code_a)
    signs = pack(negative, 1).squeeze(-1)                                       # (...,) one word per group
    slot = torch.where(sym.squeeze(-1), signs, lo.squeeze(-1).contiguous().view(torch.int32))
    codes = _ungrouped(codes, axis)                                             # x's shape again
    return UnifiedQTensor(codes=pack(codes, bits) if axis == -1 else pack_tokens(codes, bits),
                          scale=torch.where(sym, scale_s, scale_a).squeeze(-1).half(), slot=slot,
                          sym=sym.squeeze(-1), bits=bits, axis=axis, shape=tuple(x.shape))


def dequantize_unified(q: UnifiedQTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    codes = unpack_int(q.codes, q.bits, q.shape[-1]) if q.axis == -1 else unpack_tokens(q.codes, q.bits)
    codes = _grouped(codes.float(), q.axis, 32)                                 # (..., 32)
    magnitude = codes * q.scale.float().unsqueeze(-1)
    negative = unpack(q.slot.unsqueeze(-1), 1, 32).bool()                      # (..., 32) sign bits
    zero = q.slot.view(torch.float32).unsqueeze(-1)
    sym = q.sym.unsqueeze(-1)
    x = torch.where(sym, torch.where(negative, -magnitude, magnitude), magnitude + zero)
    return _ungrouped(x, q.axis).to(dtype)


def pack_sym_mask(sym: Tensor, axis: int) -> Tensor:
    """Symmetric flags -> InnerQ's packed mask bits (the inverse of unpack_sym_mask): per-token groups (axis -1)
    sym (B, H, n, d/32) -> bits along tokens (B, H, d/32, n/32); per-channel groups (axis -2) sym (B, H, n/32, d)
    -> bits along channels (B, H, n/32, d/32)."""
    return pack(sym.transpose(-1, -2), 1) if axis == -1 else pack(sym, 1)


def unpack_sym_mask(mask: Tensor, axis: int, n: int, mask_upto: int, d: int) -> Tensor:
    """InnerQ's packed mask bits (kvzoo/cache/innerq.py's layout) -> symmetric flags of the groups of quantized
    tokens [0, n). axis -1 (per-token groups along d): mask int32 (B, H, d/32, >= n/32), bit t % 32 of word
    [g, t // 32] for token t's group g -> (B, H, n, d/32). axis -2 (per-channel groups of 32 tokens): mask int32
    (B, H, >= n/32, d/32), bit c % 32 of word [t // 32, c // 32] for channel c -> (B, H, n/32, d). Tokens from
    mask_upto on carry no bit: symmetric."""
    B, H = mask.shape[:2]
    shape = (n, d // 32) if axis == -1 else (n // 32, d)
    sym = torch.ones(B, H, *shape, dtype=torch.bool, device=mask.device)
    m = min(n, mask_upto)
    if m and axis == -1:
        sym[:, :, :m] = unpack(mask[:, :, :, :-(-m // 32)], 1, m).transpose(-1, -2).bool()
    elif m:
        sym[:, :, :m // 32] = unpack(mask[:, :, :m // 32], 1, d).bool()
    return sym
