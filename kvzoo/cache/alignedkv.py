"""AlignedKV: keep the KV cache in fp16, but read only the high-order bits each product needs.

Paper: Tan, Wang, Yan, Deng, "AlignedKV: Reducing Memory Access of KV-Cache with Precision-Aligned
Quantization" (alignedkv.md). The cache is not smaller; each decode step *reads* fewer bytes of it.

Precision alignment: in a sum, an addend known more finely than the sum's largest addend (Rule 1) or than
the result (Rule 2) wastes its low bits. An fp16 element is read at 16, 12 or 8 of its bits (sign, 5
exponent bits and 10, 6 or 2 mantissa bits), the missing bits filled with 100... (the middle of the
interval that was not read, so the error is at most half of it).

    Rule 1 (keys, s_j = sum_i q_i k_ji). The largest addend is estimated from the per-channel column
      maximum of each block of keys: A = max_i e(q_i) + e(colmax_i), e(x) = floor(log2|x|). Channel i of
      that block differs from it by diff_i = A - e(q_i) - e(colmax_i) binary orders. Reading m mantissa
      bits errs by |q_i| * 2^(e(k) - m - 1) < 2^(A - diff_i - m), which stays under the largest addend's
      own fp16 rounding 2^(A - 10) when m >= 10 - diff_i: 8 bits (m = 2) once diff_i >= 8, 12 bits
      (m = 6) once diff_i >= 4, else 16.
    Rule 2 (values, o_c = sum_j p_j v_jc). O_est = the top-k probabilities times their (exact) values
      estimates each output; with the per-token row maximum of |v|, element (j, c) differs from o_c's
      order by diff_jc = e(O_est_c) - e(p_j) - e(rowmax_j), and the same thresholds give its bits.
For GQA a KV head's bytes serve every query head of its group, so an element gets the most bits any of
them asks for. Decisions come from magnitudes only (the block's colmax, the token's rowmax), so a kernel
makes them before it loads the bytes (kvzoo/kernels/alignedkv_attention.py).

Stored per layer (B rows, H = n_kv_heads, d = head_dim, BT = block tokens, NB = max_len / BT blocks), each
fp16 element's bits split into a high byte and two 4-bit planes (Figure 8), so that reading 8/12/16 bits
reads 1/1.5/2 bytes from contiguous arrays:
    k_hi  uint8 (B, H, NB, d, BT)      bits 15..8 of every key, channel-major inside a block of BT tokens
    k_mid, k_lo uint8 (B, H, NB, d, BT/2)   bits 7..4 and 3..0, two tokens per byte (token 2t low nibble)
    k_exp int8 (B, H, NB, d)           e(max |k|) per channel of each complete block (K_colmax)
    v_hi  uint8 (B, H, NB*BT, d)       bits 15..8 of every value, token-major
    v_mid, v_lo uint8 (B, H, NB*BT, d/2)    two channels per byte (channel 2c low nibble)
    v_exp int8 (B, H, NB*BT)           e(max |v|) per token (the row maximum)
Only complete blocks are read aligned: the newest L mod BT tokens (the block being filled) and the chunk
being prefilled are read exact. Keys are stored after RoPE. Models in fp32/bf16 have their K and V rounded
to fp16 when stored (the format is fp16's); a chunk's own tokens are attended at the model's precision.

Where the reads happen: decode on CUDA runs the kernels (aligned_decode) once a block is complete, for unpadded
rows; the rest runs the pure-torch reference (`aligned_attention`), which expands keys and values per query,
(B, H, T, S, d). A prefill chunk after the first (chunked prefill) and simulated mode therefore go through it in
blocks of queries, each fp32 temporary of that shape within QUERY_BLOCK_BYTES (256 MiB; a block's peak measured
about 6 of them). The queries are independent, so the blocks change nothing but the memory (an 8192-token chunk
over 32K slots would otherwise expand to hundreds of GB); the time stays the reference's, O(T * S * d).

The static step (`decode_static`, captured whole in a CUDA graph by kvzoo/graphs.py) is decode with fixed
shapes and no host sync: the slot L is a device tensor, every stored slot is scored (the complete blocks
aligned by the kernels, which read how many there are from a device tensor; the block being filled and the
token exact; unwritten slots, padding and a sliding window masked by StaticStep.mask), and the token is
written into the planes in place at L (its key nibbles merged into the bytes they share with a neighbour; on CUDA
one kernel, aligned_token, reads the block being filled and writes the token).
One graph per phase: 'close' when the token completes a block and its colmax exponents are recorded, 'fill'
otherwise. On CPU the same step runs the torch reference over the whole buffer (how tests hold it to decode).

Bytes per token per layer and KV head: 4*d (K and V planes; K in whole blocks of BT tokens) + d/BT (k_exp)
+ 1 (v_exp): 257.25 B at d = 64, BT = 64, against 256 for fp16 (ratio 1.005). What a decode step reads
instead of 4*d bytes per token is what `stats` reports (bits per element, K and V apart).

Paper settings: Llama-2-7B, fp16, levels of 8/12/16 bits; top-k for O_est is "approximate" (size not
given); BT is the kernel's tile. kvzoo: BT = 64 (`block`), top-k = 32 (`topk`), `min_bits` = 8;
`min_bits=16` reads every bit and is exactly the fp16 cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import Chunk, LayerCache, Positions, StaticStep, attend, full_mask, register
from kvzoo.cache.store import Window
from kvzoo.graphs import WholeStep

LEVELS = (8, 12, 16)
DIFF_FOR_12, DIFF_FOR_8 = 4, 8        # binary orders below the target at which 12 / 8 bits suffice
FILL = {8: 0x80, 12: 0x8}             # the bits not read are filled with 100...
KEEP = {8: 0xFF00, 12: 0xFFF0}
QUERY_BLOCK_BYTES = 256 << 20         # the torch reference's per-query (B, H, T, S, d) fp32 temporaries, per block


@dataclass(frozen=True)
class AlignedKVOptions:
    block: int = 64        # BT: tokens per key block (colmax granularity, the kernel's tile)
    topk: int = 32         # probabilities used for the O_est estimate of Rule 2
    min_bits: int = 8      # never read fewer bits than this; 16 = plain fp16 attention
    fused: bool = True     # decode through the Triton kernels (kvzoo/kernels/alignedkv_attention.py) on CUDA

    def __post_init__(self):
        if self.block < 2 or self.block % 2:
            raise ValueError(f"block must be an even number of tokens >= 2, got {self.block}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.min_bits not in LEVELS:
            raise ValueError(f"min_bits must be one of {', '.join(map(str, LEVELS))}, got {self.min_bits}")


# ----------------------------------------------------------------------------------------------------
# fp16 bit planes
# ----------------------------------------------------------------------------------------------------
def fp16_bits(x: Tensor) -> Tensor:
    """The 16 bits of x.half() as int32 in [0, 65535]."""
    return x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF


def from_bits(bits: Tensor) -> Tensor:
    """int32 in [0, 65535] -> fp16 with those bits."""
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16)


def split_planes(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (..., n) -> high byte (..., n), middle and low nibbles (..., n/2) with elements 2i, 2i+1 of the
    last axis in the low and high nibble of byte i. All uint8."""
    bits = fp16_bits(x)
    mid, lo = (bits >> 4) & 0xF, bits & 0xF
    pair = lambda n: n[..., 0::2] | (n[..., 1::2] << 4)            # noqa: E731  (..., n/2)
    return (bits >> 8).to(torch.uint8), pair(mid).to(torch.uint8), pair(lo).to(torch.uint8)


def join_planes(hi: Tensor, mid: Tensor, lo: Tensor) -> Tensor:
    """Inverse of split_planes: fp16 (..., n)."""
    unpair = lambda p: torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2)   # noqa: E731  (..., n)
    bits = (hi.to(torch.int32) << 8) | (unpair(mid.to(torch.int32)) << 4) | unpair(lo.to(torch.int32))
    return from_bits(bits)


def read_planes(hi: Tensor, mid: Tensor, lo: Tensor, bits: Tensor) -> Tensor:
    """Elements held as planes (split_planes: hi (..., n), mid and lo (..., n/2)) read at `bits` (8/12/16 per
    element, broadcastable), as fp32: the nibbles not read are replaced by the fill (truncate's 100...)."""
    unpair = lambda p: torch.stack([p & 0xF, p >> 4], dim=-1).flatten(-2).to(torch.int32)   # noqa: E731
    m = torch.where(bits >= 12, unpair(mid), 8)                                     # 8 bits: 0x80 filled
    low = torch.where(bits == 16, unpair(lo), torch.where(bits == 12, 8, 0))        # 12 bits: 0x8 filled
    return from_bits((hi.to(torch.int32) << 8) | (m << 4) | low).float()


def truncate(x: Tensor, bits: int) -> Tensor:
    """fp16 x read at its top `bits` bits, the rest filled with 100... (bits = 16: x itself)."""
    if bits == 16:
        return x.to(torch.float16)
    return from_bits((fp16_bits(x) & KEEP[bits]) | FILL[bits])


def exponent(x: Tensor) -> Tensor:
    """floor(log2 |x|) as int32, from x's fp32 exponent field; 0 (and fp32 subnormals) give -127."""
    return ((x.float().abs().view(torch.int32) >> 23) & 0xFF) - 127


def level(diff: Tensor, min_bits: int) -> Tensor:
    """Bits to read (8, 12 or 16) for addends `diff` binary orders below their alignment target."""
    bits = torch.where(diff >= DIFF_FOR_8, 8, torch.where(diff >= DIFF_FOR_12, 12, 16))
    return bits.clamp_min(min_bits).to(torch.int8)


# ----------------------------------------------------------------------------------------------------
# The pure-torch reference of one aligned read: which bits each element needs, and the products
# ----------------------------------------------------------------------------------------------------
def key_levels(q: Tensor, k_exp: Tensor, min_bits: int) -> Tensor:
    """Rule 1. q (B, Hq, T, d); k_exp (B, H, NB, d) colmax exponents -> bits (B, H, T, NB, d), the most
    any query head of the KV head's group needs."""
    B, Hq, T, d = q.shape
    H = k_exp.shape[1]
    a = exponent(q).view(B, H, Hq // H, T, 1, d) + k_exp[:, :, None, None].to(torch.int32)   # (B, H, G, T, NB, d)
    diff = (a.amax(-1, keepdim=True) - a).amin(2)                                   # (B, H, T, NB, d)
    return level(diff, min_bits)


def value_levels(p: Tensor, o_est: Tensor, v_exp: Tensor, min_bits: int) -> Tensor:
    """Rule 2. p (B, Hq, T, S) probabilities, o_est (B, Hq, T, d), v_exp (B, H, S) rowmax exponents ->
    bits (B, H, T, S, d), the most any query head of the group needs."""
    B, Hq, T, S = p.shape
    H, d = v_exp.shape[1], o_est.shape[-1]
    G = Hq // H
    e_o = exponent(o_est).view(B, H, G, T, 1, d)
    e_pv = (exponent(p).view(B, H, G, T, S) + v_exp[:, :, None, None].to(torch.int32))[..., None]
    return level((e_o - e_pv).amin(2), min_bits)                                   # (B, H, T, S, d)


def read_levels(x: Tensor, bits: Tensor) -> Tensor:
    """x fp16 broadcast against bits (8/12/16 per element): each element read at its bits, as fp32."""
    out = torch.where(bits == 8, truncate(x, 8), torch.where(bits == 12, truncate(x, 12), x.to(torch.float16)))
    return out.float()


def estimate_output(p: Tensor, values: Tensor, topk: int) -> Tensor:
    """O_est (B, Hq, T, d): the top-k probabilities of each query times their exact values.
    p (B, Hq, T, S); values (B, H, T or 1, S, d) (each query's exact view of the values). Gathers the k
    values each query head picks from its KV head's rows, never a copy of the values per query head."""
    B, Hq, T, S = p.shape
    H, d = values.shape[1], values.shape[-1]
    G = Hq // H
    top_p, idx = p.topk(min(topk, S), dim=-1)                                     # (B, Hq, T, k)
    k = top_p.shape[-1]
    by_kv = idx.view(B, H, G, T, k).transpose(2, 3).reshape(B, H, T, G * k)       # (B, H, T, G*k)
    top_v = values.expand(B, H, T, S, d).gather(3, by_kv[..., None].expand(B, H, T, G * k, d))
    top_v = top_v.view(B, H, T, G, k, d).transpose(2, 3).reshape(B, Hq, T, k, d)  # (B, Hq, T, k, d)
    return (top_p[..., None] * top_v).sum(3)


@dataclass
class ReadStats:
    """Bits read per element of the aligned (complete-block) part, K and V apart, summed over calls.
    An element is counted once per KV head and query token (GQA heads share the read)."""

    k_bits: int = 0
    k_elements: int = 0
    v_bits: int = 0
    v_elements: int = 0

    def add(self, k_level: Tensor, v_level: Tensor) -> None:
        self.k_bits += int(k_level.sum(dtype=torch.int64))
        self.v_bits += int(v_level.sum(dtype=torch.int64))
        self.k_elements += k_level.numel()
        self.v_elements += v_level.numel()

    @property
    def mean_k_bits(self) -> float:
        return self.k_bits / max(1, self.k_elements)

    @property
    def mean_v_bits(self) -> float:
        return self.v_bits / max(1, self.v_elements)


def aligned_attention(q: Tensor, k16: Tensor, v16: Tensor, k_exp: Tensor, v_exp: Tensor, exact_k: Tensor,
                      exact_v: Tensor, n_aligned: Tensor, mask: Tensor, block: int, topk: int, min_bits: int,
                      stats: ReadStats | None = None) -> Tensor:
    """Attention of T queries where query t reads keys/values [0, n_aligned[t]) at aligned precision.

    q (B, Hq, T, d) post-RoPE; k16, v16 (B, H, NA, d) fp16 as stored, NA = a multiple of `block` covering
    max(n_aligned); k_exp (B, H, NA/block, d), v_exp (B, H, NA); exact_k, exact_v (B, H, T or 1, S, d): what
    query t reads for key j when it reads it exact; n_aligned (T,) multiples of block (a device tensor: no sync);
    mask (B, 1, T, S) booleans. Returns (B, Hq, T, d) in q's dtype. fp32 products and softmax."""
    B, Hq, T, d = q.shape
    H, NA = k16.shape[1], k16.shape[2]
    S = mask.shape[-1]
    G, NB = Hq // H, NA // block
    qf = q.float().view(B, H, G, T, d)
    slots = torch.arange(S, device=q.device)
    aligned = slots[None, :] < n_aligned[:, None]                                   # (T, S)
    # Rule 1: each key element read at its (query, block, channel) bits
    k_bits = key_levels(q, k_exp[:, :, :NB], min_bits)                              # (B, H, T, NB, d)
    k_blocks = k16.view(B, H, 1, NB, block, d)
    k_read = read_levels(k_blocks, k_bits[:, :, :, :, None]).view(B, H, T, NA, d)   # (B, H, T, NA, d)
    keys = exact_k.float().expand(B, H, T, S, d).clone()
    keys[:, :, :, :NA] = torch.where(aligned[None, None, :, :NA, None], k_read, keys[:, :, :, :NA])
    scores = torch.einsum("bhgtd,bhtsd->bhgts", qf, keys) * d ** -0.5              # (B, H, G, T, S)
    p = scores.masked_fill(~mask[:, :, None], float("-inf")).softmax(-1).view(B, Hq, T, S)
    # Rule 2: O_est from the top-k exact values, then each value element's bits
    o_est = estimate_output(p, exact_v.float(), topk)                                # (B, Hq, T, d)
    v_bits = value_levels(p[..., :NA], o_est, v_exp[:, :, :NA], min_bits)           # (B, H, T, NA, d)
    v_read = read_levels(v16[:, :, None], v_bits)                                   # (B, H, T, NA, d)
    values = exact_v.float().expand(B, H, T, S, d).clone()
    values[:, :, :, :NA] = torch.where(aligned[None, None, :, :NA, None], v_read, values[:, :, :, :NA])
    out = torch.einsum("bhgts,bhtsd->bhgtd", p.view(B, H, G, T, S), values).reshape(B, Hq, T, d)
    if stats is not None:
        blocks_read = (torch.arange(NB, device=q.device)[None, :] * block < n_aligned[:, None])   # (T, NB)
        stats.add(k_bits[:, :, blocks_read], v_bits[:, :, aligned[:, :NA]])
    return out.to(q.dtype)


# ----------------------------------------------------------------------------------------------------
# One decode token into the planes, at a device-held slot (the static step's torch path and the reference of
# kvzoo/kernels/alignedkv_attention.py's aligned_token)
# ----------------------------------------------------------------------------------------------------
def block_keys(k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, n: Tensor) -> Tensor:
    """fp16 keys of block n, a device tensor (1,): (B, H, 1, d, BT), channel-major as stored."""
    return join_planes(*(t.index_select(2, n) for t in (k_hi, k_mid, k_lo)))


def token_tail(planes: tuple[Tensor, ...], k: Tensor, v: Tensor, L: Tensor) -> tuple[Tensor, Tensor]:
    """The block being filled when the token k, v (B, H, 1, d) arrives at slot L (a device tensor (1,)), exact,
    (B, H, BT, d) each: the stored slots before L, the token's own k, v at L (at the model's precision), the
    stored keys after it (p = 0 there) and zero values (slots left from an earlier sequence could hold anything).
    planes: k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp."""
    k_hi, k_mid, k_lo, _, v_hi, v_mid, v_lo, _ = planes
    BT = k_hi.shape[-1]
    n_full = torch.div(L, BT, rounding_mode="floor")
    slots = (n_full * BT + torch.arange(BT, device=k.device))[:, None]                   # (BT, 1)
    keys = block_keys(k_hi, k_mid, k_lo, n_full).transpose(-1, -2).flatten(2, 3)         # (B, H, BT, d)
    values = join_planes(*(t.index_select(2, slots[:, 0]) for t in (v_hi, v_mid, v_lo)))
    tail_k = torch.where(slots == L, k, keys.to(k.dtype))
    tail_v = torch.where(slots < L, values.to(v.dtype), torch.where(slots == L, v, 0))
    return tail_k, tail_v


def store_token(planes: tuple[Tensor, ...], k: Tensor, v: Tensor, L: Tensor, close: bool) -> None:
    """The token (k, v (B, H, 1, d)) into the planes at slot L (a device tensor (1,)), in place: its key's high
    bytes, its key nibbles merged into the bytes they share with the block's neighbouring token, its value rows
    and rowmax exponent; with `close` (the token completes its block) the block's colmax exponents."""
    k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp = planes
    B, H, _, d = k.shape
    BT = k_hi.shape[-1]
    n_full = torch.div(L, BT, rounding_mode="floor")
    t = L - n_full * BT                                                  # (1,) the token's place in its block
    rows = n_full * d + torch.arange(d, device=k.device)                 # (d,) its block's channel rows
    bits = fp16_bits(k[:, :, 0])                                         # (B, H, d)
    k_hi.view(B, H, -1).index_copy_(2, rows * BT + t, (bits >> 8).to(torch.uint8))   # (B, H, NB*d*BT)
    odd = t % 2 == 1                                                     # the high nibble of its byte
    for plane, nibble in ((k_mid, (bits >> 4) & 0xF), (k_lo, bits & 0xF)):
        flat, at = plane.view(B, H, -1), rows * (BT // 2) + t // 2        # (B, H, NB*d*BT/2), (d,)
        byte = flat.index_select(2, at).to(torch.int32)                   # (B, H, d)
        merged = torch.where(odd, (byte & 0x0F) | (nibble << 4), (byte & 0xF0) | nibble)
        flat.index_copy_(2, at, merged.to(torch.uint8))
    v16 = v.to(torch.float16)
    for plane, part in zip((v_hi, v_mid, v_lo), split_planes(v16)):
        plane.index_copy_(2, L, part)                                    # (B, H, 1, d or d/2) into row L
    v_exp.index_copy_(2, L, exponent(v16.abs().amax(-1)).to(torch.int8))
    if close:
        k_exp.index_copy_(2, n_full, exponent(block_keys(k_hi, k_mid, k_lo, n_full).abs().amax(-1)).to(torch.int8))


# ----------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------
@register("alignedkv")
class AlignedKVCache(WholeStep, LayerCache):
    """fp16 bit planes of every slot (not the windowed store: the format is fp16's own, nothing is quantized).
    Query t reads slot j < t from storage, aligned where j lies in a block complete before t; so `window` says
    every stored slot is read as held (a token at a time, Window(0, 0, 1)) and `attend_simulated`, fed that,
    reads the complete blocks aligned."""

    Options = AlignedKVOptions
    window = Window(0, 0, 1)

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        BT, d = self.opts.block, layer.head_dim
        if d % 2:
            raise ValueError(f"alignedkv needs an even head dimension, got {d}")
        NB = -(-max_len // BT)
        shape = (batch_size, layer.n_kv_heads)
        self._buf("k_hi", (*shape, NB, d, BT), torch.uint8)
        self._buf("k_mid", (*shape, NB, d, BT // 2), torch.uint8)
        self._buf("k_lo", (*shape, NB, d, BT // 2), torch.uint8)
        self._buf("k_exp", (*shape, NB, d), torch.int8)
        self._buf("v_hi", (*shape, NB * BT, d), torch.uint8)
        self._buf("v_mid", (*shape, NB * BT, d // 2), torch.uint8)
        self._buf("v_lo", (*shape, NB * BT, d // 2), torch.uint8)
        self._buf("v_exp", (*shape, NB * BT), torch.int8)
        self.stats = ReadStats()

    def quantized_slots(self) -> tuple[int, int]:
        """Nothing is held quantized: every slot is stored as fp16 (complete blocks are read at 8/12/16 bits)."""
        return 0, 0

    def _buf(self, name: str, shape: tuple, dtype: torch.dtype) -> None:
        device = self.attn.q_proj.weight.device
        self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    # ---- storage -----------------------------------------------------------------------------------
    def _append(self, k: Tensor, v: Tensor) -> None:
        """Store a chunk (B, H, T, d) at slots [L, L + T): rewrite the key blocks it touches, write its
        value rows, and record colmax exponents of the blocks it completes."""
        BT, L, T = self.opts.block, self.length, k.shape[2]
        first, last = L // BT, -(-(L + T) // BT)                       # blocks touched: [first, last)
        blocks = self._stored_keys(first * BT, L)                      # (B, H, L - first*BT, d)
        chunk = torch.cat([blocks, k.to(torch.float16)], dim=2)
        n = last - first
        chunk = torch.nn.functional.pad(chunk, (0, 0, 0, n * BT - chunk.shape[2]))   # (B, H, n*BT, d)
        B, H, _, d = chunk.shape
        by_channel = chunk.view(B, H, n, BT, d).transpose(-1, -2)       # (B, H, n, d, BT)
        self.k_hi[:, :, first:last], self.k_mid[:, :, first:last], self.k_lo[:, :, first:last] = \
            split_planes(by_channel)
        done = (L + T) // BT                                            # complete blocks after the chunk
        if done > first:
            self.k_exp[:, :, first:done] = exponent(by_channel[:, :, :done - first].abs().amax(-1)).to(torch.int8)
        v16 = v.to(torch.float16)
        self.v_hi[:, :, L:L + T], self.v_mid[:, :, L:L + T], self.v_lo[:, :, L:L + T] = split_planes(v16)
        self.v_exp[:, :, L:L + T] = exponent(v16.abs().amax(-1)).to(torch.int8)
        self.length = L + T

    def _stored_keys(self, a: int, b: int) -> Tensor:
        """fp16 keys of slots [a, b), a a multiple of block: (B, H, b - a, d)."""
        BT = self.opts.block
        first, last = a // BT, -(-b // BT)
        keys = join_planes(self.k_hi[:, :, first:last], self.k_mid[:, :, first:last], self.k_lo[:, :, first:last])
        return keys.transpose(-1, -2).flatten(2, 3)[:, :, :b - a]      # (B, H, n*BT, d) -> (B, H, b - a, d)

    def _stored_values(self, b: int, a: int = 0) -> Tensor:
        """fp16 values of slots [a, b): (B, H, b - a, d)."""
        return join_planes(self.v_hi[:, :, a:b], self.v_mid[:, :, a:b], self.v_lo[:, :, a:b])

    # ---- attention ---------------------------------------------------------------------------------
    def _attend(self, c: Chunk, exact_mask: Tensor, n_aligned: Tensor, mask: Tensor) -> Tensor:
        """c.q (B, Hq, T, d) over the L = self.length slots stored (the chunk's T included): c.keys, c.values the
        chunk's exact view of them (the history as held, the chunk exact), the planes the fp16 copy as stored.
        exact_mask (T or 1, L): True where query t reads the chunk's exact copy of slot j; n_aligned (T,): query t
        reads slots [0, n_aligned[t]) aligned.

        The reference expands keys and values per query, (B, H, T, S, d), so queries go through it in blocks
        of `rows`, each such fp32 temporary within QUERY_BLOCK_BYTES (a block's peak is about 6 of them); the
        queries are independent, so the result does not depend on the blocking."""
        o, q, keys, values = self.opts, c.q, c.keys, c.values           # (B, H, S, d), model dtype
        if o.min_bits == 16 or int(n_aligned.max()) == 0:
            return attend(q, keys, values, mask)
        L = self.length
        stored_k, stored_v = self._stored_keys(0, L), self._stored_values(L)   # (B, H, S, d): every slot as stored
        B, H, S, d = keys.shape
        rows = max(1, QUERY_BLOCK_BYTES // (4 * B * H * S * d))         # queries per block
        out = []
        for a in range(0, q.shape[2], rows):
            t = slice(a, a + rows)
            NA = -(-int(n_aligned[t].max()) // o.block) * o.block      # aligned slots any query of the block reads
            if NA == 0:
                out.append(attend(q[:, :, t], keys, values, mask[:, :, t]))
                continue
            em = exact_mask[t if exact_mask.shape[0] > 1 else slice(None)][None, None, :, :, None]  # (1, 1, Tb|1, S, 1)
            exact_k = torch.where(em, keys[:, :, None], stored_k.to(keys.dtype)[:, :, None])   # (B, H, Tb or 1, S, d)
            exact_v = torch.where(em, values[:, :, None], stored_v.to(values.dtype)[:, :, None])
            out.append(aligned_attention(q[:, :, t], stored_k[:, :, :NA], stored_v[:, :, :NA], self.k_exp, self.v_exp,
                                         exact_k, exact_v, n_aligned[t], mask[:, :, t], o.block, o.topk, o.min_bits,
                                         self.stats))
        return torch.cat(out, dim=2)

    @staticmethod
    def _zero_padding(k: Tensor, v: Tensor, pos: Positions) -> tuple[Tensor, Tensor]:
        """Left-padding slots are never attended; stored as zeros they cannot inflate a block's colmax."""
        slots = torch.arange(pos.start, pos.start + k.shape[2], device=k.device)
        real = (slots[None, :] >= pos.pad[:, None])[:, None, :, None]          # (B, 1, T, 1)
        return k * real, v * real

    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        q, k = self.attn.rope(q, k, pos.ids)
        k, v = self._zero_padding(k, v, pos)
        L = self.length
        hist_k, hist_v = self._stored_keys(0, L), self._stored_values(L)              # (B, H, L, d) fp16
        self._append(k, v)
        c = Chunk(q, torch.cat([hist_k.to(k.dtype), k], dim=2), torch.cat([hist_v.to(v.dtype), v], dim=2))
        if held:
            L = self.length
            c.held_keys, c.held_values = self._stored_keys(0, L).to(k.dtype), self._stored_values(L).to(v.dtype)
        return c

    def prefill(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """The history as stored (complete blocks aligned, the block being filled exact) plus the chunk
        exact, then store the chunk. Not the base class's plain attention over what `append` returns: an aligned
        read depends on the query (each element's bits come from its product), so the chunk's queries read the
        complete blocks through the reference, as decode reads them."""
        L0 = self.length
        c = self.append(x, q, k, v, pos)
        L, T = self.length, c.q.shape[2]
        n_aligned = torch.full((T,), L0 // self.opts.block * self.opts.block, device=c.q.device)
        exact_mask = (torch.arange(L, device=c.q.device) >= L0)[None, :]            # (1, L): every query alike
        return self._attend(c, exact_mask, n_aligned, full_mask(pos, L, c.q.device))

    def attend_simulated(self, c: Chunk, use_k: Tensor, use_v: Tensor, mask: Tensor) -> Tensor:
        """Query slot t reads slot j < t from storage (use_k, use_v: one window, the same), aligned if j lies in a
        block complete before t (j < floor(t / block) * block), and its own slot exact, as decoding it would; the prompt's queries
        read every slot exact."""
        if self.opts.min_bits == 16 and c.keys.dtype == torch.float16:     # every bit read: the fp16 cache
            return attend(c.q, c.keys, c.values, mask)
        if self.opts.min_bits == 16:   # every bit read: the stored copy for j < t, the exact one for j = t
            return super().attend_simulated(c, use_k, use_v, mask)
        L, T = self.length, c.q.shape[2]
        q_slots = torch.arange(L - T, L, device=c.q.device)
        n_aligned = torch.where(q_slots >= self.prompt, q_slots // self.opts.block * self.opts.block, 0)
        return self._attend(c, ~use_k, n_aligned, mask)

    # ---- decode: the kernels on CUDA ---------------------------------------------------------------
    def _kernels_fit(self) -> bool:
        """`fused` is on and the kernels take the shapes: power-of-two head_dim and block >= 16 (tl.dot tiles)."""
        pow2 = lambda n: n >= 16 and n & (n - 1) == 0                   # noqa: E731
        return self.opts.fused and pow2(self.attn.head_dim) and pow2(self.opts.block)

    def _fused_ok(self, q: Tensor, pos: Positions) -> bool:
        o = self.opts
        return q.is_cuda and o.min_bits < 16 and pos.mask is None and self._kernels_fit() and self.length >= o.block

    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token: the complete blocks through aligned_qk / aligned_pv, which decide each element's bits
        before loading its low bits; the block being filled and the new token exact, in torch. Elsewhere (a CPU,
        padding) `_decode_planes`, the same reads in torch; the reference (prefill) for min_bits=16 and before a
        block is complete."""
        if not self._fused_ok(q, pos):
            if self.opts.min_bits == 16 or self.length < self.opts.block:
                return self.prefill(x, q, k, v, pos)
            q, k = self.attn.rope(q, k, pos.ids)
            k, v = self._zero_padding(k, v, pos)
            out = self._decode_planes(q, k, v, pos.mask)
            self._append(k, v)
            return out
        from kvzoo.kernels.alignedkv_attention import aligned_decode

        o = self.opts
        q, k = self.attn.rope(q, k, pos.ids)
        L = self.length
        NA = L // o.block * o.block
        tail_k = torch.cat([self._stored_keys(NA, L).to(k.dtype), k], dim=2)            # (B, H, W, d)
        tail_v = torch.cat([self._stored_values(L, NA).to(v.dtype), v], dim=2)
        out = aligned_decode(q[:, :, 0], self.k_hi, self.k_mid, self.k_lo, self.k_exp, self.v_hi, self.v_mid,
                             self.v_lo, self.v_exp, L // o.block, tail_k, tail_v, o.topk, o.min_bits)
        self._append(k, v)
        return out.to(q.dtype)[:, :, None]                                              # (B, Hq, 1, d)

    def _decode_planes(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """One token's aligned attention read from the planes, for T = 1 (aligned_attention's reads without its
        per-query copies): q (B, Hq, 1, d) and the token's k, v (B, H, 1, d) after RoPE; mask (B, 1, 1, L + 1) or
        None. The NA = floor(L / BT) * BT slots of complete blocks are read at their 8/12/16 bits (Rules 1 and 2),
        the block being filled and the token exact. Returns (B, Hq, 1, d)."""
        o, L = self.opts, self.length
        (B, Hq, _, d), H = q.shape, k.shape[1]
        NB = L // o.block
        NA = NB * o.block
        qf = q.float().view(B, H, Hq // H, d)                                           # (B, H, G, d)
        k_bits = key_levels(q, self.k_exp[:, :, :NB], o.min_bits)[:, :, 0]              # (B, H, NB, d)
        keys = read_planes(self.k_hi[:, :, :NB], self.k_mid[:, :, :NB], self.k_lo[:, :, :NB], k_bits[..., None])
        aligned = (qf.unsqueeze(2) @ keys).transpose(2, 3).flatten(-2)                  # (B, H, G, NA)
        tail_k = torch.cat([self._stored_keys(NA, L).float(), k.float()], dim=2)        # (B, H, L + 1 - NA, d)
        scores = torch.cat([aligned, qf @ tail_k.transpose(-1, -2)], dim=-1) * d ** -0.5  # (B, H, G, L + 1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = scores.softmax(dim=-1)
        # O_est: the top-k probabilities times their exact values (every bit of a stored slot, the token's v)
        top_p, idx = p.flatten(2, 3).view(B, Hq, L + 1).topk(min(o.topk, L + 1), dim=-1)   # (B, Hq, k)
        rows = idx.view(B, H, -1).clamp_max(L - 1)                                      # (B, H, G*k)
        planes = (t.gather(2, rows[..., None].expand(-1, -1, -1, t.shape[-1])) for t in (self.v_hi, self.v_mid, self.v_lo))
        top_v = torch.where(idx.view(B, H, -1, 1) == L, v.float(), join_planes(*planes).float())   # (B, H, G*k, d)
        o_est = (top_p[..., None] * top_v.view(B, Hq, -1, d)).sum(2)                    # (B, Hq, d)
        v_bits = value_levels(p[..., :NA].reshape(B, Hq, 1, NA), o_est[:, :, None], self.v_exp[:, :, :NA],
                              o.min_bits)[:, :, 0]                                       # (B, H, NA, d)
        values = read_planes(self.v_hi[:, :, :NA], self.v_mid[:, :, :NA], self.v_lo[:, :, :NA], v_bits)
        tail_v = torch.cat([self._stored_values(L, NA).float(), v.float()], dim=2)
        out = p[..., :NA] @ values + p[..., NA:] @ tail_v                                # (B, H, G, d)
        self.stats.add(k_bits, v_bits)
        return out.reshape(B, Hq, 1, d).to(q.dtype)

    # ---- the static step (CUDA graphs, kvzoo/graphs.py) ----------------------------------------------
    def _static_fused(self) -> bool:
        """The static step runs the kernels on CUDA (aligned_decode_static); elsewhere the torch reference."""
        return self.k_hi.is_cuda and self._kernels_fit()

    def can_decode_static(self, padded: bool) -> bool:
        """Streaming caches (simulated mode has no decode step); on CUDA only where the kernels fit, since the torch
        reference over the whole buffer would build several (B, H, max_len, d) fp32 copies every step (the eager
        decode, through PiecewiseDecoder, serves those settings). Padded rows and sliding windows are served: the
        step masks its scores with StaticStep.mask."""
        return not self.simulated and (self._static_fused() or not self.k_hi.is_cuda)

    def static_phase(self) -> str:
        """'close' when the token completes a block, whose colmax exponents the step then records; else 'fill'."""
        return "close" if (self.length + 1) % self.opts.block == 0 else "fill"

    def _static_slots(self, step: StaticStep) -> tuple[Tensor, Tensor]:
        """(complete blocks before the token n_full (1,), mask (B, 1, 1, S) over every stored slot, S = NB*BT >=
        max_len) from the device-held slot, shared by every layer."""
        key = ("alignedkv", self.opts.block)
        if key not in step.derived:
            n_full = torch.div(step.slot, self.opts.block, rounding_mode="floor")
            mask = step.mask.new_zeros(*step.mask.shape[:-1], self.v_exp.shape[2])
            mask[..., :step.mask.shape[-1]] = step.mask
            step.derived[key] = (n_full, mask)
        return step.derived[key]

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode's attention at the device-held slot L = step.slot, with fixed shapes and no host sync: every
        stored slot is scored, the complete blocks (n_full = L // BT of them) read aligned, the block being filled
        and the token exact, the rest masked; the token is written into the planes in place (and, in phase
        'close', its block's colmax exponents): on CUDA by one kernel that also reads the block being filled, before
        the attention (which reads only the blocks before it aligned), elsewhere after the torch reference. No read
        statistics: counting them would sync."""
        q, k = self.attn.rope(q, k, step.ids)
        n_full, mask = self._static_slots(step)
        L, o = step.slot, self.opts
        close = self.static_phase() == "close"
        if self._static_fused():
            from kvzoo.kernels.alignedkv_attention import aligned_decode_static, aligned_token

            # the token's block is read exact, and only the complete blocks before it aligned: storing the token
            # (and, closing its block, the block's colmax exponents) first changes nothing the kernels read
            tail = aligned_token(self._planes(), k, v, L, close)
            out = aligned_decode_static(q[:, :, 0], *self._planes(), n_full, *tail, mask[:, 0, 0], o.topk,
                                        o.min_bits)
            return out.to(q.dtype)[:, :, None]                                            # (B, Hq, 1, d)
        S = self.v_exp.shape[2]
        stored_k, stored_v = self._stored_keys(0, S), self._stored_values(S)              # (B, H, S, d) fp16
        new = (torch.arange(S, device=q.device) == L)[:, None]                           # (S, 1): the token's slot
        exact_k = torch.where(new, k, stored_k.to(k.dtype))[:, :, None]                  # (B, H, 1, S, d)
        exact_v = torch.where(new, v, stored_v.to(v.dtype))[:, :, None]
        out = aligned_attention(q, stored_k, stored_v, self.k_exp, self.v_exp, exact_k, exact_v, n_full * o.block,
                                mask, o.block, o.topk, o.min_bits)
        store_token(self._planes(), k, v, L, close)
        return out

    def _planes(self) -> tuple[Tensor, ...]:
        return self.k_hi, self.k_mid, self.k_lo, self.k_exp, self.v_hi, self.v_mid, self.v_lo, self.v_exp

    # ---- bookkeeping -------------------------------------------------------------------------------
    def nbytes(self) -> int:
        BT, L = self.opts.block, self.length
        touched, done = -(-L // BT), L // BT
        keys = (self.k_hi[:, :, :touched], self.k_mid[:, :, :touched], self.k_lo[:, :, :touched],
                self.k_exp[:, :, :done])
        values = (self.v_hi[:, :, :L], self.v_mid[:, :, :L], self.v_lo[:, :, :L], self.v_exp[:, :, :L])
        return sum(t.nbytes for t in keys + values)

    def formula_nbytes(self, length: int) -> int:
        BT, d = self.opts.block, self.attn.head_dim
        per_head = 2 * d * BT * -(-length // BT) + d * (length // BT) + 2 * d * length + length
        return self.batch_size * self.attn.n_kv_heads * per_head

    def reset(self) -> None:
        super().reset()
        self.stats = ReadStats()
