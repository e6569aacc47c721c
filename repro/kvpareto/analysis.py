"""KV Pareto: configurations of KV quantization x prefill chunking, each scored for total memory and
accuracy, and the non-dominated set (kv-pareto.md §4, Figure 2).

A configuration is a weight format (w16, or 4-bit w4-rtn / w4-awq from kvzoo.weightquant.awq, applied to the model
before it is evaluated), a KV cache spec and a prefill chunk (0 = none), written like the paper's
`w4-awq / kvpareto:k_bits=4,... / chunk 256`. Memory is the total of repro.kvpareto.memory_model (model + KV + peak
activation) at the task's context, the model's 4-bit codes counted as held: measured on CUDA, the Appendix I
estimate elsewhere.
Accuracy tasks, higher is better:
    wikitext   -perplexity on the first windows of WikiText-2 at the context length (simulated mode, the
               papers' protocol; chunking changes memory, not this score)
    needle     the share of needle-in-a-haystack cells retrieved (kvzoo.eval.needle), prefilled in chunks
A configuration is on the frontier when no other has at most its memory and at least its accuracy, one of
them strictly. The chosen point is the frontier's smallest memory whose accuracy is within `tolerance`
(relative) of the baseline's, as the paper picks its 68-78% reductions at 1-3% accuracy cost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvzoo.cache.base import CacheSpec
from kvzoo.eval.needle import needle_grid
from kvzoo.eval.perplexity import perplexity

from repro.kvpareto.memory_model import estimate, measure

TASKS = ("wikitext", "needle")


@dataclass
class Point:
    cache: str
    chunk: int
    memory: int            # bytes: model + KV + peak activation
    memory_source: str     # "measured" (CUDA) or "estimate" (Appendix I)
    accuracy: float
    weights: str = "w16"   # w16, w4-rtn or w4-awq
    frontier: bool = False

    @property
    def label(self) -> str:
        return f"{self.weights} / {self.cache} / chunk {self.chunk or 'none'}"

    @property
    def short(self) -> str:
        """The paper's style of name: w4-awq_k4v4_token32_pc256 (k16v16 for the fp16 cache)."""
        spec = CacheSpec.parse(self.cache)
        if spec.name == "fp16":
            kv = "k16v16"
        elif spec.name == "kvpareto":
            o = spec.options
            kv = f"k{o.k_bits}v{o.v_bits}_{o.granularity}{o.group_size if o.granularity != 'tensor' else ''}"
        else:
            kv = spec.name
        return f"{self.weights}_{kv}" + (f"_pc{self.chunk}" if self.chunk else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "label": self.label, "short": self.short}


def frontier(points: list[Point]) -> list[Point]:
    """Mark and return the non-dominated points, by increasing memory."""
    for p in points:
        p.frontier = not any(o.memory <= p.memory and o.accuracy >= p.accuracy
                             and (o.memory < p.memory or o.accuracy > p.accuracy) for o in points)
    return sorted((p for p in points if p.frontier), key=lambda p: p.memory)


def choose(front: list[Point], baseline: Point, tolerance: float) -> Point:
    """The frontier's smallest memory within `tolerance` (relative) of the baseline's accuracy."""
    ok = [p for p in front if p.accuracy >= baseline.accuracy - tolerance * abs(baseline.accuracy)]
    return min(ok or [baseline], key=lambda p: p.memory)


def evaluate(model, tokenizer, cache: str | CacheSpec, chunk: int, task: str, context: int, *, windows: int = 2,
             wikitext_ids=None, filler=None, depths=(0.0, 0.5, 1.0), weights: str = "w16") -> Point:
    """One configuration: its total memory at `context` tokens and its accuracy on `task`. `model` already
    holds the weight format named by `weights`."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")
    spec = CacheSpec.parse(cache) if isinstance(cache, str) else cache
    if model.device.type == "cuda":
        memory, source = measure(model, spec, context, chunk or None).total, "measured"
    else:
        memory, source = estimate(model, spec, context, chunk or None).total, "estimate"
    if task == "wikitext":
        accuracy = -perplexity(model, wikitext_ids, seq_len=context, max_windows=windows, cache=spec,
                               progress=False).perplexity
    else:
        cells = needle_grid(model, tokenizer, filler, [context - 32], list(depths), cache=spec,
                            prefill_chunk=chunk or None, batch_size=len(depths))
        accuracy = sum(c.found for c in cells) / len(cells)
    return Point(str(spec), chunk, memory, source, accuracy, weights)
