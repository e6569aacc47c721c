"""The boundary between the model and a KV-cache strategy.

The attention module computes q, k, v (before RoPE) and hands them, with the layer input x and the
chunk's `Positions`, to its layer's `LayerCache`, which stores whatever it wants (K/V, quantized codes,
the layer input X, cross-layer deltas...) and returns the attention output. Because the strategy owns
both storage and attention, it never has to hand a dequantized copy of the whole history back to the
model, and it can apply RoPE before or after quantization as its paper prescribes.

What a strategy says (the contract):
    append(x, q, k, v, pos, held) -> Chunk   store a chunk of T >= 1 tokens; return what its queries read:
                                             the queries after RoPE, every slot's key/value as a streaming
                                             prefill sees them (the history as held, the chunk exact) and,
                                             with held=True, every slot as held once the chunk is stored
    decode(x, q, k, v, pos) -> out           one token per row, the hot path (kernels live here);
                                             by default a one-token prefill
    nbytes() -> int                          bytes of every tensor held for the tokens stored so far
    formula_nbytes(length) -> int            the module docstring's bytes-per-token formula (the contract
                                             test holds nbytes() to it)
    reset()                                  forget every token (buffers are kept for reuse)
    window, value_window                     which key (value) slots are quantized when (kvzoo/cache/store.py's
                                             Window; value_window None: the keys'), or window None for a
                                             strategy that shows every token what it stored
The base class owns `length` and derives the two evaluation modes from `append`:
  streaming   prefill = attention over what `append` returns; what chat and benchmarks do.
  simulated   the papers' perplexity protocol: in one teacher-forced forward, the query at slot s sees
              every key/value exactly as token-by-token decoding would have shown it at that moment: slot j
              round-tripped (as held) where `window.rounded` says j was quantized by the time s is decoded,
              exact otherwise. Its logits equal a streaming run that decodes the text one token at a time.
              With a prompt of P tokens (`new_cache(..., prompt=P)`), the queries of slots [0, P) see every
              key exact, as a streaming prefill of the prompt does. It is causal: no prediction depends on a
              later token (tests/cache/test_cache_contract.py checks every strategy).
Statistics a strategy takes from the prompt (InnerQ's key norm, KV Pareto's smoothing mean, SQuat's query
subspace) come from the first `prompt_slots` tokens of the first call: the prompt, exactly as a streaming run
has it (a streaming prefill's whole chunk; in simulated mode slots [0, max(P, 1)), the first token standing in
for a run that decodes from one token).
A whole-step CUDA-graph decode is an opt-in capability (kvzoo/graphs.py's `WholeStep`).

Shapes: x (B, T, hidden); q (B, n_heads, T, hd); k, v (B, n_kv_heads, T, hd); out (B, n_heads, T, hd).

Strategies register by name (`@register("fp16")`) and declare their knobs as an `Options` dataclass, so
`CacheSpec.parse("innerq:bits=2,group_size=32")` can check every name and value before any work starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:  # pragma: no cover
    from kvzoo.models.llama import Attention


# ----------------------------------------------------------------------------------------------------
# Positions and masks
# ----------------------------------------------------------------------------------------------------
@dataclass
class Positions:
    """Where a chunk of T tokens sits. Rows are left-padded, so every row writes the same cache slots
    [start, start + T); a row's RoPE position is its slot minus its padding."""

    start: int            # cache slot of the chunk's first token (same for every row)
    pad: Tensor           # (B,) left-padding length of each row
    ids: Tensor           # (B, T) RoPE position of each token (0 on padding slots)
    mask: Tensor | None   # (B, 1, T, start + T) True = may attend; None = plain causal from slot 0

    @classmethod
    def make(cls, start: int, length: int, pad: Tensor, sliding_window: int | None = None,
             has_pad: bool = True) -> "Positions":
        """Positions of slots [start, start + length) for rows with left padding `pad` (B,).
        has_pad=False promises pad is all zeros (no device sync needed to find out)."""
        device = pad.device
        q_slot = torch.arange(start, start + length, device=device)        # (T,)
        ids = (q_slot[None, :] - pad[:, None]).clamp_min(0)                 # (B, T)
        n_keys = start + length
        window_binds = sliding_window is not None and sliding_window < n_keys
        if not has_pad and not window_binds and (start == 0 or length == 1):
            return cls(start, pad, ids, None)   # SDPA's is_causal (or no mask for one token) is exact
        k_slot = torch.arange(n_keys, device=device)                        # (S,)
        allowed = k_slot[None, :] <= q_slot[:, None]                        # (T, S) causal
        if sliding_window is not None:
            allowed &= k_slot[None, :] > q_slot[:, None] - sliding_window
        allowed = allowed[None] & (k_slot[None, None, :] >= pad[:, None, None])   # (B, T, S)
        # A padding query would see no key at all (a NaN row in softmax): let it see itself.
        allowed |= k_slot[None, None, :] == q_slot[None, :, None]
        return cls(start, pad, ids, allowed[:, None])                       # (B, 1, T, S)


UPKEEP = "step upkeep"       # side_stream role of the work a static step runs `beside` it
TAIL = "attention tail"      # side_stream role of an attention's exact tokens, beside its quantized ones


@dataclass
class StaticStep:
    """One decode token whose cache slot lives in a device tensor, so that the same kernels serve every
    step (a CUDA graph replays them; kvzoo/graphs.py). Attention runs over the whole preallocated buffer,
    the slots not yet written masked out."""

    slot: Tensor          # (1,) long: the slot this token writes (tokens stored before it)
    ids: Tensor           # (B, 1) RoPE position of the token
    mask: Tensor          # (B, 1, 1, max_len) True = may attend
    masked: bool = True   # whether mask may forbid a stored slot (padding, a sliding window), else it is causal
    derived: dict = field(default_factory=dict)   # tensors computed from these once per step, shared by layers
    forked: bool = False  # whether work runs `beside` the step, to be joined at its end

    @contextlib.contextmanager
    def beside(self, *inputs: Tensor):
        """Run the block's work where no later op of the step reads its results (a cache's upkeep after its
        attention: storing the token, quantizing what left a window): on a GPU on a second stream that starts here
        and that the step joins at its end (`join`), so it overlaps the layers after it; elsewhere in order.
        inputs: tensors made before the block that it reads and nothing keeps (their memory is not reused before
        the block has run)."""
        if not self.slot.is_cuda:
            yield
            return
        side = side_stream(self.slot.device, UPKEEP)
        side.wait_stream(torch.cuda.current_stream(self.slot.device))
        for t in inputs:
            t.record_stream(side)
        self.forked = True
        with torch.cuda.stream(side):
            yield

    @contextlib.contextmanager
    def tail(self, *inputs: Tensor):
        """Run the block's work where only the attention's exact tokens read its results (the token's window rows):
        on a GPU on the attention's second stream (side_stream TAIL, yielded), which the attention joins before
        its combine (innerq_decode_attention runs its window kernel there), so it overlaps the quantized part;
        elsewhere in order (yields None). inputs: as `beside`'s."""
        if not self.slot.is_cuda:
            yield None
            return
        main, side = torch.cuda.current_stream(self.slot.device), side_stream(self.slot.device, TAIL)
        side.wait_stream(main)
        for t in inputs:
            t.record_stream(side)
        try:
            with torch.cuda.stream(side):
                yield side
        except BaseException:       # the attention never joins it: a graph capture must not end with work apart
            main.wait_stream(side)
            raise

    def join(self) -> None:
        """The step's end: what ran `beside` it is done before anything after it."""
        if self.forked:
            torch.cuda.current_stream(self.slot.device).wait_stream(side_stream(self.slot.device, UPKEEP))

    @classmethod
    def make(cls, slot: Tensor, pad: Tensor, max_len: int, sliding_window: int | None = None,
             padded: bool = True) -> "StaticStep":
        """From device tensors only (no host sync): slot (1,), pad (B,) left padding of each row; padded=False
        promises pad is all zeros."""
        k_slot = torch.arange(max_len, device=slot.device)                      # (S,)
        allowed = (k_slot[None, :] <= slot) & (k_slot[None, :] >= pad[:, None])  # (B, S)
        window_binds = sliding_window is not None and sliding_window < max_len
        if window_binds:
            allowed &= k_slot[None, :] > slot - sliding_window
        ids = (slot - pad).clamp_min(0)[:, None]                                 # (B, 1)
        return cls(slot, ids, allowed[:, None, None, :], padded or window_binds)


@functools.cache
def side_stream(device: torch.device, role: str) -> "torch.cuda.Stream":
    """A second stream of the device for `role` (one a role, so that one role's work never waits on another's);
    CUDA graphs capture work forked onto it as a parallel branch."""
    return torch.cuda.Stream(device)


def full_mask(pos: Positions, n_keys: int, device) -> Tensor:
    """pos.mask made explicit: (B or 1, 1, T, n_keys) booleans, also when pos.mask is None (causal)."""
    if pos.mask is not None:
        return pos.mask
    q_slot = torch.arange(pos.start, pos.start + pos.ids.shape[1], device=device)
    return (torch.arange(n_keys, device=device)[None, :] <= q_slot[:, None])[None, None]


def attend_split(q: Tensor, k_a: Tensor, v_a: Tensor, k_b: Tensor, v_b: Tensor, use_kb: Tensor, use_vb: Tensor,
                 mask: Tensor) -> Tensor:
    """Attention where each (query, key) pair reads key version a or b (use_kb (T, S) True picks b) and value
    version a or b (use_vb).

    The simulated mode's workhorse: b is the quantize-dequantize round trip, a full precision.
    q (B, Hq, T, hd); k_*, v_* (B, Hkv, S, hd); mask (B, 1, T, S) booleans. Pure torch, fp32 softmax."""
    rep = q.shape[1] // k_a.shape[1]
    k_a, v_a, k_b, v_b = (t.repeat_interleave(rep, dim=1) for t in (k_a, v_a, k_b, v_b))   # (B, Hq, S, hd)
    scale = q.shape[-1] ** -0.5
    scores = torch.where(use_kb, q @ k_b.transpose(-1, -2), q @ k_a.transpose(-1, -2)) * scale  # (B, Hq, T, S)
    probs = scores.float().masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
    return probs.masked_fill(use_vb, 0) @ v_a + probs.masked_fill(~use_vb, 0) @ v_b


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None) -> Tensor:
    """Softmax attention of q (B, Hq, T, hd) over k, v (B, Hkv, S, hd), Hq a multiple of Hkv (GQA).

    mask is a boolean (B, 1, T, S) or None; None with T > 1 means causal from the first key."""
    causal = mask is None and q.shape[2] > 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


# ----------------------------------------------------------------------------------------------------
# Specs and registry
# ----------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, type["LayerCache"]] = {}


def register(name: str):
    """Class decorator: make a LayerCache subclass available as `--cache name`."""
    def wrap(cls: type[LayerCache]) -> type[LayerCache]:
        assert name not in _REGISTRY, f"cache strategy {name!r} registered twice"
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def list_caches() -> list[str]:
    """Names of every registered cache strategy."""
    import kvzoo.cache  # noqa: F401  (importing the package registers the built-in strategies)
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type["LayerCache"]:
    names = list_caches()
    if name not in _REGISTRY:
        raise ValueError(f"unknown cache {name!r}; available caches: {', '.join(names)}")
    return _REGISTRY[name]


@dataclass(frozen=True)
class CacheSpec:
    """A strategy name plus its validated options (an instance of the strategy's `Options`)."""

    name: str = "fp16"
    options: Any = None

    @classmethod
    def parse(cls, text: str, **overrides: Any) -> "CacheSpec":
        """'name' or 'name:key=value,key=value' -> CacheSpec, with every key and value checked."""
        name, _, rest = text.partition(":")
        strategy = get_strategy(name.strip())
        given = dict(overrides)
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"cache option {item!r} is not key=value (in {text!r})")
            given[key.strip()] = value.strip()
        return cls(strategy.name, strategy.make_options(given))

    def __str__(self) -> str:
        """The spec in the form `parse` reads: name, then every option (defaults included)."""
        options = dataclasses.asdict(self.options) if self.options is not None else {}
        return ":".join([self.name, ",".join(f"{k}={v}" for k, v in options.items())]).rstrip(":")


# ----------------------------------------------------------------------------------------------------
# The per-layer contract and the whole-model container
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass
class Chunk:
    """What a chunk's queries read (LayerCache.append): keys after RoPE, (B, n_kv_heads, L, hd), L = every
    slot stored once the chunk is."""

    q: Tensor                          # (B, n_heads, T, hd) the chunk's queries, as attention uses them
    keys: Tensor                       # the history as held before the chunk, then the chunk exact
    values: Tensor
    held_keys: Tensor | None = None    # every slot as held after the chunk is stored (held=True only)
    held_values: Tensor | None = None


class LayerCache(nn.Module):
    """One layer's cache. Subclasses implement append, nbytes and formula_nbytes (and decode for a fast path)."""

    name: ClassVar[str]
    Options: ClassVar[type] = NoOptions
    window: Any = None          # a kvzoo.cache.store.Window, or None: every token is seen as stored
    value_window: Any = None    # the values' Window where it differs from the keys'

    def __init__(self, spec: CacheSpec, layer: "Attention", prev: "LayerCache | None",
                 batch_size: int, max_len: int):
        super().__init__()
        self.spec, self.opts = spec, spec.options
        if layer.layer_idx < getattr(self.opts, "high_layers", 0):
            # the papers' "first layers in higher precision" rule (XQuant Table 4: the first 3 at 4 bits)
            self.opts = dataclasses.replace(self.opts, bits=self.opts.high_bits)
        self.layer = [layer]      # a list, so nn.Module does not register the model's weights as ours
        self.prev = [prev]
        self.batch_size, self.max_len = batch_size, max_len
        self.simulated = False    # set by ModelCache for mode="simulated"
        self.prompt = 0           # simulated mode: slots [0, prompt) are prefilled exact (set by ModelCache)
        self.length = 0           # tokens stored so far

    @property
    def attn(self) -> "Attention":
        return self.layer[0]

    @classmethod
    def make_options(cls, given: dict[str, Any]) -> Any:
        """Build `cls.Options` from strings or values, refusing unknown keys and bad types."""
        fields = {f.name: f for f in dataclasses.fields(cls.Options)}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            accepted = ", ".join(fields) or "none"
            raise ValueError(f"cache {cls.name!r} has no option {', '.join(unknown)}; accepted options: {accepted}")
        values = {}
        for key, raw in given.items():
            kind = type(getattr(cls.Options(), key))
            try:
                values[key] = _coerce(raw, kind)
            except ValueError:
                raise ValueError(f"cache {cls.name!r} option {key}={raw!r} is not a valid {kind.__name__}") from None
        return cls.Options(**values)

    # ---- the contract ------------------------------------------------------------------------------
    def append(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions, held: bool = False) -> Chunk:
        """Store the chunk (advancing self.length) and return what its queries read (see Chunk)."""
        raise NotImplementedError

    def decode(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """One token per row; a strategy with a faster path than a one-token prefill overrides this."""
        return self.prefill(x, q, k, v, pos)

    def nbytes(self) -> int:
        raise NotImplementedError

    def formula_nbytes(self, length: int) -> int:
        """What the module docstring's bytes-per-token formula gives for `length` stored tokens (all
        rows); the contract test holds nbytes() to it."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every token; preallocated buffers are simply overwritten by the next ones."""
        self.length = 0

    def quantized_slots(self) -> tuple[int, int]:
        """(keys, values): how many of the stored slots are held quantized (by `window`, `value_window`); the
        others are exact."""
        if self.window is None:
            return 0, 0
        return self.window.quantized(self.length), (self.value_window or self.window).quantized(self.length)

    def prompt_slots(self, chunk: int) -> int:
        """Of a chunk of `chunk` tokens, how many prompt statistics come from (module docstring): the whole
        chunk on a streaming first call, the first max(prompt, 1) on a simulated one, none once a token is stored."""
        if self.length:
            return 0
        return min(chunk, max(self.prompt, 1)) if self.simulated else chunk

    # ---- the two evaluation modes, for every strategy ------------------------------------------------
    def prefill(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """Streaming: the chunk attends over the history as held plus itself exact, then stays stored."""
        c = self.append(x, q, k, v, pos)
        return attend(c.q, c.keys, c.values, pos.mask)

    def simulate(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, pos: Positions) -> Tensor:
        """Simulated mode: query slot s reads slot j as held (round-tripped) where `window` says j was
        quantized by the time s is decoded, exact elsewhere; the prompt's queries read every slot exact."""
        if self.window is None:           # nothing is ever quantized: simulated is streaming
            return self.prefill(x, q, k, v, pos)
        c = self.append(x, q, k, v, pos, held=True)
        L = self.length
        q_slots = torch.arange(L - q.shape[2], L, device=q.device)
        decoded = (q_slots >= self.prompt)[:, None]                                          # (T, 1)
        use_k = self.window.rounded(q_slots, L) & decoded                                    # (T, L)
        use_v = (self.value_window or self.window).rounded(q_slots, L) & decoded
        return self.attend_simulated(c, use_k, use_v, full_mask(pos, L, q.device))

    def attend_simulated(self, c: Chunk, use_k: Tensor, use_v: Tensor, mask: Tensor) -> Tensor:
        """Attention of simulated mode; a strategy whose reads depend on the query (AlignedKV) overrides it."""
        return attend_split(c.q, c.keys, c.values, c.held_keys, c.held_values, use_k, use_v, mask)


def _coerce(raw: Any, kind: type) -> Any:
    """A CLI string (or a Python value) -> the option's type; ValueError if it does not fit."""
    if not isinstance(raw, str):
        if kind is float and isinstance(raw, int):
            return float(raw)
        if not isinstance(raw, kind) or (kind is int and isinstance(raw, bool)):
            raise ValueError(raw)
        return raw
    if kind is bool:
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise ValueError(raw)
        return raw.lower() in ("1", "true", "yes", "on")
    return kind(raw)


def used_nbytes(*tensors: Tensor, length: int, dim: int = 2) -> int:
    """Bytes of the first `length` entries along `dim` of preallocated buffers (what is really held)."""
    return sum(t.narrow(dim, 0, length).nbytes for t in tensors)


class ModelCache(nn.Module):
    """One LayerCache per layer, built in order so each can see the previous one (`prev`)."""

    MODES = ("streaming", "simulated")

    def __init__(self, spec: CacheSpec, layers: list["Attention"], batch_size: int, max_len: int,
                 mode: str = "streaming", prompt: int = 0, sharded: bool = False):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"unknown evaluation mode {mode!r}; accepted: {', '.join(self.MODES)}")
        strategy = get_strategy(spec.name)
        if spec.options is None:
            spec = CacheSpec(spec.name, strategy.make_options({}))
        self.spec, self.batch_size, self.max_len = spec, batch_size, max_len
        built: list[LayerCache] = []
        for attn in layers:
            built.append(strategy(spec, attn, built[-1] if built else None, batch_size, max_len))
        if prompt and mode != "simulated":
            raise ValueError("a prompt length applies to simulated mode only (streaming prefills the prompt)")
        for layer in built:
            layer.simulated, layer.prompt = mode == "simulated", prompt
        self.layers = nn.ModuleList(built)
        self.mode = mode
        self.sharded = sharded    # each layer holds this rank's KV heads (kvzoo/models/tp.py)
        self.length = 0

    def nbytes(self) -> int:
        """Bytes held, summed over the ranks of a sharded model (every rank must call it then)."""
        from kvzoo.models.tp import all_sum
        held = sum(layer.nbytes() for layer in self.layers)
        return all_sum(held) if self.sharded else held

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.length = 0

    def quantized_slots(self) -> tuple[int, int]:
        """(keys, values) held quantized per row, in the layer that quantizes the most (the rest are exact)."""
        counts = [layer.quantized_slots() for layer in self.layers]
        return max(k for k, _ in counts), max(v for _, v in counts)

    @torch.no_grad()
    def repeat_row(self, src: "ModelCache") -> None:
        """Make every row a copy of the single row of `src` (same strategy, options and max_len): one prompt
        prefilled once and then decoded B ways (parallel sampling); bench_decode fills large batches so."""
        if src.batch_size != 1 or src.spec != self.spec or src.max_len != self.max_len or src.mode != self.mode:
            raise ValueError("repeat_row needs a one-row cache of the same strategy, options, max_len and mode")
        for mine, theirs in zip(self.modules(), src.modules()):      # layers and their sub-stores, in order
            loose = [k for k, v in vars(theirs).items() if isinstance(v, Tensor)]
            if loose:
                raise ValueError(f"cache strategy {self.spec.name} keeps state outside its buffers ({', '.join(loose)}); "
                                 f"repeat_row cannot copy it")
            for name, buf in mine.named_buffers(recurse=False):
                buf.copy_(theirs.get_buffer(name).expand_as(buf))      # (1, ...) -> (B, ...)
            for key, value in vars(theirs).items():                    # host-side counters
                if isinstance(value, (bool, int, float)) and key not in ("batch_size", "max_len"):
                    setattr(mine, key, value)


def fp16_kv_nbytes(n_layers: int, n_kv_heads: int, head_dim: int, tokens: int) -> int:
    """Bytes an fp16 K and V cache needs for `tokens` tokens (summed over the batch): the baseline
    every strategy's `nbytes()` is divided by to report its KV size ratio."""
    return 2 * 2 * n_layers * n_kv_heads * head_dim * tokens
