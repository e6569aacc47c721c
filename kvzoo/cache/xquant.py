"""XQuant: cache the layer input X (or its low-rank latents) quantized, instead of K and V, and
rematerialize K = X W_k and V = X W_v every time attention needs them.

Paper: Tomar, Hooper et al., "XQuant: Breaking the Memory Wall for LLM Inference with KV Cache
Rematerialization" (../shared/papers/xquant.md): §3.1 (MHA), §3.3.1 (GQA), Appendix B (outlier channel).
The cross-layer variant XQuant-CL (§3.2, §3.3.2) is xquant_cl.py, which reuses this module's storage.

X is the layer input after RMSNorm (what the attention module hands its cache as `x`). Two layouts:

- MHA (n_kv_heads == n_heads): K and V are each as wide as X, so caching X alone halves the cache
  before any quantization. X is quantized per token (groups along the hidden dimension); K = X̂ W_kᵀ
  (then RoPE at the cached positions) and V = X̂ W_vᵀ are recomputed from the model's own weights.
- GQA (n_kv_heads < n_heads): X (hidden wide) is wider than K or V (n_kv_heads*head_dim), so X itself
  would cost more than the KV cache. Offline (here: at cache construction, in fp32) the thin SVD
  W_k = U_k Σ_k B_kᵀ (W_k = k_proj.weight.T, hidden x n_kv*hd) and likewise W_v; the cache holds the
  latents X U_k (quantized per channel, as KIVI's keys: the first channel carries the outliers) and
  X U_v (per token), and rematerializes K = (X U_k)(Σ_k B_kᵀ), V = (X U_v)(Σ_v B_vᵀ) with the fused
  square matrices Σ Bᵀ. A latent has the rank r = min(hidden, n_kv*hd) of W_k, i.e. r = n_kv*hd
  (192 for SmolLM2-135M), so the latents take exactly the KV cache's room: for GQA the gain is not
  size but quantizability (the paper's §3.3.1 point). With `outlier_channel` the first channel of
  X U_k stays at full precision beside the codes of channels 1..r-1 (Table B.1).

Windows follow KIVI (kivi.py): per-channel groups need G tokens before they can be quantized, so the
newest tokens wait at the model's precision; with L tokens stored, Nq = max(0, floor((L - R)/G)) * G are
quantized (once, when their group leaves the window: never requantized) and L - Nq < R + G are exact.
Both layouts use the one window (§4: "we leave the final residual tokens unquantized (up to group size
tokens)" in generation, for every method). Per-token groups span Gt = the largest divisor of the row
width that is <= G channels (G = 128: Gt = 96 for SmolLM2's 192-wide latents, 128 for Llama's 4096).

Stored per layer (B rows, Nmax = quantized slots for max_len, W = R + G window slots, b = bits):
    MHA  x:  codes int32 (B, Nmax, hidden*b/32), scale/zero fp16 (B, Nmax, hidden/Gt), window (B, W, hidden)
    GQA  k:  codes int32 (B, Nmax, c*b/32),      scale/zero fp16 (B, Nmax/G, c),      window (B, W, r)
             [first (B, Nmax, 1) at the model's dtype with outlier_channel; then c = r - 1, else c = r]
         v:  codes int32 (B, Nmax, r*b/32),      scale/zero fp16 (B, Nmax, r/Gt),     window (B, W, r)
    plus the SVD factors (GQA: U_k|U_v (hidden, 2r), Σ_k B_kᵀ and Σ_v B_vᵀ (r, n_kv*hd), fp32), which are
    weights, not per-token storage, and are not counted in nbytes().
    (packed words are rounded up to whole packing blocks: 16 codes at 2 bits, 32 at 3, 8 at 4, 4 at 8)

Bytes per quantized token and layer, e = bytes(model dtype):
    MHA  hidden*b/8 + 4*hidden/Gt                        (fp16 KV: 4*hidden)
    GQA  r*b/8 + 4*r/G  (X U_k)  +  r*b/8 + 4*r/Gt  (X U_v)  [outlier_channel: + e, codes for r - 1]
Exact window tokens: hidden*e (MHA) or 2*r*e (GQA). fp16 K+V: 4*n_kv*hd.
SmolLM2-135M (r = 192, G = 128, Gt = 96): b = 4: 102 + 104 = 206 B against 768 B, ratio 0.268 (the
paper's 0.27); b = 3: 0.206; b = 2: 110 B, 0.143. At L = 2048 and R = 0 every token is quantized.

Paper settings (the defaults): b = 4 (the abstract's "<0.1 perplexity degradation" setting; Table 1
also reports 3 and 2), G = 128 for every quantizer (§4), R = 0 (a window of < G tokens), asymmetric
uniform quantization, fp16 scales and zeros, no outlier channel (Table B.1 turns it on). Table 4 keeps
the first 3 layers at 4 bits for every method: `high_layers=3` (`high_bits=4`).
bits = 16 turns quantization off: every row is kept at the model's precision (16-bit in an fp16/bf16
run, fp32 in an fp32 one), which rematerializes the fp16 cache's attention up to fp32 rounding.

Static step (`decode_static`, for kvzoo/graphs.py's whole-step CUDA graph): the same decode with fixed
shapes and the length L in a device tensor. The token's rows go into window row L - Nq by an index write;
attention runs over every allocated slot (all Nmax quantized slots and all R + G window rows,
rematerialized, through dequant_matmul on a GPU) plus the token's exact k, v, a key masked where it is not
live yet (slot >= Nq, window row >= L - Nq) or the step's mask forbids its slot (padding, sliding window).
The host's counters only pick the phase: "flush" when the token fills the window, whose oldest group is
then quantized into slots [Nq, Nq + G) at the device-held Nq and the rest moved down; "step" otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvzoo.cache.base import (LayerCache, Positions, StaticStep, attend, attend_split, device_slots, full_mask,
                              register)
from kvzoo.cache.kvquant import SUPPORTED_BITS, QTensor, dequantize, packed_words, quantize
from kvzoo.kernels.xquant_remat import REMAT_BITS, dequant_matmul

SCALE_DTYPE = torch.float16
EXACT = 16        # bits = 16: no quantization, rows kept at the model's precision


def check_latent_bits(bits: int, option: str = "bits") -> None:
    if bits != EXACT and bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported {option}={bits}; accepted: {', '.join(map(str, SUPPORTED_BITS))}, "
                         f"or {EXACT} (no quantization: kept at the model's precision)")


def check_window(group_size: int, residual: int) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if residual < 0 or residual % group_size:
        raise ValueError(f"residual must be a non-negative multiple of group_size {group_size}, got {residual}")


def token_group(width: int, group_size: int) -> int:
    """Channels per per-token group: the largest divisor of `width` that is at most `group_size`."""
    return max(g for g in range(1, min(width, group_size) + 1) if width % g == 0)


def svd_factors(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Thin SVD, in fp32, of the projection W = weight.T (hidden, n) = U Σ Bᵀ: returns the down-projection
    U (hidden, r) and the fused up-projection Σ Bᵀ (r, n), r = min(hidden, n)."""
    u, s, vh = torch.linalg.svd(weight.detach().float().T, full_matrices=False)
    return u.contiguous(), (s[:, None] * vh).contiguous()


def dequantize_latent(latent: QTensor | Tensor, first: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Cached rows (B, N, c) as `dtype`: packed codes dequantized, or rows kept exact (window, bits=16),
    with the full-precision first channel put back in front when there is one."""
    x = dequantize(latent, dtype) if isinstance(latent, QTensor) else latent.to(dtype)
    return x if first is None else torch.cat([first.to(dtype), x], dim=-1)


def rematerialize(latent: QTensor | Tensor, first: Tensor | None, up: Tensor, fused: bool | None = None) -> Tensor:
    """K or V (flat heads, before RoPE) from cached rows: dequantize (B, N, c) and multiply by the
    up-projection `up` (c, n_kv*hd) -> (B, N, n_kv*hd) in up's dtype. This is all XQuant adds to a KV
    cache's decode step. Packed 2/4/8-bit codes on a GPU (or with fused=True: the Triton interpreter in
    tests) go through the fused kernel kvzoo.kernels.xquant_remat.dequant_matmul, so the dequantized rows
    never reach device memory; 3-bit codes and exact rows take the torch path."""
    if fused is None:
        fused = isinstance(latent, QTensor) and latent.codes.is_cuda
    if fused and isinstance(latent, QTensor) and latent.bits in REMAT_BITS:
        if first is None:
            return dequant_matmul(latent, up)
        return dequant_matmul(latent, up[1:]) + first.to(up.dtype) @ up[:1]      # channel 0 kept exact
    return dequantize_latent(latent, first, up.dtype) @ up


def heads(flat: Tensor, n_heads: int, dtype: torch.dtype) -> Tensor:
    """(B, N, n_heads*hd) -> (B, n_heads, N, hd) in the model's dtype."""
    B, N, width = flat.shape
    return flat.view(B, N, n_heads, width // n_heads).transpose(1, 2).to(dtype)


def rope_stored_keys(attn, k: Tensor, pos: Positions) -> Tensor:
    """Rotate keys of stored slots [0, S) (B, H, S, hd), rematerialized before RoPE, to their positions."""
    slots = torch.arange(k.shape[2], device=k.device)
    return attn.rope.apply(k, (slots[None, :] - pos.pad[:, None]).clamp_min(0))


class LatentStore(nn.Module):
    """One cached stream of rows (B, N, width): quantized slots [0, n) plus a window of exact rows.

    per_channel: a scale/zero per channel for each group of `group_size` slots (n is then a multiple of
    it); otherwise per token: a scale/zero per `token_group(width, group_size)` channels of each row.
    exact_first: channel 0 is kept at the model's precision (buffer `first`) and only channels 1.. get
    codes. bits = 16: buffer `rows` holds the rows themselves at the model's precision, no codes."""

    def __init__(self, batch: int, capacity: int, window: int, width: int, bits: int, group_size: int,
                 per_channel: bool, dtype: torch.dtype, device, exact_first: bool = False):
        super().__init__()
        self.bits, self.width, self.per_channel = bits, width, per_channel
        self.exact_first = exact_first and bits != EXACT
        self.coded = width - int(self.exact_first)                 # channels that get codes
        self.group = group_size if per_channel else token_group(self.coded, group_size)

        def buf(name: str, shape: tuple, dt: torch.dtype) -> None:
            self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), persistent=False)

        if bits == EXACT:
            buf("rows", (batch, capacity, width), dtype)
        else:
            groups = (capacity // self.group, self.coded) if per_channel else (capacity, self.coded // self.group)
            buf("codes", (batch, capacity, packed_words(self.coded, bits)), torch.int32)
            buf("scale", (batch, *groups), SCALE_DTYPE)
            buf("zero", (batch, *groups), SCALE_DTYPE)
            if self.exact_first:
                buf("first", (batch, capacity, 1), dtype)
        buf("window", (batch, window, width), dtype)

    def _groups(self, a: int, b: int) -> slice:
        return slice(a // self.group, b // self.group) if self.per_channel else slice(a, b)

    def _encode(self, rows: Tensor) -> list[tuple[Tensor, Tensor, bool]]:
        """What storing rows (B, n, width) writes: (buffer, values along dim 1, indexed by group rather
        than by slot) for each buffer."""
        if self.bits == EXACT:
            return [(self.rows, rows, False)]
        parts = [(self.first, rows[..., :1], False)] if self.exact_first else []
        coded = rows[..., 1:] if self.exact_first else rows
        q = quantize(coded, self.bits, self.group, axis=-2 if self.per_channel else -1, scale_dtype=SCALE_DTYPE)
        grouped = self.per_channel
        return parts + [(self.codes, q.codes, False), (self.scale, q.scale, grouped), (self.zero, q.zero, grouped)]

    def write(self, a: int, b: int, rows: Tensor) -> None:
        """Quantize rows (B, b - a, width) into slots [a, b)."""
        for buf, values, grouped in self._encode(rows):
            buf[:, self._groups(a, b) if grouped else slice(a, b)] = values

    def write_at(self, start: Tensor, rows: Tensor) -> None:
        """Quantize rows (B, n, width) into slots [start, start + n), start a device tensor (1,), with index
        writes and no host sync (the static step); per-channel stores take whole groups (start and n
        multiples of the group)."""
        n = rows.shape[1]
        if self.per_channel and n % self.group:
            raise ValueError(f"a per-channel store writes whole groups of {self.group} rows, got {n}")
        slots, groups = device_slots(start, n, self.group)
        for buf, values, grouped in self._encode(rows):
            buf.index_copy_(1, groups if grouped else slots, values)

    def quantized(self, upto: int) -> tuple[QTensor | Tensor, Tensor | None]:
        """Slots [0, upto) as stored: (codes as a QTensor, or the exact rows with bits=16; first channel)."""
        if self.bits == EXACT:
            return self.rows[:, :upto], None
        g = self._groups(0, upto)
        q = QTensor(self.codes[:, :upto], self.scale[:, g], self.zero[:, g], self.bits, self.group,
                    -2 if self.per_channel else -1, (self.codes.shape[0], upto, self.coded))
        return q, (self.first[:, :upto] if self.exact_first else None)

    def nbytes(self, n: int, in_window: int) -> int:
        """Bytes held for n quantized slots and `in_window` exact window rows."""
        if self.bits == EXACT:
            parts = [self.rows[:, :n]]
        else:
            g = self._groups(0, n)
            parts = [self.codes[:, :n], self.scale[:, g], self.zero[:, g]]
            parts += [self.first[:, :n]] if self.exact_first else []
        return sum(t.nbytes for t in parts) + self.window[:, :in_window].nbytes

    def token_bytes(self) -> float:
        """The formula: bytes of one quantized row (one batch row), scales and zeros included."""
        e = self.window.element_size()
        if self.bits == EXACT:
            return self.width * e
        # packed codes, then an fp16 scale + zero per group: coded/group groups per row either way
        # (per channel: `coded` channel groups shared by `group` slots)
        return 4 * packed_words(self.coded, self.bits) + 4 * self.coded / self.group + e * self.exact_first

    def window_token_bytes(self) -> int:
        return self.width * self.window.element_size()


@dataclass(frozen=True)
class XQuantOptions:
    bits: int = 4
    group_size: int = 128
    residual: int = 0
    outlier_channel: bool = False    # GQA: the first channel of X U_k at full precision (Table B.1)
    high_layers: int = 0             # the first high_layers layers use high_bits (Table 4: 3 layers at 4 bits)
    high_bits: int = 4

    def __post_init__(self):
        check_latent_bits(self.bits)
        check_latent_bits(self.high_bits, "high_bits")
        if self.high_layers < 0:
            raise ValueError(f"high_layers must be >= 0, got {self.high_layers}")
        check_window(self.group_size, self.residual)


@register("xquant")
class XQuantCache(LayerCache):
    """Slots [0, n_q) quantized | [n_q, L) exact window, of X (MHA) or of X U_k and X U_v (GQA)."""

    Options = XQuantOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        o = self.opts
        weight = layer.k_proj.weight
        self.gqa = layer.n_kv_heads < layer.n_heads
        if o.outlier_channel and not self.gqa:
            raise ValueError("xquant outlier_channel applies to GQA models (the first channel of the latent "
                             "X U_k, Appendix B); this model is MHA (n_kv_heads == n_heads) and caches X itself")

        def store(width: int, per_channel: bool, exact_first: bool = False) -> LatentStore:
            return LatentStore(batch_size, self.quantized_len(max_len), o.residual + o.group_size, width, o.bits,
                               o.group_size, per_channel, weight.dtype, weight.device, exact_first)

        if self.gqa:
            down_k, up_k = svd_factors(layer.k_proj.weight)       # U_k (hidden, r), Σ_k B_kᵀ (r, n_kv*hd)
            down_v, up_v = svd_factors(layer.v_proj.weight)
            self.register_buffer("down", torch.cat([down_k, down_v], dim=1), persistent=False)   # (hidden, 2r)
            self.register_buffer("up_k", up_k, persistent=False)
            self.register_buffer("up_v", up_v, persistent=False)
            self.stores = nn.ModuleDict({"k": store(up_k.shape[0], True, o.outlier_channel),
                                         "v": store(up_v.shape[0], False)})
        else:
            self.stores = nn.ModuleDict({"x": store(weight.shape[1], False)})
        self.n_q = 0
        self.capacity = self.quantized_len(max_len)            # quantized slots allocated

    # ---- what is cached, and how K and V come back -------------------------------------------------
    def _rows(self, x: Tensor) -> dict[str, Tensor]:
        """Rows to cache for a chunk x (B, T, hidden), at the model's dtype: X, or X U_k and X U_v."""
        if not self.gqa:
            return {"x": x}
        z = (x.float() @ self.down).to(x.dtype)                    # (B, T, 2r)
        r = self.up_k.shape[0]
        return {"k": z[..., :r], "v": z[..., r:]}

    def _sources(self) -> tuple[tuple[LatentStore, Tensor], tuple[LatentStore, Tensor]]:
        """(store, up-projection) for K and for V."""
        if self.gqa:
            return (self.stores["k"], self.up_k), (self.stores["v"], self.up_v)
        x = self.stores["x"]
        return (x, self.attn.k_proj.weight.t()), (x, self.attn.v_proj.weight.t())

    def _kv(self, n: int, in_window: int) -> tuple[Tensor, Tensor]:
        """K and V (before RoPE) of quantized slots [0, n) then the first `in_window` window rows:
        (B, n_kv, n + in_window, hd) each, at the model's dtype."""
        out = []
        for store, up in self._sources():
            flat = torch.cat([rematerialize(*store.quantized(n), up),
                              rematerialize(store.window[:, :in_window], None, up)], dim=1)   # (B, N, n_kv*hd)
            out.append(heads(flat, self.attn.n_kv_heads, store.window.dtype))
        return out[0], out[1]

    # ---- the window (KIVI's bookkeeping, on rows of X or of its latents) -----------------------------
    def quantized_len(self, length: int) -> int:
        """Tokens held quantized once `length` are stored: whole groups older than the residual window."""
        return max(0, (length - self.opts.residual) // self.opts.group_size) * self.opts.group_size

    def _append(self, x: Tensor) -> None:
        """Store a chunk x (B, T, hidden): its rows join the window, whose oldest whole groups beyond R
        rows are quantized once."""
        rows = self._rows(x)
        r = self.length - self.n_q
        new_len = self.length + x.shape[1]
        flush = self.quantized_len(new_len) - self.n_q
        for name, store in self.stores.items():
            tail = torch.cat([store.window[:, :r], rows[name]], dim=1)            # (B, r + T, width)
            if flush:
                store.write(self.n_q, self.n_q + flush, tail[:, :flush])
            store.window[:, :tail.shape[1] - flush] = tail[:, flush:]
        self.n_q += flush
        self.length = new_len

    def reset(self) -> None:
        super().reset()
        self.n_q = 0

    def nbytes(self) -> int:
        return sum(s.nbytes(self.n_q, self.length - self.n_q) for s in self.stores.values())

    def formula_nbytes(self, length: int) -> int:
        n = self.quantized_len(length)
        per_row = sum(n * s.token_bytes() + (length - n) * s.window_token_bytes() for s in self.stores.values())
        return round(self.batch_size * per_row)

    # ---- attention ---------------------------------------------------------------------------------
    def prefill(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """The history rematerialized from storage plus the new chunk exact; then store the chunk."""
        hist_k, hist_v = self._kv(self.n_q, self.length - self.n_q)
        keys = rope_stored_keys(self.attn, torch.cat([hist_k, k], dim=2), pos)
        out = attend(self.attn.rope.apply(q, pos.ids), keys, torch.cat([hist_v, v], dim=2), pos.mask)
        self._append(x)
        return out

    decode = prefill

    # ---- the static step (CUDA graphs, kvzoo/graphs.py) ----------------------------------------------
    def can_decode_static(self, padded: bool) -> bool:
        """Every streaming cache: the step attends over every allocated slot with a mask built from the
        step's (B, 1, 1, max_len) mask, so left padding and sliding windows are served as in decode. The
        simulated mode has no decode step."""
        return not self.simulated

    def static_phase(self) -> str:
        """Whether the next token fills the window, so that its oldest group is quantized (one graph each)."""
        return "flush" if self.quantized_len(self.length + 1) > self.n_q else "step"

    def static_scratch(self) -> tuple[Tensor, ...]:
        """The windows: a flush moves their rows down, which a second run would repeat."""
        return tuple(store.window for store in self.stores.values())

    def advance(self) -> None:
        super().advance()
        self.n_q = self.quantized_len(self.length)

    def _static_keys(self, step: StaticStep) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The step's keys are every quantized slot, every window row, then the new token (K = capacity +
        W + 1, W = R + G). From the device-held length L = step.slot: (quantized tokens n_q (1,), the new
        token's window row r = L - n_q (1,), RoPE positions of the keys (B, K), mask (B, 1, 1, K): a key
        may be attended where it is live (a quantized slot < n_q, a window row < r, the new token) and
        the step's mask allows its slot). Shared by every layer of the step."""
        R, G = self.opts.residual, self.opts.group_size
        key = ("xquant", R, G, self.capacity)
        if key not in step.derived:
            L, device = step.slot, step.slot.device
            n_q = torch.div(L - R, G, rounding_mode="floor").clamp_min(0) * G                   # quantized_len(L)
            r = L - n_q
            quant, win = torch.arange(self.capacity, device=device), torch.arange(R + G, device=device)
            slots = torch.cat([quant, n_q + win, L])                                             # (K,) key slots
            live = torch.cat([quant < n_q, win < r, torch.ones_like(L, dtype=torch.bool)])       # (K,)
            mask = step.mask.index_select(-1, slots.clamp_max(self.max_len - 1)) & live          # (B, 1, 1, K)
            ids = (slots[None, :] + (step.ids - L)).clamp_min(0)           # (B, K): slot - pad, as in decode
            step.derived[key] = (n_q, r, ids, mask)
        return step.derived[key]

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode with fixed shapes: the token's rows into window row r, attention over every quantized
        slot and window row rematerialized (the dead ones masked) and the token's exact k, v; in the
        "flush" phase the window's oldest group is then quantized into slots [n_q, n_q + G)."""
        n_q, r, ids, mask = self._static_keys(step)
        rows = self._rows(x)
        for name, store in self.stores.items():
            store.window.index_copy_(1, r, rows[name])                  # rows (B, 1, width) into window row r
        hist_k, hist_v = self._kv(self.capacity, self.opts.residual + self.opts.group_size)    # (B, H, K - 1, hd)
        keys = self.attn.rope.apply(torch.cat([hist_k, k], dim=2), ids)
        out = attend(self.attn.rope.apply(q, step.ids), keys, torch.cat([hist_v, v], dim=2), mask)
        if self.static_phase() == "flush":
            G, R = self.opts.group_size, self.opts.residual
            for store in self.stores.values():
                store.write_at(n_q, store.window[:, :G])
                store.window[:, :R] = store.window[:, G:G + R].clone()
        return out

    def simulate(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """Query slot s sees slots [0, quantized_len(s)) rematerialized from codes and every other slot
        exact, as it would when decoded after s stored tokens."""
        hist_k, hist_v = self._kv(self.n_q, self.length - self.n_q)
        exact_k, exact_v = torch.cat([hist_k, k], dim=2), torch.cat([hist_v, v], dim=2)   # (B, H, L, hd)
        self._append(x)
        n, L = self.n_q, self.length
        deq_k, deq_v = self._kv(n, 0)
        round_k, round_v = exact_k.clone(), exact_v.clone()
        round_k[:, :, :n], round_v[:, :, :n] = deq_k, deq_v
        q_slots = torch.arange(pos.start, L, device=q.device)
        G, R = self.opts.group_size, self.opts.residual
        seen = ((q_slots - R) // G).clamp_min(0) * G                  # quantized_len(s) per query (T,)
        use_round = self.after_prompt(torch.arange(L, device=q.device)[None, :] < seen[:, None], q_slots)  # (T, L)
        return attend_split(self.attn.rope.apply(q, pos.ids), rope_stored_keys(self.attn, exact_k, pos), exact_v,
                            rope_stored_keys(self.attn, round_k, pos), round_v, use_round, full_mask(pos, L, q.device))
