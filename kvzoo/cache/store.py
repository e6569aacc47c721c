"""The windowed quantized store every quantizing strategy keeps its rows in.

A stream of rows (..., L, w) (keys or values per KV head (B, H, L, d), or XQuant's layer inputs (B, L, w))
is held as

    slots [0, S)             sink window: the first tokens, exact (at the model's precision)
    slots [S, S + Nq)        quantized, in whole groups of G tokens, by the stream's `Codec`
    slots [S + Nq, L)        recent window: the newest tokens, exact; R <= L - S - Nq < R + G once L >= S + R

with Nq = Window.quantized(L) = max(0, floor((L - S - R) / G)) * G. A group is quantized once, when it
leaves the recent window, and never requantized. G = 1, R = 0 quantizes every token as it is stored.
The recent window's buffer holds R + G rows. With G = 1 it is a ring (slot s in row (s - S) mod (R + 1)): a token
leaves it at every step and no row moves; with G > 1 its rows move down G rows when a group leaves
(Window.first_row). `recent_rows` gives the live rows in slot order.

`Window.quantized` is the one formula of what is quantized when: the store uses it on host ints, the static
(CUDA-graph) steps on device tensors, and simulated mode (kvzoo/cache/base.py) per query: the query at slot
s sees slots [S, S + quantized(s)) round-tripped and every other slot exact, as decoding it would.

A strategy picks a codec per stream (how a group of rows becomes integer codes, which buffers hold them,
their bytes); the store owns everything around it: the windows, where a chunk's rows go, host writes and
device-slot writes (the static step), bytes held and their formula.

Each stream has its own window, and a window *policy* says which (`policy_windows`):
    reference  what the paper or the authors' code does (the default of every strategy). KIVI's and SQuat's code
               keep exactly R values exact (Window(S, R, 1), a value quantized per token as it leaves) and flush
               the key residual all at once when it reaches R (Window(S, 0, R): 0..R-1 exact keys); InnerQ's
               paper keeps exactly w_recent keys (Window(S, R, 1)) and quantizes values a group of 32 tokens
               at a time (Window(S, R, 32)).
    grouped    every stream Window(S, R, G): R..R+G-1 newest tokens exact, flushed a group at a time.
    none       the XQuant paper's perplexity protocol: no sink, no exact window; each token is quantized as
               soon as its group is complete (Window(0, 0, 1) for groups within a token, Window(0, 0, G) for
               groups of G tokens, whose newest G-1 tokens wait exact: the causal form of quantizing all).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor, nn

from kvzoo.cache.kvquant import QTensor, dequantize, packed_words, quantize

SCALE_DTYPE = torch.float16
EXACT = 16        # bits = 16: rows kept at the model's precision, no codes
POLICIES = ("reference", "grouped", "none")
FUSED_TOKEN_WRITE = True   # GroupCodec.write_at of one token in one kernel; False: the torch path, its reference


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

    def first_row(self, n_q):
        """The row of the recent window's buffer (R + G rows) that holds its oldest slot S + n_q. A window of
        one-token groups is a ring, slot s in row (s - S) mod (R + 1), so that no row moves when its oldest leaves
        (every token); one of G > 1 tokens moves down G rows when a group leaves (once every G tokens), its
        oldest slot in row 0. Slot S + n_q + j is then in row (first_row(n_q) + j) mod (R + G). An int for an int
        n_q, else a device tensor like it (no host copy, which a CUDA graph's capture refuses)."""
        return n_q % (self.recent + 1) if self.group == 1 else n_q * 0

    def rounded(self, q_slots: Tensor, n_keys: int) -> Tensor:
        """(T, n_keys) True where the query at slot q_slots[t] reads key slot j quantized: j in [S, S + Nq(s))."""
        keys = torch.arange(n_keys, device=q_slots.device)[None, :]
        return (keys >= self.sink) & (keys < self.sink + self.quantized(q_slots)[:, None])


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown window policy {policy!r}; accepted: {', '.join(POLICIES)}")


def policy_windows(policy: str, reference: dict[str, Window], sink: int, recent: int, group: int,
                   spans: dict[str, int]) -> dict[str, Window]:
    """The window of each stream under `policy` (module docstring): `reference` is the strategy's own (the
    paper's), `spans[name]` the tokens one group of that stream covers (G along tokens, 1 within a token)."""
    check_policy(policy)
    if policy == "reference":
        return reference
    if policy == "grouped":
        return {name: Window(sink, recent, group) for name in spans}
    return {name: Window(0, 0, span) for name, span in spans.items()}


def token_group(width: int, group_size: int) -> int:
    """Channels per per-token group: the largest divisor of `width` that is at most `group_size`."""
    return max(g for g in range(1, min(width, group_size) + 1) if width % g == 0)


def move_down(window: Tensor, group: int) -> None:
    """Rows (*lead, R + group, width): rows group.. move down `group` rows (the oldest group has left)."""
    window[..., :-group, :] = window[..., group:, :].clone()


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
    capacity: int           # quantized slots the buffers hold

    def write(self, a: int, b: int, rows: Tensor, real: Tensor | None = None) -> None:
        """Quantize rows (*lead, b - a, width) into slots [a, b); real (B, b - a) False on padding (or None)."""
        raise NotImplementedError

    def write_at(self, start: Tensor, rows: Tensor) -> None:
        """The same at a device-held slot start (1,): index writes, no host sync (the static step)."""
        raise NotImplementedError

    def flush_at(self, start: Tensor, window: Tensor, group: int) -> None:
        """A window's oldest `group` rows (window (*lead, R + group, width)) into slots [start, start + group) at a
        device-held start (1,) (the static step): a ring's (group 1) from its row start mod (R + 1), where it stays;
        else rows 0 .. group - 1, the other rows then moved down `group` rows (Window.first_row)."""
        if group == 1:
            self.write_at(start, window.index_select(-2, start % window.shape[-2]))
            return
        self.write_at(start, window[..., :group, :])
        move_down(window, group)

    def held(self, n: int):
        """Slots [0, n) as stored (a QTensor-like object, or exact rows)."""
        raise NotImplementedError

    def read(self, n: int, dtype: torch.dtype, start: int = 0) -> Tensor:
        """Slots [start, n) dequantized: (*lead, n - start, width); start a multiple of the codec's token
        groups."""
        raise NotImplementedError

    def nbytes(self, n: int) -> int:
        """Bytes of every tensor held for slots [0, n)."""
        raise NotImplementedError

    def scores(self, q: Tensor, n: int, start: int = 0) -> Tensor:
        """q·row for every held slot of [start, n): q (*lead, rep, width) fp32 -> (*lead, rep, n - start). `read`
        unpacks the codes into one fp32 tensor and turns it into rows in place (kvquant.scale_codes_), so the step
        makes one pass over the codes and one matmul."""
        return q @ self.read(n, torch.float32, start).transpose(-1, -2)

    def weigh(self, p: Tensor, n: int, start: int = 0) -> Tensor:
        """Σ_t p_t row_t over the held slots [start, n): p (*lead, rep, n - start) fp32 -> (*lead, rep, width)."""
        return p @ self.read(n, torch.float32, start)

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
        self.width, self.bits, self.per_channel, self.capacity = width, bits, per_channel, capacity
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
        if n == 1 and self._token_kernel(rows):          # a static step's one token: one kernel
            from kvzoo.kernels.quantize_pack import group_token_write
            group_token_write(rows, start, self.codes, self.scale, self.zero, self.bits, self.group)
            return
        slots, groups = device_slots(start, n, self.group)
        for buf, values, grouped in self._encode(rows):
            buf.index_copy_(buf.dim() - 2, groups if grouped else slots, values)

    def flush_at(self, start: Tensor, window: Tensor, group: int) -> None:
        if group == 1 and self._token_kernel(window) and window.is_contiguous():   # one kernel, from its ring row
            from kvzoo.kernels.quantize_pack import group_token_write
            group_token_write(window, start, self.codes, self.scale, self.zero, self.bits, self.group, ring=True)
            return
        super().flush_at(start, window, group)

    def _token_kernel(self, rows: Tensor) -> bool:
        """Whether group_token_write serves a one-token write: per-token groups of 2/4/8-bit codes filling whole
        words, this class's own quantizer, a device the kernels run on, and FUSED_TOKEN_WRITE."""
        from kvzoo.kernels.quant_matvec import kernels_run_on

        g = self.group
        return (FUSED_TOKEN_WRITE and not self.per_channel and not self.exact_first and self.bits in (2, 4, 8)
                and not g & (g - 1) and g % (32 // self.bits) == 0 and type(self).quantize is GroupCodec.quantize
                and kernels_run_on(rows.device))

    def held_first(self, n: int) -> Tensor | None:
        """Channel 0 of slots [0, n) at full precision (exact_first), else None."""
        return self.first[..., :n, :] if self.exact_first else None

    def held(self, n: int, start: int = 0) -> QTensor | Tensor:
        if self.bits == EXACT:
            return self.rows[..., start:n, :]
        g = self._groups(start, n)
        return QTensor(self.codes[..., start:n, :], self.scale[..., g, :], self.zero[..., g, :], self.bits, self.group,
                       -2 if self.per_channel else -1, (*self.codes.shape[:-2], n - start, self.coded))

    def read(self, n: int, dtype: torch.dtype, start: int = 0) -> Tensor:
        q = self.held(n, start)
        x = q.to(dtype) if isinstance(q, Tensor) else dequantize(q, dtype)
        return x if not self.exact_first else torch.cat([self.first[..., start:n, :].to(dtype), x], dim=-1)

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
    docstring). `codecs` names the streams; `windows` gives each its window (one Window: all share it). The
    store keeps no counters: the caller's length L says what is where (Nq = window.quantized(L))."""

    def __init__(self, windows: Window | dict[str, Window], codecs: dict[str, Codec], lead: tuple[int, ...],
                 dtype: torch.dtype, device):
        super().__init__()
        self.windows = windows if isinstance(windows, dict) else {name: windows for name in codecs}
        shared = set(self.windows.values())
        self.window = shared.pop() if len(shared) == 1 else None     # the window every stream shares, if one
        self.lead = lead
        self.codecs = nn.ModuleDict(codecs)
        for name, codec in codecs.items():
            w = self.windows[name]
            self.register_buffer(f"sink_{name}", torch.zeros((*lead, w.sink, codec.width), dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"recent_{name}", torch.zeros((*lead, w.recent + w.group, codec.width), dtype=dtype,
                                                               device=device), persistent=False)

    def sink(self, name: str) -> Tensor:
        return self.get_buffer(f"sink_{name}")

    def recent(self, name: str) -> Tensor:
        """Stream `name`'s recent window buffer (*lead, R + G, width), its rows placed by Window.first_row."""
        return self.get_buffer(f"recent_{name}")

    def recent_rows(self, name: str, length: int) -> Tensor:
        """The recent window's live rows in slot order once `length` are stored: (*lead, r, width), a view
        unless a ring's rows wrap past its last row."""
        _, n_q, r = self.counts(length, name)
        buf, first = self.recent(name), self.windows[name].first_row(n_q)
        wrapped = first + r - buf.shape[-2]
        if wrapped <= 0:
            return buf[..., first:first + r, :]
        return torch.cat([buf[..., first:, :], buf[..., :wrapped, :]], dim=-2)

    def counts(self, length: int, name: str | None = None) -> tuple[int, int, int]:
        """(tokens in the sink, quantized, in the recent window) of stream `name` (default: the shared window)
        once `length` are stored."""
        w = self.windows[name] if name is not None else self.shared()
        in_sink, n_q = min(length, w.sink), w.quantized(length)
        return in_sink, n_q, length - in_sink - n_q

    def shared(self) -> Window:
        if self.window is None:
            raise ValueError(f"the streams have different windows ({self.windows}); name the stream")
        return self.window

    def append(self, length: int, rows: dict[str, Tensor], real: Tensor | None = None) -> int:
        """Store a chunk (rows[name] (*lead, T, width)) after `length` stored tokens; returns the new length.
        The first tokens of the sequence fill the sink window, the rest join the recent window, whose oldest
        whole groups beyond R tokens are quantized. real (B, T): False on padding slots, for codecs whose
        ranges span tokens (only with windows that quantize every token as it comes: S = R = 0, G = 1)."""
        for name, x in rows.items():
            w, at = self.windows[name], length
            into_sink = max(0, min(w.sink - at, x.shape[-2]))
            if into_sink:
                self.sink(name)[..., at:at + into_sink, :] = x[..., :into_sink, :]
                x, at = x[..., into_sink:, :], at + into_sink
            _, n_q, r = self.counts(at, name)
            flush = w.quantized(at + x.shape[-2]) - n_q
            assert real is None or (r == 0 and flush == x.shape[-2]), "padding masks go with token-by-token windows"
            recent = self.recent(name)
            tail = torch.cat([self.recent_rows(name, at), x], dim=-2)         # (*lead, r + T, width), slot order
            if flush:
                self.codecs[name].write(n_q, n_q + flush, tail[..., :flush, :], real)
            kept = tail.shape[-2] - flush                                   # < R + G rows, from slot S + n_q + flush
            rows_at = (w.first_row(n_q + flush) + torch.arange(kept, device=recent.device)) % recent.shape[-2]
            recent.index_copy_(recent.dim() - 2, rows_at, tail[..., flush:, :].to(recent.dtype))
        return length + next(iter(rows.values())).shape[-2]

    def read(self, length: int, dtype: torch.dtype, start: int = 0, names: tuple[str, ...] | None = None
             ) -> dict[str, Tensor]:
        """The stored slots as attention sees them, per stream (`names`, default all): the sink, quantized slots
        [start, Nq) dequantized, the recent window: (*lead, length - start, width). start > 0 leaves out quantized
        slots the caller reads another way (decode kernels read them in place)."""
        out = {}
        for name in names or self.codecs:
            codec = self.codecs[name]
            in_sink, n_q, r = self.counts(length, name)
            out[name] = torch.cat([self.sink(name)[..., :in_sink, :], codec.read(n_q, dtype, min(start, n_q)),
                                   self.recent_rows(name, length)], dim=-2)
        return out

    def attend(self, q: Tensor, length: int, token: dict[str, Tensor], mask: Tensor | None = None,
               keys: Tensor | None = None) -> Tensor:
        """One decode token's attention over the slots held (streams "k" and "v", keys as attention sees them)
        plus the token's own k, v exact, the quantized slots read from their codes a stream at a time
        (Codec.scores / weigh), never the whole history at the model's precision. q (B, Hq, 1, d) (Hq a multiple
        of H, GQA); token (B, H, 1, d) each; mask (B, 1, 1, length + 1) True = may attend, or None; keys (B, H, length, d): the history's keys given
        instead (keys stored before RoPE, rotated by the caller). Returns (B, Hq, 1, d) in q's dtype; fp32 inside."""
        (B, Hq, _, d), H = q.shape, self.lead[1]
        qf = q.float().view(B, H, Hq // H, d) * d ** -0.5                            # (B, H, rep, d)
        if keys is not None:
            scores = torch.cat([qf @ keys.float().transpose(-1, -2), qf @ token["k"].float().transpose(-1, -2)], -1)
        else:
            in_sink, n_q, r = self.counts(length, "k")
            exact = [self.sink("k")[..., :in_sink, :], self.recent_rows("k", length), token["k"]]
            k_sink, k_recent, k_token = (qf @ rows.float().transpose(-1, -2) for rows in exact)
            scores = torch.cat([k_sink, self.codecs["k"].scores(qf, n_q), k_recent, k_token], dim=-1)  # (B, H, rep, L + 1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = scores.softmax(dim=-1)
        in_sink, n_q, r = self.counts(length, "v")
        p_sink, p_q, p_recent, p_token = p.split([in_sink, n_q, r, 1], dim=-1)
        out = (p_sink @ self.sink("v")[..., :in_sink, :].float() + self.codecs["v"].weigh(p_q, n_q)
               + p_recent @ self.recent_rows("v", length).float() + p_token @ token["v"].float())
        return out.view(B, Hq, 1, d).to(q.dtype)

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
        total = 0
        for name, codec in self.codecs.items():
            in_sink, n_q, r = self.counts(length, name)
            total += self.sink(name)[..., :in_sink, :].nbytes + codec.nbytes(n_q) + self.recent(name)[..., :r, :].nbytes
        return total

    def formula_nbytes(self, length: int) -> int:
        """The bytes-per-token formula: quantized slots at their codec's token_bytes, the rest exact."""
        per_row = 0.0
        for name, codec in self.codecs.items():
            n_q = self.windows[name].quantized(length)
            per_row += n_q * codec.token_bytes() + (length - n_q) * codec.width * self.sink(name).element_size()
        return round(prod(self.lead) * per_row)

    # ---- device-held lengths (the static step, kvzoo/graphs.py) -------------------------------------------
    # A static step holds each stream's rows in a fixed layout, [quantized slots (capacity N) | sink rows (S) |
    # recent rows (R + G)], the rows not live yet masked; streams with different windows meet through
    # `route`, which moves attention weights from one stream's layout to the other's by slot.
    def phase(self, length: int, name: str | None = None) -> str:
        """What the next token does in stream `name` (default: the shared window): joins the sink, joins the
        recent window, or fills it so that its oldest group is quantized ("flush")."""
        w = self.windows[name] if name is not None else self.shared()
        if length < w.sink:
            return "sink"
        return "flush" if w.quantized(length + 1) > w.quantized(length) else "recent"

    def phases(self, length: int) -> str:
        """The static step's phase: the shared window's, or every stream's ("k:flush v:recent")."""
        if self.window is not None:
            return self.phase(length)
        return " ".join(f"{name}:{self.phase(length, name)}" for name in self.codecs)

    def window_row(self, step, name: str | None = None) -> tuple[Tensor, Tensor]:
        """From the device-held length L = step.slot: (Nq (1,), the token's row in its window: sink row L while
        L < S, else the recent row of slot L, Window.first_row) of stream `name` (default: the shared window).
        Computed once per step and window, shared by every layer."""
        w = self.windows[name] if name is not None else self.shared()
        S, R, G = w.sink, w.recent, w.group
        key = ("window", S, R, G)
        if key not in step.derived:
            L = step.slot
            n_q = w.quantized(L)
            recent_row = (w.first_row(n_q) + L - S - n_q) % (R + G)
            step.derived[key] = (n_q, torch.where(L < S, L.clamp_max(max(S - 1, 0)), recent_row))
        return step.derived[key]

    def static_rows(self, step, name: str) -> tuple[Tensor, Tensor]:
        """(slots (K,), live (K,)) of stream `name`'s static layout, K = N + S + R + G: the slot each row holds
        and whether it holds one yet (a quantized slot < Nq, a sink row <= L, a recent row up to the token's)."""
        w, n = self.windows[name], self.codecs[name].capacity
        key = ("rows", w, n)
        if key not in step.derived:
            L, device = step.slot, step.slot.device
            n_q, _ = self.window_row(step, name)
            quant, sink, recent = (torch.arange(k, device=device) for k in (n, w.sink, w.recent + w.group))
            recent = (recent - w.first_row(n_q)) % (w.recent + w.group)      # recent row i holds slot S + n_q + j
            slots = torch.cat([w.sink + quant, sink, w.sink + n_q + recent])
            live = torch.cat([quant < n_q, sink <= L, recent <= L - w.sink - n_q])
            step.derived[key] = (slots, live)
        return step.derived[key]

    def route(self, p: Tensor, step, src: str, dst: str) -> Tensor:
        """Weights p (..., K_src) over stream src's static rows as weights over stream dst's (..., K_dst): each
        slot's weight moves to the row that holds that slot in dst (rows not live in src must weigh 0; rows not
        live in dst get 0)."""
        if self.windows[src] == self.windows[dst] and self.codecs[src].capacity == self.codecs[dst].capacity:
            return p
        s_src, _ = self.static_rows(step, src)
        s_dst, live = self.static_rows(step, dst)
        n_slots = max(s.numel() for s in (s_src, s_dst))          # every row's slot is below N + S + R + G
        by_slot = p.new_zeros(*p.shape[:-1], n_slots).scatter_add_(-1, s_src.expand(p.shape), p)
        return by_slot.index_select(-1, s_dst) * live

    def row_map(self, step, src: str, dst: str) -> Tensor:
        """(K_src,) long: for each of stream src's static rows, the row of stream dst's static layout that holds
        the same slot (rows not live in src map to row 0, to be masked). Once per step and pair of layouts."""
        key = ("row map", self.windows[src], self.codecs[src].capacity, self.windows[dst], self.codecs[dst].capacity)
        if key not in step.derived:
            s_src, _ = self.static_rows(step, src)
            s_dst, live = self.static_rows(step, dst)
            n_slots = max(s.numel() for s in (s_src, s_dst))          # every row's slot is below N + S + R + G
            rows = torch.arange(s_dst.numel(), device=s_dst.device)
            # live rows hold distinct slots; dead ones are sent to a spare entry past the last slot
            by_slot = torch.zeros(n_slots + 1, dtype=torch.long, device=s_dst.device)
            by_slot.scatter_(0, torch.where(live, s_dst, n_slots), torch.where(live, rows, 0))
            step.derived[key] = by_slot.index_select(0, s_src.clamp_max(n_slots - 1))
        return step.derived[key]

    def write_token_at(self, length: int, step, rows: dict[str, Tensor]) -> None:
        """The token's rows (*lead, 1, width) into each stream's window row (a device tensor (1,)); `length`
        tokens stored before it (host-side, for the phase)."""
        for name, x in rows.items():
            _, row = self.window_row(step, name)
            buf = self.sink(name) if self.phase(length, name) == "sink" else self.recent(name)
            buf.index_copy_(buf.dim() - 2, row, x)

    def flush_at(self, length: int, step, names: tuple[str, ...] | None = None) -> None:
        """Each stream (of `names`, default all) whose recent window the token filled: its oldest group into
        quantized slots [Nq, Nq + G) at the device-held Nq (Codec.flush_at: a ring's rows stay, others move)."""
        for name, codec in self.codecs.items():
            if (names is None or name in names) and self.phase(length, name) == "flush":
                n_q, _ = self.window_row(step, name)
                codec.flush_at(n_q, self.recent(name), self.windows[name].group)

    def shift(self, names: tuple[str, ...] | None = None) -> None:
        """Move the recent windows (of `names`, default all) down by one group (after its oldest was quantized by
        the caller); a ring (Window.first_row) does not move."""
        for name in names or tuple(self.codecs):
            if self.windows[name].group > 1:
                move_down(self.recent(name), self.windows[name].group)

    def token_kernel_serves(self, padded: bool, attn, max_len: int) -> bool:
        """Whether `attend_token_kernel` serves this store: streams "k" and "v" in per-token groups (GroupCodec,
        a power-of-two group of channels, the same for both, bits the fused kernel takes), every token quantized
        as it is stored (Window(0, 0, 1)), on a device the kernels run on, with a causal mask (unpadded rows, no
        binding sliding window)."""
        from kvzoo.kernels.outer_attention import OUTER_BITS
        from kvzoo.kernels.quant_matvec import kernels_run_on

        if set(self.codecs) != {"k", "v"}:
            return False
        codecs = [self.codecs["k"], self.codecs["v"]]
        if any(not isinstance(c, GroupCodec) or c.per_channel or c.exact_first or c.bits not in OUTER_BITS
               for c in codecs):
            return False
        group, window = codecs[0].group, getattr(attn, "sliding_window", None)
        return (all(w == Window(0, 0, 1) for w in self.windows.values()) and codecs[1].group == group
                and group & (group - 1) == 0 and kernels_run_on(codecs[0].codes.device) and not padded
                and (window is None or window >= max_len))

    def attend_token_kernel(self, q: Tensor, length: int, step, rows: dict[str, Tensor]) -> Tensor:
        """The static step where `token_kernel_serves`: attention over the stored slots, then the token's k, v
        (rows, not yet stored), in one fused kernel (kvzoo/kernels/outer_attention.py, keys and values in per-token
        groups); then, beside the step (StaticStep.beside), the token into the window row and quantized at the
        device-held slot. q (B, Hq, 1, d) after RoPE; returns (B, Hq, 1, d)."""
        from kvzoo.kernels.outer_attention import outer_decode_attention

        key = ("token kernel lengths",)
        if key not in step.derived:            # [keys quantized, values quantized, slots stored, sink, rows]
            n_q, _ = self.window_row(step, "k")       # and the windows' rows of their oldest slots: one row each
            step.derived[key] = torch.cat([n_q, n_q, n_q] + [torch.zeros_like(n_q)] * 3).to(torch.int32)
        kc, vc = self.codecs["k"], self.codecs["v"]
        # every stored slot is quantized (the windows' one row only stages the token): no window to attend
        out = outer_decode_attention(q[:, :, 0], kc.codes, kc.scale, kc.zero, vc.codes, vc.scale, vc.zero, kc.bits,
                                     None, None, step.derived[key], v_bits=vc.bits,
                                     key_groups="token", group=kc.group, k_token=rows["k"], v_token=rows["v"])
        with step.beside(*rows.values()):       # nothing later in the step reads this layer's windows or codes
            self.write_token_at(length, step, rows)
            self.flush_at(length, step)
        return out[:, :, None]

    def scratch(self) -> tuple[Tensor, ...]:
        """Buffers a static step changes so that running it twice would differ: the windows of G > 1 tokens, which
        move down when a group leaves (a ring's step writes the same rows again)."""
        return tuple(self.recent(name) for name in self.codecs if self.windows[name].group > 1)
