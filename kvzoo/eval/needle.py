"""Needle-in-a-haystack, offline (KV Pareto Figure 8, after Kamradt 2023).

A haystack of `length` tokens is cut from a shared text (WikiText-2 by default); a needle sentence holding
a random 7-digit number is inserted at a relative `depth` (0 = the start, 1 = the end), at a sentence
boundary of the filler when one is near; the question follows, all in one user turn of the model's chat
template. The model answers greedily (`max_new_tokens`), and the cell scores 1 when the number appears in
the answer: exact retrieval. `length` counts the whole prompt (haystack, needle, question, template).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvzoo.generate import generate

NEEDLE = "The secret number of the lighthouse keeper is {value}."
QUESTION = "What is the secret number of the lighthouse keeper? Answer with the number only."


@dataclass
class NeedleCell:
    length: int            # prompt tokens
    depth: float           # where the needle sits, 0..1 of the haystack
    value: str             # the number hidden
    answer: str            # what the model said
    found: bool


def prompt_ids(tokenizer, filler: list[int], length: int, depth: float, value: str) -> list[int]:
    """Token ids of one chat turn of exactly `length` tokens (or fewer if the template alone is longer):
    filler[:n] with the needle inserted at depth, then the question."""
    needle = tokenizer.encode(" " + NEEDLE.format(value=value) + " ", bos=False)

    def render(n: int) -> list[int]:
        cut = filler[:n]
        at = int(depth * n)
        text = tokenizer.decode(cut[:at] + needle + cut[at:]) + "\n\n" + QUESTION
        messages = [{"role": "user", "content": text}]
        if tokenizer.has_chat_template:
            return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True), bos=False)
        return tokenizer.encode(text)

    n = max(0, length - len(render(0)))
    ids = render(n)
    while len(ids) > length and n > 0:           # re-tokenizing at the seams can add a token or two
        n -= len(ids) - length
        ids = render(max(n, 0))
    return ids


# keyword -> the option of scripts/needle.py that sets it, to name it in check_grid's messages
FLAGS = {key: "--" + key.replace("_", "-") for key in ("lengths", "depths", "batch_size", "prefill_chunk")}


def check_grid(lengths: list[int], depths: list[float], batch_size: int = 1, prefill_chunk: int | None = None,
               names: dict[str, str] | None = None) -> None:
    """Refuse a grid needle_grid() cannot run, before a model or text is loaded. Messages name each setting by
    its keyword, or as `names` maps it (FLAGS for the script)."""
    name = {key: key for key in FLAGS} | (names or {})
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"{name['lengths']} must be token counts >= 1, got {lengths}")
    if not depths or any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"{name['depths']} must lie in [0, 1], got {depths}")
    if batch_size < 1:
        raise ValueError(f"{name['batch_size']} must be >= 1, got {batch_size}")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"{name['prefill_chunk']} must be >= 1, got {prefill_chunk}")


def needle_grid(model, tokenizer, filler: list[int], lengths: list[int], depths: list[float], cache="fp16",
                max_new_tokens: int = 24, seed: int = 0, prefill_chunk: int | None = None,
                progress=None, batch_size: int = 1) -> list[NeedleCell]:
    """Score every (length, depth) cell; `progress` wraps the iterator over batches of cells (e.g. tqdm).
    batch_size cells are generated side by side (left-padded to the longest prompt of the batch)."""
    check_grid(lengths, depths, batch_size, prefill_chunk)
    if max(lengths) + max_new_tokens > model.cfg.max_position_embeddings:
        raise ValueError(f"lengths up to {max(lengths)} + {max_new_tokens} new tokens exceed the model's context "
                         f"of {model.cfg.max_position_embeddings}")
    if len(filler) < max(lengths):
        raise ValueError(f"the filler text has {len(filler)} tokens, fewer than the longest haystack {max(lengths)}")
    rng = random.Random(seed)
    cells = [(n, d, str(rng.randrange(10 ** 6, 10 ** 7))) for n in lengths for d in depths]
    batches = [cells[i:i + batch_size] for i in range(0, len(cells), batch_size)]
    out = []
    for batch in (progress(batches) if progress else batches):
        prompts = [prompt_ids(tokenizer, filler, n, d, value) for n, d, value in batch]
        answers = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=0.0, cache=cache,
                           prefill_chunk=prefill_chunk).texts
        out += [NeedleCell(len(ids), d, value, answer, value in answer)
                for ids, (n, d, value), answer in zip(prompts, batch, answers)]
    return out
