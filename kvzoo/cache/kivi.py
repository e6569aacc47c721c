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

Stored per layer, in kvzoo/cache/store.py's windowed store (B rows, H = n_kv_heads, d = head_dim, b = bits,
G = group_size, R = residual, S = sink):
    k_codes  int32 (B, H, Nq, d*b/32)     keys of the Nq quantized tokens, bit-packed along d
    k_scale, k_zero  fp16 (B, H, Nq/G, d) one pair per channel per G tokens
    v_codes  int32 (B, H, Nq, d*b/32)     values, bit-packed along d
    v_scale, v_zero  fp16 (B, H, Nq, d/Gv) one pair per Gv = min(G, d) channels per token
    sink and recent windows (B, H, ., d)  the first S and the r most recent tokens at the model's precision
Windows (`policy`, kvzoo/cache/store.py). reference, the authors' code: keys wait in a residual of up to R
exact keys that is quantized whole when it fills (Nq_k = floor((L - S) / R) * R: 0..R-1 exact keys), values
leave the R-token window one at a time (Nq_v = L - S - R: exactly R exact values). grouped: both streams
Nq = floor((L - S - R) / G) * G (R..R+G-1 exact). none: no window (keys in whole groups of G, values per
token). A group is quantized once, when it leaves the window; quantized data is never requantized.

Bytes per token, per layer and KV head: quantized d*b/4 (K and V codes, d a multiple of 32) + 4*d/G
(fp16 key scale and zero) + 4*d/Gv (value scale and zero); residual 2*d*bytes(dtype). fp16 cache: 4*d.
For b=2, G=32, d=64: 48 vs 256 bytes, and at L=2048, R=128 (grouped): (1920*48 + 128*256) / (2048*256) = 0.2383 of
the fp16 cache.

Eager decode on a GPU (unpadded rows, KIVI and SQuat, not KIVI*, whose keys need RoPE after dequantization) reads
the quantized history in place through the outer-layout kernels of kvzoo/kernels/quant_matvec.py (q·Kᵀ with
per-channel key groups, p·V with per-token value groups; one launch each, GQA rows reading their KV head), with the
windows and the token exact in one fp32 softmax; everywhere else decode is a one-token prefill, which
dequantizes the whole history. With the authors' windows the kernels read the whole groups quantized in both
streams and the rest (at most R + G keys) joins the exact rows. `decode_static` is the same step with the
length in a device tensor, for kvzoo/graphs.py's whole-step CUDA graph (WholeStep), under every window policy.
Where the step's mask is causal (unpadded rows, no sliding window) one fused flash-decoding kernel per layer
(kvzoo/kernels/outer_attention.py) attends every stored slot, each slot's key and value read from its codes or
its stream's window (KIVI*: the kernel rotates the quantized keys to their positions, the step the sink's and the
key window's; KIVI* has a static step only there); otherwise attention runs over every allocated slot of each
stream's static layout (WindowedStore.static_rows), the dead ones and those the mask forbids masked, the key
weights routed to the value rows by slot where the two streams' windows differ. One graph per phase (in each
stream the token joins the sink, joins the window, or fills it and its oldest group is quantized at a device-held
slot; one kernel quantizes a value from its row of the value window, a ring, on a second stream beside the layers
after it). Its cost grows with the buffer (max_len), not with the tokens stored.

Paper settings: b = 2 (also 4), G = 32, R = 128 (Llama/Mistral); scales and zeros in fp16. The XQuant
paper's KIVI* rows of its Table 4 keep the first 3 layers at 4 bits: `high_layers=3` (`high_bits=4`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import Chunk, LayerCache, Positions, StaticStep, register
from kvzoo.cache.kvquant import check_bits
from kvzoo.cache.store import GroupCodec, Window, WindowedStore, check_policy, policy_windows
from kvzoo.graphs import WholeStep


@dataclass(frozen=True)
class KIVIOptions:
    bits: int = 2
    group_size: int = 32
    residual: int = 128
    sink: int = 0          # "KIVI+sink" (InnerQ's baseline): the first tokens also stay exact
    high_layers: int = 0   # the first high_layers layers use high_bits (XQuant Table 4: 3 layers at 4 bits)
    high_bits: int = 4
    policy: str = "reference"   # window policy (kvzoo/cache/store.py): reference | grouped | none

    def __post_init__(self):
        check_policy(self.policy)
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
class KIVICache(WholeStep, LayerCache):
    """Slots [0, sink) exact | [sink, sink + Nq) quantized | [sink + Nq, L) exact residual window: keys per
    channel, values per token."""

    Options = KIVIOptions
    pre_rope = False      # KIVI quantizes keys after RoPE

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        o, d, weight = self.opts, layer.head_dim, layer.q_proj.weight
        self.v_group = min(o.group_size, d)      # a value group never spans two heads
        if d % self.v_group:
            raise ValueError(f"{self.name} group_size {o.group_size} must divide the head dimension {d} "
                             f"(values are grouped along it), or be at least {d}")
        # the authors' code: the key residual is flushed whole when it holds R keys, exactly R values stay exact
        reference = {"k": Window(o.sink, 0, max(o.residual, o.group_size)), "v": Window(o.sink, o.residual, 1)}
        windows = policy_windows(o.policy, reference, o.sink, o.residual, o.group_size, {"k": o.group_size, "v": 1})
        self.window, self.value_window = windows["k"], windows["v"]
        lead = (batch_size, layer.n_kv_heads)
        # the most ever quantized, rounded up to whole groups of G slots (the kernels read whole groups)
        capacity = {name: -(-w.quantized(max_len) // o.group_size) * o.group_size for name, w in windows.items()}
        values = GroupCodec(lead, capacity["v"], d, o.bits, self.v_group, False, weight.dtype, weight.device)
        self.store = WindowedStore(windows, {"k": self.key_codec(lead, capacity["k"]), "v": values}, lead,
                                   weight.dtype, weight.device)

    def key_codec(self, lead: tuple[int, int], capacity: int) -> GroupCodec:
        """Keys per channel: each channel of G consecutive tokens shares a scale and zero."""
        weight = self.attn.q_proj.weight
        return GroupCodec(lead, capacity, self.attn.head_dim, self.opts.bits, self.opts.group_size, True,
                          weight.dtype, weight.device)

    def nbytes(self) -> int:
        return self.store.nbytes(self.length)

    def formula_nbytes(self, length: int) -> int:
        return self.store.formula_nbytes(length)

    # ---- storing and reading -------------------------------------------------------------------------
    def _rope_keys(self, k: Tensor, pos: Positions) -> Tensor:
        """KIVI* stores keys before RoPE: rotate stored slots [0, S) to their positions (slot - pad)."""
        if not self.pre_rope:
            return k
        slots = torch.arange(k.shape[2], device=k.device)
        return self.attn.rope.apply(k, (slots[None, :] - pos.pad[:, None]).clamp_min(0))

    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        q, k_rot = self.attn.rope(q, k, pos.ids)
        rows = {"k": k if self.pre_rope else k_rot, "v": v}                  # keys as stored
        self.length, seen, after = self.store.append_read(self.length, rows, held)
        c = Chunk(q, self._rope_keys(seen["k"], pos), seen["v"])
        if held:
            c.held_keys, c.held_values = self._rope_keys(after["k"], pos), after["v"]
        return c

    # ---- decode through the outer-layout kernels ------------------------------------------------------
    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token per row. On a GPU (unpadded rows, keys stored after RoPE, 2/4 bits, groups of 32) the
        quantized history is read where it lies by the outer-layout kernels of kvzoo/kernels/quant_matvec.py;
        elsewhere scores and outputs are read from the codes a stream at a time (WindowedStore.attend), KIVI*'s keys
        dequantized and rotated first (RoPE differs per slot)."""
        if not self.length:
            return self.prefill(x, q, k, v, pos)
        if not self._kernels_serve(q, pos):
            q, k_rot = self.attn.rope(q, k, pos.ids)
            keys = None
            if self.pre_rope:
                keys = self._rope_keys(self.store.read(self.length, q.dtype, names=("k",))["k"], pos)
            out = self.store.attend(q, self.length, {"k": k_rot, "v": v}, pos.mask, keys)
            self.length = self.store.append(self.length, {"k": k if self.pre_rope else k_rot, "v": v})
            return out
        q, k_rot = self.attn.rope(q, k, pos.ids)
        # the kernels read the whole groups quantized in both streams; the rest (a stream's later quantized
        # slots, dequantized, the sink and recent windows) joins the token as exact rows
        G = self.opts.group_size
        n = min(self.store.counts(self.length, name)[1] for name in "kv") // G * G
        rows = self.store.read(self.length, q.dtype, start=n)
        out = self._attend_kernels(q, n, torch.cat([rows["k"], k_rot], dim=2), torch.cat([rows["v"], v], dim=2))
        self.length = self.store.append(self.length, {"k": k_rot, "v": v})
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

    def _attend_kernels(self, q: Tensor, n: int, k_win: Tensor, v_win: Tensor, mask: Tensor | None = None,
                        route=None) -> Tensor:
        """q (B, Hq, 1, d) after RoPE over quantized key slots [0, n) (qk_outer, one launch, GQA rows reading
        their KV head's codes) and the exact rows k_win (B, H, W, d), in one fp32 softmax; mask (B, 1, 1, n + W)
        True = may attend, or None: all. The weights p (B, H, rep, n + W) then weigh the quantized values and
        the exact rows v_win (B, H, Wv, d) (pv_outer over value slots [0, n_v), n_v = p's length - Wv); route:
        p over the keys' rows -> p over the values' rows, where the two streams hold their slots differently
        (the static step with the reference windows), else the same rows. Returns (B, Hq, 1, d) in q's dtype."""
        from kvzoo.kernels.quant_matvec import pv_outer, qk_outer

        (B, Hq, _, d), dtype = q.shape, q.dtype
        H, G, bits = k_win.shape[1], self.opts.group_size, self.opts.bits
        kc, vc = self.store.codecs["k"], self.store.codecs["v"]
        rep, half = Hq // H, dtype in (torch.float16, torch.bfloat16)   # half: fp16 tile products, as flash attention
        q = q[:, :, 0].float() * d ** -0.5                          # (B, Hq, d): query head h*rep + j
        quant = qk_outer(q, kc.codes[:, :, :n], kc.scale[:, :, :n // G], kc.zero[:, :, :n // G], bits, half=half)
        window = q.view(B, H, rep, d) @ k_win.float().transpose(-1, -2)                # (B, H, rep, W)
        scores = torch.cat([quant.view(B, H, rep, n), window], dim=-1)                # (B, H, rep, n + W)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        if route is not None:
            p = route(p)                                                               # (B, H, rep, n_v + Wv)
        n_v = p.shape[-1] - v_win.shape[2]
        out = (p[..., n_v:] @ v_win.float()).view(B, Hq, d)
        out += pv_outer(p[..., :n_v].reshape(B, Hq, n_v), vc.codes[:, :, :n_v], vc.scale[:, :, :n_v],
                        vc.zero[:, :, :n_v], bits, half=half)
        return out[:, :, None].to(dtype)

    # ---- the static step (WholeStep: CUDA graphs, kvzoo/graphs.py) -------------------------------------
    def can_decode_static(self, padded: bool) -> bool:
        """Streaming caches in a layout the kernels take, on a device they run on (CUDA, or any under the
        Triton interpreter), once a prompt is stored. The step's mask serves padding and sliding windows; KIVI*'s
        keys, rotated inside the fused kernel only, need a causal mask (unpadded rows, no binding sliding
        window)."""
        from kvzoo.kernels.quant_matvec import GROUP, KERNEL_BITS, kernels_run_on

        if self.simulated or not self.length or not kernels_run_on(self.store.codecs["k"].codes.device):
            return False
        if self.pre_rope:
            window = getattr(self.attn, "sliding_window", None)
            return (self.opts.bits in KERNEL_BITS and self.opts.group_size == GROUP and self.v_group == GROUP
                    and not padded and (window is None or window >= self.max_len))
        return self._kernel_layout()

    def static_phase(self) -> str:
        return self.store.phases(self.length)

    def static_scratch(self) -> tuple[Tensor, ...]:
        return self.store.scratch()

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode with fixed shapes: the token's k, v into each stream's window row; attention in one fused kernel
        over the stored slots where the step's mask is causal, else over every quantized slot (the kernels) and
        every window row in each stream's static layout (WindowedStore.static_rows: [quantized | sink | recent],
        the rows not live and the slots the mask forbids masked), the key weights routed to the value rows by slot;
        then each stream whose window the token filled quantizes its oldest group at a device-held slot, beside the
        step (StaticStep.beside: a second stream on a GPU, joined at the step's end)."""
        q, k_rot = self.attn.rope(q, k, step.ids)
        st = self.store
        token = {"k": k if self.pre_rope else k_rot, "v": v}
        if step.masked:
            assert not self.pre_rope, "KIVI*'s static step needs a causal mask (can_decode_static)"
            st.write_token_at(self.length, step, token)
            slots, live = st.static_rows(step, "k")
            mask = step.mask.index_select(-1, slots.clamp_max(self.max_len - 1)) & live          # (B, 1, 1, K)
            out = self._attend_kernels(q, st.codecs["k"].capacity, torch.cat([st.sink("k"), st.recent("k")], dim=2),
                                       torch.cat([st.sink("v"), st.recent("v")], dim=2), mask,
                                       lambda p: st.route(p, step, "k", "v"))
            with step.beside():             # nothing later in the step reads this layer's windows or codes
                st.flush_at(self.length, step)
            return out
        out = self._attend_fused(q, k_rot, v, step)                    # the token attended apart from the windows
        with step.beside(*token.values()):  # so it is stored beside the step, which reads nothing stored here
            st.write_token_at(self.length, step, token)
            st.flush_at(self.length, step)
        return out

    def _attend_fused(self, q: Tensor, k_rot: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """q (B, Hq, 1, d) after RoPE over every stored slot, in one fused kernel (kvzoo/kernels/outer_attention.py):
        each slot's key and value from its codes or its stream's window; then over the token, k_rot (after RoPE)
        and v (B, H, 1, d), not yet stored. KIVI*: the kernel rotates every stored key to its position."""
        from kvzoo.kernels.outer_attention import outer_decode_attention

        st, kc, vc = self.store, self.store.codecs["k"], self.store.codecs["v"]
        rope = self.attn.rope.position_tables(self.max_len, q.dtype) if self.pre_rope else None
        out = outer_decode_attention(q[:, :, 0], kc.codes, kc.scale, kc.zero, vc.codes, vc.scale, vc.zero,
                                     self.opts.bits, st.recent("k"), st.recent("v"), self._static_lengths(step),
                                     k_sink=st.sink("k"), v_sink=st.sink("v"), rope=rope, k_token=k_rot, v_token=v)
        return out[:, :, None]                                                  # (B, Hq, 1, d)

    def _static_lengths(self, step: StaticStep) -> Tensor:
        """From the device-held length L: int32 (6,) [keys quantized, values quantized, slots stored after the
        sink, slots stored in the sink, the key and the value window's rows of their oldest slots (rings,
        Window.first_row)], the token's not counted, as the fused kernel takes them; shared by every layer."""
        st = self.store
        key = ("outer", st.windows["k"], st.windows["v"])
        if key not in step.derived:
            S, L = self.opts.sink, step.slot
            (n_k, _), (n_v, _) = st.window_row(step, "k"), st.window_row(step, "v")
            in_sink = L < S
            step.derived[key] = torch.cat([n_k, n_v, torch.where(in_sink, 0, L - S), torch.where(in_sink, L, S),
                                           st.windows["k"].first_row(n_k), st.windows["v"].first_row(n_v)]
                                          ).to(torch.int32)
        return step.derived[key]


@register("kivi-pre")
class KIVIPreRoPECache(KIVICache):
    """KIVI*: keys quantized before RoPE, rotated after dequantization."""

    pre_rope = True
