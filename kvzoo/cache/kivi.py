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

Decode on a GPU (unpadded rows, KIVI and SQuat, not KIVI*, whose keys need RoPE after dequantization) reads
the quantized history in place through the outer-layout kernels of kvzoo/kernels/quant_matvec.py (q·Kᵀ with
per-channel key groups, p·V with per-token value groups; one launch each, GQA rows reading their KV head), with the
windows and the token exact in one fp32 softmax; everywhere else decode is a one-token prefill, which
dequantizes the whole history. `decode_static` is the same step with the length in a device tensor, for
kvzoo/graphs.py's whole-step CUDA graph: attention over every allocated slot, the dead ones and those the
step's mask forbids (padding, sliding windows) masked, one graph per phase (the token joins the sink, joins
the residual window, or fills it and its oldest group is quantized at a device-held slot). Its cost grows
with the buffer (max_len), not with the tokens stored.

Paper settings: b = 2 (also 4), G = 32, R = 128 (Llama/Mistral); scales and zeros in fp16. The XQuant
paper's KIVI* rows of its Table 4 keep the first 3 layers at 4 bits: `high_layers=3` (`high_bits=4`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import (LayerCache, Positions, StaticStep, attend, attend_split, device_slots, full_mask,
                              register)
from kvzoo.cache.kvquant import QTensor, check_bits, dequantize, packed_words, quantize

SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class KIVIOptions:
    bits: int = 2
    group_size: int = 32
    residual: int = 128
    sink: int = 0          # "KIVI+sink" (InnerQ's baseline): the first tokens also stay exact
    high_layers: int = 0   # the first high_layers layers use high_bits (XQuant Table 4: 3 layers at 4 bits)
    high_bits: int = 4

    def __post_init__(self):
        check_bits(self.bits)
        check_bits(self.high_bits)
        if self.high_layers < 0:
            raise ValueError(f"high_layers must be >= 0, got {self.high_layers}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.residual < 0 or self.residual % self.group_size:
            raise ValueError(f"residual must be a non-negative multiple of group_size {self.group_size}, "
                             f"got {self.residual}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")


@register("kivi")
class KIVICache(LayerCache):
    """Slots [0, sink) exact | [sink, sink + n_q) quantized | [sink + n_q, L) exact residual window.

    The window machinery (append, streaming prefill/decode, simulated mode) lives here; the quantized
    storage is behind four hooks (_alloc_quantized, _write_quantized, _stored_quantized,
    _quantized_nbytes) so that InnerQ reuses the windows with its own layout."""

    Options = KIVIOptions
    pre_rope = False      # KIVI quantizes keys after RoPE

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        G, R, S, d = self.opts.group_size, self.opts.residual, self.opts.sink, layer.head_dim
        weight = layer.q_proj.weight
        shape = (batch_size, layer.n_kv_heads)
        self._buf("k_sink", (*shape, S, d), weight.dtype)
        self._buf("v_sink", (*shape, S, d), weight.dtype)
        self._buf("k_res", (*shape, R + G, d), weight.dtype)
        self._buf("v_res", (*shape, R + G, d), weight.dtype)
        self._alloc_quantized(self.quantized_len(max_len))   # the most tokens this cache will ever quantize
        self.n_q = 0

    def _buf(self, name: str, shape: tuple, dtype: torch.dtype) -> None:
        device = self.attn.q_proj.weight.device
        self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    # ---- KIVI's quantized storage (the hooks) ------------------------------------------------------
    def _alloc_quantized(self, n_q: int) -> None:
        G, bits, d = self.opts.group_size, self.opts.bits, self.attn.head_dim
        self.v_group = min(G, d)      # a value group never spans two heads
        if d % self.v_group:
            raise ValueError(f"{self.name} group_size {G} must divide the head dimension {d} "
                             f"(values are grouped along it), or be at least {d}")
        shape, words = (self.batch_size, self.attn.n_kv_heads), packed_words(d, bits)
        self._buf("k_codes", (*shape, n_q, words), torch.int32)
        self._buf("k_scale", (*shape, n_q // G, d), SCALE_DTYPE)
        self._buf("k_zero", (*shape, n_q // G, d), SCALE_DTYPE)
        self._buf("v_codes", (*shape, n_q, words), torch.int32)
        self._buf("v_scale", (*shape, n_q, d // self.v_group), SCALE_DTYPE)
        self._buf("v_zero", (*shape, n_q, d // self.v_group), SCALE_DTYPE)

    def _quantize(self, k: Tensor, v: Tensor) -> tuple[QTensor, QTensor]:
        """k, v (B, H, n, d), n a multiple of G: keys per channel (groups along tokens), values per token
        (groups along d)."""
        G, bits = self.opts.group_size, self.opts.bits
        return (quantize(k, bits, G, axis=-2, scale_dtype=SCALE_DTYPE),
                quantize(v, bits, self.v_group, axis=-1, scale_dtype=SCALE_DTYPE))

    def _write_quantized(self, a: int, b: int, k: Tensor, v: Tensor) -> None:
        """Quantize k, v (B, H, b - a, d) into quantized slots [a, b)."""
        G = self.opts.group_size
        kq, vq = self._quantize(k, v)
        self.k_codes[:, :, a:b], self.v_codes[:, :, a:b] = kq.codes, vq.codes
        self.k_scale[:, :, a // G:b // G], self.k_zero[:, :, a // G:b // G] = kq.scale, kq.zero
        self.v_scale[:, :, a:b], self.v_zero[:, :, a:b] = vq.scale, vq.zero

    def _write_quantized_at(self, start: Tensor, k: Tensor, v: Tensor) -> None:
        """The same into slots [start, start + n), start a device tensor (1,), a multiple of G: index
        writes, no host sync (the static step)."""
        kq, vq = self._quantize(k, v)
        slots, groups = device_slots(start, k.shape[2], self.opts.group_size)
        for buf, index, values in ((self.k_codes, slots, kq.codes), (self.v_codes, slots, vq.codes),
                                   (self.k_scale, groups, kq.scale), (self.k_zero, groups, kq.zero),
                                   (self.v_scale, slots, vq.scale), (self.v_zero, slots, vq.zero)):
            buf.index_copy_(2, index, values)

    def _stored_quantized(self, upto: int) -> tuple[Tensor, Tensor]:
        """Dequantized keys and values of quantized slots [0, upto), upto <= n_q: (B, H, upto, d) each."""
        G, bits, dtype = self.opts.group_size, self.opts.bits, self.k_res.dtype
        shape = (*self.k_codes.shape[:2], upto, self.k_res.shape[-1])
        kq = QTensor(self.k_codes[:, :, :upto], self.k_scale[:, :, :upto // G], self.k_zero[:, :, :upto // G],
                     bits, G, -2, shape)
        vq = QTensor(self.v_codes[:, :, :upto], self.v_scale[:, :, :upto], self.v_zero[:, :, :upto],
                     bits, self.v_group, -1, shape)
        return dequantize(kq, dtype), dequantize(vq, dtype)

    def _quantized_nbytes(self, n: int) -> int:
        G = self.opts.group_size
        parts = (self.k_codes[:, :, :n], self.k_scale[:, :, :n // G], self.k_zero[:, :, :n // G],
                 self.v_codes[:, :, :n], self.v_scale[:, :, :n], self.v_zero[:, :, :n])
        return sum(t.nbytes for t in parts)

    def _quantized_token_bytes(self) -> float:
        """Bytes per quantized token per KV head, as the module docstring's formula gives them."""
        d, G, b = self.attn.head_dim, self.opts.group_size, self.opts.bits
        # K and V codes (d*b/4 when 32 | d), then fp16 scale + zero for keys and for values
        return 2 * 4 * packed_words(d, b) + 4 * d / G + 4 * d / self.v_group

    # ---- bookkeeping -------------------------------------------------------------------------------
    def quantized_len(self, length: int) -> int:
        """Tokens held quantized once `length` tokens are stored: whole groups between the windows."""
        G, R, S = self.opts.group_size, self.opts.residual, self.opts.sink
        return max(0, (length - S - R) // G) * G

    def reset(self) -> None:
        super().reset()
        self.n_q = 0

    def advance(self) -> None:
        super().advance()
        self.n_q = self.quantized_len(self.length)

    def nbytes(self) -> int:
        S, n = self.opts.sink, self.n_q
        in_sink = min(self.length, S)
        r = self.length - in_sink - n
        exact = (self.k_sink[:, :, :in_sink], self.v_sink[:, :, :in_sink], self.k_res[:, :, :r], self.v_res[:, :, :r])
        return self._quantized_nbytes(n) + sum(t.nbytes for t in exact)

    def formula_nbytes(self, length: int) -> int:
        n_q = self.quantized_len(length)
        per_exact = 2 * self.attn.head_dim * self.k_res.element_size()
        per_head = n_q * self._quantized_token_bytes() + (length - n_q) * per_exact
        return round(self.batch_size * self.attn.n_kv_heads * per_head)

    # ---- the windows -------------------------------------------------------------------------------
    def _append(self, k: Tensor, v: Tensor) -> None:
        """Store a chunk (B, H, T, d): the first `sink` tokens of the sequence fill the sink window, the
        rest join the residual window, whose oldest whole groups beyond R tokens are quantized once."""
        S = self.opts.sink
        into_sink = max(0, min(S - self.length, k.shape[2]))
        if into_sink:
            self.k_sink[:, :, self.length:self.length + into_sink] = k[:, :, :into_sink]
            self.v_sink[:, :, self.length:self.length + into_sink] = v[:, :, :into_sink]
            k, v = k[:, :, into_sink:], v[:, :, into_sink:]
            self.length += into_sink
        r = self.length - S - self.n_q if self.length >= S else 0
        k_tail = torch.cat([self.k_res[:, :, :r], k], dim=2)            # (B, H, r + T, d)
        v_tail = torch.cat([self.v_res[:, :, :r], v], dim=2)
        new_len = self.length + k.shape[2]
        flush = self.quantized_len(new_len) - self.n_q
        if flush:
            self._write_quantized(self.n_q, self.n_q + flush, k_tail[:, :, :flush], v_tail[:, :, :flush])
        keep = k_tail.shape[2] - flush
        self.k_res[:, :, :keep] = k_tail[:, :, flush:]
        self.v_res[:, :, :keep] = v_tail[:, :, flush:]
        self.n_q += flush
        self.length = new_len

    def _history(self) -> tuple[Tensor, Tensor]:
        """Keys and values of every stored slot as attention sees them: (B, H, L, d) each."""
        in_sink = min(self.length, self.opts.sink)
        r = self.length - in_sink - self.n_q
        deq_k, deq_v = self._stored_quantized(self.n_q)
        keys = torch.cat([self.k_sink[:, :, :in_sink], deq_k, self.k_res[:, :, :r]], dim=2)
        values = torch.cat([self.v_sink[:, :, :in_sink], deq_v, self.v_res[:, :, :r]], dim=2)
        return keys, values

    def _rope_keys(self, k: Tensor, pos: Positions) -> Tensor:
        """KIVI* stores keys before RoPE: rotate stored slots [0, S) to their positions (slot - pad)."""
        if not self.pre_rope:
            return k
        slots = torch.arange(k.shape[2], device=k.device)
        return self.attn.rope.apply(k, (slots[None, :] - pos.pad[:, None]).clamp_min(0))

    def _qk(self, q: Tensor, k: Tensor, pos: Positions) -> tuple[Tensor, Tensor, Tensor]:
        """(query for attention, key as attention sees it, key as stored) for a chunk."""
        q, k_rot = self.attn.rope(q, k, pos.ids)
        return q, k_rot, (k if self.pre_rope else k_rot)

    # ---- attention ---------------------------------------------------------------------------------
    def prefill(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """The history as stored (exact windows + dequantized codes) plus the new chunk exact."""
        q, _, k_store = self._qk(q, k, pos)
        hist_k, hist_v = self._history()
        keys = self._rope_keys(torch.cat([hist_k, k_store], dim=2), pos)
        out = attend(q, keys, torch.cat([hist_v, v], dim=2), pos.mask)
        self._append(k_store, v)
        return out

    # ---- decode through the outer-layout kernels ------------------------------------------------------
    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token per row. On a GPU (unpadded rows, keys stored after RoPE, 2/4 bits, groups of 32) the
        quantized history is read where it lies by the outer-layout kernels of kvzoo/kernels/quant_matvec.py,
        with no dequantized copy of it; otherwise as prefill (dequantize everything, then attend)."""
        if not self._kernels_serve(q, pos):
            return self.prefill(x, q, k, v, pos)
        q, k_rot, k_store = self._qk(q, k, pos)
        in_sink = min(self.length, self.opts.sink)
        r = self.length - in_sink - self.n_q
        k_win = torch.cat([self.k_sink[:, :, :in_sink], self.k_res[:, :, :r], k_rot], dim=2)      # (B, H, W, d)
        v_win = torch.cat([self.v_sink[:, :, :in_sink], self.v_res[:, :, :r], v], dim=2)
        out = self._attend_kernels(q, self.n_q, k_win, v_win)
        self._append(k_store, v)
        return out

    def _kernels_serve(self, q: Tensor, pos: Positions) -> bool:
        return q.is_cuda and self._kernels_fit(pos)

    def _kernels_fit(self, pos: Positions) -> bool:
        """Decode's conditions for the kernels, the device apart: unpadded rows (no mask), a prefilled
        history, a layout the kernels take."""
        return pos.mask is None and self.length > 0 and self._kernel_layout()

    def _kernel_layout(self) -> bool:
        """Keys stored as attention sees them (not KIVI*), 2 or 4 bits, and the kernels' groups: 32 tokens
        (keys) and 32 channels (values)."""
        from kvzoo.kernels.quant_matvec import GROUP, KERNEL_BITS

        return (not self.pre_rope and self.opts.bits in KERNEL_BITS and self.opts.group_size == GROUP
                and self.v_group == GROUP)

    def _attend_kernels(self, q: Tensor, n: int, k_win: Tensor, v_win: Tensor, mask: Tensor | None = None) -> Tensor:
        """q (B, Hq, 1, d) after RoPE over quantized slots [0, n) (qk_outer and pv_outer, one launch each, GQA
        rows reading their KV head's codes) and the exact rows k_win, v_win (B, H, W, d), in one fp32
        softmax; mask (B, 1, 1, n + W) True = may attend, or None: all. Returns (B, Hq, 1, d) in q's dtype."""
        from kvzoo.kernels.quant_matvec import pv_outer, qk_outer

        (B, Hq, _, d), dtype = q.shape, q.dtype
        H, G, bits = k_win.shape[1], self.opts.group_size, self.opts.bits
        rep = Hq // H
        q = q[:, :, 0].float() * d ** -0.5                          # (B, Hq, d): query head h*rep + j
        quant = qk_outer(q, self.k_codes[:, :, :n], self.k_scale[:, :, :n // G], self.k_zero[:, :, :n // G], bits)
        window = q.view(B, H, rep, d) @ k_win.float().transpose(-1, -2)                # (B, H, rep, W)
        scores = torch.cat([quant.view(B, H, rep, n), window], dim=-1)                # (B, H, rep, n + W)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out = (p[..., n:] @ v_win.float()).view(B, Hq, d)
        out += pv_outer(p[..., :n].reshape(B, Hq, n), self.v_codes[:, :, :n], self.v_scale[:, :, :n],
                        self.v_zero[:, :, :n], bits)
        return out[:, :, None].to(dtype)

    # ---- the static step (CUDA graphs, kvzoo/graphs.py) ----------------------------------------------
    def can_decode_static(self, padded: bool) -> bool:
        """Streaming caches in a layout the kernels take, on a device they run on (CUDA, or any under the
        Triton interpreter), once a prompt is stored. The step's mask serves padding and sliding windows."""
        from kvzoo.kernels.quant_matvec import kernels_run_on

        return (not self.simulated and self.length > 0 and self._kernel_layout()
                and kernels_run_on(self.k_codes.device))

    def static_phase(self) -> str:
        """What the next token does, known on the host from the length: joins the sink window, joins the
        recent window, or fills it, so that its oldest group is quantized (one graph each)."""
        if self.length < self.opts.sink:
            return "sink"
        return "flush" if self.quantized_len(self.length + 1) > self.n_q else "recent"

    def static_scratch(self) -> tuple[Tensor, ...]:
        """Buffers a static step changes in a way that running it twice would not repeat (the window shift)."""
        return (self.k_res, self.v_res)

    def _static_window(self, step: StaticStep) -> tuple[Tensor, Tensor]:
        """From the device-held length L = step.slot: (quantized tokens n_q = quantized_len(L) (1,), the token's
        row in its window (1,): sink row L while L < S, else residual row L - S - n_q). Shared by every layer
        of the step (InnerQ's too)."""
        S, R, G = self.opts.sink, self.opts.residual, self.opts.group_size
        key = ("window", S, R, G)
        if key not in step.derived:
            L = step.slot
            n_q = torch.div(L - S - R, G, rounding_mode="floor").clamp_min(0) * G             # quantized_len(L)
            step.derived[key] = (n_q, torch.where(L < S, L.clamp_max(max(S - 1, 0)), L - S - n_q))
        return step.derived[key]

    def _static_keys(self, step: StaticStep) -> tuple[Tensor, Tensor, Tensor]:
        """The step's keys are every quantized slot, every sink row, every residual row (K = N + S + R + G):
        (n_q, the token's window row, as _static_window gives them; mask (B, 1, 1, K): a key may be attended
        where it is live (a quantized slot < n_q, a sink row <= L, a residual row up to the token's) and the
        step's mask allows its slot). Shared by every layer of the step."""
        S, R, G, N = self.opts.sink, self.opts.residual, self.opts.group_size, self.k_codes.shape[2]
        key = ("kivi", S, R, G, N)
        if key not in step.derived:
            L, device = step.slot, step.slot.device
            n_q, row = self._static_window(step)
            quant, sink, win = (torch.arange(n, device=device) for n in (N, S, R + G))
            slots = torch.cat([S + quant, sink, S + n_q + win])                                 # (K,) key slots
            live = torch.cat([quant < n_q, sink <= L, win <= L - S - n_q])                     # (K,)
            mask = step.mask.index_select(-1, slots.clamp_max(self.max_len - 1)) & live          # (B, 1, 1, K)
            step.derived[key] = (n_q, row, mask)
        return step.derived[key]

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode with fixed shapes: the token's k, v into its window row, attention over every quantized
        slot (the kernels) and every window row, the dead ones masked; in the "flush" phase the full
        window's oldest group is then quantized into slots [n_q, n_q + G) and the rest moves down."""
        q, k = self.attn.rope(q, k, step.ids)
        n_q, row, mask = self._static_keys(step)
        phase = self.static_phase()
        k_buf, v_buf = (self.k_sink, self.v_sink) if phase == "sink" else (self.k_res, self.v_res)
        k_buf.index_copy_(2, row, k)                                    # k (B, H, 1, d) into its window row
        v_buf.index_copy_(2, row, v)
        out = self._attend_kernels(q, self.k_codes.shape[2], torch.cat([self.k_sink, self.k_res], dim=2),
                                   torch.cat([self.v_sink, self.v_res], dim=2), mask)
        if phase == "flush":
            G, R = self.opts.group_size, self.opts.residual
            self._write_quantized_at(n_q, self.k_res[:, :, :G], self.v_res[:, :, :G])
            for buf in (self.k_res, self.v_res):
                buf[:, :, :R] = buf[:, :, G:G + R].clone()
        return out

    def simulate(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """Query slot s sees slots [sink, sink + quantized_len(s)) dequantized and every other slot
        exact, as it would when decoded after s stored tokens."""
        q, _, k_store = self._qk(q, k, pos)
        hist_k, hist_v = self._history()
        exact_k = torch.cat([hist_k, k_store], dim=2)                   # (B, H, L, d)
        exact_v = torch.cat([hist_v, v], dim=2)
        self._append(k_store, v)
        S, n = self.opts.sink, self.n_q
        deq_k, deq_v = self._stored_quantized(n)
        round_k, round_v = exact_k.clone(), exact_v.clone()
        round_k[:, :, S:S + n], round_v[:, :, S:S + n] = deq_k, deq_v
        L = self.length
        G, R = self.opts.group_size, self.opts.residual
        q_slots = torch.arange(pos.start, L, device=q.device)
        seen = ((q_slots - S - R) // G).clamp_min(0) * G                # quantized_len(s) per query (T,)
        key_slots = torch.arange(L, device=q.device)[None, :]
        use_round = self.after_prompt((key_slots >= S) & (key_slots < S + seen[:, None]), q_slots)   # (T, L)
        return attend_split(q, self._rope_keys(exact_k, pos), exact_v, self._rope_keys(round_k, pos), round_v,
                            use_round, full_mask(pos, L, q.device))


@register("kivi-pre")
class KIVIPreRoPECache(KIVICache):
    """KIVI*: keys quantized before RoPE, rotated after dequantization."""

    pre_rope = True
