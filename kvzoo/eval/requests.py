"""Generation requests as lm-evaluation-harness makes them, answered by kvzoo without the harness installed.

`KvzooLM.generate_until` (kvzoo/eval/harness.py) runs `generate_requests`, and so does `scripts/harness_split.py
generate`, which answers requests recorded on another machine: a GPU box without lm_eval (or without the hub) then
generates, and the harness scores the answers from its response cache where it is installed (docs/harness.md).

A request is (context, gen_kwargs): lm-eval's `until` (stop strings), `max_gen_toks` (256 when absent),
`do_sample`, `temperature`, `top_p`, `top_k`. Requests with the same gen_kwargs are batched in the order given,
`batch_size` rows at a time, left-padded by kvzoo.generate; a context longer than max_length - max_gen_toks keeps
its end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from tqdm import tqdm

from kvzoo.cache.base import CacheSpec
from kvzoo.generate import generate


@dataclass
class KVReport:
    """KV bytes held at the end of each scored row, summed over the requests of one kind."""

    rows: int = 0
    nbytes: int = 0
    fp16_nbytes: int = 0

    def add(self, nbytes: int, fp16: int, rows: int) -> None:
        self.rows, self.nbytes, self.fp16_nbytes = self.rows + rows, self.nbytes + nbytes, self.fp16_nbytes + fp16

    @property
    def ratio(self) -> float:
        return self.nbytes / self.fp16_nbytes if self.fp16_nbytes else float("nan")


def generate_requests(model, tokenizer, spec: CacheSpec, requests: Sequence[tuple[str, dict]], batch_size: int,
                      max_length: int, report: KVReport, prefill_chunk: int | None = None,
                      on_result: Callable[[int, str], None] | None = None, disable_tqdm: bool = False) -> list[str]:
    """The generated text of each request (module docstring); each batch's KV bytes added to `report`, and
    on_result(i, text) called as soon as request i's batch is done."""
    groups: dict[str, list[int]] = {}
    for i, (_, kwargs) in enumerate(requests):
        groups.setdefault(repr(sorted(kwargs.items())), []).append(i)
    out = [""] * len(requests)
    bar = tqdm(total=len(requests), desc=f"generate_until ({spec})", disable=disable_tqdm)
    for rows in groups.values():
        kwargs = dict(requests[rows[0]][1])
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", 256))
        sampled = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 0.0)) if sampled else 0.0
        top_p, top_k = kwargs.pop("top_p", None), kwargs.pop("top_k", None)
        for a in range(0, len(rows), batch_size):
            batch = rows[a:a + batch_size]
            prompts = [tokenizer.encode(requests[i][0]) for i in batch]
            room = max_length - max_new
            prompts = [p[-room:] if room > 0 else p[-1:] for p in prompts]              # the context's end fits
            gen = generate(model, tokenizer, prompts, max_new_tokens=max_new, temperature=temperature,
                           top_p=top_p if sampled else None, top_k=top_k if sampled else None,
                           cache=spec, stop=until, prefill_chunk=prefill_chunk)
            report.add(gen.cache_nbytes, gen.fp16_nbytes, len(batch))
            for i, text in zip(batch, gen.texts):
                out[i] = text
                if on_result is not None:
                    on_result(i, text)
            bar.update(len(batch))
    bar.close()
    return out
