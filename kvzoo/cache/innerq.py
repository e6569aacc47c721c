"""InnerQ: KV-cache quantization grouped over the *inner* dimension of each decode product, with hybrid
symmetric/asymmetric groups, sink + recent high-precision windows and per-channel key normalization.

Paper: "InnerQ: Hardware-aware Tuning-free Quantization of KV Cache for Large Language Models"
(../shared/papers/innerq.md). The windows, the once-only quantization of groups leaving the recent window
and both evaluation modes are KIVI's machinery (kivi.py); InnerQ changes what is quantized and how:

- Inner grouping (§4.4). In decode, q·Kᵀ runs along head_dim and P·V along tokens, so keys are grouped
  per token along head_dim and values per channel along tokens: one scale serves a whole group of the
  product's reduction. `outer=True` gives KIVI's layout (keys per channel, values per token) for the
  ablation.
- Hybrid quantization (§4.1.2). Each group of G = 32 is quantized both asymmetrically (scale, zero) and
  symmetrically (scale = max|x| / (2^b - 1), magnitude codes and a sign bit per value) and keeps the mode
  with the lower error. Both share one layout: the 32-bit slot holds the fp32 zero point of an asymmetric
  group or the 32 sign bits of a symmetric one, and a 1-bit mask per group says which (`mode`: asym |
  sym | hybrid | hybrid_prefill, the last using hybrid groups only for the first forward call, the
  prompt, and symmetric ones afterwards, so the mask stops growing).
- High-precision windows (§4.2): the first `sink` and the last `recent` tokens stay exact.
- Per-channel key normalization (§4.3): at the end of the prefill, norm_i = sqrt(max_t |K_t,i|) over the
  prompt's (post-RoPE) keys; keys are stored divided by it and queries multiplied by it, so q·k is
  unchanged. The paper folds the factor into W_q and W_k; RoPE rotates channel i with i + d/2, so the
  folding commutes with RoPE only if both channels share one factor, hence norms are tied per RoPE pair
  (the larger of the two). kvzoo applies the factor to q and k after projection, which is the folded
  product exactly, without rewriting weights shared by every sequence the model serves.

Stored per layer (B rows, H = n_kv_heads, d = head_dim, b = bits, Nq quantized tokens; inner layout):
    k_codes int32 (B, H, Nq, d*b/32)   k_scale fp16 + k_slot int32 (B, H, Nq, d/32)   per-token groups
    v_codes int32 (B, H, Nq, d*b/32)   v_scale fp16 + v_slot int32 (B, H, Nq/32, d)   per-channel groups
    k_mask int32 (B, H, d/32, Nq/32)   v_mask int32 (B, H, Nq/32, d/32)              hybrid modes only
    sink and recent windows (B, H, ·, d) at the model's precision; norm (B, H, 1, d) with key_norm
Bytes per quantized token, per layer and KV head: d*b/4 (codes) + 2 * 6d/32 (fp16 scale + 32-bit slot per
group, K and V) + d/128 (mask bits, hybrid). d = 64, b = 2: 32 + 24 + 0.5 = 56.5 bytes against 256 in fp16.

Paper settings (the defaults): b = 2, G = 32, w_sink = 32, w_recent = 96, hybrid, key normalization on.

Decode on a GPU runs the fused kernel (kvzoo/kernels/innerq_attention.py) over these buffers as stored: packed
codes, and mask bits read in place. `decode_static` is the same step with the lengths in device tensors, so
that a CUDA graph holds it (kvzoo/graphs.py). It has one graph per phase: a token joins the sink, joins the
recent window, or fills it and a group is quantized in place by innerq_flush.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import Positions, StaticStep, register
from kvzoo.cache.kivi import KIVICache
from kvzoo.cache.kvquant import (UnifiedQTensor, check_bits, dequantize_unified, pack_sym_mask, packed_words,
                               quantize_unified, unpack_sym_mask)

GROUP = 32        # the unified slot holds 32 bits: an fp32 zero point or 32 sign bits
MODES = ("asym", "sym", "hybrid", "hybrid_prefill")


@dataclass(frozen=True)
class InnerQOptions:
    bits: int = 2
    group_size: int = GROUP
    sink: int = 32
    recent: int = 96
    quant_mode: str = "hybrid"
    key_norm: bool = True
    outer: bool = False
    fused: bool = True     # decode through the Triton kernel (kvzoo/kernels/innerq_attention.py) on CUDA

    def __post_init__(self):
        check_bits(self.bits)
        if self.group_size != GROUP:
            raise ValueError(f"innerq group_size must be {GROUP} (one 32-bit slot holds a group's zero point "
                             f"or its sign bits), got {self.group_size}")
        if self.quant_mode not in MODES:
            raise ValueError(f"unknown innerq quant_mode {self.quant_mode!r}; accepted: {', '.join(MODES)}")
        if self.recent < 0 or self.recent % GROUP:
            raise ValueError(f"recent must be a non-negative multiple of {GROUP}, got {self.recent}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")

    @property
    def residual(self) -> int:          # the name KIVI's window machinery reads
        return self.recent


@register("innerq")
class InnerQCache(KIVICache):
    Options = InnerQOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        self._buf("norm", (batch_size, layer.n_kv_heads, 1, layer.head_dim), layer.q_proj.weight.dtype)
        self.first_call_q = 0     # quantized tokens written during the first forward call (hybrid_prefill)
        self.in_first_call = False

    # ---- layout ------------------------------------------------------------------------------------
    @property
    def axes(self) -> tuple[int, int]:
        """(key group axis, value group axis): -1 groups along head_dim, -2 along tokens."""
        return (-2, -1) if self.opts.outer else (-1, -2)

    @property
    def has_mask(self) -> bool:
        return self.opts.quant_mode in ("hybrid", "hybrid_prefill")

    def _group_shape(self, axis: int, n: int) -> tuple[int, int]:
        d = self.attn.head_dim
        return (n, d // GROUP) if axis == -1 else (n // GROUP, d)

    def _alloc_quantized(self, n_q: int) -> None:
        d = self.attn.head_dim
        if d % GROUP:
            raise ValueError(f"innerq needs a head dimension divisible by {GROUP}, got {d}")
        shape, words = (self.batch_size, self.attn.n_kv_heads), packed_words(d, self.opts.bits)
        for name, axis in zip("kv", self.axes):
            self._buf(f"{name}_codes", (*shape, n_q, words), torch.int32)
            self._buf(f"{name}_scale", (*shape, *self._group_shape(axis, n_q)), torch.float16)
            self._buf(f"{name}_slot", (*shape, *self._group_shape(axis, n_q)), torch.int32)
            # mask bits packed along tokens (per-token groups) or along channels (per-channel groups); no
            # bits at all (zero columns along tokens) in the asym and sym modes
            tokens = n_q // 32 if self.has_mask else 0
            self._buf(f"{name}_mask", (*shape, *((d // GROUP, tokens) if axis == -1 else (tokens, d // 32))),
                      torch.int32)

    def _group_slice(self, axis: int, a: int, b: int) -> slice:
        return slice(a, b) if axis == -1 else slice(a // GROUP, b // GROUP)

    # ---- the storage hooks -------------------------------------------------------------------------
    def _write_quantized(self, a: int, b: int, k: Tensor, v: Tensor) -> None:
        mode = self.opts.quant_mode
        if mode == "hybrid_prefill":
            mode = "hybrid" if self.in_first_call else "sym"
            if self.in_first_call:
                self.first_call_q = b
        for name, x, axis in (("k", k, self.axes[0]), ("v", v, self.axes[1])):
            q = quantize_unified(x, self.opts.bits, axis, mode)
            getattr(self, f"{name}_codes")[:, :, a:b] = q.codes
            groups = self._group_slice(axis, a, b)
            getattr(self, f"{name}_scale")[:, :, groups] = q.scale
            getattr(self, f"{name}_slot")[:, :, groups] = q.slot
            if self.has_mask:
                mask = getattr(self, f"{name}_mask")
                if axis == -1:     # bits along tokens (B, H, d/32, n/32)
                    mask[:, :, :, a // 32:b // 32] = pack_sym_mask(q.sym, axis)
                else:              # bits along channels (B, H, n/32, d/32)
                    mask[:, :, a // GROUP:b // GROUP] = pack_sym_mask(q.sym, axis)

    def _mask_upto(self) -> int:
        """Quantized tokens whose groups carry a mask bit; later groups are symmetric (hybrid_prefill) and
        in the sym mode all are."""
        return {"hybrid": self.k_codes.shape[2], "hybrid_prefill": self.first_call_q}.get(self.opts.quant_mode, 0)

    def _sym_flags(self, name: str, axis: int, upto: int) -> Tensor:
        """Which groups of quantized slots [0, upto) are symmetric: (B, H, *group shape) booleans."""
        shape = (self.batch_size, self.attn.n_kv_heads, *self._group_shape(axis, upto))
        if self.opts.quant_mode == "asym":
            return torch.zeros(shape, dtype=torch.bool, device=self.k_codes.device)
        return unpack_sym_mask(getattr(self, f"{name}_mask"), axis, upto, self._mask_upto(), self.attn.head_dim)

    def _stored_quantized(self, upto: int) -> tuple[Tensor, Tensor]:
        dtype, d = self.k_res.dtype, self.attn.head_dim
        out = []
        for name, axis in zip("kv", self.axes):
            groups = self._group_slice(axis, 0, upto)
            q = UnifiedQTensor(codes=getattr(self, f"{name}_codes")[:, :, :upto],
                               scale=getattr(self, f"{name}_scale")[:, :, groups],
                               slot=getattr(self, f"{name}_slot")[:, :, groups],
                               sym=self._sym_flags(name, axis, upto), bits=self.opts.bits, axis=axis,
                               shape=(self.batch_size, self.attn.n_kv_heads, upto, d))
            out.append(dequantize_unified(q, dtype))
        return out[0], out[1]

    def _mask_tokens(self, n: int) -> int:
        """Quantized tokens whose groups carry a mask bit."""
        if self.opts.quant_mode == "hybrid":
            return n
        return min(n, self.first_call_q) if self.opts.quant_mode == "hybrid_prefill" else 0

    def _quantized_nbytes(self, n: int) -> int:
        total = 0
        for name, axis in zip("kv", self.axes):
            groups = self._group_slice(axis, 0, n)
            total += sum(getattr(self, f"{name}_{part}")[:, :, groups if part != "codes" else slice(0, n)].nbytes
                         for part in ("codes", "scale", "slot"))
        m = self._mask_tokens(n)
        if m:
            total += self.k_mask[:, :, :, :m // 32].nbytes + self.v_mask[:, :, :m // GROUP].nbytes
        return total

    def _quantized_token_bytes(self) -> float:
        d, b = self.attn.head_dim, self.opts.bits
        return 2 * 4 * packed_words(d, b) + 2 * 6 * d / GROUP

    def nbytes(self) -> int:
        norm = self.norm.nbytes if self.opts.key_norm and self.length else 0
        return super().nbytes() + norm

    def formula_nbytes(self, length: int) -> int:
        H, d, B = self.attn.n_kv_heads, self.attn.head_dim, self.batch_size
        mask = self._mask_tokens(self.quantized_len(length)) * B * H * d / 128
        norm = B * H * d * self.norm.element_size() if self.opts.key_norm and length else 0
        return super().formula_nbytes(length) + round(mask) + norm

    def reset(self) -> None:
        super().reset()
        self.first_call_q = 0

    # ---- decode: the fused kernel ---------------------------------------------------------------------
    def _fused_ok(self, q: Tensor) -> bool:
        """The kernel runs CUDA tensors (or any under the Triton interpreter) for 2/4 bits, the inner layout
        and a power-of-two head_dim."""
        from kvzoo.kernels.quant_matvec import kernels_run_on
        d = self.attn.head_dim
        return (self.opts.fused and kernels_run_on(q.device) and not self.opts.outer and self.opts.bits in (2, 4)
                and d >= 32 and d & (d - 1) == 0)

    def _kernel_inputs(self) -> tuple:
        """The quantized buffers as innerq_decode_attention takes them (every allocated slot; lengths or a
        slice say which are live)."""
        masks = (None, None) if self.opts.quant_mode == "asym" else (self.k_mask, self.v_mask)
        return (self.k_codes, self.k_scale, self.k_slot, masks[0], self.v_codes, self.v_scale, self.v_slot, masks[1])

    def _attend_fused(self, q: Tensor, n: int | None, windows: tuple, lengths: Tensor | None = None,
                      q_scale: Tensor | None = None) -> Tensor:
        """q (B, Hq, 1, d) after RoPE (times q_scale (B, H, d) inside the kernel where given) over quantized
        slots [0, n) (all of them, `lengths` saying how many are live, when n is None) and the exact windows
        ((k, v), (k2, v2)): (B, Hq, 1, d)."""
        from kvzoo.kernels.innerq_attention import innerq_decode_attention

        kc, ks, kz, km, vc, vs, vz, vm = self._kernel_inputs()
        if n is not None:
            kc, ks, kz, vc, vs, vz = kc[:, :, :n], ks[:, :, :n], kz[:, :, :n], vc[:, :, :n], vs[:, :, :n // GROUP], \
                vz[:, :, :n // GROUP]
        (k_win, v_win), (k_win2, v_win2) = windows
        out = innerq_decode_attention(q[:, :, 0], kc, ks, kz, km, vc, vs, vz, vm, k_win, v_win, self.opts.bits,
                                      k_win2=k_win2, v_win2=v_win2, lengths=lengths, mask_upto=self._mask_upto(),
                                      q_scale=q_scale)
        return out[:, :, None]                                                 # (B, Hq, 1, d)

    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token: dequantize-and-attend in one Triton kernel over the packed codes plus the exact sink and
        recent windows; the torch path (prefill) where the kernel does not apply (CPU, padding, outer layout)."""
        if pos.mask is not None or not self._fused_ok(q) or not q.is_cuda:
            return self.prefill(x, q, k, v, pos)
        q, _, k_store = self._qk(q, k, pos)
        S, L, n = self.opts.sink, self.length, self.n_q
        if L < S:                     # the token joins the sink window; nothing is quantized yet
            self.k_sink[:, :, L:L + 1], self.v_sink[:, :, L:L + 1] = k_store, v
            windows = ((self.k_sink[:, :, :L + 1], self.v_sink[:, :, :L + 1]), (None, None))
        else:                         # the token joins the recent window (room for R + G tokens)
            r = L - S - n
            self.k_res[:, :, r:r + 1], self.v_res[:, :, r:r + 1] = k_store, v
            windows = ((self.k_sink, self.v_sink), (self.k_res[:, :, :r + 1], self.v_res[:, :, :r + 1]))
        out = self._attend_fused(q, n, windows)
        self._append(k_store, v)      # rewrites the window slot above, quantizes a group leaving the window
        return out

    # ---- the static step (CUDA graphs, kvzoo/graphs.py) ----------------------------------------------
    def can_decode_static(self, padded: bool) -> bool:
        """Whole-step graphs need the kernel (no mask: unpadded rows) and a prompt already stored."""
        return not padded and self.length > 0 and self._fused_ok(self.k_res)

    def _static_lengths(self, step: StaticStep) -> tuple[Tensor, Tensor, Tensor]:
        """From the device-held length L: (quantized tokens n_q (1,), window slot r of the new token (1,), as
        _static_window gives them; live lengths (3,) int32 [n_q, sink tokens, recent tokens] for the kernel),
        shared by every layer."""
        key = ("innerq", self.opts.sink, self.opts.recent)
        if key not in step.derived:
            S, L = self.opts.sink, step.slot
            n_q, r = self._static_window(step)
            in_sink = L < S
            lengths = torch.cat([torch.where(in_sink, 0, n_q), torch.where(in_sink, L + 1, S),
                                 torch.where(in_sink, 0, r + 1)]).to(torch.int32)
            step.derived[key] = (n_q, r, lengths)
        return step.derived[key]

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        q, k = self.attn.rope(q, k, step.ids)
        if self.opts.key_norm:
            k = k / self.norm                            # the kernel multiplies q by the norm
        n_q, r, lengths = self._static_lengths(step)
        phase = self.static_phase()
        k_win, v_win = (self.k_sink, self.v_sink) if phase == "sink" else (self.k_res, self.v_res)
        k_win.index_copy_(2, r, k)                                      # k (B, H, 1, d) into window slot r
        v_win.index_copy_(2, r, v)
        out = self._attend_fused(q, None, ((self.k_sink, self.v_sink), (self.k_res, self.v_res)), lengths,
                                 self.norm[:, :, 0] if self.opts.key_norm else None)
        if phase == "flush":
            self._flush_static(n_q)
        return out

    def _flush_static(self, n_q: Tensor) -> None:
        """The full recent window's oldest group (G = 32 tokens) into quantized slots [n_q, n_q + G), n_q a
        device tensor (1,), in one kernel (kvzoo/kernels/quantize_pack.py); the rest of the window moves
        down by G."""
        from kvzoo.kernels.quantize_pack import innerq_flush

        mode = "sym" if self.opts.quant_mode == "hybrid_prefill" else self.opts.quant_mode
        innerq_flush(self.k_res, self.v_res, n_q, self.k_codes, self.k_scale, self.k_slot, self.k_mask, self.v_codes,
                     self.v_scale, self.v_slot, self.v_mask, self.opts.bits, mode, write_mask=mode == "hybrid")
        G, R = GROUP, self.opts.recent
        for buf in (self.k_res, self.v_res):
            buf[:, :, :R] = buf[:, :, G:G + R].clone()

    # ---- key normalization -------------------------------------------------------------------------
    def _qk(self, q: Tensor, k: Tensor, pos: Positions) -> tuple[Tensor, Tensor, Tensor]:
        q, k = self.attn.rope(q, k, pos.ids)
        self.in_first_call = self.length == 0
        if not self.opts.key_norm:
            return q, k, k
        if self.in_first_call:
            slots = torch.arange(pos.start, pos.start + k.shape[2], device=k.device)
            real = (slots[None, :] >= pos.pad[:, None])[:, None, :, None]        # (B, 1, T, 1): not padding
            peak = k.abs().masked_fill(~real, 0).amax(dim=2, keepdim=True)       # (B, H, 1, d)
            half = peak.shape[-1] // 2
            tied = torch.maximum(peak[..., :half], peak[..., half:])             # one factor per RoPE pair
            self.norm.copy_(torch.cat([tied, tied], dim=-1).clamp_min(1e-6).sqrt())
        rep = q.shape[1] // k.shape[1]
        k = k / self.norm
        return q * self.norm.repeat_interleave(rep, dim=1), k, k
