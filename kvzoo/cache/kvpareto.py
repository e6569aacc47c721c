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
unchanged; only the quantization error changes (tested). The mean is taken once, over the first prefill
chunk (simulated mode: over the prompt, or the first token without one), and kept:
    k_mean fp32 (B, H, 1, d)
Codes: int32 (B, H, N, d*b/32) for token / tensor, (B, H, N/G, G*d*b/32) for block; a 16-bit tensor is kept
at the model's precision instead.

Bytes per token per layer and KV head (b = k_bits or v_bits, summed over K and V): token d*b/8 + 4*d/G;
block d*b/8 + 4/G (+ the exact tokens of the block being filled at the model's precision); tensor
d*b/8 + 4/H; 16 bits: d*bytes(dtype); plus 4*d per sequence for k_mean. SmolLM2 (d = 64) k4v4 per token
G = 32: 2 * (32 + 8) = 80 bytes against 256 for fp16 (0.31).

Paper settings: per-token group-wise with G = 32 for ~3B models (64 for 7-8B), K-smoothing on, k8v8 /
k8v4 / k4v4 ... chosen by the Pareto search.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvzoo.cache.base import LayerCache, Positions, attend, attend_split, full_mask, register
from kvzoo.cache.kvquant import QTensor, dequantize, packed_words, quantize

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


class _Store(nn.Module):
    """One of K or V for one layer: `bits`-bit codes at `granularity`, or exact when bits = 16."""

    def __init__(self, bits: int, granularity: str, G: int, shape: tuple[int, int, int, int], dtype, device):
        super().__init__()
        B, H, N, d = shape
        self.bits, self.granularity, self.G, self.d = bits, granularity, G, d
        buf = lambda name, size, kind: self.register_buffer(   # noqa: E731
            name, torch.zeros(size, dtype=kind, device=device), persistent=False)
        if bits == 16:
            buf("exact", (B, H, N, d), dtype)
        elif granularity == "block":
            buf("codes", (B, H, N // G, packed_words(G * d, bits)), torch.int32)
            buf("scale", (B, H, N // G), torch.float16)
            buf("zero", (B, H, N // G), torch.float16)
            buf("exact", (B, H, G, d), dtype)                  # the block being filled
        else:
            if granularity == "token" and d % G:
                raise ValueError(f"kvpareto group_size {G} must divide the head dimension {d} (per-token groups)")
            groups = (B, H, N, d // G) if granularity == "token" else (B, N)
            buf("codes", (B, H, N, packed_words(d, bits)), torch.int32)
            buf("scale", groups, torch.float16)
            buf("zero", groups, torch.float16)
            buf("lo", (B,), torch.float32)                      # tensor: the running range of the row
            buf("hi", (B,), torch.float32)

    def append(self, x: Tensor, start: int, real: Tensor) -> None:
        """Store x (B, H, T, d) at slots [start, start + T); real (B, T) False on padding slots."""
        T = x.shape[2]
        if self.bits == 16:
            self.exact[:, :, start:start + T] = x
        elif self.granularity == "token":
            q = quantize(x, self.bits, self.G, axis=-1)
            self.codes[:, :, start:start + T], self.scale[:, :, start:start + T] = q.codes, q.scale
            self.zero[:, :, start:start + T] = q.zero
        elif self.granularity == "tensor":
            xf = x.float()
            inf = torch.tensor(float("inf"), device=x.device)
            tok_lo = torch.where(real, xf.amin((1, 3)), inf).cummin(1).values       # (B, T): running minimum
            tok_hi = torch.where(real, xf.amax((1, 3)), -inf).cummax(1).values
            if start == 0:
                self.lo.fill_(float("inf"))
                self.hi.fill_(-float("inf"))
            lo = torch.minimum(tok_lo, self.lo[:, None])
            hi = torch.maximum(tok_hi, self.hi[:, None])
            lo, hi = torch.where(lo <= hi, lo, 0.0), torch.where(lo <= hi, hi, 0.0)   # rows of padding only
            self.lo.copy_(lo[:, -1])
            self.hi.copy_(hi[:, -1])
            q = quantize(x, self.bits, self.d, axis=-1, limits=(lo[:, None, :, None, None], hi[:, None, :, None, None]))
            self.codes[:, :, start:start + T] = q.codes
            self.scale[:, start:start + T], self.zero[:, start:start + T] = q.scale[:, 0, :, 0], q.zero[:, 0, :, 0]
        else:
            G, B, H = self.G, x.shape[0], x.shape[1]
            r = start % G
            tail = torch.cat([self.exact[:, :, :r], x], dim=2)                        # (B, H, r + T, d)
            n = tail.shape[2] // G                                                    # blocks completed
            if n:
                q = quantize(tail[:, :, :n * G].reshape(B, H, n, G * self.d), self.bits, G * self.d, axis=-1)
                first = start // G
                self.codes[:, :, first:first + n] = q.codes
                self.scale[:, :, first:first + n], self.zero[:, :, first:first + n] = q.scale[..., 0], q.zero[..., 0]
            left = tail.shape[2] - n * G
            self.exact[:, :, :left] = tail[:, :, n * G:]

    def read(self, length: int, dtype) -> Tensor:
        """Slots [0, length) as attention reads them: (B, H, length, d)."""
        if self.bits == 16:
            return self.exact[:, :, :length]
        B, H = self.codes.shape[:2]
        d, G = self.d, self.G
        if self.granularity == "block":
            n = length // G
            q = QTensor(self.codes[:, :, :n], self.scale[:, :, :n, None], self.zero[:, :, :n, None], self.bits,
                        G * d, -1, (B, H, n, G * d))
            blocks = dequantize(q, dtype).view(B, H, n * G, d)                        # (B, H, n*G, d)
            return torch.cat([blocks, self.exact[:, :, :length - n * G]], dim=2)
        if self.granularity == "token":
            q = QTensor(self.codes[:, :, :length], self.scale[:, :, :length], self.zero[:, :, :length], self.bits,
                        G, -1, (B, H, length, d))
        else:
            expand = lambda t: t[:, None, :length, None].expand(B, H, length, 1)        # noqa: E731
            q = QTensor(self.codes[:, :, :length], expand(self.scale), expand(self.zero), self.bits, d, -1,
                        (B, H, length, d))
        return dequantize(q, dtype)

    def nbytes(self, length: int) -> int:
        if self.bits == 16:
            return self.exact[:, :, :length].nbytes
        if self.granularity == "block":
            n = length // self.G
            parts = (self.codes[:, :, :n], self.scale[:, :, :n], self.zero[:, :, :n],
                     self.exact[:, :, :length - n * self.G])
        elif self.granularity == "token":
            parts = (self.codes[:, :, :length], self.scale[:, :, :length], self.zero[:, :, :length])
        else:
            parts = (self.codes[:, :, :length], self.scale[:, :length], self.zero[:, :length])
        return sum(t.nbytes for t in parts)

    def formula(self, length: int, B: int, H: int, elem: int) -> int:
        d, G, b = self.d, self.G, self.bits
        if b == 16:
            return B * H * length * d * elem
        if self.granularity == "block":
            n = length // G
            return B * H * (n * (4 * packed_words(G * d, b) + 4) + (length - n * G) * d * elem)
        per_token = 4 * packed_words(d, b) + (4 * d // G if self.granularity == "token" else 0)
        return B * H * length * per_token + (4 * B * length if self.granularity == "tensor" else 0)


@register("kvpareto")
class KVParetoCache(LayerCache):
    Options = KVParetoOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        o, weight = self.opts, layer.q_proj.weight
        G = o.group_size
        N = -(-max_len // G) * G if o.granularity == "block" else max_len
        shape = (batch_size, layer.n_kv_heads, N, layer.head_dim)
        self.k_store = _Store(o.k_bits, o.granularity, G, shape, weight.dtype, weight.device)
        self.v_store = _Store(o.v_bits, o.granularity, G, shape, weight.dtype, weight.device)
        self.register_buffer("k_mean", torch.zeros(batch_size, layer.n_kv_heads, 1, layer.head_dim,
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

    def prefill(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """The history as stored plus the chunk exact, then store the chunk."""
        q, k = self.attn.rope(q, k, pos.ids)
        real = self._real(pos, k.shape[2])
        k = self._smooth(k, real, k.shape[2])
        L = self.length
        keys = torch.cat([self.k_store.read(L, k.dtype), k], dim=2)
        values = torch.cat([self.v_store.read(L, v.dtype), v], dim=2)
        out = attend(q, keys, values, pos.mask)
        self._append(k, v, real)
        return out

    decode = prefill

    def simulate(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """Query slot t reads slot j < t as stored by then (quantized, or exact in a block still being
        filled) and its own slot exact; the prompt's queries read everything exact."""
        q, k = self.attn.rope(q, k, pos.ids)
        T, L = k.shape[2], self.length
        real = self._real(pos, T)
        k = self._smooth(k, real, max(self.prompt - L, 1))
        exact_k = torch.cat([self.k_store.read(L, k.dtype), k], dim=2)
        exact_v = torch.cat([self.v_store.read(L, v.dtype), v], dim=2)
        self._append(k, v, real)
        round_k, round_v = self.k_store.read(L + T, k.dtype), self.v_store.read(L + T, v.dtype)
        q_slots = torch.arange(L, L + T, device=q.device)
        key_slots = torch.arange(L + T, device=q.device)
        G = self.opts.group_size
        seen = q_slots // G * G if self.opts.granularity == "block" else q_slots   # slots quantized by then
        use_round = self.after_prompt(key_slots[None, :] < seen[:, None], q_slots)
        return attend_split(q, exact_k, exact_v, round_k, round_v, use_round, full_mask(pos, L + T, q.device))

    def _real(self, pos: Positions, T: int) -> Tensor:
        slots = torch.arange(pos.start, pos.start + T, device=pos.pad.device)
        return slots[None, :] >= pos.pad[:, None]                                     # (B, T)

    def _append(self, k: Tensor, v: Tensor, real: Tensor | None = None) -> None:
        """Store a chunk (B, H, T, d); real (B, T) False on padding slots (None: none are)."""
        if real is None:
            real = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
        self.k_store.append(k, self.length, real)
        self.v_store.append(v, self.length, real)
        self.length += k.shape[2]

    def nbytes(self) -> int:
        mean = self.k_mean.nbytes if self.opts.k_smooth and self.length else 0
        return self.k_store.nbytes(self.length) + self.v_store.nbytes(self.length) + mean

    def formula_nbytes(self, length: int) -> int:
        B, H, elem = self.batch_size, self.attn.n_kv_heads, self.attn.q_proj.weight.element_size()
        mean = 4 * B * H * self.attn.head_dim if self.opts.k_smooth and length else 0
        return self.k_store.formula(length, B, H, elem) + self.v_store.formula(length, B, H, elem) + mean
