"""Decode steps without per-token Python overhead: the whole one-token forward captured once in a CUDA graph
and replayed (`generate(compile=True)`, `--compile` in chat and bench_decode).

An eager decode step launches a few hundred small kernels from Python (about 65 ms per token for a Llama-3.1-8B
shape on an H100 at batch 1, where reading the weights takes about 5 ms). A CUDA graph records those launches
once and replays them with one call. That needs the step to have fixed shapes and no host syncs:

- the slot the token writes is a device tensor (`kvzoo.cache.base.StaticStep`), not a Python int;
- the cache writes in place into its preallocated buffers (`index_copy_` at that slot);
- attention runs over every preallocated slot, those not yet written masked out (so its cost grows with
  the buffer, `max_len`, not with the tokens stored: generation sizes the buffer to prompt + new tokens).

A strategy opts in by implementing `WholeStep` (below): `decode_static`, the one-token step at a device-held
slot, and `can_decode_static`, whether that step serves its current settings. A step that differs with the
cache's host-side counters (a token joins a sink window, a recent window, or fills it so that a group is
quantized) names the difference in `static_phase()`: one graph is recorded per phase and the host picks which
to replay. Upkeep that nothing later in the step reads (storing the token, quantizing what left a window) may
run in `StaticStep.beside()`: on a GPU a second stream, captured as a parallel branch and joined at the step's
end; work that only an attention's exact tokens read (their window rows) in `StaticStep.tail()`, a stream the
attention joins before its combine. Strategies without a whole step (or whose settings it does not serve) use
`PiecewiseDecoder`, which captures everything except attention: per layer, one graph from the block's input to
q, k, v and one from the attention output to the next block's input; the strategy's `decode` runs eagerly between
them.
`decoder()` picks the whole-step graph where every layer has a static step, else the piecewise one. On a
CPU (no CUDA graphs) both run the same code eagerly (the kernels under the Triton interpreter), which is how
the tests prove they equal the eager decode.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvzoo.cache.base import ModelCache, Positions, StaticStep


class WholeStep:
    """Mixin for a LayerCache whose one-token decode can run with fixed shapes and no host sync, so a CUDA graph
    holds the whole step. The caller advances the cache (`advance`) after each step."""

    def can_decode_static(self, padded: bool) -> bool:
        """Whether decode_static serves this cache now (`padded`: some row is left-padded)."""
        return not self.simulated

    def decode_static(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, step: StaticStep) -> Tensor:
        """One token at the device-held slot step.slot: write it in place, attend over every allocated slot
        (those not live, or that step.mask forbids, masked)."""
        raise NotImplementedError

    def static_phase(self) -> str:
        """Which recorded step the next token needs, from host-side counters (one CUDA graph per phase)."""
        return "step"

    def static_scratch(self) -> tuple[Tensor, ...]:
        """Buffers decode_static changes so that a second run would differ (restored after the warm-up run that
        precedes a capture)."""
        return ()

    def advance(self) -> None:
        """Host-side bookkeeping after a static step stored one token."""
        self.length += 1


def _static(layer, padded: bool) -> bool:
    return isinstance(layer, WholeStep) and layer.can_decode_static(padded)


def _check_streaming(cache: ModelCache) -> None:
    if cache.layers[0].simulated:
        raise ValueError("graph decoding needs a streaming cache, not a simulated one")


def _check_room(cache: ModelCache) -> None:
    if cache.length >= cache.max_len:
        raise ValueError(f"cache holds at most {cache.max_len} tokens and is full")


def _padded(pad: Tensor | None) -> bool:
    return pad is not None and bool(pad.any())


class GraphDecoder:
    """Replays one decode step for `cache` (a ModelCache already holding the prompt). Call it with the
    last tokens (B,); it returns the logits (B, vocab) and advances the cache by one token. The returned
    tensor is the graph's output buffer: the next call overwrites it.

    A strategy whose step differs with its host-side counters (InnerQ: a token joins the sink window, joins
    the recent window, or fills it and a group is quantized) names the difference `static_phase()`; one graph
    is recorded per phase, when first needed, and the host picks which to replay.

    The host work between two steps is kept short, since the GPU waits for it: the step advances its device-held
    slot itself (the host writes it only when the cache's length moved another way), and the next step's phase
    is worked out right after a replay is launched, while the GPU runs it. A phase is a function of the tokens
    stored, so it is kept with the length it was worked out for."""

    def __init__(self, model, cache: ModelCache, pad: Tensor | None = None):
        _check_streaming(cache)
        padded = _padded(pad)
        refused = {type(layer).name for layer in cache.layers if not _static(layer, padded)}
        if refused:
            raise ValueError(f"cache strategy {', '.join(sorted(refused))} has no whole-step decode with these settings "
                             f"here (see the strategy's can_decode_static); PiecewiseDecoder serves every strategy")
        self.model, self.cache = model, cache
        device = model.device
        B = cache.layers[0].batch_size
        self.token = torch.zeros(B, 1, dtype=torch.long, device=device)        # (B, 1) static input
        self.slot = torch.zeros(1, dtype=torch.long, device=device)            # (1,) static input
        self.pad = (pad if pad is not None else torch.zeros(B, dtype=torch.long, device=device)).clone()
        self.padded = padded
        # the slot is advanced by the step: a capture's warm-up run restores it with the strategies' scratch
        self.scratch = (self.slot, *(t for layer in cache.layers for t in layer.static_scratch()))
        self.steps: dict[tuple[str, ...], _Captured] = {}
        self.slot_holds: int | None = None                                      # the length self.slot holds
        self.next_phase: tuple[int, tuple[str, ...]] | None = None              # (length, phase) worked out ahead

    def _step(self) -> Tensor:
        step = StaticStep.make(self.slot, self.pad, self.cache.max_len, self.model.cfg.sliding_window, self.padded)
        logits = self.model.decode_static(self.token, self.cache, step)
        self.slot.add_(1)
        return logits

    def _phase(self) -> tuple[str, ...]:
        length = self.cache.length
        if self.next_phase is None or self.next_phase[0] != length:
            self.next_phase = length, tuple(layer.static_phase() for layer in self.cache.layers)
        return self.next_phase[1]

    @torch.inference_mode()
    def __call__(self, token: Tensor) -> Tensor:
        _check_room(self.cache)
        self.token.copy_(token.view(-1, 1))
        if self.slot_holds != self.cache.length:
            self.slot.fill_(self.cache.length)
        phase = self._phase()
        if phase not in self.steps:
            self.steps[phase] = _Captured(self._step, None, self.scratch)
        logits = self.steps[phase](self.token.is_cuda)
        self.cache.length += 1
        self.slot_holds = self.cache.length
        for layer in self.cache.layers:
            layer.advance()
        self._phase()                               # the next step's, while the GPU runs this one
        return logits


class _Captured:
    """A function of fixed-shape device tensors, run eagerly on CPU and from a CUDA graph (captured on its
    first call, after a warm-up on a side stream) on CUDA. Graphs given one memory pool must be replayed in
    the order they were captured (None: a private pool). `scratch` tensors are restored after the warm-up,
    for functions that are not idempotent."""

    def __init__(self, fn, pool, scratch: tuple[Tensor, ...] = ()):
        self.fn, self.pool, self.scratch, self.graph, self.out = fn, pool, scratch, None, None

    def __call__(self, cuda: bool):
        if not cuda:
            return self.fn()
        if self.graph is None:
            saved = [t.clone() for t in self.scratch]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.fn()
                for t, before in zip(self.scratch, saved):
                    t.copy_(before)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.out = self.fn()
        self.graph.replay()
        return self.out


class PiecewiseDecoder:
    """Decode steps for any streaming strategy: the projections, norms and MLPs of every layer replayed from
    CUDA graphs, the strategy's own `decode` (attention over its compressed cache) run eagerly in between.
    Same calling convention as GraphDecoder."""

    def __init__(self, model, cache: ModelCache, pad: Tensor | None = None):
        _check_streaming(cache)
        self.model, self.cache = model, cache
        cfg, device = model.cfg, model.device
        B = cache.layers[0].batch_size
        self.has_pad = pad is not None      # as Transformer.forward: no pad tensor means no row is padded
        self.pad = pad if pad is not None else torch.zeros(B, dtype=torch.long, device=device)
        self.cuda = device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.token = torch.zeros(B, 1, dtype=torch.long, device=device)                 # (B, 1)
        self.hidden = [torch.zeros(B, 1, cfg.hidden_size, dtype=model.dtype, device=device)]  # block inputs
        self.attn_out = []                                                               # (B, Hq, 1, d) each
        self.before, self.after = [], []
        self.embed = _Captured(lambda: self.hidden[0].copy_(model.embed(self.token)), pool)
        for i, block in enumerate(model.layers):
            self.attn_out.append(torch.zeros(B, block.attn.n_heads, 1, cfg.head_dim, dtype=model.dtype, device=device))
            self.before.append(_Captured(self._before_fn(block, i), pool))
            self.hidden.append(torch.zeros_like(self.hidden[0]))
            self.after.append(_Captured(self._after_fn(block, i), pool))
        self.head = _Captured(lambda: model.lm_head(model.norm(self.hidden[-1]))[:, -1], pool)

    def _before_fn(self, block, i: int):
        def fn():
            x = block.attn_norm(self.hidden[i])                                          # (B, 1, hidden)
            return (x, *block.attn.qkv(x))
        return fn

    def _after_fn(self, block, i: int):
        def fn():
            B = self.attn_out[i].shape[0]
            out = self.attn_out[i].transpose(1, 2).reshape(B, 1, -1)                     # (B, 1, Hq * d)
            h = self.hidden[i] + block.attn.o_proj(out)
            return self.hidden[i + 1].copy_(h + block.mlp(block.mlp_norm(h)))
        return fn

    @torch.inference_mode()
    def __call__(self, token: Tensor) -> Tensor:
        cache, model = self.cache, self.model
        _check_room(cache)
        pos = Positions.make(cache.length, 1, self.pad, model.cfg.sliding_window, self.has_pad)
        self.token.copy_(token.view(-1, 1))
        self.embed(self.cuda)
        for i, layer in enumerate(cache.layers):
            x, q, k, v = self.before[i](self.cuda)
            self.attn_out[i].copy_(layer.decode(x, q, k, v, pos))
            self.after[i](self.cuda)
        cache.length += 1
        return self.head(self.cuda)


def decoder(model, cache: ModelCache, pad: Tensor | None = None) -> GraphDecoder | PiecewiseDecoder:
    """The whole-step graph where every layer has a static step, else the piecewise one."""
    padded = _padded(pad)
    if all(_static(layer, padded) for layer in cache.layers):
        return GraphDecoder(model, cache, pad)
    return PiecewiseDecoder(model, cache, pad)
