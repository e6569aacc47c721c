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

Windows are the shared store's (store.py). `policy=reference`, the paper's perplexity protocol (every token
quantized, §4 "teacher forcing with the output logits of all input tokens"): a per-token stream (X, X U_v)
is quantized as each token comes (Window(0, R, 1)); a per-channel stream (X U_k) needs G tokens per group,
so its newest < G tokens wait at the model's precision (Window(0, R, G), the causal form of quantizing all).
`policy=grouped` gives every stream Window(0, R, G), the paper's generation setting ("we leave the final
residual tokens unquantized (up to group size tokens)"). A group is quantized once, when it leaves the
window, never requantized. Per-token groups span Gt = the largest divisor of the row width that is <= G
channels (G = 128: Gt = 96 for SmolLM2's 192-wide latents, 128 for Llama's 4096).

Stored per layer (B rows, Nmax = quantized slots for max_len, W = R + G window slots, b = bits):
    MHA  x:  codes int32 (B, Nmax, hidden*b/32), scale/zero fp16 (B, Nmax, hidden/Gt), window (B, W, hidden)
    GQA  k:  codes int32 (B, Nmax, c*b/32),      scale/zero fp16 (B, Nmax/G, c),      window (B, W, r)
             [first (B, Nmax, 1) at the model's dtype with outlier_channel; then c = r - 1, else c = r]
         v:  codes int32 (B, Nmax, r*b/32),      scale/zero fp16 (B, Nmax, r/Gt),     window (B, W, r)
    plus the SVD factors (GQA: U_k|U_v (hidden, 2r), Σ_k B_kᵀ and Σ_v B_vᵀ (r, n_kv*hd), at the model's dtype;
    `up_dtype=float32` keeps them fp32), which are weights, not per-token storage, and are not counted in
    nbytes(). The up-projections rematerialize K and V from every cached row at every step, as W_k and W_v do for
    an MHA model's X: at the model's dtype that product runs on the GPU's tensor cores (docs/xquant.md); fp32
    models hold them in fp32 either way.
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
the first 3 layers at 4 bits for every method: `high_layers=3` (`high_bits=4`). The paper decomposes W_k and
W_v offline and does not say at what precision it keeps the factors; here both factors are held as the model
holds its weights (`up_dtype=model`), as XQuant-CL holds its basis.
bits = 16 turns quantization off: every row is kept at the model's precision (16-bit in an fp16/bf16
run, fp32 in an fp32 one), which rematerializes the fp16 cache's attention up to the rounding of the
factors (fp32 in an fp32 model or with up_dtype=float32).

Static step (`decode_static`, for kvzoo/graphs.py's whole-step CUDA graph): the same decode with fixed
shapes and the length L in a device tensor. The token's rows go into each stream's window row L - Nq by an
index write; attention runs over every allocated slot (all Nmax quantized slots and all R + G window rows,
the keys rematerialized from their rows (latent_rows: on a GPU each stream's rows dequantized in one pass,
then cuBLAS; on a GPU q and each key rotated by the scores kernel as it reads them) plus the token's exact k, v, a key
masked where it is not live yet (slot >= Nq, window row >= L - Nq) or the step's mask forbids its slot (padding,
sliding window).
Values are not rematerialized: the softmax weighs the value latents (gathered into the key rows' order by slot
where X U_k and X U_v have different windows, the paper's) and the (Hq, c) result is projected by each head's
slice of up_v (weighed_attention), which saves V's (K × c) · (c × n_kv·hd) product and its round trip.
The host's counters only pick the phase: "flush" when the token fills a stream's window, whose oldest group is
then quantized into slots [Nq, Nq + G) at the device-held Nq and the rest moved down (a window of one-token groups is
a ring, where nothing moves: kvzoo/cache/store.py); "recent" otherwise.

Tensor parallelism (kvzoo/models/tp.py): an MHA model's X is the whole layer input on every rank, so each rank
holds the same X codes (N times the bytes) and rematerializes its own heads; the GQA latents are the SVD of the
rank's own W_k, W_v rows, as wide in total as one process's latents, in a different basis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import Chunk, LayerCache, Positions, StaticStep, register
from kvzoo.cache.kvquant import SUPPORTED_BITS, QTensor, dequantize
from kvzoo.cache.store import EXACT, GroupCodec, Window, WindowedStore, check_policy, policy_windows, token_group
from kvzoo.graphs import WholeStep

UP_DTYPES = ("model", "float32")


def check_up_dtype(up_dtype: str) -> None:
    if up_dtype not in UP_DTYPES:
        raise ValueError(f"unknown up_dtype {up_dtype!r}; accepted: {', '.join(UP_DTYPES)}")


def check_latent_bits(bits: int, option: str = "bits") -> None:
    if bits != EXACT and bits not in SUPPORTED_BITS:
        raise ValueError(f"unsupported {option}={bits}; accepted: {', '.join(map(str, SUPPORTED_BITS))}, "
                         f"or {EXACT} (no quantization: kept at the model's precision)")


def check_window(group_size: int, residual: int) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if residual < 0 or residual % group_size:
        raise ValueError(f"residual must be a non-negative multiple of group_size {group_size}, got {residual}")


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
    up-projection `up` (c, n_kv*hd) -> (B, N, n_kv*hd) in up's dtype. This is all XQuant adds to a KV cache's
    decode step. Packed codes on a GPU (or with
    fused=True: the Triton interpreter in tests) go through kvzoo.kernels.xquant_remat.dequant_matmul (16-bit
    factors: the rows dequantized once, then cuBLAS; fp32 factors: one fused kernel); exact rows take the torch
    path."""
    if fused is None:
        fused = isinstance(latent, QTensor) and latent.codes.is_cuda
    if fused and isinstance(latent, QTensor):
        from kvzoo.kernels.xquant_remat import REMAT_BITS, dequant_matmul

        if latent.bits in REMAT_BITS:
            if first is None:
                return dequant_matmul(latent, up)
            return dequant_matmul(latent, up[1:]).add_(first.to(up.dtype) @ up[:1])        # channel 0 kept exact
    return dequantize_latent(latent, first, up.dtype) @ up


def latent_rows(latent: QTensor | Tensor, first: Tensor | None, window: Tensor, src: Tensor, dtype: torch.dtype,
                fused: bool | None = None) -> Tensor:
    """A static step's cached rows in a chosen order, dequantized: the stream's stored rows (B, N, c) then its window
    rows (B, W, c), row i of the result from row src[i] (S,) of that list, zeros where src[i] >= N + W (the token's
    row); (B, S, c) in `dtype`. Packed codes on a GPU (or with fused=True, the interpreter in tests) are gathered
    and dequantized in one pass (kvzoo.kernels.xquant_remat.dequant_gather); otherwise torch dequantizes,
    concatenates and gathers."""
    if fused is None:
        fused = isinstance(latent, QTensor) and latent.codes.is_cuda
    B, c = window.shape[0], window.shape[-1]
    if fused and isinstance(latent, QTensor):
        from kvzoo.kernels.xquant_remat import REMAT_BITS, dequant_gather

        if latent.bits in REMAT_BITS:
            rest = window if first is None else window[..., 1:]
            x = dequant_gather(latent, rest, src, dtype)                                   # (B, S, c or c - 1)
            if first is not None:                                                          # channel 0 kept exact
                head = torch.cat([first.to(dtype), window[..., :1].to(dtype), x.new_zeros(B, 1, 1)], dim=1)
                x = torch.cat([head.index_select(1, src.clamp_max(head.shape[1] - 1)), x], dim=-1)
            return x
    rows = torch.cat([dequantize_latent(latent, first, dtype), window.to(dtype),
                      window.new_zeros(B, 1, c, dtype=dtype)], dim=1)                    # (B, N + W + 1, c)
    return rows.index_select(1, src.clamp_max(rows.shape[1] - 1))


def weigh_rows(rows: Tensor) -> Callable[[Tensor], Tensor]:
    """weighed_attention's `weigh` over rows (B, K + 1, c) held in memory: p (B, Hq, K + 1) -> Σ_t p_t row_t
    (B, Hq, c), p rounded to the rows' dtype."""
    return lambda p: torch.bmm(p.to(rows.dtype), rows)


def weigh_latent(latent: QTensor | Tensor, first: Tensor | None, window: Tensor, src: Tensor, dtype: torch.dtype,
                 fused: bool | None = None) -> Callable[[Tensor], Tensor]:
    """weighed_attention's `weigh` over latent_rows(latent, first, window, src, dtype) without writing them: packed
    codes on a GPU (or with fused=True, the interpreter in tests) at the window's 16-bit dtype are read by
    kvzoo.kernels.xquant_remat.weigh_gather as it weighs them; otherwise the rows are gathered (latent_rows) and
    multiplied."""
    if fused is None:
        fused = isinstance(latent, QTensor) and latent.codes.is_cuda
    if fused and isinstance(latent, QTensor) and first is None and dtype == window.dtype \
            and dtype in (torch.float16, torch.bfloat16):
        from kvzoo.kernels.xquant_remat import REMAT_BITS, weigh_gather

        if latent.bits in REMAT_BITS:
            return lambda p: weigh_gather(latent, window, src, p)
    return weigh_rows(latent_rows(latent, first, window, src, dtype, fused))


def weighed_attention(q: Tensor, q_tables: tuple[Tensor, Tensor], keys: Tensor, key_tables: tuple[Tensor, Tensor],
                      bias: Tensor, weigh: Callable[[Tensor], Tensor], up_v: Tensor, v: Tensor,
                      fused: bool | None = None) -> Tensor:
    """A static step's attention with values weighed from their latent rows instead of rematerialized:
    a query head's output Σ_t p_t (row_t · up_v) = (Σ_t p_t row_t) · up_v, two small products in place of V's
    (K × c) · (c × n_kv·hd) rematerialization and its round trip through memory.

    q (B, Hq, 1, hd) before RoPE and q_tables its (cos, sin) (B, 1, 1, hd); keys (B, n_kv, K + 1, hd) before RoPE,
    a view of a (B, K + 1, n_kv·hd) buffer (as `heads` makes it), the token's own key last; key_tables the keys'
    RoPE (cos, sin) (B, 1, K + 1, hd) from RotaryEmbedding.cos_sin; bias (B, 1, 1, K + 1) additive (0 or -inf);
    weigh(p) the softmax p (B, Hq, K + 1) times the value latents in the key rows' order, the last (the token's)
    zero (weigh_rows, weigh_latent): (B, Hq, c); up_v (c, n_kv·hd); v (B, n_kv, 1, hd) the token's exact value.
    Scores and softmax in fp32: `fused` (default on a GPU; the interpreter in tests) takes kvzoo.kernels.scores,
    which reads the keys' buffer as it is and rotates q and each key as it loads them, then softmax_rows (the bias
    added) and add_weighted for the token's value; otherwise torch rotates q and the keys first. The weighed rows
    in rows' dtype. Returns (B, Hq, 1, hd) in v's dtype."""
    (B, Hq, _, d), H = q.shape, keys.shape[1]
    rep, K = Hq // H, keys.shape[2]
    if fused is None:
        fused = q.is_cuda
    if fused:
        from kvzoo.kernels.scores import add_weighted, gqa_scores, softmax_rows

        p = softmax_rows(gqa_scores(q.reshape(B, Hq, d), keys.transpose(1, 2).reshape(B, K, H * d), d ** -0.5,
                                    key_tables, q_tables=q_tables), bias.view(B, K))  # (B, Hq, K + 1)
    else:
        from kvzoo.models.llama import RotaryEmbedding

        q = RotaryEmbedding.apply_tables(q, *q_tables)
        keys = RotaryEmbedding.apply_tables(keys, *key_tables)
        scores = (q.float().view(B, H, rep, d) @ keys.float().transpose(-1, -2)).view(B, Hq, K) * d ** -0.5
        p = (scores + bias.view(B, 1, K)).softmax(dim=-1)
    mixed = weigh(p)                                                                 # (B, Hq, c): Σ_t p_t row_t
    by_head = mixed.view(B, H, rep, -1).transpose(0, 1).reshape(H, B * rep, -1)     # (H, B·rep, c)
    up = up_v.unflatten(1, (H, d)).transpose(0, 1)                                   # (H, c, hd), a view
    out = torch.bmm(by_head.to(up.dtype), up).view(H, B, rep, d).transpose(0, 1)    # (B, H, rep, hd)
    if fused:                                                                        # the token's exact value, added
        return add_weighted(out, p[..., -1], v[:, :, 0]).view(B, Hq, 1, d)
    own = p[..., -1].view(B, H, rep, 1) * v.float()
    return (out.float() + own).reshape(B, Hq, 1, d).to(v.dtype)


def static_key_rows(step: StaticStep, slots: Tensor, live: Tensor, max_len: int, dtype: torch.dtype
                    ) -> tuple[Tensor, Tensor]:
    """A static step's key rows: the cached rows (the slot each holds, slots (K0,), and whether it holds one yet,
    live (K0,)), dead rows up to a multiple of 8 (aligned rows for cuBLAS's fast kernels: 76 µs against 30 for the
    values' product at 32K on an H100), then the new token exact. From the device-held length L = step.slot:
    (RoPE positions of the keys (B, K + 1), the additive mask (B, 1, 1, K + 1) in `dtype`: 0 where a key may be
    attended, that is where its row is live, is not the token's own row (the token's exact k comes last) and the
    step's mask allows its slot, -inf elsewhere), K + 1 = _aligned(K0 + 1)."""
    L = step.slot
    pad = _aligned(slots.numel() + 1) - slots.numel() - 1                  # dead rows before the token's
    live = torch.cat([live & (slots != L), live.new_zeros(pad), torch.ones_like(L, dtype=torch.bool)])
    slots = torch.cat([slots, L.expand(pad), L])
    mask = step.mask.index_select(-1, slots.clamp_max(max_len - 1)) & live                 # (B, 1, 1, K + 1)
    ids = (slots[None, :] + (step.ids - L)).clamp_min(0)                   # (B, K + 1): slot - pad, as in decode
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return ids, bias


def _aligned(rows: int) -> int:
    """rows rounded up to a multiple of 8 (16-byte rows of 16-bit values along a product's inner dimension)."""
    return -(-rows // 8) * 8


def heads(flat: Tensor, n_heads: int, dtype: torch.dtype) -> Tensor:
    """(B, N, n_heads*hd) -> (B, n_heads, N, hd) in the model's dtype."""
    B, N, width = flat.shape
    return flat.view(B, N, n_heads, width // n_heads).transpose(1, 2).to(dtype)


def rope_stored_keys(attn, k: Tensor, pos: Positions) -> Tensor:
    """Rotate keys of stored slots [0, S) (B, H, S, hd), rematerialized before RoPE, to their positions."""
    slots = torch.arange(k.shape[2], device=k.device)
    return attn.rope.apply(k, (slots[None, :] - pos.pad[:, None]).clamp_min(0))


def decode_attention(attn, q: Tensor, hist_k: Tensor, k: Tensor, v: Tensor, pos: Positions, weigh,
                     up_v: Tensor) -> Tensor:
    """One decode token's attention when K and V are linear in cached rows (X, or its latents). Keys are
    rematerialized (hist_k (B, H, L, hd) before RoPE, which differs per slot); values are not (latent_attention).
    The token's own k, v (B, H, 1, hd) are exact. Returns (B, Hq, 1, hd) in v's dtype."""
    keys = rope_stored_keys(attn, torch.cat([hist_k, k], dim=2), pos)                # (B, H, L + 1, hd)
    return latent_attention(attn.rope.apply(q, pos.ids), keys, v, pos.mask, weigh, up_v)


def latent_attention(q: Tensor, keys: Tensor, v: Tensor, mask: Tensor | None, weigh, up_v: Tensor) -> Tensor:
    """q (B, Hq, 1, hd) and keys (B, H, K + 1, hd) after RoPE, the token's own key last; mask (B, 1, 1, K + 1) or
    None. A query head's output over the cached rows Σ_t p_t V_t = (Σ_t p_t row_t) · up_v is the
    probability-weighted sum of the rows, weigh(p) (B, Hq, K) -> (B, Hq, width), times the head's slice of the
    up-projection up_v (width, n_kv*hd); the token's value v (B, H, 1, hd) is exact. Returns (B, Hq, 1, hd) in v's
    dtype."""
    (B, Hq, _, d), H = q.shape, keys.shape[1]
    q = q.float().view(B, H, Hq // H, d)
    scores = q @ keys.float().transpose(-1, -2) * d ** -0.5                          # (B, H, rep, K + 1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    p = scores.softmax(dim=-1).view(B, Hq, -1)
    up = up_v.float().view(-1, H, d).transpose(0, 1)                                  # (H, width, hd)
    out = weigh(p[..., :-1]).view(B, H, Hq // H, -1) @ up                            # (B, H, rep, hd)
    out = out.view(B, Hq, 1, d) + p[..., -1:, None] * v.float().repeat_interleave(Hq // H, dim=1)
    return out.to(v.dtype)


@dataclass(frozen=True)
class XQuantOptions:
    bits: int = 4
    group_size: int = 128
    residual: int = 0
    outlier_channel: bool = False    # GQA: the first channel of X U_k at full precision (Table B.1)
    high_layers: int = 0             # the first high_layers layers use high_bits (Table 4: 3 layers at 4 bits)
    high_bits: int = 4
    policy: str = "reference"        # window policy (kvzoo/cache/store.py): reference | grouped | none
    up_dtype: str = "model"          # GQA: the SVD factors U and Σ Bᵀ held at the model's dtype | float32

    def __post_init__(self):
        check_policy(self.policy)
        check_up_dtype(self.up_dtype)
        check_latent_bits(self.bits)
        check_latent_bits(self.high_bits, "high_bits")
        if self.high_layers < 0:
            raise ValueError(f"high_layers must be >= 0, got {self.high_layers}")
        check_window(self.group_size, self.residual)


@register("xquant")
class XQuantCache(WholeStep, LayerCache):
    """Slots [0, Nq) quantized | [Nq, L) exact window, of X (MHA) or of X U_k and X U_v (GQA)."""

    Options = XQuantOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        o = self.opts
        weight = layer.k_proj.weight
        self.gqa = layer.n_kv_heads < layer.n_heads
        if o.outlier_channel and not self.gqa:
            raise ValueError("xquant outlier_channel applies to GQA models (the first channel of the latent "
                             "X U_k, Appendix B); this model is MHA (n_kv_heads == n_heads) and caches X itself")
        spans = {"k": o.group_size, "v": 1} if self.gqa else {"x": 1}       # tokens one group covers
        windows = policy_windows(o.policy, {name: Window(0, o.residual, span) for name, span in spans.items()},
                                 0, o.residual, o.group_size, spans)
        self.window, self.value_window = windows["k" if self.gqa else "x"], windows["v" if self.gqa else "x"]

        def codec(name: str, width: int, per_channel: bool, exact_first: bool = False) -> GroupCodec:
            coded = width - int(exact_first and o.bits != EXACT)
            group = o.group_size if per_channel else token_group(coded, o.group_size)
            return GroupCodec((batch_size,), windows[name].quantized(max_len), width, o.bits, group, per_channel,
                              weight.dtype, weight.device, exact_first)

        if self.gqa:
            down_k, up_k = svd_factors(layer.k_proj.weight)       # U_k (hidden, r), Σ_k B_kᵀ (r, n_kv*hd)
            down_v, up_v = svd_factors(layer.v_proj.weight)
            if o.up_dtype == "model":                             # weights, as the model holds its W_k, W_v
                down_k, down_v, up_k, up_v = (t.to(weight.dtype) for t in (down_k, down_v, up_k, up_v))
            self.register_buffer("down", torch.cat([down_k, down_v], dim=1), persistent=False)   # (hidden, 2r)
            self.register_buffer("up_k", up_k, persistent=False)
            self.register_buffer("up_v", up_v, persistent=False)
            codecs = {"k": codec("k", up_k.shape[0], True, o.outlier_channel), "v": codec("v", up_v.shape[0], False)}
        else:
            codecs = {"x": codec("x", weight.shape[1], False)}
        self.store = WindowedStore(windows, codecs, (batch_size,), weight.dtype, weight.device)

    # ---- what is cached, and how K and V come back -------------------------------------------------
    def _rows(self, x: Tensor) -> dict[str, Tensor]:
        """Rows to cache for a chunk x (B, T, hidden), at the model's dtype: X, or X U_k and X U_v."""
        if not self.gqa:
            return {"x": x}
        z = (x.to(self.down.dtype) @ self.down).to(x.dtype)        # (B, T, 2r)
        r = self.up_k.shape[0]
        return {"k": z[..., :r], "v": z[..., r:]}

    def _sources(self) -> tuple[tuple[str, Tensor], tuple[str, Tensor]]:
        """(stream, up-projection) for K and for V."""
        if self.gqa:
            return ("k", self.up_k), ("v", self.up_v)
        return ("x", self.attn.k_proj.weight.t()), ("x", self.attn.v_proj.weight.t())

    def _held_kv(self, length: int) -> tuple[Tensor, Tensor]:
        """K and V (before RoPE) of every stored slot as held, of `length` stored tokens (the quantized slots then the
        window rows, each stream's own): (B, n_kv, length, hd) each, model dtype."""
        out = []
        for name, up in self._sources():
            codec, window = self.store.codecs[name], self.store.recent_rows(name, length)
            _, n_q, _ = self.store.counts(length, name)
            flat = torch.cat([rematerialize(codec.held(n_q), codec.held_first(n_q), up),
                              rematerialize(window, None, up)], dim=1)   # (B, N, n_kv*hd)
            out.append(heads(flat, self.attn.n_kv_heads, window.dtype))
        return out[0], out[1]

    def nbytes(self) -> int:
        return self.store.nbytes(self.length)

    def formula_nbytes(self, length: int) -> int:
        return self.store.formula_nbytes(length)

    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        """The history rematerialized from storage plus the new chunk exact; then store the chunk."""
        hist_k, hist_v = self._held_kv(self.length)
        self.length = self.store.append(self.length, self._rows(x))
        c = Chunk(self.attn.rope.apply(q, pos.ids), rope_stored_keys(self.attn, torch.cat([hist_k, k], dim=2), pos),
                  torch.cat([hist_v, v], dim=2))
        if held:
            held_k, c.held_values = self._held_kv(self.length)
            c.held_keys = rope_stored_keys(self.attn, held_k, pos)
        return c

    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token: keys rematerialized, values weighed from the codes (decode_attention); then the token's rows
        are stored."""
        if not self.length:
            return self.prefill(x, q, k, v, pos)
        (k_name, up_k), (v_name, up_v) = self._sources()
        codec, window = self.store.codecs[k_name], self.store.recent_rows(k_name, self.length)
        _, n_q, _ = self.store.counts(self.length, k_name)
        flat = torch.cat([rematerialize(codec.held(n_q), codec.held_first(n_q), up_k),
                          rematerialize(window, None, up_k)], dim=1)          # (B, L, n_kv*hd)
        codec, window = self.store.codecs[v_name], self.store.recent_rows(v_name, self.length)
        _, n_q, _ = self.store.counts(self.length, v_name)
        weigh = lambda p: codec.weigh(p[..., :n_q], n_q) + p[..., n_q:] @ window.float()   # noqa: E731
        out = decode_attention(self.attn, q, heads(flat, self.attn.n_kv_heads, k.dtype), k, v, pos, weigh, up_v)
        self.length = self.store.append(self.length, self._rows(x))
        return out

    # ---- the static step (WholeStep: CUDA graphs, kvzoo/graphs.py) -------------------------------------
    def can_decode_static(self, padded: bool) -> bool:
        """Every streaming cache: the step attends over every allocated slot with a mask built from the
        step's (B, 1, 1, max_len) mask, so left padding and sliding windows are served as in decode. The
        simulated mode has no decode step."""
        return not self.simulated

    def static_phase(self) -> str:
        """Which streams the next token fills, so that their oldest group is quantized (one graph each)."""
        return self.store.phases(self.length)

    def static_scratch(self) -> tuple[Tensor, ...]:
        return self.store.scratch()

    def _static_keys(self, step: StaticStep, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """static_key_rows over the K stream's allocated rows (WindowedStore.static_rows); shared by every layer."""
        key = ("xquant", name, self.store.windows[name], self.store.codecs[name].capacity, dtype)
        if key not in step.derived:
            step.derived[key] = static_key_rows(step, *self.store.static_rows(step, name), self.max_len, dtype)
        return step.derived[key]

    def _value_rows(self, step: StaticStep, k_name: str, v_name: str) -> Tensor:
        """(K + 1,): the value row holding each key row's slot (WindowedStore.row_map), then zero rows: the dead rows
        of _static_keys and the token's."""
        key = ("xquant value rows", k_name, v_name)
        if key not in step.derived:
            by_slot = self.store.row_map(step, k_name, v_name)
            token = self.store.codecs[v_name].capacity + self.store.recent(v_name).shape[1]     # a zero row
            zeros = _aligned(by_slot.numel() + 1) - by_slot.numel()                         # dead rows, the token's
            step.derived[key] = torch.cat([by_slot, by_slot.new_full((zeros,), token)])
        return step.derived[key]

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """decode with fixed shapes: the token's rows into each stream's window row; K rematerialized from every
        allocated row (latent_rows, then up_k), the token's exact k last; V's latent rows in K's row order by slot
        (WindowedStore.row_map) where X U_k and X U_v hold their slots differently, weighed by the softmax as their
        codes are read (weigh_latent) and then projected (weighed_attention), the step's mask applied (dead rows and
        the token's own row masked); then each stream the token filled quantizes its window's oldest group into
        slots [Nq, Nq + G)."""
        st = self.store
        st.write_token_at(self.length, step, self._rows(x))               # rows (B, 1, width) into window row r
        (k_name, up_k), (v_name, up_v) = self._sources()
        ids, bias = self._static_keys(step, k_name, q.dtype)
        n_kv = self.attn.n_kv_heads
        shared = step.derived                                             # made by the first layer, used by all
        if ("xquant q tables", q.dtype) not in shared:
            shared[("xquant q tables", q.dtype)] = self.attn.rope.cos_sin(step.ids, q.dtype)

        def rows(name: str, dtype: torch.dtype, order: Tensor | None) -> Tensor:
            """(B, K + 1, c): every allocated row of stream `name` dequantized (in K's row order: `order`, None for K
            itself), then zero rows (the dead rows of _static_keys and the token's)."""
            codec, window = st.codecs[name], st.recent(name)
            n, w = codec.capacity, window.shape[1]
            if order is None:                                             # K's own rows, in order, then zero rows
                count = _aligned(n + w + 1)
                if ("xquant rows", count) not in shared:
                    shared[("xquant rows", count)] = torch.arange(count, device=window.device)
                order = shared[("xquant rows", count)]
            return latent_rows(codec.held(n), codec.held_first(n), window, order, dtype)

        key = ("xquant rope tables", k_name, k.dtype)                    # RoPE of every key row: once per step
        if key not in step.derived:
            step.derived[key] = self.attn.rope.cos_sin(ids, k.dtype)
        k_rows = rows(k_name, up_k.dtype, None)
        keys = heads(k_rows @ up_k, n_kv, k.dtype)                        # (B, n_kv, K + 1, hd)
        keys[:, :, -1:] = k
        if v_name == k_name:
            weigh = weigh_rows(k_rows)
        else:
            codec = st.codecs[v_name]
            weigh = weigh_latent(codec.held(codec.capacity), codec.held_first(codec.capacity), st.recent(v_name),
                                 self._value_rows(step, k_name, v_name), up_v.dtype)
        out = weighed_attention(q, shared[("xquant q tables", q.dtype)], keys, step.derived[key], bias, weigh, up_v, v)
        st.flush_at(self.length, step)
        return out
