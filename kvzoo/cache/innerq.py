"""InnerQ: KV-cache quantization grouped over the *inner* dimension of each decode product, with hybrid
symmetric/asymmetric groups, sink + recent high-precision windows and per-channel key normalization.

Paper: "InnerQ: Hardware-aware Tuning-free Quantization of KV Cache for Large Language Models"
(../shared/papers/innerq.md). The windows and the once-only quantization of groups leaving the recent window
are the shared store's (store.py), as for KIVI; InnerQ changes what is quantized and how (`InnerQCodec`):

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
- High-precision windows (§4.2, Algorithms 1 and 2): the first `sink` tokens stay exact, and exactly the last
  `recent` keys (a key is quantized on its own, its groups lying within the token); values are quantized a
  group of 32 tokens at a time once 32 have left the recent window. `policy=grouped` flushes keys the same
  way as values, `none` keeps no window (kvzoo/cache/store.py).
- Per-channel key normalization (§4.3): norm_i = sqrt(max_t |K_t,i|) over the prompt's post-RoPE keys
  (LayerCache.prompt_slots: the prefill, as Algorithm 2 computes it); keys are stored divided by it and
  queries multiplied by it, after RoPE, so q·k is unchanged channel by channel, as the paper's factor folded
  into W_q and W_k intends, without rewriting weights shared by every sequence the model serves.
  `tie_norm=true` ties the factor per RoPE pair (channels i and i + d/2 share the larger), the form that
  could be folded into pre-RoPE weights (an ablation).

Stored per layer (B rows, H = n_kv_heads, d = head_dim, b = bits, Nq quantized tokens; inner layout):
    k_codes int32 (B, H, Nq, d*b/32)   k_scale fp16 + k_slot int32 (B, H, Nq, d/32)   per-token groups
    v_codes int32 (B, H, Nq, d*b/32)   v_scale fp16 + v_slot int32 (B, H, Nq/32, d)   per-channel groups,
                                       codes packed along tokens (kvquant.pack_tokens: a word is one channel's
                                       16 tokens at 2 bits, in one group, so it takes one scale and slot)
    k_mask int32 (B, H, d/32, ⌈Nq/32⌉) v_mask int32 (B, H, Nq/32, d/32)              hybrid modes only
    sink and recent windows (B, H, ·, d) at the model's precision; norm (B, H, 1, d) with key_norm (per KV head, so a
    tensor-parallel rank, kvzoo/models/tp.py, takes its own heads' from the prompt)
Bytes per quantized token, per layer and KV head: d*b/4 (codes) + 2 * 6d/32 (fp16 scale + 32-bit slot per
group, K and V) + d/128 (mask bits, hybrid). d = 64, b = 2: 32 + 24 + 0.5 = 56.5 bytes against 256 in fp16.

Paper settings (the defaults): b = 2, G = 32, w_sink = 32, w_recent = 96, hybrid, key normalization on.

Decode on a GPU runs the fused kernel (kvzoo/kernels/innerq_attention.py) over these buffers as stored: packed
codes, and mask bits read in place. `decode_static` is the same step with the lengths in device tensors, so
that a CUDA graph holds it (kvzoo/graphs.py). It has one graph per phase: a token joins the sink, joins the
recent window, or fills it and a group is quantized in place (one window for both: innerq_flush, one kernel; the
paper's windows: values 32 at a time through InnerQCodec.write_at, keys a token at a time). With the paper's
windows up to 31 keys are quantized while their values are still exact; the kernel reads them dequantized beside
their values' rows, and the rest of the value window's keys from the key window. Those lagging keys are one
kernel, with the token's window rows on the attention's second stream, beside its quantized part (_lagging_keys,
StaticStep.tail); the key leaving its window (a ring: no row moves, kvzoo/cache/store.py) is quantized in one
kernel after it, beside the step (_flush_keys); with FUSED_KEY_STEP off, their torch reference. Elsewhere (a CPU)
decode reads the codes a stream at a time (WindowedStore.attend; a symmetric group's signs flipped into its codes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import Chunk, LayerCache, Positions, StaticStep, register
from kvzoo.cache.kvquant import (UnifiedQTensor, check_bits, pack_sym_mask, packed_words, quantize_unified,
                                 scale_codes_, unpack_float, unpack_sym_mask, unpack_tokens)
from kvzoo.cache.store import Codec, Window, WindowedStore, check_policy, policy_windows
from kvzoo.graphs import WholeStep

GROUP = 32        # the unified slot holds 32 bits: an fp32 zero point or 32 sign bits
MODES = ("asym", "sym", "hybrid", "hybrid_prefill")
FUSED_KEY_STEP = True   # the static step's per-token key work in one kernel; False: the torch path, its reference


@dataclass(frozen=True)
class InnerQOptions:
    bits: int = 2
    group_size: int = GROUP
    sink: int = 32
    recent: int = 96
    quant_mode: str = "hybrid"
    key_norm: bool = True
    tie_norm: bool = False     # one norm factor per RoPE pair (ablation); default per channel
    policy: str = "reference"  # window policy (kvzoo/cache/store.py): reference | grouped | none
    outer: bool = False
    fused: bool = True     # decode through the Triton kernel (kvzoo/kernels/innerq_attention.py) on CUDA

    def __post_init__(self):
        check_bits(self.bits)
        check_policy(self.policy)
        if self.group_size != GROUP:
            raise ValueError(f"innerq group_size must be {GROUP} (one 32-bit slot holds a group's zero point "
                             f"or its sign bits), got {self.group_size}")
        if self.quant_mode not in MODES:
            raise ValueError(f"unknown innerq quant_mode {self.quant_mode!r}; accepted: {', '.join(MODES)}")
        if self.recent < 0 or self.recent % GROUP:
            raise ValueError(f"recent must be a non-negative multiple of {GROUP}, got {self.recent}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")


class InnerQCodec(Codec):
    """One stream (keys or values, (B, H, n, d)) in InnerQ's unified layout: groups of 32 along `axis` (-1:
    along head_dim, per token; -2: along tokens, per channel), each with an fp16 scale and a 32-bit slot (the
    fp32 zero of an asymmetric group or the sign bits of a symmetric one), and a mask bit per group saying
    which (hybrid modes). With hybrid_prefill, groups written during the first forward call (`first_call`, set
    by the cache) are hybrid and later ones symmetric; `first_call_q` counts the former."""

    def __init__(self, lead: tuple[int, int], capacity: int, d: int, bits: int, axis: int, mode: str, device):
        super().__init__()
        self.width, self.bits, self.axis, self.mode, self.capacity = d, bits, axis, mode, capacity
        self.has_mask = mode in ("hybrid", "hybrid_prefill")
        self.first_call, self.first_call_q = False, 0
        buf = lambda name, shape, dtype: self.register_buffer(  # noqa: E731
            name, torch.zeros((*lead, *shape), dtype=dtype, device=device), persistent=False)
        buf("codes", (capacity, packed_words(d, bits)), torch.int32)
        buf("scale", self._group_shape(capacity), torch.float16)
        buf("slot", self._group_shape(capacity), torch.int32)
        # mask bits packed along tokens (per-token groups) or along channels (per-channel groups); no bits at
        # all (zero columns along tokens) in the asym and sym modes
        tokens = -(-capacity // 32) if self.has_mask else 0
        buf("mask", (d // GROUP, tokens) if axis == -1 else (tokens, d // 32), torch.int32)

    def _group_shape(self, n: int) -> tuple[int, int]:
        return (n, self.width // GROUP) if self.axis == -1 else (n // GROUP, self.width)

    def _group_slice(self, a: int, b: int) -> slice:
        return slice(a, b) if self.axis == -1 else slice(a // GROUP, b // GROUP)

    def write(self, a: int, b: int, rows: Tensor, real: Tensor | None = None) -> None:
        mode = self.mode
        if mode == "hybrid_prefill":
            mode = "hybrid" if self.first_call else "sym"
            if self.first_call:
                self.first_call_q = b
        q = quantize_unified(rows, self.bits, self.axis, mode)
        self.codes[:, :, a:b] = q.codes
        groups = self._group_slice(a, b)
        self.scale[:, :, groups] = q.scale
        self.slot[:, :, groups] = q.slot
        if self.has_mask:
            if self.axis == -1:     # bits along tokens (B, H, d/32, n/32), a word shared by 32 tokens
                a0 = a // 32 * 32   # the first word's earlier tokens keep their bits
                sym = torch.cat([unpack_sym_mask(self.mask[:, :, :, a0 // 32:], -1, a - a0, a - a0, self.width), q.sym],
                                dim=2)                                                   # (B, H, b - a0, d/32)
                words = pack_sym_mask(sym, -1)
                self.mask[:, :, :, a0 // 32:a0 // 32 + words.shape[-1]] = words
            else:                   # bits along channels (B, H, n/32, d/32)
                self.mask[:, :, a // GROUP:b // GROUP] = pack_sym_mask(q.sym, self.axis)

    def mask_upto(self) -> int:
        """Quantized tokens whose groups carry a mask bit; later groups are symmetric (hybrid_prefill) and
        in the sym mode all are."""
        return {"hybrid": self.codes.shape[2], "hybrid_prefill": self.first_call_q}.get(self.mode, 0)

    def mask_tokens(self, n: int) -> int:
        """Of the first n quantized tokens, those whose groups carry a mask bit."""
        return min(n, self.mask_upto())

    def held(self, n: int, start: int = 0) -> UnifiedQTensor:
        shape = (*self.codes.shape[:2], n - start, self.width)
        a = start // 32 * 32                   # mask bits are read from the word holding slot `start` on
        if self.mode == "asym":
            sym = torch.zeros((*shape[:2], *self._group_shape(n - a)), dtype=torch.bool, device=self.codes.device)
        else:
            words = self.mask[:, :, :, a // 32:] if self.axis == -1 else self.mask[:, :, a // 32:]
            sym = unpack_sym_mask(words, self.axis, n - a, max(0, self.mask_upto() - a), self.width)
        groups = self._group_slice(start, n)
        return UnifiedQTensor(codes=self.codes[:, :, start:n], scale=self.scale[:, :, groups],
                              slot=self.slot[:, :, groups], sym=sym[:, :, self._group_slice(start - a, n - a)],
                              bits=self.bits, axis=self.axis, shape=shape)

    def read(self, n: int, dtype: torch.dtype, start: int = 0) -> Tensor:
        """Slots [start, n) as x̂ = codes * scale + zero, computed in place over the unpacked codes (equal to
        dequantize_unified, the quantizer's reference): a symmetric group's sign bits flipped into its codes and a
        zero of 0, an asymmetric group's fp32 zero from its slot."""
        return self._values(self.held(n, start), dtype)

    def _values(self, q: UnifiedQTensor, dtype: torch.dtype) -> Tensor:
        signs = q.slot * q.sym                                                      # an asymmetric group's: none
        if self.axis == -1:         # groups (B, H, T, d/32): a group's sign bits run along its channels, as its codes
            codes = unpack_float(q.codes, self.bits, self.width, signs)             # (B, H, T, d)
        else:                       # groups (B, H, T/32, d): along its tokens
            shifts = torch.arange(GROUP, dtype=torch.int32, device=signs.device)
            flip = (signs.unsqueeze(-2) >> shifts[:, None]).bitwise_left_shift_(31)  # (B, H, T/32, 32, d): bit 31
            codes = unpack_tokens(q.codes, self.bits).float()                       # (B, H, T, d)
            codes.view(torch.int32).unflatten(-2, (-1, GROUP)).bitwise_xor_(flip)   # an fp32's sign flipped
        zero = torch.where(q.sym, 0.0, q.slot.view(torch.float32))                 # a symmetric group's is 0
        return scale_codes_(codes, q.scale, zero, GROUP, self.axis).to(dtype)

    # ---- device-held slots (the static step) ----------------------------------------------------------
    def _static_mode(self) -> str:
        """The mode of a group quantized after the prompt: hybrid_prefill's later groups are symmetric."""
        return "sym" if self.mode == "hybrid_prefill" else self.mode

    def write_at(self, start: Tensor, rows: Tensor) -> None:
        """Quantize rows (B, H, n, d) into slots [start, start + n), start a device tensor (1,): index writes, no
        host sync. Groups along tokens (axis -2) take whole groups of 32 at a multiple of 32; a per-token group's
        mask bit is set in its word (bit t % 32 of word t // 32) one token at a time."""
        n, mode = rows.shape[2], self._static_mode()
        if self.axis == -2 and n != GROUP:
            raise ValueError(f"groups along tokens are written {GROUP} tokens at a time, got {n}")
        q = quantize_unified(rows, self.bits, self.axis, mode)
        slots = start + torch.arange(n, device=start.device)
        self.codes.index_copy_(2, slots, q.codes)
        if self.axis == -1:
            self.scale.index_copy_(2, slots, q.scale)
            self.slot.index_copy_(2, slots, q.slot)
        else:
            self.scale.index_copy_(2, start // GROUP, q.scale)
            self.slot.index_copy_(2, start // GROUP, q.slot)
        if mode != "hybrid":                     # asym and sym groups carry no mask bit
            return
        if self.axis == -2:
            self.mask.index_copy_(2, start // GROUP, pack_sym_mask(q.sym, -2))
            return
        for i in range(n):                       # (B, H, d/32, 1): the word holding token t's bit, per group
            t = slots[i:i + 1]
            word, bit = self.mask.index_select(3, t // 32), (t % 32).to(torch.int32)
            sym = q.sym[:, :, i:i + 1].transpose(-1, -2).to(torch.int32)
            word = (word & ~torch.bitwise_left_shift(1, bit)) | torch.bitwise_left_shift(sym, bit)
            self.mask.index_copy_(3, t // 32, word)

    def read_at(self, start: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        """Slots [start, start + n) of per-token groups (axis -1) dequantized, start a device tensor (1,); slots
        past the buffers read the last one (the caller leaves them out): (B, H, n, d)."""
        assert self.axis == -1, "read_at serves groups along the head dimension"
        slots = (start + torch.arange(n, device=start.device)).clamp_max(self.capacity - 1)
        codes, scale, slot = (t.index_select(2, slots) for t in (self.codes, self.scale, self.slot))
        B, H = codes.shape[:2]
        if self.mode == "asym":
            sym = torch.zeros(B, H, n, self.width // GROUP, dtype=torch.bool, device=codes.device)
        elif self.has_mask:           # bit t % 32 of word [g, t // 32]; tokens from mask_upto on carry none: symmetric
            words = self.mask.index_select(3, slots // 32)                           # (B, H, d/32, n)
            bits = (words >> (slots % 32).to(torch.int32)) & 1
            sym = bits.transpose(-1, -2).bool() | (slots >= self.mask_upto())[:, None]
        else:
            sym = torch.ones(B, H, n, self.width // GROUP, dtype=torch.bool, device=codes.device)
        return self._values(UnifiedQTensor(codes=codes, scale=scale, slot=slot, sym=sym, bits=self.bits, axis=-1,
                                           shape=(B, H, n, self.width)), dtype)

    def mask_words(self, n: int) -> int:
        """32-bit mask words per (row, head) held for the first n quantized tokens."""
        m = self.mask_tokens(n)
        return -(-m // 32) * self.width // GROUP if self.axis == -1 else m // 32 * self.width // 32

    def nbytes(self, n: int) -> int:
        groups = self._group_slice(0, n)
        total = self.codes[:, :, :n].nbytes + self.scale[:, :, groups].nbytes + self.slot[:, :, groups].nbytes
        m = -(-self.mask_tokens(n) // 32)
        if m:
            total += (self.mask[:, :, :, :m] if self.axis == -1 else self.mask[:, :, :m]).nbytes
        return total

    def token_bytes(self) -> float:
        """Codes, then an fp16 scale and a 32-bit slot per group of 32 (mask bits: the cache's formula)."""
        return 4 * packed_words(self.width, self.bits) + 6 * self.width / GROUP


@register("innerq")
class InnerQCache(WholeStep, LayerCache):
    """Slots [0, sink) exact | [sink, sink + Nq) in InnerQ's layout | [sink + Nq, L) exact recent window."""

    Options = InnerQOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        o, d, weight = self.opts, layer.head_dim, layer.q_proj.weight
        if d % GROUP:
            raise ValueError(f"innerq needs a head dimension divisible by {GROUP}, got {d}")
        # (key group axis, value group axis): -1 groups along head_dim, -2 along tokens
        axes = dict(zip("kv", (-2, -1) if o.outer else (-1, -2)))
        spans = {name: 1 if axis == -1 else GROUP for name, axis in axes.items()}    # tokens one group covers
        windows = policy_windows(o.policy, {name: Window(o.sink, o.recent, span) for name, span in spans.items()},
                                 o.sink, o.recent, GROUP, spans)
        self.window, self.value_window = windows["k"], windows["v"]
        lead = (batch_size, layer.n_kv_heads)
        # room for the most ever quantized in either stream, in whole groups of 32 slots (the kernel reads whole
        # groups, the same slots of both)
        capacity = -(-max(w.quantized(max_len) for w in windows.values()) // GROUP) * GROUP
        codecs = {name: InnerQCodec(lead, capacity, d, o.bits, axis, o.quant_mode, weight.device)
                  for name, axis in axes.items()}
        self.store = WindowedStore(windows, codecs, lead, weight.dtype, weight.device)
        self.register_buffer("norm", torch.zeros(*lead, 1, d, dtype=weight.dtype, device=weight.device),
                             persistent=False)

    # ---- key normalization -------------------------------------------------------------------------
    def _qk(self, q: Tensor, k: Tensor, pos: Positions) -> tuple[Tensor, Tensor]:
        """(q, k) after RoPE and key normalization; the prompt (the first call) sets the per-channel norm."""
        q, k = self.attn.rope(q, k, pos.ids)
        first_call = self.length == 0
        for codec in self.store.codecs.values():
            codec.first_call = first_call
        if not self.opts.key_norm:
            return q, k
        if first_call:
            n = self.prompt_slots(k.shape[2])
            slots = torch.arange(pos.start, pos.start + n, device=k.device)
            real = (slots[None, :] >= pos.pad[:, None])[:, None, :, None]        # (B, 1, n, 1): not padding
            peak = k[:, :, :n].abs().masked_fill(~real, 0).amax(dim=2, keepdim=True)   # (B, H, 1, d)
            if self.opts.tie_norm:                                               # one factor per RoPE pair
                half = peak.shape[-1] // 2
                peak = torch.maximum(peak[..., :half], peak[..., half:]).repeat(1, 1, 1, 2)
            self.norm.copy_(peak.clamp_min(1e-6).sqrt())
        rep = q.shape[1] // k.shape[1]
        return q * self.norm.repeat_interleave(rep, dim=1), k / self.norm

    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        q, k = self._qk(q, k, pos)
        self.length, seen, after = self.store.append_read(self.length, {"k": k, "v": v}, held)
        return Chunk(q, seen["k"], seen["v"], *((after["k"], after["v"]) if held else ()))

    # ---- bytes -------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        norm = self.norm.nbytes if self.opts.key_norm and self.length else 0
        return self.store.nbytes(self.length) + norm

    def formula_nbytes(self, length: int) -> int:
        H, d, B = self.attn.n_kv_heads, self.attn.head_dim, self.batch_size
        # mask bits: one per group, packed in 32-bit words (along tokens for keys: a partly filled last word)
        mask = sum(4 * B * H * codec.mask_words(self.store.windows[name].quantized(length))
                   for name, codec in self.store.codecs.items())
        norm = B * H * d * self.norm.element_size() if self.opts.key_norm and length else 0
        return self.store.formula_nbytes(length) + mask + norm

    def reset(self) -> None:
        super().reset()
        for codec in self.store.codecs.values():
            codec.first_call_q = 0

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
        k, v = self.store.codecs["k"], self.store.codecs["v"]
        masks = (None, None) if self.opts.quant_mode == "asym" else (k.mask, v.mask)
        return (k.codes, k.scale, k.slot, masks[0], v.codes, v.scale, v.slot, masks[1])

    def _attend_fused(self, q: Tensor, n: int | None, windows: tuple, lengths: Tensor | None = None,
                      q_scale: Tensor | None = None, ring: Tensor | None = None) -> Tensor:
        """q (B, Hq, 1, d) after RoPE (times q_scale (B, H, d) inside the kernel where given) over quantized
        slots [0, n) (all of them, `lengths` saying how many are live, when n is None) and the exact windows
        ((k, v), (k2, v2)), k2 the lagging keys and `ring` the key window where given (innerq_decode_attention's
        k_ring2): (B, Hq, 1, d)."""
        from kvzoo.kernels.innerq_attention import innerq_decode_attention

        kc, ks, kz, km, vc, vs, vz, vm = self._kernel_inputs()
        if n is not None:
            kc, ks, kz, vc, vs, vz = kc[:, :, :n], ks[:, :, :n], kz[:, :, :n], vc[:, :, :n], vs[:, :, :n // GROUP], \
                vz[:, :, :n // GROUP]
        (k_win, v_win), (k_win2, v_win2) = windows
        out = innerq_decode_attention(q[:, :, 0], kc, ks, kz, km, vc, vs, vz, vm, k_win, v_win, self.opts.bits,
                                      k_win2=k_win2, v_win2=v_win2, lengths=lengths,
                                      mask_upto=self.store.codecs["k"].mask_upto(),
                                      q_scale=q_scale, k_ring2=ring)
        return out[:, :, None]                                                 # (B, Hq, 1, d)

    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token: dequantize-and-attend in one Triton kernel over the packed codes plus the exact sink and
        recent windows; where the kernel does not apply (CPU, padding, outer layout), scores and outputs from the
        codes a stream at a time (WindowedStore.attend)."""
        if not self.length:
            return self.prefill(x, q, k, v, pos)
        if not q.is_cuda or pos.mask is not None or not self._fused_ok(q):
            q, k = self._qk(q, k, pos)
            out = self.store.attend(q, self.length, {"k": k, "v": v}, pos.mask)   # from the codes
            self.length = self.store.append(self.length, {"k": k, "v": v})
            return out
        q, k = self._qk(q, k, pos)
        st, L = self.store, self.length
        # the kernel reads the whole groups quantized in both streams; the rest (the sink, a stream's later
        # quantized slots dequantized, the recent window) joins the token as exact rows
        n = min(st.counts(L, name)[1] for name in "kv") // GROUP * GROUP
        rows = st.read(L, q.dtype, start=n)
        out = self._attend_fused(q, n, ((torch.cat([rows["k"], k], dim=2), torch.cat([rows["v"], v], dim=2)),
                                        (None, None)))
        self.length = st.append(L, {"k": k, "v": v})   # quantizes what leaves the recent windows
        return out

    # ---- the static step (WholeStep: CUDA graphs, kvzoo/graphs.py) -------------------------------------
    def can_decode_static(self, padded: bool) -> bool:
        """Whole-step graphs need the kernel (no mask: unpadded rows) and a prompt already stored; keys and values
        in one window, or in the paper's (the same sink and recent window, keys quantized a token at a time and
        values 32 at a time)."""
        w, wv = self.store.windows["k"], self.store.windows["v"]
        paper = (w.sink, w.recent, w.group, wv.group) == (wv.sink, wv.recent, 1, GROUP)
        return not padded and self.length > 0 and (w == wv or paper) and self._fused_ok(self.norm)

    def static_phase(self) -> str:
        return self.store.phases(self.length)

    def static_scratch(self) -> tuple[Tensor, ...]:
        return self.store.scratch()

    def _static_lengths(self, step: StaticStep) -> tuple[Tensor, Tensor]:
        """From the device-held length L: (the values' quantized tokens n_q (1,), as WindowedStore.window_row gives
        them; live lengths int32 [n_q, sink tokens, recent tokens] for the kernel, and with the paper's windows
        [.., delta = Nq_k - n_q], the keys quantized before their values), shared by every layer. The kernel reads
        slots [S, S + n_q) from both streams' codes and every later slot from the value window's rows, their keys
        from the key window (a ring) or, for the first delta, dequantized (_lagging_keys)."""
        key = ("innerq", self.opts.sink, self.opts.recent)
        if key not in step.derived:
            S, L = self.opts.sink, step.slot
            n_q, r = self.store.window_row(step, "v")
            in_sink = L < S
            lengths = [torch.where(in_sink, 0, n_q), torch.where(in_sink, L + 1, S), torch.where(in_sink, 0, r + 1)]
            if self.store.window is None:
                lengths.append(self.store.window_row(step, "k")[0] - n_q)
            step.derived[key] = (n_q, torch.cat(lengths).to(torch.int32))
        return step.derived[key]

    def _lagging_keys(self, step: StaticStep, n_q: Tensor) -> Tensor:
        """The keys of the value window's first 32 rows (B, H, 32, d), row j holding slot S + n_q + j's key:
        dequantized from the codes for j < Nq_k - n_q (< 32 keys that left their window before their values left
        theirs), else the key window's row (a ring); the kernel reads only the first, the rest from the key window
        itself. One kernel (kvzoo/kernels/quantize_pack.py) where FUSED_KEY_STEP, else the torch path, its
        reference."""
        st = self.store
        n_k, _ = st.window_row(step, "k")
        codec = st.codecs["k"]
        if FUSED_KEY_STEP:
            from kvzoo.kernels.quantize_pack import innerq_aligned_keys
            read = "asym" if codec.mode == "asym" else "mask" if codec.has_mask else "sym"
            return innerq_aligned_keys(st.recent("k"), n_k, n_q, codec.codes, codec.scale, codec.slot,
                                       codec.mask if codec.has_mask else None, GROUP, codec.bits, read,
                                       codec.mask_upto())
        delta = n_k - n_q                                                        # (1,) in [0, 32)
        rows = torch.arange(GROUP, device=n_q.device)
        keys = st.recent("k").index_select(2, (n_q + rows) % st.recent("k").shape[2])     # slot S + n_q + j, a ring
        if codec.capacity:                       # else nothing is ever quantized: every key is in its window
            quantized = codec.read_at(n_q, GROUP, keys.dtype).index_select(2, rows.clamp_max(GROUP - 1))
            keys = torch.where((rows < delta)[:, None], quantized, keys)
        return keys

    def _flush_keys(self, step: StaticStep) -> None:
        """With the paper's windows, if the token filled the key window: its oldest token quantized at its
        device-held slot, from its row of the ring (innerq_key_flush where FUSED_KEY_STEP)."""
        st = self.store
        if st.window is not None or st.phase(self.length, "k") != "flush":
            return
        if FUSED_KEY_STEP:
            from kvzoo.kernels.quantize_pack import innerq_key_flush
            codec = st.codecs["k"]
            n_k, _ = st.window_row(step, "k")
            innerq_key_flush(st.recent("k"), n_k, codec.codes, codec.scale, codec.slot,
                             codec.mask if codec.has_mask else None, codec.bits, codec._static_mode())
        else:
            st.flush_at(self.length, step, ("k",))

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode with fixed shapes: the token's k, v into their windows' rows and the keys quantized before their
        values (_lagging_keys), on a GPU on the attention's second stream (StaticStep.tail), where the fused
        kernel's window part then runs beside its quantized part; the fused kernel over every quantized slot
        (`lengths` says which are live), the sink and the value window's rows with their keys; then, beside the
        step (StaticStep.beside: a second stream on a GPU, joined at the step's end), the key leaving its window
        quantized and a value window the token filled quantizing its oldest group, at device-held slots."""
        q, k = self.attn.rope(q, k, step.ids)
        n_q, lengths = self._static_lengths(step)
        st = self.store
        with step.tail(k, v):               # only the kernel's window part reads these: beside its quantized part
            if self.opts.key_norm:
                k = k / self.norm                        # the kernel multiplies q by the norm
            st.write_token_at(self.length, step, {"k": k, "v": v})  # k, v (B, H, 1, d) into their window rows
            keys, ring = (st.recent("k"), None) if st.window is not None else (self._lagging_keys(step, n_q),
                                                                              st.recent("k"))
        out = self._attend_fused(q, None, ((st.sink("k"), st.sink("v")), (keys, st.recent("v"))),
                                 lengths, self.norm[:, :, 0] if self.opts.key_norm else None, ring)
        with step.beside():                 # nothing later in the step reads this layer's windows or codes
            self._flush_keys(step)
            if st.window is None:
                st.flush_at(self.length, step, ("v",))      # values 32 at a time
            elif st.phase(self.length) == "flush":
                self._flush_static(n_q)
        return out

    def _flush_static(self, n_q: Tensor) -> None:
        """The full recent window's oldest group (G = 32 tokens) into quantized slots [n_q, n_q + G), n_q a
        device tensor (1,), in one kernel (kvzoo/kernels/quantize_pack.py); the rest of the window moves
        down by G."""
        from kvzoo.kernels.quantize_pack import innerq_flush

        st, k, v = self.store, self.store.codecs["k"], self.store.codecs["v"]
        mode = k._static_mode()
        innerq_flush(st.recent("k"), st.recent("v"), n_q, k.codes, k.scale, k.slot, k.mask, v.codes, v.scale, v.slot,
                     v.mask, self.opts.bits, mode, write_mask=mode == "hybrid")
        st.shift()
