"""Llama and Mistral, written out by hand in one file, top to bottom.

    tokens -> Embedding -> n_layers x Block -> RMSNorm -> lm_head -> logits
    Block:  x = x + Attention(RMSNorm(x));  x = x + MLP(RMSNorm(x))

The pieces follow the Hugging Face layout exactly, so HF safetensors load without any permutation:
rotate-half RoPE (optionally with Llama 3.1's frequency scaling), grouped-query attention (n_heads query
heads share n_kv_heads key/value heads), SwiGLU MLP, tied or untied embeddings, and Mistral's sliding
window (a token sees itself and the previous sliding_window - 1 tokens).

What makes this model kvzoo's: the attention module computes q, k, v before RoPE and hands them to its
layer's cache strategy (kvzoo/cache/), which stores what it likes and returns the attention output. With
no cache at all, attention is plain causal attention over the chunk (a teacher-forced forward).

On a GPU (without autograd) the norms, RoPE and SwiGLU's product run as one Triton kernel each
(kvzoo/kernels/layer_ops.py); each module's `reference` holds the torch code they compute.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvzoo.cache.base import CacheSpec, LayerCache, ModelCache, Positions, StaticStep, attend
from kvzoo.config import ModelConfig


LAYER_OPS = ("fused", "torch")
if os.environ.get("KVZOO_LAYER_OPS", "fused") not in LAYER_OPS:
    raise ValueError(f"KVZOO_LAYER_OPS must be one of {LAYER_OPS}, got {os.environ['KVZOO_LAYER_OPS']!r}")
FUSED_OPS = os.environ.get("KVZOO_LAYER_OPS", "fused") == "fused"


def _fused(x: Tensor) -> bool:
    """Whether x's block operations take the one-kernel versions of kvzoo/kernels/layer_ops.py and the joined
    projections: on a GPU, without autograd (the kernels have no backward), unless KVZOO_LAYER_OPS=torch (for
    comparisons). They compute what the torch code (`reference`) does."""
    return FUSED_OPS and x.is_cuda and not torch.is_grad_enabled()


def layer_ops():
    """kvzoo.kernels.layer_ops, imported where a CUDA path first needs it (on a CPU kvzoo runs without Triton)."""
    from kvzoo.kernels import layer_ops as ops
    return ops


def join_weights(*linears: nn.Module) -> None:
    """Make the weights of bias-free linears with one input size consecutive rows of one tensor, each module's
    weight a view of it, so that their products can run as one (`joined_product`). Layers of another kind that
    join themselves (a `join` of their class, e.g. kvzoo.weightquant.awq.W4Linear's 4-bit codes) do so."""
    if not all(isinstance(lin, nn.Linear) for lin in linears):
        join = getattr(type(linears[0]), "join", None)
        if join is not None and all(type(lin) is type(linears[0]) for lin in linears):
            join(*linears)
        return
    joined = torch.cat([lin.weight.detach() for lin in linears])              # (sum of out_features, in_features)
    for lin, part in zip(linears, joined.split([lin.out_features for lin in linears])):
        lin.weight = nn.Parameter(part, requires_grad=lin.weight.requires_grad)


def consecutive_rows(parts: list[Tensor]) -> Tensor | None:
    """The 2-D tensor whose consecutive rows are `parts` (contiguous, one dtype and width), where they lie so in one
    storage (views that a join made and nothing has replaced since); else None."""
    first = parts[0]
    at = first.data_ptr()
    for w in parts:
        if (w.data_ptr() != at or not w.is_contiguous() or w.dtype != first.dtype or w.shape[1] != first.shape[1]
                or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        at += w.numel() * w.element_size()
    rows = sum(w.shape[0] for w in parts)
    return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]))


def _hooked(linears: tuple[nn.Module, ...]) -> bool:
    """Whether a module has hooks (a calibration that reads its inputs), which one joined product would skip."""
    return any(lin._forward_hooks or lin._forward_pre_hooks for lin in linears)


def joined_weight(*linears: nn.Module) -> Tensor | None:
    """The (sum of out_features, in_features) tensor whose consecutive rows are the linears' weights, where
    join_weights made them so and nothing has replaced a module or its weight since; else None. None too where a
    module has hooks or a bias."""
    if _hooked(linears) or not all(isinstance(lin, nn.Linear) and lin.bias is None for lin in linears):
        return None
    return consecutive_rows([lin.weight for lin in linears])


def joined_product(x: Tensor, *linears: nn.Module) -> Tensor | None:
    """x times the linears' weights in one product, their outputs side by side, where join_weights made them one
    (joined_weight; layers of another kind through their class's `joined_product`); else None."""
    if isinstance(linears[0], nn.Linear):
        w = joined_weight(*linears)
        return None if w is None else F.linear(x, w)
    product = getattr(type(linears[0]), "joined_product", None)
    if product is None or _hooked(linears) or not all(type(lin) is type(linears[0]) for lin in linears):
        return None
    return product(x, *linears)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if _fused(x) and x.dtype == self.weight.dtype and x.shape[-1] <= layer_ops().MAX_ROW:
            return layer_ops().rms_norm(x, self.weight, self.eps)
        return self.reference(x)

    def add(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, its norm): a residual add and the norm after it."""
        if _fused(x) and x.dtype == self.weight.dtype == delta.dtype and x.shape[-1] <= layer_ops().MAX_ROW:
            return layer_ops().add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self.reference(x)

    def reference(self, x: Tensor) -> Tensor:
        # Normalize in fp32 whatever the model dtype, then scale in the model dtype (as HF does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies theta^(-2i/d), i < d/2, with linear or Llama-3.1 scaling when configured."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: leave high frequencies alone, divide low frequencies by `factor`, blend in between.
    old_len = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE: dims [0, d/2) pair with [d/2, d), matching HF's q/k weight layout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._recent: dict = {}              # (ids shape, dtype) -> (ids, inv_freq, cos, sin) of the last CPU call
        self._positions: dict = {}           # (n, dtype, device) -> (inv_freq, cos, sin) of positions [0, n)

    def cos_sin(self, ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # On a CPU, strategies that rotate every stored key after reading it (KIVI*, XQuant) ask each layer for the
        # same positions in a decode step: the last table of each shape is reused (comparing B*T ids costs far less
        # than d-wide sines). On a GPU nothing is kept: the comparison would sync, and CUDA graphs replay the step.
        # Only without autograd: a table made under inference_mode cannot enter a graph that records gradients.
        memo = ids.device.type == "cpu" and not torch.is_grad_enabled()
        key = (tuple(ids.shape), dtype)
        last = self._recent.get(key) if memo else None
        if last is not None and last[1] is self.inv_freq and torch.equal(last[0], ids):
            return last[2], last[3]
        angles = ids.float()[..., None] * self.inv_freq          # (B, T, d/2), fp32
        emb = torch.cat((angles, angles), dim=-1)[:, None]       # (B, 1, T, d): broadcast over heads
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        if memo:
            if len(self._recent) > 4:
                self._recent.clear()
            self._recent[key] = (ids.clone(), self.inv_freq, cos, sin)
        return cos, sin

    def position_tables(self, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin (n, d) of positions 0 .. n-1, made once and kept: a kernel that rotates every stored key
        (KIVI*'s) reads them in every decode step. The last pair made is kept, except while a CUDA graph is being
        captured, where making them is part of the graph (a graph's warm-up run makes and keeps them first)."""
        key = (n, dtype, self.inv_freq.device)
        kept = self._positions.get(key)
        if kept is not None and kept[0] is self.inv_freq:
            return kept[1], kept[2]
        cos, sin = self.cos_sin(torch.arange(n, device=self.inv_freq.device)[None], dtype)    # (1, 1, n, d) each
        cos, sin = cos[0, 0], sin[0, 0]
        if not (self.inv_freq.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._positions = {key: (self.inv_freq, cos, sin)}
        return cos, sin

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, q: Tensor, k: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Rotate q (B, Hq, T, d) and k (B, Hkv, T, d) to positions ids (B, T)."""
        if _fused(q):
            return layer_ops().rope_qk(q, k, ids, self.inv_freq)
        return self.reference(q, k, ids)

    def reference(self, q: Tensor, k: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(ids, q.dtype)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    def apply(self, x: Tensor, ids: Tensor) -> Tensor:
        """Rotate one tensor (B, H, T, d), e.g. keys stored before RoPE and rotated after dequantization: x cos,
        then each half's sin term added in place (rotate's result up to rounding, in three passes instead of five:
        this runs over every stored key in a decode step)."""
        return self.apply_tables(x, *self.cos_sin(ids, x.dtype))

    @staticmethod
    def apply_tables(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """apply with the tables of cos_sin given (made once and shared, e.g. by every layer of a decode step)."""
        h = x.shape[-1] // 2
        out = x * cos
        out[..., :h].addcmul_(x[..., h:], sin[..., :h], value=-1)
        out[..., h:].addcmul_(x[..., :h], sin[..., h:])
        return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.sliding_window = cfg.sliding_window
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.rope = rope

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project x (B, T, hidden) to q (B, Hq, T, d) and k, v (B, Hkv, T, d), before RoPE."""
        B, T, _ = x.shape
        joined = joined_product(x, self.q_proj, self.k_proj, self.v_proj) if _fused(x) else None
        if joined is not None:                      # one product; q, k and v are views of its rows
            kv = self.n_kv_heads * self.head_dim
            q, k, v = joined.split([self.n_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x: Tensor, pos: Positions | StaticStep, cache: LayerCache | None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        if cache is None:
            q, k = self.rope(q, k, pos.ids)
            out = attend(q, k, v, pos.mask)
        elif isinstance(pos, StaticStep):
            out = cache.decode_static(x, q, k, v, pos)
        elif cache.simulated:
            out = cache.simulate(x, q, k, v, pos)
        elif T == 1 and pos.start > 0:
            out = cache.decode(x, q, k, v, pos)
        else:
            out = cache.prefill(x, q, k, v, pos)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if _fused(x):
            both = joined_product(x, self.gate_proj, self.up_proj)
            gate, up = both.chunk(2, dim=-1) if both is not None else (self.gate_proj(x), self.up_proj(x))
            return self.down_proj(layer_ops().silu_mul(gate, up))
        return self.down_proj(self.reference(self.gate_proj(x), self.up_proj(x)))

    @staticmethod
    def reference(gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, rope, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, pos: Positions | StaticStep, cache: LayerCache | None) -> Tensor:
        x, h = self.mlp_norm.add(x, self.attn(self.attn_norm(x), pos, cache))
        return x + self.mlp(h)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg                      # the whole model's, also when sharded
        self.shard = None                   # this rank's kvzoo.models.tp.Shard under tensor parallelism
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg)    # one table of frequencies, shared by every layer
        self.layers = nn.ModuleList(Block(cfg, self.rope, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    def join_projections(self) -> "Transformer":
        """Every layer's q, k, v weights as one tensor and its MLP's gate and up as another (join_weights): on a
        GPU each group's products run as one GEMM (4-bit layers too: kvzoo.weightquant.awq.quantize_rtn joins them).
        The loaders call this; moving the model to another device or dtype undoes it (the products still run, one
        each)."""
        for block in self.layers:
            join_weights(block.attn.q_proj, block.attn.k_proj, block.attn.v_proj)
            join_weights(block.mlp.gate_proj, block.mlp.up_proj)
        return self

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, spec: CacheSpec | str, batch_size: int, max_len: int, mode: str = "streaming",
                  prompt: int = 0) -> ModelCache:
        """A fresh cache for `batch_size` rows of at most `max_len` tokens (prompt + generation).
        mode "streaming" stores and attends for real; "simulated" makes every token's attention see
        what token-by-token decoding would have shown it, after an exact prefill of the first `prompt`
        tokens (see kvzoo/cache/base.py)."""
        if isinstance(spec, str):
            spec = CacheSpec.parse(spec)
        if max_len > self.cfg.max_position_embeddings:
            raise ValueError(f"{max_len} tokens exceed the model's context of "
                             f"{self.cfg.max_position_embeddings} (max_position_embeddings)")
        return ModelCache(spec, [block.attn for block in self.layers], batch_size, max_len, mode, prompt,
                          sharded=self.shard is not None)

    def forward(self, tokens: Tensor, cache: ModelCache | None = None, pad: Tensor | None = None,
                last_only: bool = False) -> Tensor:
        """Logits for tokens (B, T), continuing `cache` if given (its next free slot is the chunk's
        start). pad (B,) = left padding of each row, counted from the first slot. Returns (B, T, vocab),
        or (B, 1, vocab) with last_only."""
        B, T = tokens.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"cache holds at most {cache.max_len} tokens; {start} stored + {T} new do not fit")
        has_pad = pad is not None   # callers pass pad only when some row is padded
        if pad is None:
            pad = torch.zeros(B, dtype=torch.long, device=tokens.device)
        pos = Positions.make(start, T, pad, self.cfg.sliding_window, has_pad)
        x = self.embed(tokens)                                   # (B, T, hidden)
        for i, block in enumerate(self.layers):
            x = block(x, pos, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.length = start + T
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def decode_static(self, token: Tensor, cache: ModelCache, step: StaticStep) -> Tensor:
        """Logits (B, vocab) of one token (B, 1) written at the device-held slot of `step`: fixed shapes,
        no host sync, so a CUDA graph can hold it (kvzoo/graphs.py). Does not advance cache.length."""
        try:
            x = self.embed(token)                                # (B, 1, hidden)
            for i, block in enumerate(self.layers):
                x = block(x, step, cache.layers[i])
            return self.lm_head(self.norm(x))[:, -1]
        finally:    # also when a layer fails (out of memory): a graph capture must not end with work left apart
            step.join()
