"""The windowed quantized store every quantizing strategy keeps its rows in.

A stream of rows (..., L, w) (keys or values per KV head (B, H, L, d), or XQuant's layer inputs (B, L, w))
is held as

    slots [0, S)             sink window: the first tokens, exact (at the model's precision)
    slots [S, S + Nq)        quantized, in whole groups of G tokens, by the stream's `Codec`
    slots [S + Nq, L)        recent window: the newest tokens, exact; R <= L - S - Nq < R + G once L >= S + R

with Nq = Window.quantized(L) = max(0, floor((L - S - R) / G)) * G. A group is quantized once, when it
leaves the recent window, and never requantized. G = 1, R = 0 quantizes every token as it is stored.

`Window.quantized` is the one formula of what is quantized when: the store uses it on host ints, the static
(CUDA-graph) steps on device tensors, and simulated mode (kvzoo/cache/base.py) per query: the query at slot
s sees slots [S, S + quantized(s)) round-tripped and every other slot exact, as decoding it would.

A strategy picks a codec per stream (how a group of rows becomes integer codes, which buffers hold them,
their bytes); the store owns everything around it: the windows, where a chunk's rows go, host writes and
device-slot writes (the static step), bytes held and their formula.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor, nn

from kvzoo.cache.kvquant import QTensor, dequantize, packed_words, quantize

SCALE_DTYPE = torch.float16
EXACT = 16        # bits = 16: rows kept at the model's precision, no codes


@dataclass(frozen=True)
class Window:
    """Sink S exact tokens, then whole groups of G quantized, then at least R recent exact tokens."""

    sink: int = 0
    recent: int = 0
    group: int = 1

    def quantized(self, length):
        """Tokens held quantized once `length` are stored (an int, or a device tensor: no host sync)."""
        n = (length - self.sink - self.recent) // self.group
        return (n.clamp_min(0) if isinstance(n, Tensor) else max(n, 0)) * self.group

    def rounded(self, q_slots: Tensor, n_keys: int) -> Tensor:
        """(T, n_keys) True where the query at slot q_slots[t] reads key slot j quantized: j in [S, S + Nq(s))."""
        keys = torch.arange(n_keys, device=q_slots.device)[None, :]
        return (keys >= self.sink) & (keys < self.sink + self.quantized(q_slots)[:, None])


def token_group(width: int, group_size: int) -> int:
    """Channels per per-token group: the largest divisor of `width` that is at most `group_size`."""
    return max(g for g in range(1, min(width, group_size) + 1) if width % g == 0)


def device_slots(start: Tensor, n: int, group: int) -> tuple[Tensor, Tensor]:
    """Where n rows written at a device-held slot `start` (1,) go, with no host sync: (their slots (n,), the
    groups of `group` rows they fill (n // group,), start then a multiple of it)."""
    slots = start + torch.arange(n, device=start.device)
    groups = torch.div(start, group, rounding_mode="floor") + torch.arange(n // group, device=start.device)
    return slots, groups


class Codec(nn.Module):
    """How one stream's quantized slots are held. Subclasses allocate buffers for `capacity` slots (token axis
    -2 of (*lead, capacity, width) rows) and implement the six methods below."""

    width: int

    def write(self, a: int, b: int, rows: Tensor, real: Tensor | None = None) -> None:
        """Quantize rows (*lead, b - a, width) into slots [a, b); real (B, b - a) False on padding (or None)."""
        raise NotImplementedError

    def write_at(self, start: Tensor, rows: Tensor) -> None:
        """The same at a device-held slot start (1,): index writes, no host sync (the static step)."""
        raise NotImplementedError

    def held(self, n: int):
        """Slots [0, n) as stored (a QTensor-like object, or exact rows)."""
        raise NotImplementedError

    def read(self, n: int, dtype: torch.dtype) -> Tensor:
        """Slots [0, n) dequantized: (*lead, n, width)."""
        raise NotImplementedError

    def nbytes(self, n: int) -> int:
        """Bytes of every tensor held for slots [0, n)."""
        raise NotImplementedError

    def token_bytes(self) -> float:
        """The formula: bytes of one quantized slot of one lead row (codes, scales, zeros)."""
        raise NotImplementedError


class GroupCodec(Codec):
    """Asymmetric `bits`-bit codes with an fp16 scale and zero per group (kvzoo.cache.kvquant).

    per_channel: groups run along tokens (each channel of `group` consecutive slots shares a scale/zero: KIVI's
    keys, XQuant's X U_k); otherwise along the width (`group` channels of one slot: KIVI's values).
    exact_first: channel 0 is kept at the model's precision (buffer `first`), codes cover channels 1..
    bits = 16: buffer `rows` holds the rows at the model's precision, no codes."""

    def __init__(self, lead: tuple[int, ...], capacity: int, width: int, bits: int, group: int, per_channel: bool,
                 dtype: torch.dtype, device, exact_first: bool = False):
        super().__init__()
        self.width, self.bits, self.per_channel = width, bits, per_channel
        self.exact_first = exact_first and bits != EXACT
        self.coded = width - int(self.exact_first)                 # channels that get codes
        self.group = group
        if not per_channel and self.coded % group:
            raise ValueError(f"group of {group} channels does not divide the row width {self.coded}")

        def buf(name: str, shape: tuple, dt: torch.dtype) -> None:
            self.register_buffer(name, torch.zeros((*lead, *shape), dtype=dt, device=device), persistent=False)

        if bits == EXACT:
            buf("rows", (capacity, width), dtype)
            return
        groups = (capacity // group, self.coded) if per_channel else (capacity, self.coded // group)
        buf("codes", (capacity, packed_words(self.coded, bits)), torch.int32)
        buf("scale", groups, SCALE_DTYPE)
        buf("zero", groups, SCALE_DTYPE)
        if self.exact_first:
            buf("first", (capacity, 1), dtype)

    def _groups(self, a: int, b: int) -> slice:
        return slice(a // self.group, b // self.group) if self.per_channel else slice(a, b)

    def quantize(self, rows: Tensor) -> QTensor:
        """Codes of rows (*lead, n, coded) (SQuat adjusts keys here before rounding)."""
        return quantize(rows, self.bits, self.group, axis=-2 if self.per_channel else -1, scale_dtype=SCALE_DTYPE)

    def _encode(self, rows: Tensor) -> list[tuple[Tensor, Tensor, bool]]:
        """(buffer, values for it, indexed by group rather than by slot) for each buffer a write fills."""
        if self.bits == EXACT:
            return [(self.rows, rows, False)]
        parts = [(self.first, rows[..., :1], False)] if self.exact_first else []
        q = self.quantize(rows[..., 1:] if self.exact_first else rows)
        return parts + [(self.codes, q.codes, False), (self.scale, q.scale, self.per_channel),
                        (self.zero, q.zero, self.per_channel)]

    def write(self, a: int, b: int, rows: Tensor, real: Tensor | None = None) -> None:
        for buf, values, grouped in self._encode(rows):
            buf[..., self._groups(a, b) if grouped else slice(a, b), :] = values

    def write_at(self, start: Tensor, rows: Tensor) -> None:
        n = rows.shape[-2]
        if self.per_channel and n % self.group:
            raise ValueError(f"a per-channel codec writes whole groups of {self.group} rows, got {n}")
        slots, groups = device_slots(start, n, self.group)
        for buf, values, grouped in self._encode(rows):
            buf.index_copy_(buf.dim() - 2, groups if grouped else slots, values)

    def held(self, n: int) -> QTensor | Tensor:
        if self.bits == EXACT:
            return self.rows[..., :n, :]
        g = self._groups(0, n)
        return QTensor(self.codes[..., :n, :], self.scale[..., g, :], self.zero[..., g, :], self.bits, self.group,
                       -2 if self.per_channel else -1, (*self.codes.shape[:-2], n, self.coded))

    def held_first(self, n: int) -> Tensor | None:
        """Channel 0 of slots [0, n) at full precision (exact_first), else None."""
        return self.first[..., :n, :] if self.exact_first else None

    def read(self, n: int, dtype: torch.dtype) -> Tensor:
        q = self.held(n)
        x = q.to(dtype) if isinstance(q, Tensor) else dequantize(q, dtype)
        return x if not self.exact_first else torch.cat([self.first[..., :n, :].to(dtype), x], dim=-1)

    def nbytes(self, n: int) -> int:
        if self.bits == EXACT:
            return self.rows[..., :n, :].nbytes
        g = self._groups(0, n)
        parts = [self.codes[..., :n, :], self.scale[..., g, :], self.zero[..., g, :]]
        return sum(t.nbytes for t in parts) + (self.first[..., :n, :].nbytes if self.exact_first else 0)

    def token_bytes(self) -> float:
        if self.bits == EXACT:
            return self.width * self.rows.element_size()
        # packed codes, then an fp16 scale + zero per group: coded/group groups per slot either way
        # (per channel: `coded` channel groups shared by `group` slots)
        first = self.first.element_size() if self.exact_first else 0
        return 4 * packed_words(self.coded, self.bits) + 4 * self.coded / self.group + first


class WindowedStore(nn.Module):
    """Streams of rows (*lead, L, width) held as sink | quantized groups | recent window (see the module
    docstring). `codecs` names the streams; every stream shares the window. The store keeps no counters:
    the caller's length L says what is where (Nq = window.quantized(L))."""

    def __init__(self, window: Window, codecs: dict[str, Codec], lead: tuple[int, ...], dtype: torch.dtype, device):
        super().__init__()
        self.window, self.lead = window, lead
        self.codecs = nn.ModuleDict(codecs)
        S, W = window.sink, window.recent + window.group
        for name, codec in codecs.items():
            self.register_buffer(f"sink_{name}", torch.zeros((*lead, S, codec.width), dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"recent_{name}", torch.zeros((*lead, W, codec.width), dtype=dtype, device=device),
                                 persistent=False)

    def sink(self, name: str) -> Tensor:
        return self.get_buffer(f"sink_{name}")

    def recent(self, name: str) -> Tensor:
        return self.get_buffer(f"recent_{name}")

    def counts(self, length: int) -> tuple[int, int, int]:
        """(tokens in the sink, quantized, in the recent window) once `length` are stored."""
        in_sink, n_q = min(length, self.window.sink), self.window.quantized(length)
        return in_sink, n_q, length - in_sink - n_q

    def append(self, length: int, rows: dict[str, Tensor], real: Tensor | None = None) -> int:
        """Store a chunk (rows[name] (*lead, T, width)) after `length` stored tokens; returns the new length.
        The first tokens of the sequence fill the sink window, the rest join the recent window, whose oldest
        whole groups beyond R tokens are quantized. real (B, T): False on padding slots, for codecs whose
        ranges span tokens (only with windows that quantize every token as it comes: S = R = 0, G = 1)."""
        S = self.window.sink
        T = next(iter(rows.values())).shape[-2]
        into_sink = max(0, min(S - length, T))
        if into_sink:
            for name, x in rows.items():
                self.sink(name)[..., length:length + into_sink, :] = x[..., :into_sink, :]
            rows = {name: x[..., into_sink:, :] for name, x in rows.items()}
            length += into_sink
            T -= into_sink
        _, n_q, r = self.counts(length)
        flush = self.window.quantized(length + T) - n_q
        assert real is None or (r == 0 and flush == T), "padding masks go with token-by-token windows only"
        for name, x in rows.items():
            recent = self.recent(name)
            tail = torch.cat([recent[..., :r, :], x], dim=-2)              # (*lead, r + T, width)
            if flush:
                self.codecs[name].write(n_q, n_q + flush, tail[..., :flush, :], real)
            recent[..., :tail.shape[-2] - flush, :] = tail[..., flush:, :]
        return length + T

    def read(self, length: int, dtype: torch.dtype) -> dict[str, Tensor]:
        """Every stored slot as attention sees it: (*lead, length, width) per stream (sink and recent exact,
        the quantized groups dequantized)."""
        in_sink, n_q, r = self.counts(length)
        return {name: torch.cat([self.sink(name)[..., :in_sink, :], codec.read(n_q, dtype),
                                 self.recent(name)[..., :r, :]], dim=-2)
                for name, codec in self.codecs.items()}

    def append_read(self, length: int, rows: dict[str, Tensor], held: bool = False):
        """Store a chunk and return what its queries read, per stream: (the new length; every slot as a
        streaming prefill sees it: the history as held, then the chunk exact; with held=True every slot as
        held once the chunk is stored, else None)."""
        dtype = next(iter(rows.values())).dtype
        before = self.read(length, dtype)
        new_length = self.append(length, rows)
        seen = {name: torch.cat([before[name], x], dim=-2) for name, x in rows.items()}
        return new_length, seen, (self.read(new_length, dtype) if held else None)

    def nbytes(self, length: int) -> int:
        in_sink, n_q, r = self.counts(length)
        return sum(self.sink(name)[..., :in_sink, :].nbytes + codec.nbytes(n_q) + self.recent(name)[..., :r, :].nbytes
                   for name, codec in self.codecs.items())

    def formula_nbytes(self, length: int) -> int:
        """The bytes-per-token formula: quantized slots at their codec's token_bytes, the rest exact."""
        n_q = self.window.quantized(length)
        per_row = sum(n_q * codec.token_bytes() + (length - n_q) * codec.width * self.sink(name).element_size()
                      for name, codec in self.codecs.items())
        return round(prod(self.lead) * per_row)

    # ---- device-held lengths (the static step, kvzoo/graphs.py) -------------------------------------------
    def phase(self, length: int) -> str:
        """What the next token does: joins the sink, joins the recent window, or fills it so that its oldest
        group is quantized ("flush")."""
        if length < self.window.sink:
            return "sink"
        return "flush" if self.window.quantized(length + 1) > self.window.quantized(length) else "recent"

    def window_row(self, step) -> tuple[Tensor, Tensor]:
        """From the device-held length L = step.slot: (Nq (1,), the token's row in its window: sink row L while
        L < S, else recent row L - S - Nq). Computed once per step, shared by every layer."""
        S, R, G = self.window.sink, self.window.recent, self.window.group
        key = ("window", S, R, G)
        if key not in step.derived:
            L = step.slot
            n_q = self.window.quantized(L)
            step.derived[key] = (n_q, torch.where(L < S, L.clamp_max(max(S - 1, 0)), L - S - n_q))
        return step.derived[key]

    def write_token_at(self, phase: str, row: Tensor, rows: dict[str, Tensor]) -> None:
        """The token's rows (*lead, 1, width) into its window row (a device tensor (1,))."""
        for name, x in rows.items():
            buf = self.sink(name) if phase == "sink" else self.recent(name)
            buf.index_copy_(buf.dim() - 2, row, x)

    def flush_at(self, n_q: Tensor) -> None:
        """The full recent window's oldest group into quantized slots [Nq, Nq + G), Nq a device tensor (1,)."""
        for name, codec in self.codecs.items():
            codec.write_at(n_q, self.recent(name)[..., :self.window.group, :])
        self.shift()

    def shift(self) -> None:
        """Move the recent window down by one group (after its oldest group was quantized)."""
        G, R = self.window.group, self.window.recent
        for name in self.codecs:
            buf = self.recent(name)
            buf[..., :R, :] = buf[..., G:G + R, :].clone()

    def scratch(self) -> tuple[Tensor, ...]:
        """Buffers a static step changes so that running it twice would differ (the window shift)."""
        return tuple(self.recent(name) for name in self.codecs)
