"""SQuat and SQuat-pre: key quantization whose error is orthogonal to the prompt's query subspace.

Paper: Wang et al., "SQuat: Subspace-orthogonal KV Cache Quantization" (../shared/papers/squat.md),
§3, Appendix A.2 (Lemmas 2 and 3), Appendix C (Algorithm 1), Appendix D.2 (settings).

Idea. A score is q·k, so a key's quantization error only matters along the directions queries take.
Queries lie near a low-dimensional subspace that the prompt already reveals: per layer and KV head, the
top-r right singular vectors of the prompt's queries (for GQA the queries of every head that shares the
KV head, stacked along tokens), scaled by their singular values, give Q̂ = diag(Σ[:r]) V[:r]  (r, d).
Keys are then quantized block by block along the head dimension: after block t (g channels) is rounded,
the not-yet-quantized channels of every key are moved to the solution of (Lemma 2)

    min_δ ||δ||² + λ ||Q̂ δ||²   with δ fixed on the quantized channels to their rounding error
    =>  k[tg:] += B_t H_t d,     d = deq(qtz(k[block t])) - k[block t]                         (eq. 6)

where P_inv = (I + λ Q̂ᵀQ̂)⁻¹ (Woodbury: I - λ Q̂ᵀ (I_r + λ Q̂Q̂ᵀ)⁻¹ Q̂ when r < d), A_t its top-left
tg x tg block, B_t its bottom-left (d - tg) x tg block and H_t the last g columns of A_t⁻¹. The A_t⁻¹
come from A_T⁻¹ = I + λ Q̂ᵀQ̂ by the Lemma 3 recursion (A_t⁻¹ = M - Nᵀ O⁻¹ N, only g x g solves), so
the T - 1 update matrices U_t = B_t H_t  ((d - tg), g)  are built once per prompt, and quantizing a
group costs T - 1 small matmuls on top of KIVI's quantizer. λ = 0 gives U_t = 0: plain KIVI.

Quantization is KIVI's (kvzoo/cache/kivi.py): keys per channel in groups of G tokens, values per token,
the newest R tokens exact. Rounding of block t depends only on block t's (updated) values, so SQuat's
codes are KIVI's quantizer applied to the keys as the block loop leaves them; storage and the decode
path are KIVI's, unchanged, windows included (`policy`: the authors' code flushes the key residual whole
when it holds R keys and keeps exactly R values). `squat-pre` stores keys before RoPE (RoPE after
dequantization, like KIVI*). Both take the subspace from queries after RoPE, as the reference code does by
default; `rope_queries=false` takes it from pre-RoPE queries (an ablation).

The prompt. The subspace comes from the prompt's queries (LayerCache.prompt_slots): a streaming prefill's
whole first chunk (chat: the prompt), or in simulated mode the evaluation's prompt (kvzoo/eval/perplexity.py
prefills it exact and scores the tokens after it). Padding slots are left out. As the paper does, every row
of a batch uses the matrices of the first row; per_sample=true builds them per row.

Stored per layer (B rows, H = n_kv_heads, d = head_dim, b = bits, G = group_size, T = d / g):
    KIVI's codes, scales, zeros and windows (see kivi.py)
    upd_t  fp32 (B or 1, H, d - t*g, g) for t = 1 .. T-1     the update matrices U_t
Bytes: KIVI's per token, plus 4 * H * sum_t (d - t g) g per layer (rows: 1, or B with per_sample);
for d = 64, g = 32: 4 KiB per KV head and layer, 0.8% of an fp16 cache of 2048 tokens on SmolLM2.

Paper settings (Appendix D.2): 2-bit, G = 32, R = 32, r = 5, λ = 0.001, g = 64 at head_dim 128, i.e.
two iterations. `block=0` (the default) means g = head_dim / 2, which is the paper's g = 64 on its
models and keeps its two iterations on SmolLM2 (head_dim 64), where g = 64 would make SQuat plain KIVI.

Tensor parallelism (kvzoo/models/tp.py): the query subspace and the update matrices are per KV head (from the
query heads that read it), so a rank builds exactly its own heads'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvzoo.cache.base import Chunk, Positions, register
from kvzoo.cache.kivi import KIVICache, KIVIOptions
from kvzoo.cache.kvquant import QTensor, fake_quantize
from kvzoo.cache.store import SCALE_DTYPE, GroupCodec


# ----------------------------------------------------------------------------------------------------
# The algorithm, pure torch (any leading batch dimensions)
# ----------------------------------------------------------------------------------------------------
def query_subspace(queries: Tensor, rank: int) -> Tensor:
    """Q̂ = diag(Σ[:r]) V[:r] of queries (..., N, d): (..., r, d), fp32.

    Σ and V come from the eigendecomposition of the Gram matrix QᵀQ = V Σ² Vᵀ (d x d, in float64), the
    same singular values and right singular vectors as the SVD of Q at a cost that does not grow with N
    beyond the one product. Ranks above the number of queries get zero rows."""
    q = queries.float()
    gram = (q.transpose(-1, -2) @ q).double()                                   # (..., d, d)
    evals, evecs = torch.linalg.eigh(gram)                                      # ascending
    sigma = evals.flip(-1)[..., :rank].clamp_min(0).sqrt()                      # (..., r)
    vt = evecs.flip(-1)[..., :rank].transpose(-1, -2)                           # (..., r, d)
    return (sigma[..., None] * vt).float()


def update_matrices(subspace: Tensor, lam: float, block: int) -> list[Tensor]:
    """[U_1, ..., U_{T-1}], U_t = B_t H_t  (..., d - t g, g), for Q̂ (..., r, d) and T = d / block."""
    r, d = subspace.shape[-2:]
    assert d % block == 0, "block must divide the head dimension"
    s = subspace.double()
    eye = torch.eye(d, dtype=s.dtype, device=s.device)
    a_inv = eye + lam * s.transpose(-1, -2) @ s                                 # A_T⁻¹ = I + λ Q̂ᵀQ̂
    if r < d:                                                                   # Woodbury: an r x r solve
        small = torch.eye(r, dtype=s.dtype, device=s.device) + lam * s @ s.transpose(-1, -2)
        p_inv = eye - lam * s.transpose(-1, -2) @ torch.linalg.solve(small, s)
    else:
        p_inv = torch.linalg.inv(a_inv)
    mats: list[Tensor] = []
    for t in range(d // block - 1, 0, -1):                                     # A_{t+1}⁻¹ -> A_t⁻¹ (Lemma 3)
        n = t * block
        m, nn, o = a_inv[..., :n, :n], a_inv[..., n:n + block, :n], a_inv[..., n:n + block, n:n + block]
        a_inv = m - nn.transpose(-1, -2) @ torch.linalg.solve(o, nn)            # (..., n, n)
        h = a_inv[..., :, n - block:]                                           # H_t: last g columns (..., n, g)
        mats.append((p_inv[..., n:, :n] @ h).float())                           # B_t H_t (..., d - n, g)
    return mats[::-1]


def squat_adjust(keys: Tensor, mats: list[Tensor], bits: int, group_size: int) -> Tensor:
    """Run SQuat's block loop over keys (..., N, d), N a multiple of G: each block of g channels is
    quantized per channel (groups of G tokens) and its rounding error pushed into the later channels by
    eq. (6). Returns the keys, fp32, as each block stood when it was rounded: KIVI's quantizer applied
    to them gives exactly SQuat's codes. mats: update_matrices(...), broadcastable to (..., d - tg, g)."""
    k = keys.float().clone()
    d = k.shape[-1]
    block = d // (len(mats) + 1)
    for t, u in enumerate(mats, start=1):
        cols = k[..., (t - 1) * block:t * block]                                # (..., N, g)
        rounded = fake_quantize(cols, bits, group_size, axis=-2, scale_dtype=SCALE_DTYPE)
        k[..., t * block:] += (rounded - cols) @ u.transpose(-1, -2)            # (..., N, d - tg)
    return k


def squat_quantize_keys(keys: Tensor, subspace: Tensor, bits: int, group_size: int, lam: float,
                        block: int) -> Tensor:
    """Dequantized SQuat keys (..., N, d), fp32: the whole algorithm on one tensor (for analyses)."""
    adjusted = squat_adjust(keys, update_matrices(subspace, lam, block), bits, group_size)
    return fake_quantize(adjusted, bits, group_size, axis=-2, scale_dtype=SCALE_DTYPE)


def grouped_queries(q: Tensor, n_kv_heads: int) -> Tensor:
    """(B, Hq, T, d) -> (B, Hkv, Hq/Hkv * T, d): the queries that meet each KV head, stacked along tokens
    (query head h reads KV head h // (Hq / Hkv))."""
    B, Hq, T, d = q.shape
    return q.reshape(B, n_kv_heads, Hq // n_kv_heads * T, d)


# ----------------------------------------------------------------------------------------------------
# The cache strategy
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SQuatOptions(KIVIOptions):
    residual: int = 32
    rank: int = 5             # r, the subspace dimension
    lam: float = 0.001        # λ, weight of the orthogonality term (0: plain KIVI)
    block: int = 0            # g, channels quantized per iteration; 0 = head_dim / 2 (two iterations)
    rope_queries: bool = True  # subspace of the queries after RoPE (the reference code); false: before RoPE
    per_sample: bool = False  # build the matrices per batch row (default: from the first row, as the paper)

    def __post_init__(self):
        super().__post_init__()
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")
        if self.block < 0:
            raise ValueError(f"block must be >= 0 (0: head_dim / 2), got {self.block}")


class SQuatKeys(GroupCodec):
    """KIVI's per-channel key codes, of the keys as SQuat's block loop leaves them (`mats` gives the U_t)."""

    def __init__(self, *args, mats, **kwargs):
        super().__init__(*args, **kwargs)
        self.mats = mats

    def quantize(self, rows: Tensor) -> QTensor:
        return super().quantize(squat_adjust(rows, self.mats(), self.bits, self.group))


@register("squat")
class SQuatCache(KIVICache):
    """KIVI's windows and storage; keys pass through SQuat's block loop before they are quantized."""

    Options = SQuatOptions

    def __init__(self, spec, layer, prev, batch_size, max_len):
        super().__init__(spec, layer, prev, batch_size, max_len)
        d, weight = layer.head_dim, layer.q_proj.weight
        self.block = self.opts.block or d // 2
        if d % self.block:
            raise ValueError(f"{self.name} block {self.block} must divide the head dimension {d}")
        if self.opts.rank > d:
            raise ValueError(f"{self.name} rank {self.opts.rank} exceeds the head dimension {d}")
        rows = batch_size if self.opts.per_sample else 1
        self.n_mats = d // self.block - 1
        for t in range(1, self.n_mats + 1):
            self.register_buffer(f"upd{t}", torch.zeros(rows, layer.n_kv_heads, d - t * self.block, self.block,
                                                        device=weight.device), persistent=False)
        self.ready = False

    def key_codec(self, lead: tuple[int, int], capacity: int) -> GroupCodec:
        weight = self.attn.q_proj.weight
        return SQuatKeys(lead, capacity, self.attn.head_dim, self.opts.bits, self.opts.group_size, True,
                         weight.dtype, weight.device, mats=self._mats)

    def _mats(self) -> list[Tensor]:
        return [getattr(self, f"upd{t}") for t in range(1, self.n_mats + 1)]

    def _set_subspace(self, q: Tensor, pos: Positions, prompt: int) -> None:
        """Build the update matrices from the queries (B, Hq, T, d, before RoPE) of the first `prompt`
        tokens of this chunk, padding slots zeroed (a zero row changes no singular vector)."""
        q = q[:, :, :prompt]
        if self.opts.rope_queries:
            q = self.attn.rope.apply(q, pos.ids[:, :prompt])
        slots = torch.arange(pos.start, pos.start + prompt, device=q.device)
        real = slots[None, :] >= pos.pad[:, None]                               # (B, P)
        q = q * real[:, None, :, None]
        if not self.opts.per_sample:
            q = q[:1]
        subspace = query_subspace(grouped_queries(q, self.attn.n_kv_heads), self.opts.rank)   # (rows, H, r, d)
        for buf, mat in zip(self._mats(), update_matrices(subspace, self.opts.lam, self.block)):
            buf.copy_(mat)
        self.ready = True

    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        if not self.ready:                                  # the prompt's queries give the subspace
            self._set_subspace(q, pos, self.prompt_slots(q.shape[2]))
        return super().append(x, q, k, v, pos, held)

    def reset(self) -> None:
        super().reset()
        self.ready = False

    def _state_nbytes(self) -> int:
        return sum(m.nbytes for m in self._mats()) if self.ready else 0

    def nbytes(self) -> int:
        return super().nbytes() + self._state_nbytes()

    def formula_nbytes(self, length: int) -> int:
        rows = self.batch_size if self.opts.per_sample else 1
        d, g = self.attn.head_dim, self.block
        mats = 4 * rows * self.attn.n_kv_heads * sum((d - t * g) * g for t in range(1, self.n_mats + 1))
        return super().formula_nbytes(length) + (mats if length else 0)


@register("squat-pre")
class SQuatPreRoPECache(SQuatCache):
    """SQuat-pre: keys stored before RoPE (rotated after dequantization)."""

    pre_rope = True
