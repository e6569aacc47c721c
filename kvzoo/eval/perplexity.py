"""Teacher-forced perplexity over non-overlapping windows (the GPTQ protocol), after a prompt.

The whole text is tokenized once; window w is tokens[w*L : (w+1)*L]. Its first P tokens are the prompt: they
are prefilled exact (every strategy reads them as a streaming prefill would), a strategy takes its statistics
from them (InnerQ's key norm, KV Pareto's smoothing mean, SQuat's query subspace), and they are not scored;
the window contributes the mean cross-entropy of the predictions of tokens max(P, 1)..L-1, and perplexity =
exp(mean over windows). P is one default for every strategy, `default_prompt(L)` = min(256, L // 8) (256 at
L = 2048), and is printed with every result. Every window is a forward through a fresh cache: in "simulated"
mode (the papers' protocol) every token sees the cache as token-by-token decoding would have shown it; in
"streaming" mode a real prefill of the prompt is followed by token-by-token decoding through the packed
storage; "graph" mode decodes those tokens through the step that generation and bench_decode replay
(`kvzoo.graphs.decoder`: a CUDA graph of the whole step where the strategy has one, with its fused kernels,
else the piecewise step), so its perplexity checks the fast path against "streaming". The cache's bytes after
the window are reported beside the fp16 cache's bytes for the same tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvzoo.cache.base import CacheSpec, fp16_kv_nbytes
from kvzoo.graphs import decoder
from kvzoo.models.llama import Transformer


def default_prompt(seq_len: int) -> int:
    """The prompt every strategy gets unless told otherwise: min(256, seq_len // 8) tokens."""
    return min(256, seq_len // 8)


MODES = ("simulated", "streaming", "graph")
# keyword -> the option of scripts/perplexity.py that sets it, to name it in check_args' messages
FLAGS = {key: "--" + key.replace("_", "-") for key in ("seq_len", "max_windows", "prompt", "batch_size",
                                                        "prefill_chunk", "mode")}


def check_args(seq_len: int, max_windows: int | None = None, prompt: int | None = None, batch_size: int = 1,
               prefill_chunk: int | None = None, mode: str = "simulated", names: dict[str, str] | None = None) -> int:
    """Refuse settings perplexity() cannot run, before a model or text is loaded; return the prompt (the default
    for None). Messages name each setting by its keyword, or as `names` maps it (a script's FLAGS)."""
    name = {key: key for key in FLAGS} | (names or {})
    if seq_len < 2:
        raise ValueError(f"{name['seq_len']} must be at least 2, got {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"{name['max_windows']} must be >= 1, got {max_windows}")
    prompt = default_prompt(seq_len) if prompt is None else prompt
    if not 0 <= prompt < seq_len:
        raise ValueError(f"{name['prompt']} must be in [0, {name['seq_len']}={seq_len}), got {prompt}")
    if batch_size < 1:
        raise ValueError(f"{name['batch_size']} must be >= 1, got {batch_size}")
    if mode not in MODES:
        raise ValueError(f"unknown {name['mode']} {mode!r}; accepted: {', '.join(MODES)}")
    if prefill_chunk is not None and mode == "simulated":
        raise ValueError(f"{name['prefill_chunk']} applies to streaming and graph modes only; {name['mode']} is {mode}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"{name['prefill_chunk']} must be >= 1, got {prefill_chunk}")
    return prompt


@dataclass
class PerplexityResult:
    perplexity: float
    windows: int             # windows scored
    total_windows: int       # windows the whole text holds
    seq_len: int
    tokens: int              # tokens in the whole tokenized text
    scored_tokens: int       # predictions scored: windows * (seq_len - max(prompt, 1))
    prompt: int              # the first tokens of each window: prefilled exact, statistics from them, not scored
    cache: str
    mode: str
    kv_nbytes: int           # bytes held by the cache after one window
    fp16_kv_nbytes: int      # an fp16 K/V cache for the same window
    seconds: float

    @property
    def kv_ratio(self) -> float:
        return self.kv_nbytes / self.fp16_kv_nbytes

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_ratio": self.kv_ratio}


@torch.inference_mode()
def perplexity(model: Transformer, token_ids: list[int] | torch.Tensor, seq_len: int = 2048,
               max_windows: int | None = None, cache: str | CacheSpec = "fp16",
               mode: str = "simulated", prompt: int | None = None, batch_size: int = 1,
               prefill_chunk: int | None = None, progress: bool = True) -> PerplexityResult:
    """mode "simulated": one teacher-forced forward per window, the first `prompt` tokens read exact. mode
    "streaming": a real prefill of the prompt (at least one token), then every further token decoded one at a
    time through the packed storage (teacher-forced). mode "graph": as "streaming", the decode steps through
    kvzoo.graphs.decoder (CUDA graphs and the strategies' static steps on a GPU). Predictions of tokens
    max(prompt, 1)..L-1 are scored.
    prompt defaults to default_prompt(seq_len). `batch_size` windows run side by side. prefill_chunk
    (streaming, graph): prefill that many tokens at a time (chunked prefill)."""
    if isinstance(cache, str):
        cache = CacheSpec.parse(cache)
    prompt = check_args(seq_len, max_windows, prompt, batch_size, prefill_chunk, mode)
    if seq_len > model.cfg.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds the model's context of {model.cfg.max_position_embeddings}")
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    total_windows = ids.numel() // seq_len
    if total_windows == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    windows = total_windows if max_windows is None else min(total_windows, max_windows)

    first = max(prompt, 1)                                          # the first token scored (it has a context)
    start = time.perf_counter()
    nll = 0.0
    for w in tqdm(range(0, windows, batch_size), desc=f"perplexity ({cache.name}, {mode})", disable=not progress):
        n = min(batch_size, windows - w)
        tokens = ids[w * seq_len:(w + n) * seq_len].view(n, seq_len).to(model.device)   # (n, L)
        simulated = mode == "simulated"                              # graph mode decodes a streaming cache
        kv = model.new_cache(cache, batch_size=n, max_len=seq_len, mode="simulated" if simulated else "streaming",
                             prompt=prompt if simulated else 0)
        if simulated:
            logits = model(tokens, kv)                                                   # (n, L, V)
        else:
            step = prefill_chunk or first
            steps = [model(tokens[:, a:min(a + step, first)], kv) for a in range(0, first, step)]
            if mode == "streaming":
                steps += [model(tokens[:, t:t + 1], kv) for t in range(first, seq_len)]
            else:
                step_fn = decoder(model, kv)      # its logits (n, V) are a buffer the next step overwrites
                steps += [step_fn(tokens[:, t]).unsqueeze(1).clone() for t in range(first, seq_len)]
            logits = torch.cat(steps, dim=1)
        loss = F.cross_entropy(logits[:, first - 1:-1].float().flatten(0, 1), tokens[:, first:].flatten(),
                               reduction="none")
        nll += loss.view(n, seq_len - first).mean(dim=1).sum().item()
        kv_nbytes = kv.nbytes() // n
    cfg = model.cfg
    return PerplexityResult(
        perplexity=math.exp(nll / windows), windows=windows, total_windows=total_windows, seq_len=seq_len,
        tokens=ids.numel(),
        scored_tokens=windows * (seq_len - first), prompt=prompt, cache=str(cache), mode=mode,
        kv_nbytes=kv_nbytes, fp16_kv_nbytes=fp16_kv_nbytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, seq_len),
        seconds=time.perf_counter() - start)
