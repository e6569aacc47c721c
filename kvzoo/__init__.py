"""kvzoo: a pure-PyTorch Llama/Mistral zoo whose attention hands q, k, v to pluggable KV-cache strategies.

    import kvzoo
    model, tokenizer = kvzoo.load_model()                  # embedded SmolLM2-135M-Instruct
    out = kvzoo.generate(model, tokenizer, "The capital of France is", max_new_tokens=8, cache="fp16")
    kvzoo.list_caches()                                    # ['fp16', ...]

Read in this order: config.py, models/llama.py, cache/base.py, cache/int8.py, cache/store.py, generate.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvzoo.cache.base import CacheSpec, list_caches
from kvzoo.config import ModelConfig
from kvzoo.generate import Generation, generate

__all__ = ["CacheSpec", "Generation", "ModelConfig", "generate", "list_caches", "load_model"]


def load_model(model: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "float32", progress: bool = False, shard=None):
    """(Transformer, Tokenizer) for a local HF folder, a hub id, or None for the embedded default; `shard` (a
    kvzoo.models.tp.Shard) loads one rank's slices for tensor parallelism."""
    from kvzoo.models.loader import load_weights, resolve_model_dir
    from kvzoo.tokenizer import Tokenizer

    folder = resolve_model_dir(model)
    return (load_weights(folder, device=device, dtype=dtype, progress=progress, shard=shard),
            Tokenizer.from_pretrained(folder))
