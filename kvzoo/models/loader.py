"""Load a Hugging Face safetensors checkpoint into kvzoo's hand-written model.

    resolve_model_dir(ref)  None -> the embedded default (converted from its GGUF on first use),
                            a local folder -> itself, a hub id "owner/name" -> weights/owner--name/,
                            downloaded with huggingface_hub.snapshot_download if not there yet
    load_weights(dir, ...)  config.json -> ModelConfig -> Transformer built on the meta device, then
                            every tensor read lazily from safetensors (single file or sharded index),
                            shape- and dtype-checked, cast, and assigned

The HF -> kvzoo name table below is literal: every kvzoo parameter has exactly one checkpoint key,
every checkpoint key must be used, and any mismatch is an error naming the tensor and its file.
Pickled checkpoints (pytorch_model.bin) are never loaded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from kvzoo.config import ModelConfig
from kvzoo.models.gguf_import import DEFAULT_MODEL_NAME, ensure_default_model, weights_root
from kvzoo.models.llama import Transformer, rope_inv_freq
from kvzoo.models.tp import Shard, rank_slice, shard_modules

# HF checkpoint name -> kvzoo parameter name.
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attn.q_proj.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attn.k_proj.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attn.v_proj.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attn.o_proj.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down_proj.weight",
}
# Keys some exporters write that carry nothing we need (RoPE tables are recomputed from the config).
IGNORED_KEYS = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

HUB_FILES = ["*.safetensors", "*.json", "*.jinja", "tokenizer.model"]
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# what a checkpoint's tensors may hold, as safetensors headers name them (quantized or integer ones are not read)
CHECKPOINT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; accepted: float32, bfloat16, float16")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def hf_name_table(cfg: ModelConfig) -> dict[str, str]:
    """Every HF checkpoint key this config needs -> the kvzoo parameter it fills."""
    table = dict(GLOBAL_NAMES)
    if cfg.tie_word_embeddings:
        del table["lm_head.weight"]     # lm_head shares embed.weight
    for i in range(cfg.n_layers):
        table.update({hf.format(i=i): ours.format(i=i) for hf, ours in LAYER_NAMES.items()})
    return table


def resolve_model_dir(ref: str | Path | None) -> Path:
    """A folder holding config.json + safetensors for `ref` (see the module docstring)."""
    if ref is None:
        return ensure_default_model()
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"--model {ref} is a file; pass the folder that holds config.json and *.safetensors")
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(ref)):
        raise FileNotFoundError(f"model {ref!r} not found: it is not a local folder, nor a Hugging Face "
                                "hub id like 'meta-llama/Llama-3.1-8B-Instruct'")
    local = weights_root() / str(ref).replace("/", "--")
    if (local / "config.json").is_file() and any(local.glob("*.safetensors")):
        return local
    from huggingface_hub import snapshot_download
    try:
        snapshot_download(repo_id=str(ref), local_dir=local, allow_patterns=HUB_FILES)
    except Exception as err:  # network, auth, unknown repo: all end the same way for the user
        raise FileNotFoundError(f"could not download {ref!r} from the Hugging Face Hub into {local} "
                                f"({type(err).__name__}: {err}); pass a local folder with --model instead") from err
    return local


def _checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint key -> safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = {key: model_dir / name for key, name in weight_map.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index ({type(err).__name__}: {err}); it must be JSON "
                             'with a "weight_map" object of tensor name -> shard file') from None
        missing = sorted({file.name for file in files.values() if not file.is_file()})
        if missing:
            raise FileNotFoundError(f"shard {missing[0]} named in {index} is not in {model_dir}"
                                    + (f" (nor {len(missing) - 1} other shard(s))" if len(missing) > 1 else "")
                                    + "; download or copy every shard the index lists")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        with open_safetensors(single) as f:
            return {key: single for key in f.keys()}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt*")):
        raise ValueError(f"{model_dir} holds only pickled weights; kvzoo loads safetensors only "
                         "(convert them with transformers' save_pretrained(safe_serialization=True))")
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def open_safetensors(file: Path):
    """safe_open(file), a damaged file refused with what to do about it."""
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as err:
        raise ValueError(damaged(file, err)) from None


def damaged(file: Path, err: Exception) -> str:
    """The message for a safetensors file that cannot be read: what is wrong and how to get a good copy
    (kvzoo never deletes a checkpoint itself)."""
    folder = file.parent
    if folder == weights_root() / DEFAULT_MODEL_NAME:
        fix = f"delete the folder {folder} and run again: the embedded model is converted again from its GGUF"
    elif folder.parent == weights_root() and "--" in folder.name:
        fix = f"delete the folder {folder} and run again: it is downloaded again from the Hugging Face Hub"
    else:
        fix = "download or convert the checkpoint again"
    return f"{file} is corrupted or truncated (safetensors: {err}); {fix}"


def load_weights(model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = torch.float32, progress: bool = False,
                 shard: Shard | None = None) -> Transformer:
    """Build the model from model_dir/config.json and fill it from its safetensors. With `shard` (tensor
    parallelism, kvzoo/models/tp.py) the model holds this rank's slices, and only those bytes are read."""
    model_dir = Path(model_dir)
    dtype = parse_dtype(dtype)
    cfg = ModelConfig.from_hf(model_dir)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = model.state_dict()                       # whole shapes, as the checkpoint holds them
    if shard is not None:
        shard_modules(model, shard)
    files = _checkpoint_files(model_dir)
    table = hf_name_table(cfg)

    missing = [key for key in table if key not in files]
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensor(s) the config needs, "
                         f"e.g. {missing[:3]}")
    unused = [key for key in files if key not in table and not IGNORED_KEYS.fullmatch(key)
              and not (cfg.tie_word_embeddings and key == "lm_head.weight")]
    if unused:
        raise ValueError(f"checkpoint in {model_dir} has tensor(s) kvzoo does not know, e.g. "
                         f"{unused[:3]} in {files[unused[0]].name}; is config.json the right one?")

    handles = {file: open_safetensors(file) for file in dict.fromkeys(files[key] for key in table)}
    held = {file: set(handle.keys()) for file, handle in handles.items()}
    for hf_key, ours in table.items():          # every shape and dtype from the headers, before any data is read
        if hf_key not in held[files[hf_key]]:
            raise ValueError(f"model.safetensors.index.json puts {hf_key} in {files[hf_key].name}, which does not "
                             "hold it; the index and the shards do not belong together")
        header = handles[files[hf_key]].get_slice(hf_key)
        if tuple(header.get_shape()) != tuple(expected[ours].shape):
            raise ValueError(f"tensor {hf_key} in {files[hf_key].name} has shape {tuple(header.get_shape())}; "
                             f"config.json implies {tuple(expected[ours].shape)}")
        if header.get_dtype() not in CHECKPOINT_DTYPES:
            raise ValueError(f"tensor {hf_key} in {files[hf_key].name} holds {header.get_dtype()} values; kvzoo "
                             f"loads float weights: {', '.join(f'{k} ({v})' for k, v in CHECKPOINT_DTYPES.items())}")
    state: dict[str, torch.Tensor] = {}
    for hf_key, ours in tqdm(table.items(), desc="loading weights", unit="tensor", disable=not progress):
        part = rank_slice(ours, shard, tuple(expected[ours].shape))
        try:
            handle = handles[files[hf_key]]
            tensor = handle.get_tensor(hf_key) if part is None else handle.get_slice(hf_key)[part]
        except SafetensorError as err:
            raise ValueError(damaged(files[hf_key], err)) from None
        state[ours] = tensor.to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight    # assign=True replaced the shared Parameter
    model.rope.inv_freq = rope_inv_freq(cfg).to(device)    # non-persistent buffer, still on meta
    return model.join_projections().eval()
