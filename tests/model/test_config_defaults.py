"""Keys absent from a config.json take the defaults transformers gives them (LlamaConfig, MistralConfig)."""

import pytest

from kvzoo.config import ModelConfig

MINIMAL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("arch, cls", [("LlamaForCausalLM", "LlamaConfig"), ("MistralForCausalLM", "MistralConfig")])
def test_absent_keys_take_transformers_defaults(arch, cls):
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, cls)(**MINIMAL)
    ours = ModelConfig.from_hf({**MINIMAL, "architectures": [arch]})
    assert ours.rms_norm_eps == hf.rms_norm_eps == 1e-6
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.n_kv_heads == hf.num_key_value_heads and ours.head_dim == MINIMAL["hidden_size"] // 4
    assert ours.sliding_window == getattr(hf, "sliding_window", None)
    assert ours.rope_theta == 10000.0
    assert ours.bos_token_id == hf.bos_token_id and ours.eos_token_ids == (hf.eos_token_id,)


def test_a_null_sliding_window_stays_off():
    ours = ModelConfig.from_hf({**MINIMAL, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert ours.sliding_window is None
