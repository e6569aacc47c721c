"""Decode steps without per-token Python overhead: the whole one-token forward captured once in a CUDA graph
and replayed (issue 9, `generate(compile=True)`, `--compile` in chat and bench_decode).

An eager decode step launches a few hundred small kernels from Python (about 65 ms per token for a Llama-3.1-8B
shape on an H100 at batch 1, where reading the weights takes about 5 ms). A CUDA graph records those launches
once and replays them with one call. That needs the step to have fixed shapes and no host syncs:

- the slot the token writes is a device tensor (`kvzoo.cache.base.StaticStep`), not a Python int;
- the cache writes in place into its preallocated buffers (`index_copy_` at that slot);
- attention runs over every preallocated slot, those not yet written masked out (so its cost grows with
  the buffer, `max_len`, not with the tokens stored: generation sizes the buffer to prompt + new tokens).

A strategy opts in with `LayerCache.static_decode = True` and `decode_static`; the fp16 cache does. Others
are refused with a message naming them. On a CPU (no CUDA graphs) the same static step runs eagerly, which
is how the tests prove it equals the eager decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvzoo.cache.base import ModelCache, StaticStep, get_strategy, list_caches


def static_strategies() -> list[str]:
    """The registered strategies whose decode step can be captured."""
    return [name for name in list_caches() if get_strategy(name).static_decode]


class GraphDecoder:
    """Replays one decode step for `cache` (a ModelCache already holding the prompt). Call it with the
    last tokens (B,); it returns the logits (B, vocab) and advances the cache by one token. The returned
    tensor is the graph's output buffer: the next call overwrites it."""

    def __init__(self, model, cache: ModelCache, pad: Tensor | None = None):
        if cache.layers[0].simulated:
            raise ValueError("graph decoding needs a streaming cache, not a simulated one")
        refused = {type(layer).name for layer in cache.layers if not layer.static_decode}
        if refused:
            raise ValueError(f"cache strategy {', '.join(sorted(refused))} has no static decode step for "
                             f"compiled decoding yet; accepted: {', '.join(static_strategies())}")
        self.model, self.cache = model, cache
        device = model.device
        B = cache.layers[0].batch_size
        self.token = torch.zeros(B, 1, dtype=torch.long, device=device)        # (B, 1) static input
        self.slot = torch.zeros(1, dtype=torch.long, device=device)            # (1,) static input
        self.pad = (pad if pad is not None else torch.zeros(B, dtype=torch.long, device=device)).clone()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None

    def _step(self) -> Tensor:
        step = StaticStep.make(self.slot, self.pad, self.cache.max_len, self.model.cfg.sliding_window)
        return self.model.decode_static(self.token, self.cache, step)

    def _capture(self) -> None:
        """Warm up on a side stream (the step is idempotent: it rewrites the same slot), then record."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()

    @torch.inference_mode()
    def __call__(self, token: Tensor) -> Tensor:
        if self.cache.length >= self.cache.max_len:
            raise ValueError(f"cache holds at most {self.cache.max_len} tokens and is full")
        self.token.copy_(token.view(-1, 1))
        self.slot.fill_(self.cache.length)
        if self.token.is_cuda:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        else:
            self.logits = self._step()
        self.cache.length += 1
        for layer in self.cache.layers:
            layer.length += 1
        return self.logits
