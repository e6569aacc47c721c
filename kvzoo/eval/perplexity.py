"""Teacher-forced perplexity over non-overlapping windows (the GPTQ protocol).

The whole text is tokenized once; window w is tokens[w*L : (w+1)*L] and contributes the mean
cross-entropy of its L-1 next-token predictions (or, with score_from = P, of the predictions of tokens
P..L-1 only: the protocol of strategies that need a prompt, such as SQuat, whose first P tokens play it); perplexity = exp(mean over windows). Every window is a
forward through a fresh cache: in "simulated" mode (the papers' protocol) every token sees the cache as
token-by-token decoding would have shown it; in "streaming" mode a real prefill of the first tokens is
followed by token-by-token decoding through the packed storage. The
cache's bytes after the window are reported beside the fp16 cache's bytes for the same tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvzoo.cache.base import CacheSpec, fp16_kv_nbytes
from kvzoo.models.llama import Transformer


@dataclass
class PerplexityResult:
    perplexity: float
    windows: int
    seq_len: int
    tokens: int              # tokens in the whole tokenized text
    scored_tokens: int       # predictions scored: windows * (seq_len - max(score_from, 1))
    score_from: int          # the first token scored in each window (the ones before it are the prompt)
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
               mode: str = "simulated", prefill: int | None = None, batch_size: int = 1,
               score_from: int | None = None, prefill_chunk: int | None = None,
               progress: bool = True) -> PerplexityResult:
    """mode "simulated": one teacher-forced forward per window. mode "streaming": a real prefill of the
    window's first `prefill` tokens (default 256), then every further token decoded one at a time through
    the packed storage (teacher-forced). Predictions of tokens score_from..L-1 are scored (default: all).
    A strategy that takes something from a prompt (an option prompt_frac, as SQuat's subspace) gets its
    prompt P = int(prompt_frac * seq_len): then score_from and the streaming prefill default to P and must
    equal it. `batch_size` windows run side by side. prefill_chunk (streaming): prefill that many tokens
    at a time (chunked prefill)."""
    if isinstance(cache, str):
        cache = CacheSpec.parse(cache)
    prompt_frac = getattr(cache.options, "prompt_frac", 0)
    if prompt_frac:
        prompt = int(prompt_frac * seq_len)
        score_from = prompt if score_from is None else score_from
        prefill = prompt if prefill is None else prefill
        if score_from != prompt or (mode == "streaming" and prefill != prompt):
            raise ValueError(f"cache {cache.name} takes the first prompt_frac={prompt_frac} of each window "
                             f"({prompt} tokens) as its prompt: score_from and the streaming prefill must be "
                             f"{prompt}, got {score_from} and {prefill}")
    score_from = score_from or 0
    prefill = 256 if prefill is None else prefill
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if seq_len > model.cfg.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds the model's context of {model.cfg.max_position_embeddings}")
    if mode == "streaming" and not 1 <= prefill <= seq_len:
        raise ValueError(f"prefill must be in [1, seq_len={seq_len}], got {prefill}")
    if not 0 <= score_from < seq_len:
        raise ValueError(f"score_from must be in [0, seq_len={seq_len}), got {score_from}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if prefill_chunk is not None and (mode != "streaming" or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk applies to streaming mode and must be >= 1, got {prefill_chunk} "
                         f"in {mode} mode")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1, got {max_windows}")
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    windows = ids.numel() // seq_len
    if windows == 0:
        raise ValueError(f"text has {ids.numel()} tokens, fewer than one window of {seq_len}")
    if max_windows is not None:
        windows = min(windows, max_windows)

    start = time.perf_counter()
    nll = 0.0
    for w in tqdm(range(0, windows, batch_size), desc=f"perplexity ({cache.name}, {mode})", disable=not progress):
        n = min(batch_size, windows - w)
        tokens = ids[w * seq_len:(w + n) * seq_len].view(n, seq_len).to(model.device)   # (n, L)
        kv = model.new_cache(cache, batch_size=n, max_len=seq_len, mode=mode,
                             prompt=score_from if mode == "simulated" else 0)
        if mode == "simulated":
            logits = model(tokens, kv)                                                   # (n, L, V)
        else:
            step = prefill_chunk or prefill
            steps = [model(tokens[:, a:min(a + step, prefill)], kv) for a in range(0, prefill, step)]
            steps += [model(tokens[:, t:t + 1], kv) for t in range(prefill, seq_len)]
            logits = torch.cat(steps, dim=1)
        first = max(score_from, 1)                                  # the first token scored (it has a context)
        loss = F.cross_entropy(logits[:, first - 1:-1].float().flatten(0, 1), tokens[:, first:].flatten(),
                               reduction="none")
        nll += loss.view(n, seq_len - first).mean(dim=1).sum().item()
        kv_nbytes = kv.nbytes() // n
    cfg = model.cfg
    return PerplexityResult(
        perplexity=math.exp(nll / windows), windows=windows, seq_len=seq_len, tokens=ids.numel(),
        scored_tokens=windows * (seq_len - max(score_from, 1)), score_from=score_from, cache=str(cache), mode=mode, kv_nbytes=kv_nbytes,
        fp16_kv_nbytes=fp16_kv_nbytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, seq_len),
        seconds=time.perf_counter() - start)
