"""Text generation: prefill the prompt, then decode one token at a time through a cache strategy.

    prefill(model, tokens, cache, pad)      -> logits of each row's last prompt token  (B, vocab)
    decode_one_token(model, token, ...)     -> logits of the next token                (B, vocab)
    sample(logits, temperature, ...)        -> next token ids                          (B,)
    generate(model, tokenizer, prompts)     -> Generation (texts, tokens, timings, cache bytes)

A batch of prompts of different lengths is left-padded to one width, so every row writes the same cache
slots; the padding is masked out of attention and RoPE positions start at each row's first real token,
which makes a batched row produce the same tokens as the same prompt alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from kvzoo.cache.base import CacheSpec, ModelCache, fp16_kv_nbytes
from kvzoo.models.llama import Transformer


def prefill(model: Transformer, tokens: Tensor, cache: ModelCache, pad: Tensor | None,
            chunk: int | None = None) -> Tensor:
    """Logits (B, vocab) after the prompt tokens (B, P). chunk: fill the cache `chunk` tokens at a time
    (chunked prefill, KV Pareto §4.1), so attention scores are at most (chunk x P) instead of (P x P);
    each chunk attends over the history as the strategy stored it plus itself exact."""
    step = chunk or tokens.shape[1]
    for a in range(0, tokens.shape[1], step):
        logits = model(tokens[:, a:a + step], cache, pad=pad, last_only=True)
    return logits[:, -1]


def decode_one_token(model: Transformer, token: Tensor, cache: ModelCache, pad: Tensor | None) -> Tensor:
    return model(token[:, None], cache, pad=pad)[:, -1]


def penalize(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """The CTRL / transformers repetition penalty on tokens already generated (seen (B, V) True): a positive
    logit divided by `penalty`, a negative one multiplied, so a repeat becomes less likely either way."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def sample(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """Greedy when temperature == 0; otherwise softmax(logits / T) restricted to the top-k tokens and
    the smallest top-p nucleus. Drawn with the exponential-race trick (argmax of p / Exp(1)), which needs
    no device-to-host sync, unlike torch.multinomial on some backends."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature                                    # (B, V)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]                     # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > top_p                       # keep the first token always
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(outside, float("-inf")))
    probs = logits.softmax(dim=-1)
    race = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / race).argmax(dim=-1)


@dataclass
class Generation:
    texts: list[str]                  # each row's answer, cut at EOS or a stop string
    tokens: list[list[int]]           # each row's new token ids, cut the same way
    finish: list[str]                 # "eos" | "stop" | "length" per row
    prompt_tokens: int                # real (unpadded) prompt tokens over the batch
    new_tokens: int                   # tokens generated over the batch
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int                 # forward passes after the prefill
    cache_nbytes: int                 # bytes the cache strategy holds at the end
    fp16_nbytes: int                  # what an fp16 K/V cache would hold for the same slots
    model_nbytes: int                 # what a K/V cache at the model's dtype would hold (fp32 models: twice fp16's)
    stored_tokens: int                # slots per row in the cache at the end (prompt + answer, padding included)
    quantized_tokens: tuple[int, int]  # (keys, values) of them held quantized per row; the rest exact

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second of the decode loop, over the batch."""
        steps = self.decode_steps * len(self.texts)
        return steps / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def kv_ratio(self) -> float:
        return self.cache_nbytes / self.fp16_nbytes


def chat_sampling(generation_config: dict) -> dict:
    """Sampling defaults for chat from a model's generation_config.json, read as transformers reads it: sampling
    (temperature, top_p, top_k) only where it says do_sample, otherwise greedy; its repetition_penalty, or 1.1 on
    the answer's own tokens (a guard: a small model's greedy answer otherwise tends to loop to the token limit)."""
    cfg = generation_config
    sampled = bool(cfg.get("do_sample"))
    return {"temperature": float(cfg.get("temperature", 1.0)) if sampled else 0.0,
            "top_p": float(cfg["top_p"]) if sampled and cfg.get("top_p") is not None else None,
            "top_k": int(cfg["top_k"]) if sampled and cfg.get("top_k") else None,
            "repetition_penalty": float(cfg.get("repetition_penalty") or 1.1)}


def check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None,
                   repetition_penalty: float = 1.0) -> None:
    if repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 = none), got {repetition_penalty}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.inference_mode()
def generate(model: Transformer, tokenizer, prompts: str | Sequence[str] | Sequence[Sequence[int]], *,
             max_new_tokens: int = 256, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, repetition_penalty: float = 1.0, seed: int | None = None,
             cache: str | CacheSpec = "fp16",
             stop: Sequence[str] = (), on_step: Callable[[list[int]], None] | None = None,
             prefill_chunk: int | None = None, compile: bool = False) -> Generation:
    """Generate for one prompt or a batch. Prompts are strings (encoded with the tokenizer's BOS rule)
    or lists of token ids. on_step(ids) is called after every decode step with each row's new token.
    prefill_chunk: prefill the prompt that many tokens at a time (chunked prefill). compile: replay the
    decode step from CUDA graphs (kvzoo.graphs.decoder: the whole step for strategies with a static step,
    all but attention for the others; the same code runs eagerly on CPU). repetition_penalty (1 = none, the
    default) penalizes the tokens each row has generated so far (transformers also counts the prompt's)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p, repetition_penalty)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    rows = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every prompt needs at least one token")
    context = model.cfg.max_position_embeddings
    width = max(len(r) for r in rows)
    if width >= context:
        raise ValueError(f"prompt of {width} tokens does not fit the model's context of {context} tokens")
    max_new_tokens = min(max_new_tokens, context - width)

    device = model.device
    B = len(rows)
    pad_lengths = [width - len(r) for r in rows]
    tokens = torch.tensor([[tokenizer.pad_id] * p + r for p, r in zip(pad_lengths, rows)], device=device)
    pad = torch.tensor(pad_lengths, device=device) if any(pad_lengths) else None
    kv = model.new_cache(cache, batch_size=B, max_len=width + max_new_tokens)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed())
    eos = set(tokenizer.eos_ids)

    new: list[list[int]] = [[] for _ in rows]
    finish = ["length"] * B
    done = [False] * B
    steps = 0
    t0 = time.perf_counter()
    step_fn = (lambda token: decode_one_token(model, token, kv, pad))
    if compile:
        from kvzoo.graphs import decoder
        step_fn = decoder(model, kv, pad)
    seen = torch.zeros(B, model.cfg.vocab_size, dtype=torch.bool, device=device)   # each row's generated tokens

    def pick(logits: Tensor) -> Tensor:
        if repetition_penalty != 1.0:
            logits = penalize(logits, seen, repetition_penalty)
        token = sample(logits, temperature, top_k, top_p, generator)
        seen.scatter_(1, token[:, None], True)
        return token

    logits = prefill(model, tokens, kv, pad, prefill_chunk)
    token = pick(logits)
    t1 = time.perf_counter()
    for step in range(max_new_tokens):
        ids = token.tolist()
        for b, tok in enumerate(ids):
            if done[b]:
                continue
            if tok in eos:
                done[b], finish[b] = True, "eos"
                continue
            new[b].append(tok)
            if stop and any(s in tokenizer.decode(new[b]) for s in stop):
                done[b], finish[b] = True, "stop"
        if on_step is not None:
            on_step(ids)
        if all(done) or step == max_new_tokens - 1:
            break
        token = pick(step_fn(token))
        steps += 1
    t2 = time.perf_counter()

    texts = []
    for b in range(B):
        text = tokenizer.decode(new[b])
        if finish[b] == "stop":
            text = text[:min(text.find(s) for s in stop if s in text)]
        texts.append(text)
    cfg = model.cfg
    fp16 = fp16_kv_nbytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, B * kv.length)
    return Generation(texts=texts, tokens=new, finish=finish, prompt_tokens=sum(map(len, rows)),
                      new_tokens=sum(map(len, new)), prefill_seconds=t1 - t0, decode_seconds=t2 - t1,
                      decode_steps=steps, cache_nbytes=kv.nbytes(), fp16_nbytes=fp16,
                      model_nbytes=fp16 * model.dtype.itemsize // 2, stored_tokens=kv.length,
                      quantized_tokens=kv.quantized_slots())
