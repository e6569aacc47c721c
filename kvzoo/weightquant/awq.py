"""4-bit weight-only quantization of the model's linear layers: plain round-to-nearest (RTN) and AWQ.

Paper: Lin et al., "AWQ: Activation-aware Weight Quantization" (MLSys 2024), as KV Pareto uses it
(kv-pareto.md §4.3): asymmetric 4-bit, groups of 128 input channels, activations kept at 16 bits (w4a16).

Storage per linear layer (N outputs, K inputs, G = group_size): kvzoo.kernels.w4a16.W4Weight, codes int32 (N,
K/8) + fp16 scale and zero (N, K/G), codes in that module's panel order: 0.5 + 4/G bytes per weight instead of
2. Embeddings and lm_head stay at the model's precision (as AWQ does). On CUDA the product runs in the w4a16
Triton kernel; elsewhere the weight is dequantized and multiplied in torch (the kernel's reference).

AWQ: a few weights matter more because their input channels carry large activations. Scaling input channel
k of W up by s_k (and the activation down by s_k) makes its weights quantize with relatively less error:
    Y = X W^T = (X diag(s)^-1) (W diag(s))^T,   quantize W diag(s) instead of W.
s = mean|x_k|^α over calibration tokens, normalized to a geometric mean of 1; α in a grid on [0, 1] is chosen
per group of layers sharing an input to minimize ||X W^T - (X/s) Q(W diag(s))^T||^2 on the calibration
activations (α = 0 is RTN). diag(s)^-1 is folded into the operator before, where that is exact:
    q, k, v    <- attn_norm's weight      gate, up <- mlp_norm's weight      down <- up's output rows
o_proj follows attention, which is linear in V only per KV head; for GQA the fold would need one scale per
KV-head channel shared by its query heads, so o_proj is quantized by RTN (AWQ does the same when v_proj and
o_proj differ in shape). Calibration: token windows from the last documents of the C4 sample, disjoint from
the windows the perplexity scripts score (its first tokens). AWQ's weight-clipping search is not done.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from kvzoo.cache.kvquant import fake_quantize
from kvzoo.kernels.w4a16 import (BITS, PANEL_ROWS, W4Weight, in_panels, quantize_weight, w4a16_matmul,
                                 w4a16_matmul_ref)
from kvzoo.models.llama import consecutive_rows

ALPHAS = [i / 20 for i in range(21)]
METHODS = ("w16", "w4-rtn", "w4-awq")


class W4Linear(nn.Module):
    """A bias-free linear layer whose weight is held as 4-bit codes (kvzoo.kernels.w4a16.W4Weight)."""

    def __init__(self, weight: Tensor, group_size: int):
        super().__init__()
        w = quantize_weight(weight, group_size)
        self.register_buffer("codes", w.codes)
        self.register_buffer("scale", w.scale)
        self.register_buffer("zero", w.zero)
        self.group_size, self.in_features, self.out_features = group_size, weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype

    @property
    def w4(self) -> W4Weight:
        return W4Weight(self.codes, self.scale, self.zero, self.group_size, (self.out_features, self.in_features))

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (N, K) at the model's dtype, for code that reads W (XQuant's SVD)."""
        return self.w4.dequantize(self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return _product(x, self.w4)

    @staticmethod
    def join(*layers: "W4Linear") -> None:
        """Make the codes, scales and zeros of layers with one input size and group size consecutive rows of one
        tensor each, each layer's buffers views of them, so that their products can run as one (joined_product;
        kvzoo.models.llama.join_weights calls this). Layers in panel order (kvzoo.kernels.w4a16) whose rows do not
        meet at whole panels (every layer but the last a multiple of 64 outputs) stay apart."""
        if not _one_input(layers):
            raise ValueError("4-bit layers join only with one input size and group size, got "
                             f"{[(lin.in_features, lin.group_size) for lin in layers]}")
        if in_panels(layers[0].in_features) and any(lin.out_features % PANEL_ROWS for lin in layers[:-1]):
            return
        for name in ("codes", "scale", "zero"):
            joined = torch.cat([getattr(lin, name) for lin in layers])
            for lin, part in zip(layers, joined.split([lin.out_features for lin in layers])):
                setattr(lin, name, part)

    @staticmethod
    def joined_product(x: Tensor, *layers: "W4Linear") -> Tensor | None:
        """x times the layers' weights in one W4A16 product, their outputs side by side, where join made their
        buffers one tensor each and nothing has replaced them since; else None."""
        first = layers[0]
        if not _one_input(layers):
            return None
        codes, scale, zero = (consecutive_rows([getattr(lin, name) for lin in layers])
                              for name in ("codes", "scale", "zero"))
        if codes is None or scale is None or zero is None:
            return None
        rows = sum(lin.out_features for lin in layers)
        return _product(x, W4Weight(codes, scale, zero, first.group_size, (rows, first.in_features)))


def _one_input(layers: tuple[W4Linear, ...]) -> bool:
    """Whether the layers share one input size and group size (what joining their codes needs)."""
    return len({(lin.in_features, lin.group_size) for lin in layers}) == 1


def _product(x: Tensor, w: W4Weight) -> Tensor:
    """x @ dequant(w)ᵀ: the W4A16 kernel on a GPU, the reference elsewhere (and under Triton's interpreter)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if x.is_cuda and not interpret:
        return w4a16_matmul(x, w)
    return w4a16_matmul_ref(x, w)


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _owner(block: nn.Module, name: str) -> nn.Module:
    return block.attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp


def quantize_rtn(model: nn.Module, group_size: int = 128) -> nn.Module:
    """Replace every linear layer of every block by its 4-bit RTN W4Linear (in place); q, k, v and gate, up are
    joined (Transformer.join_projections), so that on a GPU each group's products run as one."""
    for block in model.layers:
        for name in LINEARS:
            owner = _owner(block, name)
            setattr(owner, name, W4Linear(getattr(owner, name).weight.data, group_size))
    return model.join_projections()


@torch.no_grad()
def _inputs(model: nn.Module, calib: Tensor) -> list[dict[str, Tensor]]:
    """Per block, the (tokens, K) inputs of its three scaled groups: attention input (after attn_norm),
    MLP input (after mlp_norm) and down_proj's input."""
    found: list[dict[str, Tensor]] = [dict() for _ in model.layers]
    hooks = []
    for i, block in enumerate(model.layers):
        def keep(name, i=i):
            return lambda module, args: found[i].setdefault(name, []).append(args[0].flatten(0, -2).float())
        hooks += [block.attn.q_proj.register_forward_pre_hook(keep("qkv")),
                  block.mlp.gate_proj.register_forward_pre_hook(keep("gate_up")),
                  block.mlp.down_proj.register_forward_pre_hook(keep("down"))]
    try:
        for row in calib:
            model(row[None].to(model.device))
    finally:
        for h in hooks:
            h.remove()
    return [{k: torch.cat(v) for k, v in d.items()} for d in found]


def _best_scale(x: Tensor, weights: list[Tensor], group_size: int) -> tuple[Tensor, float]:
    """AWQ's grid search: the s = mean|x|^α (geometric mean 1) minimizing the outputs' squared error."""
    w = torch.cat([w.float() for w in weights])                                      # (N, K)
    reference = x @ w.T                                                              # (tokens, N)
    mean = x.abs().mean(0).clamp_min(1e-8)                                           # (K,)
    best = (float("inf"), None, 0.0)
    for alpha in ALPHAS:
        s = mean ** alpha
        s = s / (s.max() * s.min()).sqrt()
        wq = fake_quantize(w * s, BITS, group_size) / s                              # quantize_weight's values
        err = (x @ wq.T - reference).pow(2).mean().item()
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


@torch.no_grad()
def quantize_awq(model: nn.Module, calib: Tensor, group_size: int = 128, max_tokens: int = 4096) -> list[dict]:
    """AWQ in place: per block, search and fold the scales of q/k/v, gate/up and down, then quantize every
    linear layer to 4 bits. calib (n, L) token ids. Returns the chosen α per block and group."""
    inputs = _inputs(model, calib)
    chosen = []
    for block, x in zip(model.layers, inputs):
        attn, mlp = block.attn, block.mlp
        sub = {k: v[torch.randperm(v.shape[0], generator=torch.Generator().manual_seed(0))[:max_tokens]].to(
            attn.q_proj.weight.device) for k, v in x.items()}
        s, a_qkv = _best_scale(sub["qkv"], [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], group_size)
        block.attn_norm.weight.div_(s.to(block.attn_norm.weight.dtype))
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
            lin.weight.mul_(s.to(lin.weight.dtype))
        s, a_mlp = _best_scale(sub["gate_up"], [mlp.gate_proj.weight, mlp.up_proj.weight], group_size)
        block.mlp_norm.weight.div_(s.to(block.mlp_norm.weight.dtype))
        for lin in (mlp.gate_proj, mlp.up_proj):
            lin.weight.mul_(s.to(lin.weight.dtype))
        s, a_down = _best_scale(sub["down"], [mlp.down_proj.weight], group_size)
        mlp.up_proj.weight.div_(s.to(mlp.up_proj.weight.dtype)[:, None])            # rows: down's input channels
        mlp.down_proj.weight.mul_(s.to(mlp.down_proj.weight.dtype))
        chosen.append({"qkv": a_qkv, "gate_up": a_mlp, "down": a_down})
    quantize_rtn(model, group_size)
    return chosen


def calibration_ids(tokenizer, n: int = 32, seq_len: int = 512) -> Tensor:
    """n windows of seq_len tokens from the last documents of the C4 sample (the end of the file, which the
    perplexity scripts' first windows do not reach): (n, seq_len)."""
    import json

    from kvzoo.eval.datasets import dataset_path

    with dataset_path("c4").open(encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f if line.strip()]
    ids: list[int] = []
    for doc in reversed(docs):
        ids += tokenizer.encode(doc)
        if len(ids) >= n * seq_len:
            break
    if len(ids) < n * seq_len:
        raise ValueError(f"the C4 sample has fewer than {n * seq_len} tokens for calibration")
    return torch.tensor(ids[:n * seq_len]).view(n, seq_len)


def group_for(model: nn.Module) -> int:
    """The paper's 128 when it divides every layer's input width, else 64 or 32 (SmolLM2's 576 = 9 x 64)."""
    widths = {model.cfg.hidden_size, model.cfg.intermediate_size, model.cfg.n_heads * model.cfg.head_dim}
    for g in (128, 64, 32):
        if all(w % g == 0 for w in widths):
            return g
    raise ValueError(f"no group size of 128, 64 or 32 divides the layer widths {sorted(widths)}")


def quantize_weights(model: nn.Module, tokenizer, method: str, group_size: int | None = None,
                     calib_windows: int = 32):
    """Apply `method` (w16: nothing, w4-rtn, w4-awq) to the model in place; returns AWQ's choices or None.
    group_size None: group_for(model)."""
    if method not in METHODS:
        raise ValueError(f"unknown weight quantization {method!r}; accepted: {', '.join(METHODS)}")
    if method != "w16" and getattr(model, "shard", None) is not None:
        raise ValueError(f"{method} weights serve one process; a tensor-parallel model (torchrun) keeps w16 weights")
    group_size = group_size or group_for(model)
    if method == "w4-rtn":
        quantize_rtn(model, group_size)
    elif method == "w4-awq":
        return quantize_awq(model, calibration_ids(tokenizer, calib_windows), group_size)
    return None
