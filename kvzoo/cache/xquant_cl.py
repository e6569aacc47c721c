"""XQuant-CL: XQuant over cross-layer deltas of X, accumulated from a higher-precision base layer.

Paper: Tomar, Hooper et al., "XQuant" (../shared/papers/xquant.md): §3.2 (MHA), §3.3.2 (GQA), Figure 4
(decode), Figure A.1 (prefill), §4.3 (settings). Plain XQuant, whose storage this reuses, is xquant.py.

The residual stream changes little from one layer to the next, so the layer inputs X_i (after RMSNorm)
of successive layers are close. From the base layer b on, layer i > b caches only its delta against the
running approximation, quantized:

    X̂_b = Q(X_b)                          the base, kept in higher precision
    ΔX̂_i = Q(X_i - X̂_{i-1})               (MHA; GQA: Q((X_i - X̂_{i-1}) U_kv), see below)
    X̂_i = X̂_{i-1} + ΔX̂_i                  the accumulator, handed from layer i to layer i + 1
    K_i = X̂_i W_k,  V_i = X̂_i W_v          (then RoPE at the cached positions)

so a layer reads the accumulator and its own delta, never all the deltas before it. The accumulator is
rebuilt in every forward pass: the base layer dequantizes X̂_b for every stored token, and each layer
adds its delta and hands X̂_i (B, L, hidden), fp32, to the next (`prev` is the previous layer's cache),
which takes it and drops the reference. Its storage between passes is therefore the base's codes, at
the base's precision high_bits (the paper's accumulator precision e_b = 4 bits, §3.4); the running sum
is working memory of one pass, like the dequantized history of any strategy's torch path, and is not
in nbytes(). New tokens are stored before attention (Figure A.1 for a prompt, Figure 4 for one token):
layer i's delta of a new token is taken against X̂_{i-1} of that token, which the previous layers wrote
in this same pass.

GQA (§3.3.2): a delta is as wide as X, wider than K+V. The thin SVD [W_k | W_v] = U_kv Σ_kv B_kvᵀ
(hidden x 2*n_kv*hd, fp32, at cache construction) gives a shared basis U_kv (hidden, r_kv),
r_kv = min(hidden, 2*n_kv*hd); the delta is cached as the latent (X_i - X̂_{i-1}) U_kv and added back
as ΔX̂ U_kvᵀ. Without quantization this is lossless for layer i's K and V, because U_kv U_kvᵀ W_kv = W_kv:
(X̂_{i-1} + (X_i - X̂_{i-1}) U_kv U_kvᵀ) W_kv = X_i W_kv.

Layers (§4.3: "the first 3 layers are quantized in 4-bit ... we use the third layer as the
higher-precision base layer which becomes the accumulator"; base_layer counts from 0):
    i < base_layer   plain XQuant (xquant.py, with its window) at high_bits if i < high_layers, else bits
    i = base_layer   X_i per token at high_bits (hidden wide, also for GQA: the accumulator lives in X's space)
    i > base_layer   the delta per token at high_bits if i < high_layers, else bits
Deltas and the base are quantized per token (groups of Gt = the largest divisor of the row width <= G
channels), so a token is quantized as soon as it is stored and no full-precision window is needed; the
paper's residual window exists for per-channel groups (§4), which only the layers before the base have.

Stored per layer i >= base_layer (B rows, N = max_len slots, w = hidden (base, MHA deltas) or r_kv):
    codes int32 (B, N, w*b/32), scale/zero fp16 (B, N, w/Gt)     (bits = 16: rows (B, N, w) at the model's dtype)
    GQA deltas: U_kv (hidden, r_kv) and U_kvᵀ at the model's dtype (up_dtype=float32: fp32), weight factors
    not counted in nbytes(); the accumulator itself is fp32 either way
Bytes per token and layer: w*b/8 + 4*w/Gt; layers before the base: xquant.py's formula.
SmolLM2-135M (hidden 576, r_kv = 384, 30 layers; fp16 K+V: 30 * 768 = 23,040 B/token), defaults, L = 2048:
    layers 0-1 XQuant 4-bit 2 * 206 + base 576*4/8 + 4*576/96 = 312 + 27 deltas * (384*3/8 + 4*384/128 = 156)
    = 4,936 B/token, ratio 0.214 (paper: 0.21 at 3 bits); bits = 2: 3,640 B, 0.158 (paper: 0.15).

Paper settings (the defaults): bits = 3 (the abstract's "10x with 0.01 perplexity degradation"; Table 4
also reports 4 and 2), high_bits = 4 for the first high_layers = 3 layers, base_layer = 2 (the third
layer), G = 128 (§4), residual R = 0 for the layers before the base, asymmetric uniform quantization. The
factors are held as the model holds its weights (`up_dtype=model`, as in xquant.py): U_kvᵀ up-projects every
stored delta at every step, which on a GPU runs on the tensor cores at the model's dtype.
bits = high_bits = 16 turn quantization off (rows at the model's precision): the fp16 attention up to
fp32 rounding.

Static step (`decode_static`, for kvzoo/graphs.py's whole-step CUDA graph): the accumulator has a fixed
shape when it covers every slot. The base and delta layers write the token's per-token row at the
device-held slot (index writes; no window, so one phase), rebuild X̂ over all max_len slots (B, max_len,
hidden) and rematerialize K from all of it. V is never rematerialized: a head's output over the rows is
(Σ_t p_t X̂_t) W_v, so the softmax weighs X̂'s rows and the head's slice of W_v projects the (hidden,) result
(xquant.weighed_attention). The token's own slot is masked and its exact k, v come last; the slots not yet
written (zeros or stale rows, finite either way) are masked by the step's mask. The layers before the base
are plain XQuant and take its static step, with its window's phases.

Tensor parallelism (kvzoo/models/tp.py): the base layer's X and the accumulator are the whole hidden width on
every rank (replicated); a GQA delta's basis U_kv is the SVD of the rank's own [W_k | W_v] rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import CacheSpec, Chunk, LayerCache, Positions, StaticStep, register
from kvzoo.cache.kvquant import QTensor
from kvzoo.cache.store import GroupCodec, Window, WindowedStore, check_policy, token_group
from kvzoo.cache.xquant import (XQuantCache, XQuantOptions, check_latent_bits, check_up_dtype, check_window,
                                decode_attention, dequantize_latent, heads, rematerialize, rope_stored_keys,
                                static_key_rows, svd_factors, weigh_rows, weighed_attention)
from kvzoo.graphs import WholeStep


@dataclass(frozen=True)
class XQuantCLOptions:
    bits: int = 3
    high_bits: int = 4
    high_layers: int = 3
    base_layer: int = 2
    group_size: int = 128
    residual: int = 0       # the window of the plain-XQuant layers before the base
    policy: str = "reference"   # window policy of the plain-XQuant layers (base and deltas: every token quantized)
    up_dtype: str = "model"     # GQA: U_kv (and the plain layers' Σ Bᵀ) at the model's dtype | float32

    def __post_init__(self):
        check_policy(self.policy)
        check_up_dtype(self.up_dtype)
        check_latent_bits(self.bits)
        check_latent_bits(self.high_bits, "high_bits")
        check_window(self.group_size, self.residual)
        if self.high_layers < 0:
            raise ValueError(f"high_layers must be >= 0, got {self.high_layers}")
        if self.base_layer < 0:
            raise ValueError(f"base_layer must be >= 0 (a layer index, counted from 0), got {self.base_layer}")


def accumulate(acc: Tensor | None, delta: QTensor | Tensor, up: Tensor | None) -> Tensor:
    """X̂_i = X̂_{i-1} + ΔX̂_i U_kvᵀ: dequantize a layer's cached rows (B, N, w), up-project them (GQA:
    up = U_kvᵀ (r_kv, hidden); MHA: None) and add them to the accumulator (None at the base layer).
    (B, N, hidden) fp32. On a GPU with 16-bit factors the rows are dequantized once and one cuBLAS call multiplies
    them and adds the product to the accumulator in place, in fp32 (addmm with out_dtype); elsewhere the
    up-projection goes through xquant.rematerialize, rounded to the factors' dtype, and is added."""
    if up is not None and acc is not None and acc.is_cuda and acc.is_contiguous() and up.dtype != torch.float32 \
            and isinstance(delta, QTensor):
        from kvzoo.kernels.xquant_remat import REMAT_BITS, dequant_rows

        if delta.bits in REMAT_BITS:
            x = dequant_rows(delta, up.dtype)                                               # (B, N, r_kv)
            rows = acc.view(-1, acc.shape[-1])                   # X̂_{i-1}, handed on by the previous layer: no one
            torch.addmm(rows, x.view(-1, x.shape[-1]), up, out_dtype=torch.float32, out=rows)   # reads it after
            return acc
    x = dequantize_latent(delta, None, torch.float32) if up is None else rematerialize(delta, None, up)
    return x if acc is None else acc + x


@register("xquant-cl")
class XQuantCLCache(WholeStep, LayerCache):
    Options = XQuantCLOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        o, i = self.opts, layer.layer_idx
        self.chain = prev.chain if prev is not None else []     # every layer's cache, shared (a plain list)
        self.chain.append(self)
        self.bits = o.high_bits if i < o.high_layers or i == o.base_layer else o.bits
        self.role = "xquant" if i < o.base_layer else "base" if i == o.base_layer else "delta"
        self._acc: Tensor | None = None                          # X̂_i of this pass, for the next layer
        if self.role == "xquant":
            plain = XQuantOptions(bits=self.bits, group_size=o.group_size, residual=o.residual, policy=o.policy,
                                  up_dtype=o.up_dtype)
            self.plain = XQuantCache(CacheSpec("xquant", plain), layer, None, batch_size, max_len)
            self.window, self.value_window = self.plain.window, self.plain.value_window
            return
        weight = layer.k_proj.weight
        width = weight.shape[1]                                   # hidden
        self.gqa = self.role == "delta" and layer.n_kv_heads < layer.n_heads
        if self.gqa:
            kv = torch.cat([layer.k_proj.weight, layer.v_proj.weight], dim=0)      # [W_k | W_v]ᵀ (2 n_kv hd, hidden)
            down = svd_factors(kv)[0].to(weight.dtype if o.up_dtype == "model" else torch.float32)
            self.register_buffer("down", down, persistent=False)                   # U_kv (hidden, r_kv)
            self.register_buffer("up", down.T.contiguous(), persistent=False)      # U_kvᵀ (r_kv, hidden)
            width = self.down.shape[1]
        # every token quantized per token as it is stored: no window
        self.window = Window(0, 0, 1)
        codec = GroupCodec((batch_size,), max_len, width, self.bits, token_group(width, o.group_size), False,
                           weight.dtype, weight.device)
        self.store = WindowedStore(self.window, {"x": codec}, (batch_size,), weight.dtype, weight.device)

    def _check_base(self) -> None:
        n = len(self.chain)
        if self.opts.base_layer >= n:
            raise ValueError(f"xquant-cl base_layer={self.opts.base_layer} is not a layer of this {n}-layer model; "
                             f"accepted: 0 to {n - 1}")

    # ---- the accumulator ---------------------------------------------------------------------------
    def _advance(self, x: Tensor, slot: Tensor | None = None) -> Tensor:
        """Store the chunk x (B, T, hidden) and return X̂ of this layer for every stored token
        (B, L, hidden), fp32, handing it on to the next layer. The static step (slot: the device-held slot
        (1,) of one token, T = 1) writes the token at `slot` and returns X̂ of every slot (B, max_len,
        hidden), those past the token holding whatever their buffers hold (the step's mask hides them)."""
        a = self.length
        b = a + x.shape[1] if slot is None else self.max_len            # rows of X̂ returned

        codec = self.store.codecs["x"]

        def write(rows: Tensor) -> None:
            if slot is None:
                self.store.append(a, {"x": rows})
            else:
                codec.write_at(slot, rows)

        if self.role == "base":
            write(x)
            acc = accumulate(None, codec.held(b), None)
        else:
            prev = self.prev[0]
            acc_prev, prev._acc = prev._acc, None
            assert acc_prev is not None and acc_prev.shape[1] == b, "the previous layer did not hand on X̂"
            mine = acc_prev[:, a:] if slot is None else acc_prev.index_select(1, slot)   # X̂_{i-1} (B, T, hidden)
            delta = x.float() - mine                                        # X_i - X̂_{i-1} (B, T, hidden)
            if self.gqa:
                delta = delta.to(self.down.dtype) @ self.down               # its latent (B, T, r_kv)
            write(delta)
            acc = accumulate(acc_prev, codec.held(b), self.up if self.gqa else None)
        if slot is None:
            self.length = b
        self._acc = acc if self.attn.layer_idx + 1 < len(self.chain) else None
        return acc

    def _kv(self, acc: Tensor) -> tuple[Tensor, Tensor]:
        """K = X̂ W_k and V = X̂ W_v (before RoPE) for rows of X̂ (B, N, hidden): (B, n_kv, N, hd) each."""
        dtype, H = self.attn.k_proj.weight.dtype, self.attn.n_kv_heads
        x = acc.to(dtype)
        return heads(self.attn.k_proj(x), H, dtype), heads(self.attn.v_proj(x), H, dtype)

    # ---- attention ---------------------------------------------------------------------------------
    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        """The history rematerialized from X̂ plus the new chunk exact. The chunk is stored first (its deltas
        are taken against X̂_{i-1} of its own tokens), which leaves the history's slots as they were."""
        self._check_base()
        if self.role == "xquant":
            c = self.plain.append(x, q, k, v, pos, held)
            self.length = self.plain.length
            return c
        start = self.length
        acc = self._advance(x)                                                 # (B, L, hidden)
        if held:
            held_k, held_v = self._kv(acc)                                     # (B, H, L, hd)
            hist_k, hist_v = held_k[:, :, :start], held_v[:, :, :start]
        else:
            hist_k, hist_v = self._kv(acc[:, :start])
        c = Chunk(self.attn.rope.apply(q, pos.ids), rope_stored_keys(self.attn, torch.cat([hist_k, k], dim=2), pos),
                  torch.cat([hist_v, v], dim=2))
        if held:
            c.held_keys, c.held_values = rope_stored_keys(self.attn, held_k, pos), held_v
        return c

    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token: the accumulator advanced over the stored slots and the token, keys rematerialized from it,
        values weighed from it (xquant.decode_attention: Σ_t p_t X̂_t times W_v, no V rematerialized)."""
        self._check_base()
        if self.role == "xquant":
            out = self.plain.decode(x, q, k, v, pos)
            self.length = self.plain.length
            return out
        if not self.length:
            return self.prefill(x, q, k, v, pos)
        start, dtype = self.length, self.attn.k_proj.weight.dtype
        hist = self._advance(x)[:, :start]                                       # X̂ of the stored slots (B, L, hidden)
        hist_k = heads(self.attn.k_proj(hist.to(dtype)), self.attn.n_kv_heads, dtype)
        return decode_attention(self.attn, q, hist_k, k, v, pos, lambda p: p @ hist.float(),
                                self.attn.v_proj.weight.t())

    # ---- the static step (CUDA graphs, kvzoo/graphs.py) ----------------------------------------------
    def static_phase(self) -> str:
        return self.plain.static_phase() if self.role == "xquant" else "step"

    def static_scratch(self) -> tuple[Tensor, ...]:
        """The plain layers' windows; the base and delta layers only write the token's own slot."""
        return self.plain.static_scratch() if self.role == "xquant" else ()

    def advance(self) -> None:
        if self.role == "xquant":
            self.plain.advance()
        super().advance()

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode with fixed shapes: the token's base row or delta written at step.slot and the accumulator rebuilt
        over every slot (B, max_len, hidden), then xquant.static_key_rows' layout: those rows, dead rows up to a
        multiple of 8 and the token's. K is rematerialized from the rows (the token's exact k last) and rotated;
        V is not: the softmax weighs the rows and each head's slice of W_v projects the result
        (xquant.weighed_attention), the token's exact v added with its own weight. The token's stored slot and the
        slots not yet written are masked."""
        self._check_base()
        if self.role == "xquant":
            return self.plain.decode_static(x, q, k, v, step)
        acc = self._advance(x, step.slot)                                      # (B, max_len, hidden) fp32
        key = ("xquant-cl keys", self.max_len, q.dtype)                       # shared by every layer
        if key not in step.derived:
            slots = torch.arange(self.max_len, device=q.device)
            ids, bias = static_key_rows(step, slots, slots < step.slot, self.max_len, q.dtype)
            step.derived[key] = (bias, self.attn.rope.cos_sin(ids, k.dtype), self.attn.rope.cos_sin(step.ids, q.dtype))
        bias, k_tables, q_tables = step.derived[key]
        B, N, hidden = acc.shape
        dtype = self.attn.k_proj.weight.dtype
        rows = torch.empty(B, bias.shape[-1], hidden, dtype=dtype, device=acc.device)      # (B, K + 1, hidden)
        rows[:, :N] = acc
        rows[:, N:] = 0                                                                     # dead rows, the token's
        keys = heads(self.attn.k_proj(rows), self.attn.n_kv_heads, k.dtype)                # (B, H, K + 1, hd)
        keys[:, :, -1:] = k
        return weighed_attention(q, q_tables, keys, k_tables, bias, weigh_rows(rows), self.attn.v_proj.weight.t(), v)

    # ---- bytes -------------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return self.plain.nbytes() if self.role == "xquant" else self.store.nbytes(self.length)

    def formula_nbytes(self, length: int) -> int:
        if self.role == "xquant":
            return self.plain.formula_nbytes(length)
        return self.store.formula_nbytes(length)

    def reset(self) -> None:
        super().reset()
        self._acc = None
        if self.role == "xquant":
            self.plain.reset()
