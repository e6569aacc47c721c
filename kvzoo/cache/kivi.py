"""KIVI and KIVI*: 2-bit asymmetric KV cache with per-channel keys, per-token values and a residual window.

Paper: Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache" (ICML 2024).
KIVI* (named so in the XQuant paper, `--cache kivi-pre` here) is the same with keys quantized *before*
RoPE and rotated after dequantization, which keeps the per-channel structure RoPE would smear.

Why this split: key activations have a few outlier channels, so keys are grouped along tokens (each
channel of G consecutive tokens shares a scale/zero, "per-channel"); values have no such channels and
are multiplied by attention weights per token, so they are grouped along the head dimension
("per-token", G channels of one token share a scale/zero). Per-channel groups need G tokens before they
can be quantized, hence the full-precision residual window, which also keeps the most recent tokens
(the ones attention weighs most) exact.

Stored per layer (B rows, H = n_kv_heads, d = head_dim, b = bits, G = group_size, R = residual):
    k_codes  int32 (B, H, Nq, d*b/32)     keys of the Nq quantized tokens, bit-packed along d
    k_scale, k_zero  fp16 (B, H, Nq/G, d) one pair per channel per G tokens
    v_codes  int32 (B, H, Nq, d*b/32)     values, bit-packed along d
    v_scale, v_zero  fp16 (B, H, Nq, d/Gv) one pair per Gv = min(G, d) channels per token
    k_res, v_res (B, H, r, d)             the r most recent tokens at the model's precision
With L tokens stored, Nq = max(0, floor((L - R) / G)) * G and r = L - Nq, so R <= r < R + G once L >= R:
the newest R tokens are always exact, and a group is quantized once, when it leaves the window;
quantized data is never dequantized and requantized.

Bytes per token, per layer and KV head: quantized d*b/4 (K and V codes, d a multiple of 32) + 4*d/G
(fp16 key scale and zero) + 4*d/Gv (value scale and zero); residual 2*d*bytes(dtype). fp16 cache: 4*d.
For b=2, G=32, d=64: 48 vs 256 bytes, and at L=2048, R=128: (1920*48 + 128*256) / (2048*256) = 0.2383 of the fp16 cache.

Paper settings: b = 2 (also 4), G = 32, R = 128 (Llama/Mistral); scales and zeros in fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import LayerCache, Positions, attend, attend_split, full_mask, register
from kvzoo.cache.quant import QTensor, check_bits, dequantize, packed_words, quantize

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class KIVIOptions:
    bits: int = 2
    group_size: int = 32
    residual: int = 128

    def __post_init__(self):
        check_bits(self.bits)
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.residual < 0 or self.residual % self.group_size:
            raise ValueError(f"residual must be a non-negative multiple of group_size {self.group_size}, "
                             f"got {self.residual}")


@register("kivi")
class KIVICache(LayerCache):
    Options = KIVIOptions
    pre_rope = False      # KIVI quantizes keys after RoPE

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        G, R, bits, d = self.opts.group_size, self.opts.residual, self.opts.bits, layer.head_dim
        self.v_group = min(G, d)      # a value group never spans two heads
        if d % self.v_group:
            raise ValueError(f"{self.name} group_size {G} must divide the head dimension {d} "
                             f"(values are grouped along it), or be at least {d}")
        weight = layer.q_proj.weight
        B, H = batch_size, layer.n_kv_heads
        n_q = self.quantized_len(max_len)             # the most tokens this cache will ever quantize
        words = packed_words(d, bits)

        def buf(name, shape, dtype):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=weight.device), persistent=False)

        buf("k_codes", (B, H, n_q, words), torch.int32)
        buf("k_scale", (B, H, n_q // G, d), SCALE_DTYPE)
        buf("k_zero", (B, H, n_q // G, d), SCALE_DTYPE)
        buf("v_codes", (B, H, n_q, words), torch.int32)
        buf("v_scale", (B, H, n_q, d // self.v_group), SCALE_DTYPE)
        buf("v_zero", (B, H, n_q, d // self.v_group), SCALE_DTYPE)
        buf("k_res", (B, H, R + G, d), weight.dtype)
        buf("v_res", (B, H, R + G, d), weight.dtype)
        self.n_q = 0

    # ---- bookkeeping -------------------------------------------------------------------------------
    def quantized_len(self, length: int) -> int:
        """Tokens held quantized once `length` tokens are stored: whole groups outside the window."""
        G, R = self.opts.group_size, self.opts.residual
        return max(0, (length - R) // G) * G

    def reset(self) -> None:
        super().reset()
        self.n_q = 0

    def nbytes(self) -> int:
        n, G, r = self.n_q, self.opts.group_size, self.length - self.n_q
        parts = (self.k_codes[:, :, :n], self.k_scale[:, :, :n // G], self.k_zero[:, :, :n // G],
                 self.v_codes[:, :, :n], self.v_scale[:, :, :n], self.v_zero[:, :, :n],
                 self.k_res[:, :, :r], self.v_res[:, :, :r])
        return sum(t.nbytes for t in parts)

    def formula_nbytes(self, length: int) -> int:
        d, G, b = self.attn.head_dim, self.opts.group_size, self.opts.bits
        n_q = self.quantized_len(length)
        # K and V codes (d*b/4 when 32 | d), then fp16 scale + zero for keys and for values
        per_quantized = 2 * 4 * packed_words(d, b) + 4 * d // G + 4 * d // self.v_group
        per_residual = 2 * d * self.k_res.element_size()
        return self.batch_size * self.attn.n_kv_heads * (n_q * per_quantized + (length - n_q) * per_residual)

    # ---- storage -----------------------------------------------------------------------------------
    def _quantize(self, k: Tensor, v: Tensor) -> tuple[QTensor, QTensor]:
        """k, v (B, H, n, d) with n a multiple of G: keys per channel (groups along tokens), values per token."""
        G, bits = self.opts.group_size, self.opts.bits
        return (quantize(k, bits, G, axis=-2, scale_dtype=SCALE_DTYPE),
                quantize(v, bits, self.v_group, axis=-1, scale_dtype=SCALE_DTYPE))

    def _stored_quantized(self, upto: int) -> tuple[Tensor, Tensor]:
        """Dequantized keys and values of stored slots [0, upto), upto <= n_q: (B, H, upto, d) each."""
        G, bits, dtype = self.opts.group_size, self.opts.bits, self.k_res.dtype
        shape = (*self.k_codes.shape[:2], upto, self.k_res.shape[-1])
        kq = QTensor(self.k_codes[:, :, :upto], self.k_scale[:, :, :upto // G], self.k_zero[:, :, :upto // G],
                     bits, G, -2, shape)
        vq = QTensor(self.v_codes[:, :, :upto], self.v_scale[:, :, :upto], self.v_zero[:, :, :upto],
                     bits, self.v_group, -1, shape)
        return dequantize(kq, dtype), dequantize(vq, dtype)

    def _append(self, k: Tensor, v: Tensor) -> None:
        """Store a chunk (B, H, T, d): it joins the residual window, whose oldest whole groups beyond R
        tokens are quantized and written after the codes already held."""
        r = self.length - self.n_q
        k_tail = torch.cat([self.k_res[:, :, :r], k], dim=2)            # (B, H, r + T, d)
        v_tail = torch.cat([self.v_res[:, :, :r], v], dim=2)
        new_len = self.length + k.shape[2]
        flush = self.quantized_len(new_len) - self.n_q
        if flush:
            kq, vq = self._quantize(k_tail[:, :, :flush], v_tail[:, :, :flush])
            G, a, b = self.opts.group_size, self.n_q, self.n_q + flush
            self.k_codes[:, :, a:b], self.v_codes[:, :, a:b] = kq.codes, vq.codes
            self.k_scale[:, :, a // G:b // G], self.k_zero[:, :, a // G:b // G] = kq.scale, kq.zero
            self.v_scale[:, :, a:b], self.v_zero[:, :, a:b] = vq.scale, vq.zero
        keep = new_len - self.n_q - flush
        self.k_res[:, :, :keep] = k_tail[:, :, flush:]
        self.v_res[:, :, :keep] = v_tail[:, :, flush:]
        self.n_q += flush
        self.length = new_len

    def _rope_keys(self, k: Tensor, pos: Positions) -> Tensor:
        """KIVI* stores keys before RoPE: rotate stored slots [0, S) to their positions (slot - pad)."""
        if not self.pre_rope:
            return k
        slots = torch.arange(k.shape[2], device=k.device)
        return self.attn.rope.apply(k, (slots[None, :] - pos.pad[:, None]).clamp_min(0))

    # ---- attention ---------------------------------------------------------------------------------
    def prefill(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """The history as stored (dequantized codes + residual) plus the new chunk at full precision."""
        q, k_rot = self.attn.rope(q, k, pos.ids)
        k_store = k if self.pre_rope else k_rot
        hist_k, hist_v = self._stored_quantized(self.n_q)
        r = self.length - self.n_q
        keys = self._rope_keys(torch.cat([hist_k, self.k_res[:, :, :r], k_store], dim=2), pos)
        values = torch.cat([hist_v, self.v_res[:, :, :r], v], dim=2)
        out = attend(q, keys, values, pos.mask)
        self._append(k_store, v)
        return out

    decode = prefill

    def simulate(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """Query slot s sees slots below quantized_len(s) dequantized and the rest exact, as it would
        when decoded after s stored tokens."""
        q, k_rot = self.attn.rope(q, k, pos.ids)
        k_store = k if self.pre_rope else k_rot
        n_q0, r = self.n_q, self.length - self.n_q
        exact_k = torch.cat([self.k_res[:, :, :r], k_store], dim=2)     # slots [n_q0, L) at full precision
        exact_v = torch.cat([self.v_res[:, :, :r], v], dim=2)
        self._append(k_store, v)
        deq_k, deq_v = self._stored_quantized(self.n_q)                 # slots [0, n_q) round-tripped
        tail = self.n_q - n_q0                                          # slots [n_q, L) are never quantized
        keys_a = self._rope_keys(torch.cat([deq_k[:, :, :n_q0], exact_k], dim=2), pos)
        vals_a = torch.cat([deq_v[:, :, :n_q0], exact_v], dim=2)
        keys_b = self._rope_keys(torch.cat([deq_k, exact_k[:, :, tail:]], dim=2), pos)
        vals_b = torch.cat([deq_v, exact_v[:, :, tail:]], dim=2)
        L = self.length
        q_slots = torch.arange(pos.start, L, device=q.device)
        G, R = self.opts.group_size, self.opts.residual
        seen = ((q_slots - R) // G).clamp_min(0) * G                    # quantized_len(s) per query (T,)
        use_b = torch.arange(L, device=q.device)[None, :] < seen[:, None]                         # (T, L)
        return attend_split(q, keys_a, vals_a, keys_b, vals_b, use_b, full_mask(pos, L, q.device))


@register("kivi-pre")
class KIVIPreRoPECache(KIVICache):
    """KIVI*: keys quantized before RoPE, rotated after dequantization."""

    pre_rope = True
