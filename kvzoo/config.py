"""Model configuration: a frozen dataclass built from a Hugging Face ``config.json``.

Only the architectures kvzoo implements by hand are accepted, by exact name; anything else is refused
with a message that lists what is supported. Both spellings of RoPE settings that appear in the wild
are read: the legacy ``rope_theta`` + ``rope_scaling`` keys (Hub checkpoints) and the
``rope_parameters`` dict that transformers 5 writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# keys without a default: the model's shapes
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", "factor": 8.0, ...} or None for plain RoPE
    rope_scaling: dict | None = None
    # Mistral: a query attends to itself and the previous sliding_window - 1 tokens; None = full causal
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def n_rep(self) -> int:
        """How many query heads share one key/value head (grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, source: str | Path | dict) -> "ModelConfig":
        """Build from a HF config: a folder holding config.json, the file itself, or its parsed dict."""
        if isinstance(source, dict):
            hf, where = source, "config dict"
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"no config.json at {path}; a model folder needs a Hugging Face config.json")
            try:
                hf = json.loads(path.read_text())
            except ValueError as err:       # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{path} is not valid JSON ({err}); a model folder needs the Hugging Face "
                                 "config.json its checkpoint was saved with") from None
            if not isinstance(hf, dict):
                raise ValueError(f"{path} holds a JSON {type(hf).__name__}, not the object of a Hugging Face config")
            where = str(path)

        archs = hf.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(
            hf.get("model_type", ""), hf.get("model_type", "<none>"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} in {where}; "
                             f"kvzoo implements: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{where} sets {flag}=true; kvzoo's Llama/Mistral have no bias terms")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where} uses hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")

        rope_theta, rope_scaling = _rope_settings(hf, where)
        missing = [key for key in REQUIRED_KEYS if key not in hf]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}; a {arch} config needs {', '.join(REQUIRED_KEYS)}")
        n_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        mistral = arch == "MistralForCausalLM"
        # absent keys take transformers' defaults (LlamaConfig / MistralConfig)
        window = hf.get("sliding_window", 4096) if mistral else None
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or (8 if mistral else n_heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096 * 32 if mistral else 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_ids=eos_ids,
        )


def _rope_settings(hf: dict, where: str) -> tuple[float, dict | None]:
    """Return (rope_theta, scaling dict or None) from either config spelling."""
    params = dict(hf.get("rope_parameters") or {})
    if not params and hf.get("rope_scaling"):
        params = dict(hf["rope_scaling"])
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{where} uses rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    params["rope_type"] = rope_type
    return float(theta), params
