"""The shared windowed store (kvzoo/cache/store.py): one formula of what is quantized when, windows, bytes."""

import pytest
import torch

from kvzoo.cache.kvquant import quantize
from kvzoo.cache.store import GroupCodec, Window, WindowedStore, device_slots

WINDOWS = [Window(0, 0, 1), Window(0, 0, 8), Window(0, 16, 8), Window(5, 16, 8), Window(32, 96, 32)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_one_formula_on_host_ints_device_tensors_and_per_query_vectors(window):
    """Window.quantized gives the same counts for a Python int (the host's bookkeeping), a (1,) tensor (the
    static step's device-held length) and a vector of query slots (simulated mode)."""
    lengths = torch.arange(300)
    vector = window.quantized(lengths)
    for L in range(300):
        want = max(0, (L - window.sink - window.recent) // window.group) * window.group
        assert window.quantized(L) == want == vector[L].item() == window.quantized(torch.tensor([L])).item()
    rounded = window.rounded(lengths, 300)                                    # (T, L)
    assert torch.equal(rounded.sum(-1), vector)
    assert not rounded[:, :window.sink].any()


def store(window: Window, capacity: int = 256) -> WindowedStore:
    lead = (2, 3)
    codecs = {"k": GroupCodec(lead, capacity, 16, 3, window.group, True, torch.float32, "cpu"),
              "v": GroupCodec(lead, capacity, 16, 4, 8, False, torch.float32, "cpu")}
    return WindowedStore(window, codecs, lead, torch.float32, "cpu")


@pytest.mark.parametrize("window", [Window(0, 16, 8), Window(5, 16, 8), Window(0, 0, 8)], ids=str)
def test_chunks_are_quantized_once_and_windows_stay_exact(window):
    s = store(window)
    k, v = torch.randn(2, 2, 3, 200, 16, generator=torch.Generator().manual_seed(0))
    length = 0
    for size in (1, 3, 37, 5, 1, 90, 2, 61):
        length = s.append(length, {"k": k[:, :, length:length + size], "v": v[:, :, length:length + size]})
    assert length == 200
    in_sink, n_q, r = s.counts(length)
    S = window.sink
    assert in_sink == S and n_q == window.quantized(200) and window.recent <= r < window.recent + window.group
    held = s.read(length, torch.float32)
    quantized = slice(S, S + n_q)
    assert torch.equal(held["k"][:, :, quantized],
                       quantize(k[:, :, quantized], 3, window.group, axis=-2).dequantize())   # per channel
    assert torch.equal(held["v"][:, :, quantized], quantize(v[:, :, quantized], 4, 8, axis=-1).dequantize())
    for name, x in (("k", k), ("v", v)):                                      # sink and recent windows exact
        assert torch.equal(held[name][:, :, :S], x[:, :, :S])
        assert torch.equal(held[name][:, :, S + n_q:], x[:, :, S + n_q:])
    assert s.nbytes(length) == s.formula_nbytes(length)


def test_device_slot_writes_equal_host_writes():
    """The static step's flush (write_at at a device-held slot, then the window moves down) stores what the
    host path stores."""
    window = Window(4, 16, 8)
    host, dev = store(window), store(window)
    k, v = torch.randn(2, 2, 3, 60, 16, generator=torch.Generator().manual_seed(1))
    length = host.append(0, {"k": k[:, :, :27], "v": v[:, :, :27]})
    dev.append(0, {"k": k[:, :, :27], "v": v[:, :, :27]})
    for t in range(27, 60):                                         # one token at a time, as decode does
        step = type("Step", (), {"slot": torch.tensor([length]), "derived": {}})()
        n_q, row = dev.window_row(step)
        phase = dev.phase(length)
        dev.write_token_at(phase, row, {"k": k[:, :, t:t + 1], "v": v[:, :, t:t + 1]})
        if phase == "flush":
            dev.flush_at(n_q)
        length = host.append(length, {"k": k[:, :, t:t + 1], "v": v[:, :, t:t + 1]})
    assert torch.equal(host.read(length, torch.float32)["k"], dev.read(length, torch.float32)["k"])
    assert torch.equal(host.read(length, torch.float32)["v"], dev.read(length, torch.float32)["v"])


def test_device_slots():
    slots, groups = device_slots(torch.tensor([16]), 8, 8)
    assert slots.tolist() == list(range(16, 24)) and groups.tolist() == [2]
