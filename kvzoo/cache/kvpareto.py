"""KV Pareto's KV quantization: signed asymmetric round-to-nearest K and V at their own bit widths, at one
of three granularities, with K-smoothing.

Paper: "KV Pareto: Systems-level optimization of KV cache and model compression for long context inference"
(kv-pareto.md §4.2, Appendices C-E). The paper quantizes and dequantizes K/V (QDQ) to insert the error; here
the codes are stored bit-packed and attention reads them back.

Precisions: k_bits, v_bits in {2, 4, 8, 16} (16 = not quantized): the paper's k8v8, k8v4, k8v2, k4v4, k4v2,
k2v2 and the k16v16 baseline. Quantization (Appendix C): scale = (max - min) / (2^b - 1), zero = min, codes
round((x - min) / scale) (kvzoo.cache.kvquant, asymmetric). Granularity (Figure 6):
    token   per-token group-wise: each token's head vector in groups of G channels; a token is quantized
            when it is stored                                  scale, zero fp16 (B, H, N, d/G)
    block   per-sequence (per-block) group-wise: each block of G consecutive tokens of a head shares one
            scale and zero over its G x d elements; a block is quantized once it is complete and the block
            being filled stays exact                           scale, zero fp16 (B, H, N/G)
    tensor  per-tensor: one scale and zero over all heads and channels. In a cache that grows, token t is
            quantized with the range of every element of its row stored up to t (a running min/max),
            so its scale is fixed when it is stored               scale, zero fp16 (B, N)
K-smoothing (Appendix E, from SageAttention): K' = K - mean over the sequence, per row, head and channel.
q·(k - m) = q·k - q·m shifts every score of a query by the same amount, so softmax and the output are
unchanged; only the quantization error changes (tested). The mean is taken once, over the prompt's keys
(LayerCache.prompt_slots: a streaming run's first prefill chunk, the evaluation's prompt in simulated mode),
summed in fp32, and kept in the model's dtype, the keys' own, so that the step subtracts it with no cast:
    k_mean (B, H, 1, d)

Stored per layer, in kvzoo/cache/store.py's windowed store (streams "k" and "v", B rows, H = n_kv_heads,
d = head_dim, N quantized tokens) with no sink and no recent window beyond the block being filled:
    token   Window(0, 0, 1), GroupCodec: codes int32 (B, H, N, d*b/32), scale, zero fp16 (B, H, N, d/G)
    block   Window(0, 0, G), BlockCodec: codes int32 (B, H, N/G, G*d*b/32), scale, zero fp16 (B, H, N/G);
            the r = L mod G tokens of the block being filled in the store's recent window (B, H, G, d)
    tensor  Window(0, 0, 1), TensorCodec: codes int32 (B, H, N, d*b/32), scale, zero fp16 (B, N), and the
            row's running range lo, hi fp32 (B,) (8 bytes per row, not counted below)
A 16-bit K or V is kept at the model's precision instead (GroupCodec's exact rows; with block granularity the
block being filled stays in the window as for the quantized stream, so every token is still held once).

Bytes per token per layer and KV head (b = k_bits or v_bits, summed over K and V): token d*b/8 + 4*d/G;
block d*b/8 + 4/G (+ the exact tokens of the block being filled at the model's precision); tensor
d*b/8 + 4/H; 16 bits: d*bytes(dtype); plus d*bytes(dtype) per sequence for k_mean. SmolLM2 (d = 64) k4v4
per token G = 32: 2 * (32 + 8) = 80 bytes against 256 for fp16 (0.31).

Paper settings: per-token group-wise with G = 32 for ~3B models (64 for 7-8B), K-smoothing on, k8v8 /
k8v4 / k4v4 ... chosen by the Pareto search.

Decode: eagerly through the store (WindowedStore.attend); in a CUDA graph (WholeStep), token granularity at 2, 4
or 8 bits, through the fused kernel of kvzoo/kernels/outer_attention.py over the codes (keys and values in
per-token groups, WindowedStore.attend_token_kernel), whose quantized runs at 8 bits in groups of 32 or 64 channels
on an H100/H200 at head_dim 128 take kvzoo/kernels/token_hopper.py. Block and tensor granularity, and 16-bit
streams, decode piecewise.

Tensor parallelism (kvzoo/models/tp.py): k_mean and the token and block groups are per KV head, so each rank has
its own heads'; the tensor granularity's range spans the rank's heads only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import Chunk, LayerCache, Positions, StaticStep, register
from kvzoo.cache.kvquant import QTensor, dequantize, packed_words, quantize
from kvzoo.cache.store import EXACT, SCALE_DTYPE, Codec, GroupCodec, Window, WindowedStore
from kvzoo.graphs import WholeStep

PRECISIONS = (2, 4, 8, 16)
GRANULARITIES = ("token", "block", "tensor")


@dataclass(frozen=True)
class KVParetoOptions:
    k_bits: int = 8
    v_bits: int = 8
    granularity: str = "token"
    group_size: int = 32       # token: channels per group; block: tokens per block
    k_smooth: bool = True

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"{name} must be one of {', '.join(map(str, PRECISIONS))}, got {getattr(self, name)}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {self.granularity!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")


class BlockCodec(Codec):
    """Block granularity: each block of G consecutive slots of a (row, head) shares one scale and zero over its
    G x d elements. Written in whole blocks (the window's groups of G)."""

    def __init__(self, lead: tuple[int, int], capacity: int, width: int, bits: int, G: int, device):
        super().__init__()
        self.width, self.bits, self.G, self.capacity = width, bits, G, capacity
        for name, shape, kind in (("codes", (capacity // G, packed_words(G * width, bits)), torch.int32),
                                  ("scale", (capacity // G,), SCALE_DTYPE), ("zero", (capacity // G,), SCALE_DTYPE)):
            self.register_buffer(name, torch.zeros((*lead, *shape), dtype=kind, device=device), persistent=False)

    def write(self, a: int, b: int, rows: Tensor, real: Tensor | None = None) -> None:
        B, H, G = rows.shape[0], rows.shape[1], self.G
        n, first = (b - a) // G, a // G
        q = quantize(rows.reshape(B, H, n, G * self.width), self.bits, G * self.width, axis=-1)
        self.codes[:, :, first:first + n] = q.codes
        self.scale[:, :, first:first + n], self.zero[:, :, first:first + n] = q.scale[..., 0], q.zero[..., 0]

    def held(self, n: int, start: int = 0) -> QTensor:
        """Blocks of slots [start, n), start and n multiples of G."""
        B, H = self.codes.shape[:2]
        blocks = slice(start // self.G, n // self.G)
        return QTensor(self.codes[:, :, blocks], self.scale[:, :, blocks, None], self.zero[:, :, blocks, None],
                       self.bits, self.G * self.width, -1, (B, H, (n - start) // self.G, self.G * self.width))

    def read(self, n: int, dtype: torch.dtype, start: int = 0) -> Tensor:
        B, H = self.codes.shape[:2]
        blocks = self.held(n, start)
        return dequantize(blocks, dtype).view(B, H, n - start, self.width)                     # (B, H, n - start, d)

    def nbytes(self, n: int) -> int:
        nb = n // self.G
        return sum(t[:, :, :nb].nbytes for t in (self.codes, self.scale, self.zero))

    def token_bytes(self) -> float:
        return (4 * packed_words(self.G * self.width, self.bits) + 4) / self.G


class TensorCodec(Codec):
    """Tensor granularity: one scale and zero per row and token over all heads and channels, from the row's
    running min/max over the real (unpadded) tokens stored so far. Written a token at a time (Window(0, 0, 1))."""

    def __init__(self, lead: tuple[int, int], capacity: int, width: int, bits: int, device):
        super().__init__()
        B = lead[0]
        self.width, self.bits, self.heads, self.capacity = width, bits, lead[1], capacity
        for name, shape, kind in (("codes", (*lead, capacity, packed_words(width, bits)), torch.int32),
                                  ("scale", (B, capacity), SCALE_DTYPE), ("zero", (B, capacity), SCALE_DTYPE),
                                  ("lo", (B,), torch.float32), ("hi", (B,), torch.float32)):   # the running range
            self.register_buffer(name, torch.zeros(shape, dtype=kind, device=device), persistent=False)

    def write(self, a: int, b: int, rows: Tensor, real: Tensor | None = None) -> None:
        if real is None:
            real = torch.ones(rows.shape[0], b - a, dtype=torch.bool, device=rows.device)
        xf = rows.float()
        inf = torch.tensor(float("inf"), device=rows.device)
        tok_lo = torch.where(real, xf.amin((1, 3)), inf).cummin(1).values       # (B, T): running minimum
        tok_hi = torch.where(real, xf.amax((1, 3)), -inf).cummax(1).values
        if a == 0:
            self.lo.fill_(float("inf"))
            self.hi.fill_(-float("inf"))
        lo = torch.minimum(tok_lo, self.lo[:, None])
        hi = torch.maximum(tok_hi, self.hi[:, None])
        lo, hi = torch.where(lo <= hi, lo, 0.0), torch.where(lo <= hi, hi, 0.0)   # rows of padding only
        self.lo.copy_(lo[:, -1])
        self.hi.copy_(hi[:, -1])
        q = quantize(rows, self.bits, self.width, axis=-1,
                     limits=(lo[:, None, :, None, None], hi[:, None, :, None, None]))
        self.codes[:, :, a:b] = q.codes
        self.scale[:, a:b], self.zero[:, a:b] = q.scale[:, 0, :, 0], q.zero[:, 0, :, 0]

    def held(self, n: int, start: int = 0) -> QTensor:
        B, H = self.codes.shape[:2]
        expand = lambda t: t[:, None, start:n, None].expand(B, H, n - start, 1)        # noqa: E731
        return QTensor(self.codes[:, :, start:n], expand(self.scale), expand(self.zero), self.bits, self.width, -1,
                       (B, H, n - start, self.width))

    def read(self, n: int, dtype: torch.dtype, start: int = 0) -> Tensor:
        return dequantize(self.held(n, start), dtype)

    def nbytes(self, n: int) -> int:
        return self.codes[:, :, :n].nbytes + self.scale[:, :n].nbytes + self.zero[:, :n].nbytes

    def token_bytes(self) -> float:
        return 4 * packed_words(self.width, self.bits) + 4 / self.heads      # the fp16 scale + zero, shared by H heads


@register("kvpareto")
class KVParetoCache(WholeStep, LayerCache):
    """K and V in one windowed store: quantized token by token (token, tensor) or block by block, the block being
    filled exact (block); keys smoothed before they are stored."""

    Options = KVParetoOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        o, weight, d = self.opts, layer.q_proj.weight, layer.head_dim
        G = o.group_size
        if o.granularity == "token" and d % G and (o.k_bits != EXACT or o.v_bits != EXACT):
            raise ValueError(f"kvpareto group_size {G} must divide the head dimension {d} (per-token groups)")
        self.window = Window(0, 0, G if o.granularity == "block" else 1)
        lead, capacity = (batch_size, layer.n_kv_heads), self.window.quantized(max_len)

        def codec(bits: int) -> Codec:
            if bits == EXACT:
                return GroupCodec(lead, capacity, d, bits, d, False, weight.dtype, weight.device)   # exact rows
            if o.granularity == "block":
                return BlockCodec(lead, capacity, d, bits, G, weight.device)
            if o.granularity == "tensor":
                return TensorCodec(lead, capacity, d, bits, weight.device)
            return GroupCodec(lead, capacity, d, bits, G, False, weight.dtype, weight.device)

        self.store = WindowedStore(self.window, {"k": codec(o.k_bits), "v": codec(o.v_bits)}, lead, weight.dtype,
                                   weight.device)
        self.register_buffer("k_mean", torch.zeros(batch_size, layer.n_kv_heads, 1, d, dtype=weight.dtype,
                                                   device=weight.device), persistent=False)

    def _smooth(self, k: Tensor, real: Tensor, first: int) -> Tensor:
        """K - mean, the mean taken over the real tokens among the first `first` slots of the first call."""
        if not self.opts.k_smooth:
            return k
        if self.length == 0:
            use = real[:, None, :first, None].float()                               # (B, 1, first, 1)
            total = (k[:, :, :first].float() * use).sum(2, keepdim=True)
            self.k_mean.copy_(total / use.sum(2, keepdim=True).clamp_min(1))
        return k - self.k_mean.to(k.dtype)

    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        q, k = self.attn.rope(q, k, pos.ids)
        real = self._real(pos, k.shape[2])
        k = self._smooth(k, real, self.prompt_slots(k.shape[2]))           # the mean: over the prompt's keys
        before = self.store.read(self.length, k.dtype)                            # (B, H, L, d) each
        self._append(k, v, real)
        c = Chunk(q, torch.cat([before["k"], k], dim=2), torch.cat([before["v"], v], dim=2))
        if held:
            after = self.store.read(self.length, k.dtype)
            c.held_keys, c.held_values = after["k"], after["v"]
        return c

    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token: attention read from the codes (WindowedStore.attend; the smoothed keys shift
        every score of a query by q·mean, which softmax ignores), then the token stored."""
        if not self.length:
            return self.prefill(x, q, k, v, pos)
        q, k = self.attn.rope(q, k, pos.ids)
        k = self._smooth(k, None, 0)
        out = self.store.attend(q, self.length, {"k": k, "v": v}, pos.mask)
        self._append(k, v)
        return out

    # ---- the static step (WholeStep: CUDA graphs, kvzoo/graphs.py): token granularity, one fused kernel ----
    def can_decode_static(self, padded: bool) -> bool:
        """Per-token groups at 2, 4 or 8 bits in both streams (store.token_kernel_serves), once a prompt (and the
        keys' mean) is stored."""
        return not self.simulated and self.length > 0 and self.store.token_kernel_serves(padded, self.attn,
                                                                                         self.max_len)

    def static_phase(self) -> str:
        return self.store.phases(self.length)

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode with fixed shapes: the smoothed key and the value of the token into the window row, attention
        over the codes in one fused kernel, the token quantized at the device-held slot."""
        q, k = self.attn.rope(q, k, step.ids)
        return self.store.attend_token_kernel(q, self.length, step, {"k": self._smooth(k, None, 0), "v": v})

    def _real(self, pos: Positions, T: int) -> Tensor:
        slots = torch.arange(pos.start, pos.start + T, device=pos.pad.device)
        return slots[None, :] >= pos.pad[:, None]                                     # (B, T)

    def _append(self, k: Tensor, v: Tensor, real: Tensor | None = None) -> None:
        """Store a chunk (B, H, T, d), keys smoothed; real (B, T) False on padding slots (None: none are), which
        the tensor granularity's running range skips."""
        self.length = self.store.append(self.length, {"k": k, "v": v},
                                        real if self.opts.granularity == "tensor" else None)

    def nbytes(self) -> int:
        mean = self.k_mean.nbytes if self.opts.k_smooth and self.length else 0
        return self.store.nbytes(self.length) + mean

    def formula_nbytes(self, length: int) -> int:
        B, H, d = self.batch_size, self.attn.n_kv_heads, self.attn.head_dim
        mean = B * H * d * self.k_mean.element_size() if self.opts.k_smooth and length else 0
        return self.store.formula_nbytes(length) + mean
