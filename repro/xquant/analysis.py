"""XQuant, Appendix B: the outlier channel of X U_k, and the keys' outlier channel predicted from weights.

Tomar, Hooper et al., "XQuant: Breaking the Memory Wall for LLM Inference with KV Cache
Rematerialization" (2025), Sec. 3.3.1 and Appendix B (Figures B.1-B.3, Table B.2).

Notation, as in the paper (row vectors, one token per row):

    X    (L, d)   the attention input of a layer *after* its RMSNorm (the paper's "X", Sec. 3.1)
    W_k  (d, r)   the key projection, K = X W_k, r = n_kv_heads * head_dim = d / g under GQA
    W_k = U_k Σ_k B_kᵀ      U_k (d, r) orthonormal columns, Σ_k = diag(σ_0 >= σ_1 >= ...), B_kᵀ (r, r)
    K   = (X U_k) Σ_k B_kᵀ  the pre-RoPE keys, rematerialized from the cached latent X U_k

kvzoo's nn.Linear stores k_proj.weight as (r, d) and computes K = X weightᵀ, so the paper's W_k is
``k_proj.weight.T``; ``svd_factors`` takes the nn.Linear weight and returns the paper's factors.

Statistic 1 -- "X U_k has massive outliers in the first channel" (Sec. 3.3.1, Figs. B.2/B.3). The paper
shows this only as plots of |X U_k| per channel, so we report numbers that say the same thing. With
Z = X U_k (L, r):

    share        Σ_t |Z[t,0]| / Σ_t Σ_j |Z[t,j]|     share of the latent magnitude in channel 0 (uniform: 1/r)
    energy       Σ_t Z[t,0]² / Σ_t Σ_j Z[t,j]²       the same for squared magnitude
    dominance    mean_t |Z[t,0]| / max_{j>=1} mean_t |Z[t,j]|   channel 0 against the next-largest channel
    led          fraction of tokens t whose largest |Z[t,j]| is at j = 0 ("outliers across all tokens")
    cos          mean_t |cos(x_t, u_0)| = mean_t |Z[t,0]| / ||x_t||   ("high cosine similarity with u_0")

and the same for Z = X U_v as the control (the paper finds no such structure there).

Statistic 2 -- Table B.2, predicting the keys' outlier channel without calibration data:
    prediction    the top-k indices c of |B_kᵀ[0, c]| (the first row of B_kᵀ: the weights that spread the
                  outlier latent channel σ_0 X u_0 over the r key channels)
    ground truth  argmax_c mean_t |K[t, c]| (the key channel of largest average magnitude), per sequence
    hit@k         the ground truth is among the k predicted channels; the accuracy is the fraction of
                  (sequence, layer) pairs that hit (the paper: "across the Keys for all layers")
We keep the rank of the ground truth in the |B_kᵀ[0]| ordering (1 = largest), so hit@k <=> rank <= k
for every k at once. Appendix B writes B_vᵀ where the keys are concerned; the keys are rematerialized
with B_kᵀ (Sec. 3.3.1 and Fig. 5), so B_kᵀ is the prediction, and the literal B_vᵀ reading is kept as
a second (control) predictor. As a diagnostic that is not the paper's, the row of B_kᵀ for the latent
channel *measured* largest is tried too (it differs from row 0 where σ_0 ≈ σ_1).
The paper's keys are pre-RoPE (KIVI*/KVQuant quantize pre-RoPE keys, Fig. 3 shows pre-RoPE keys, and
X U_k Σ_k B_kᵀ is pre-RoPE); post-RoPE keys are measured as well.

Table B.1 is not a statistic of X U_k but a perplexity experiment (XQuant with channel 0 of X U_k kept
in FP16); it belongs with the XQuant cache strategy, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm import tqdm


# ----------------------------------------------------------------------------------------------------
# Pure functions on tensors
# ----------------------------------------------------------------------------------------------------
def svd_factors(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The paper's SVD W = U diag(S) Bᵀ of an nn.Linear weight (out=r, in=d), whose W is weightᵀ (d, r).

    Returns U (d, r) with orthonormal columns, S (r,) descending, Bt (r, r) = Bᵀ; computed in float64
    on the CPU. So that x @ weight.T == ((x @ U) * S) @ Bt."""
    w = weight.detach().to(device="cpu", dtype=torch.float64).T     # (d, r): the paper's orientation
    u, s, bt = torch.linalg.svd(w, full_matrices=False)               # (d, r), (r,), (r, r)
    return u, s, bt


def predicted_outlier_channels(bt: Tensor, k: int, row: int = 0) -> Tensor:
    """Table B.2's prediction: the k key channels c with the largest |Bᵀ[0, c]|, largest first.
    (`row` picks another latent channel's row; the paper always uses row 0.)"""
    return bt[row].abs().topk(k).indices


def prediction_rank(bt: Tensor, channel: Tensor | int, row: int = 0) -> Tensor:
    """Rank (1 = largest) of `channel` in the |Bᵀ[row, :]| ordering; hit@k <=> rank <= k.
    channel may be a tensor of indices (any shape); the ranks have its shape."""
    b0 = bt[row].abs()                                                 # (r,)
    channel = torch.as_tensor(channel, device=b0.device)
    return 1 + (b0 > b0[channel][..., None]).sum(-1)


def outlier_channel(keys: Tensor) -> Tensor:
    """Ground truth: the channel of largest average magnitude. keys (..., T, r) -> (...) indices."""
    return keys.abs().mean(dim=-2).argmax(dim=-1)


def rope_pair(channel: Tensor, head_dim: int) -> Tensor:
    """The RoPE pair a key channel belongs to: rotate-half RoPE rotates dims i and i + head_dim/2 of
    each head together, so post-RoPE an outlier may sit on either member of its pair."""
    half = head_dim // 2
    return (channel // head_dim) * half + channel % half


@dataclass
class ChannelSums:
    """Running sums over tokens of one latent projection Z = X U (L, r), for the statistics above."""

    tokens: int = 0
    abs_sum: Tensor | None = None       # (r,) Σ_t |Z[t, j]|
    sq_sum: Tensor | None = None        # (r,) Σ_t Z[t, j]²
    led: int = 0                        # tokens whose largest |Z[t, j]| is j = 0
    cos_sum: float = 0.0                # Σ_t |Z[t, 0]| / ||x_t||

    def update(self, x: Tensor, u: Tensor) -> None:
        """x (N, d) tokens, u (d, r) orthonormal columns."""
        z = x @ u                                                      # (N, r)
        a = z.abs()
        if self.abs_sum is None:
            self.abs_sum, self.sq_sum = torch.zeros_like(a[0]), torch.zeros_like(a[0])
        self.tokens += z.shape[0]
        self.abs_sum += a.sum(0)
        self.sq_sum += (z * z).sum(0)
        self.led += int((a.argmax(-1) == 0).sum())
        self.cos_sum += float((a[:, 0] / x.norm(dim=-1).clamp_min(1e-30)).sum())

    def stats(self) -> dict:
        mean_abs = self.abs_sum / self.tokens                          # (r,)
        return {
            "share": float(self.abs_sum[0] / self.abs_sum.sum()),
            "energy_share": float(self.sq_sum[0] / self.sq_sum.sum()),
            "dominance": float(mean_abs[0] / mean_abs[1:].max()) if mean_abs.numel() > 1 else float("inf"),
            "top_channel": int(mean_abs.argmax()),
            "led_by_first": self.led / self.tokens,
            "cos_first": self.cos_sum / self.tokens,
        }


def latent_stats(x: Tensor, u: Tensor) -> dict:
    """Statistic 1 for tokens x (..., d) projected by u (d, r): share, energy_share, dominance,
    top_channel, led_by_first, cos_first (see the module docstring)."""
    sums = ChannelSums()
    sums.update(x.reshape(-1, x.shape[-1]), u)
    return sums.stats()


# ----------------------------------------------------------------------------------------------------
# One layer's accumulator
# ----------------------------------------------------------------------------------------------------
@dataclass
class LayerOutliers:
    """Weights-only factors of one layer plus running statistics over the sequences shown to it."""

    layer: int
    head_dim: int
    w_k: Tensor                          # (r, d) k_proj.weight, in the dtype/device the stats run in
    u_k: Tensor                          # (d, r)
    s_k: Tensor                          # (r,)
    bt_k: Tensor                         # (r, r)
    u_v: Tensor
    s_v: Tensor
    bt_v: Tensor
    xk: ChannelSums = field(default_factory=ChannelSums)
    xv: ChannelSums = field(default_factory=ChannelSums)
    truth_pre: list[int] = field(default_factory=list)     # per sequence: argmax_c mean_t |K_pre[t, c]|
    truth_post: list[int] = field(default_factory=list)    # the same for post-RoPE keys
    k_pre_abs: Tensor | None = None                        # (r,) Σ over every token of |K_pre|
    k_post_abs: Tensor | None = None

    @classmethod
    def from_attention(cls, attn, device: torch.device | str = "cpu") -> "LayerOutliers":
        """The SVD factors of a kvzoo Attention's k_proj and v_proj (float64 SVD, float32 results)."""
        f32 = dict(device=device, dtype=torch.float32)
        u_k, s_k, bt_k = (t.to(**f32) for t in svd_factors(attn.k_proj.weight))
        u_v, s_v, bt_v = (t.to(**f32) for t in svd_factors(attn.v_proj.weight))
        return cls(attn.layer_idx, attn.head_dim, attn.k_proj.weight.detach().to(**f32),
                   u_k, s_k, bt_k, u_v, s_v, bt_v)

    def update(self, x: Tensor, k_post: Tensor | None = None) -> None:
        """x (B, T, d): B sequences of the attention input after RMSNorm. k_post (B, T, r): their keys
        after RoPE (optional). Pre-RoPE keys are K = x W_kᵀ."""
        x = x.float()
        flat = x.reshape(-1, x.shape[-1])                              # (B*T, d)
        self.xk.update(flat, self.u_k)
        self.xv.update(flat, self.u_v)
        k_pre = x @ self.w_k.T                                         # (B, T, r)
        self.truth_pre += outlier_channel(k_pre).tolist()
        self.k_pre_abs = k_pre.abs().sum((0, 1)) + (0 if self.k_pre_abs is None else self.k_pre_abs)
        if k_post is not None:
            k_post = k_post.float()
            self.truth_post += outlier_channel(k_post).tolist()
            self.k_post_abs = k_post.abs().sum((0, 1)) + (0 if self.k_post_abs is None else self.k_post_abs)

    def result(self, ks: list[int]) -> dict:
        """Everything for one row of the table / one entry of the JSON."""
        kmax = max(ks)
        pre = torch.tensor(self.truth_pre)
        rank_pre = prediction_rank(self.bt_k.cpu(), pre)
        out = {
            "layer": self.layer,
            "sigma0_over_sigma1_k": float(self.s_k[0] / self.s_k[1]),
            "xu_k": self.xk.stats(),
            "xu_v": self.xv.stats(),
            "predicted_k": predicted_outlier_channels(self.bt_k, kmax).tolist(),
            "predicted_v": predicted_outlier_channels(self.bt_v, kmax).tolist(),
            "pre_rope": {
                "outlier_per_sequence": self.truth_pre,
                "rank_per_sequence": rank_pre.tolist(),
                "rank_per_sequence_bv": prediction_rank(self.bt_v.cpu(), pre).tolist(),
                # not the paper's: the row of the latent channel measured largest (calibration data)
                "rank_per_sequence_top_row": prediction_rank(self.bt_k.cpu(), pre,
                                                             row=self.xk.stats()["top_channel"]).tolist(),
                "outlier_pooled": int(self.k_pre_abs.argmax()),
                "rank_pooled": int(prediction_rank(self.bt_k.cpu(), int(self.k_pre_abs.argmax()))),
                "hit": {k: float((rank_pre <= k).float().mean()) for k in ks},
            },
        }
        if self.truth_post:
            post = torch.tensor(self.truth_post)
            rank_post = prediction_rank(self.bt_k.cpu(), post)
            pred = predicted_outlier_channels(self.bt_k.cpu(), kmax)
            pairs_pred = rope_pair(pred, self.head_dim)                 # (kmax,)
            pairs_true = rope_pair(post, self.head_dim)                 # (S,)
            out["post_rope"] = {
                "outlier_per_sequence": self.truth_post,
                "rank_per_sequence": rank_post.tolist(),
                "outlier_pooled": int(self.k_post_abs.argmax()),
                "hit": {k: float((rank_post <= k).float().mean()) for k in ks},
                # hit when the true channel's RoPE partner is predicted counts too
                "pair_hit": {k: float((pairs_true[:, None] == pairs_pred[None, :k]).any(-1).float().mean())
                             for k in ks},
            }
        return out


# ----------------------------------------------------------------------------------------------------
# Running a model
# ----------------------------------------------------------------------------------------------------
@torch.inference_mode()
def analyze(model, token_ids, seq_len: int = 2048, max_windows: int | None = 4, ks: tuple[int, ...] = (1, 2, 4, 8),
            cache=None, progress: bool = True) -> dict:
    """Run non-overlapping windows of `seq_len` tokens (as kvzoo.eval.perplexity cuts them) through
    `model`, capture every layer's attention input (after RMSNorm) with a forward pre-hook, and return
    {"layers": [LayerOutliers.result(ks) ...], "summary": {...}, "windows": n, "rank": r}.

    cache: None runs plain causal attention; a CacheSpec (or name) runs the windows through that
    strategy in simulated mode, so later layers see what the cache lets attention see."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if seq_len > model.cfg.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds the model's context of {model.cfg.max_position_embeddings}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1, got {max_windows}")
    cfg = model.cfg
    r = cfg.n_kv_heads * cfg.head_dim
    ks = sorted(set(ks))
    if not ks or ks[0] < 1 or ks[-1] > r:
        raise ValueError(f"top-k values must lie in [1, {r}] (the key width n_kv_heads * head_dim), got {ks}")
    windows = ids.numel() // seq_len
    if windows == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    if max_windows is not None:
        windows = min(windows, max_windows)

    layers = [LayerOutliers.from_attention(block.attn, model.device)
              for block in tqdm(model.layers, desc="SVD of W_k, W_v", disable=not progress, leave=False)]

    def hook(attn, args):                                              # Attention.forward(x, pos, cache)
        x, pos = args[0], args[1]                                      # x (B, T, d) after RMSNorm
        B, T, _ = x.shape
        stats = layers[attn.layer_idx]
        k = (x.float() @ stats.w_k.T).view(B, T, attn.n_kv_heads, attn.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        k_post = attn.rope.apply(k, pos.ids).transpose(1, 2).reshape(B, T, -1)        # (B, T, r), fp32
        stats.update(x, k_post)

    handles = [block.attn.register_forward_pre_hook(hook) for block in model.layers]
    try:
        for w in tqdm(range(windows), desc="windows", disable=not progress):
            tokens = ids[w * seq_len:(w + 1) * seq_len].view(1, seq_len).to(model.device)   # (1, L)
            kv = model.new_cache(cache, 1, seq_len, mode="simulated") if cache is not None else None
            model(tokens, kv, last_only=True)
    finally:
        for h in handles:
            h.remove()

    results = [layer.result(ks) for layer in layers]
    return {"windows": windows, "seq_len": seq_len, "rank": r, "head_dim": cfg.head_dim,
            "ks": ks, "layers": results, "summary": summarize(results, ks, r)}


def summarize(results: list[dict], ks: list[int], r: int) -> dict:
    """Hit rates over every (sequence, layer) pair, and layer averages of statistic 1."""
    def hits(sub: str, field_: str) -> dict:
        ranks = [rk for res in results if sub in res for rk in res[sub][field_]]
        return {k: sum(rk <= k for rk in ranks) / len(ranks) for k in ks} if ranks else {}

    n = len(results)
    out = {
        "layers": n,
        "chance": {k: k / r for k in ks},
        "hit_pre_rope_bk": hits("pre_rope", "rank_per_sequence"),
        "hit_pre_rope_bv": hits("pre_rope", "rank_per_sequence_bv"),
        "hit_pre_rope_bk_top_row": hits("pre_rope", "rank_per_sequence_top_row"),
        "hit_post_rope_bk": hits("post_rope", "rank_per_sequence"),
        "layers_with_first_latent_channel_largest_k": sum(res["xu_k"]["top_channel"] == 0 for res in results),
        "layers_with_first_latent_channel_largest_v": sum(res["xu_v"]["top_channel"] == 0 for res in results),
    }
    if all("post_rope" in res for res in results):
        pair = {k: sum(res["post_rope"]["pair_hit"][k] for res in results) / n for k in ks}
        out["pair_hit_post_rope_bk"] = pair
    for key in ("share", "energy_share", "dominance", "led_by_first", "cos_first"):
        out[f"mean_{key}_k"] = sum(res["xu_k"][key] for res in results) / n
        out[f"mean_{key}_v"] = sum(res["xu_v"][key] for res in results) / n
    return out
