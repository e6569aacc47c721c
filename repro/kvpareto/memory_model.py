"""Total inference memory, estimated and measured (KV Pareto §3 and Appendix I).

    total = model bytes + KV-cache bytes + peak activation bytes

Estimates (no run needed):
    model       the bytes of every parameter and persistent buffer (4-bit W4Linear codes, scales and zeros
                included; a tied embedding counted once)
    KV          the strategy's documented bytes per token (LayerCache.formula_nbytes) at M tokens
    activation  Appendix I, eq. 6-8, in bytes: the attention score matrix of a prefill chunk,
                n_heads x c x M x 4 (fp32 softmax; c = M without chunked prefill), against the logits,
                n_logits x vocab x 4 (n_logits = 1 for generation, which only needs the last token's logits;
                M for perplexity); the larger of the two
Measured (`measure`): prefill M tokens of a batch-1 prompt (chunked or not) through the strategy, then
    model       the bytes of the parameter tensors held
    KV          cache.nbytes(), the bytes of the tensors the strategy holds
    activation  CUDA: torch.cuda.max_memory_allocated() during the prefill minus what was allocated before
                (model + the preallocated cache buffers); on CPU there is no allocator statistic, so it is None
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvzoo.cache.base import CacheSpec
from kvzoo.generate import prefill


@dataclass
class Memory:
    model: int
    kv: int
    activation: int | None

    @property
    def total(self) -> int | None:
        return None if self.activation is None else self.model + self.kv + self.activation

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def model_bytes(model) -> int:
    """Parameters and persistent buffers (state_dict), each storage counted once (tied embeddings)."""
    held = {(t.data_ptr(), t.numel()): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in held.values())


def activation_estimate(model, tokens: int, chunk: int | None, logits_rows: int = 1) -> int:
    """Appendix I: max(attention scores of one chunk, logits), in bytes (fp32 scores and logits)."""
    cfg = model.cfg
    c = min(chunk or tokens, tokens)
    return max(cfg.n_heads * c * tokens * 4, logits_rows * cfg.vocab_size * 4)


def estimate(model, cache: str | CacheSpec, tokens: int, chunk: int | None = None) -> Memory:
    """Memory of a batch-1 generation whose prompt is `tokens` long, without running it."""
    kv = model.new_cache(cache, batch_size=1, max_len=tokens)
    kv_bytes = sum(layer.formula_nbytes(tokens) for layer in kv.layers)
    return Memory(model_bytes(model), kv_bytes, activation_estimate(model, tokens, chunk))


@torch.inference_mode()
def measure(model, cache: str | CacheSpec, tokens: int, chunk: int | None = None, seed: int = 0) -> Memory:
    """Prefill `tokens` random ids (batch 1) through the strategy and measure what it holds."""
    device = model.device
    ids = torch.randint(0, model.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    kv = model.new_cache(cache, batch_size=1, max_len=tokens)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    prefill(model, ids.to(device), kv, None, chunk)
    activation = None
    if cuda:
        torch.cuda.synchronize()
        activation = torch.cuda.max_memory_allocated(device) - before
    return Memory(model_bytes(model), kv.nbytes(), activation)
