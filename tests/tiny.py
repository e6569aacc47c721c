"""Tiny random HF checkpoints built offline for tests (saved with transformers' save_pretrained).

transformers (the `test` extra) is imported when a checkpoint is built, so a test that builds one is skipped
where it is missing, and the modules that import these helpers still collect."""

from pathlib import Path

import pytest
import torch


def tiny_llama(path: Path, **overrides) -> Path:
    """A 2-layer GQA Llama (vocab 97, hidden 64) saved as model.safetensors + config.json in `path`."""
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    tie_word_embeddings=False)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(settings | overrides)))
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)


def tiny_mistral(path: Path, **overrides) -> Path:
    """A 2-layer GQA Mistral (vocab 97, hidden 64) with a sliding window of 6 tokens, saved like tiny_llama."""
    settings = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=16,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=6)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**(settings | overrides)))
    model.save_pretrained(path, safe_serialization=True)
    return Path(path)
