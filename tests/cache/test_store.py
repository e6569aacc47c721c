"""The shared windowed store (kvzoo/cache/store.py): one formula of what is quantized when, windows, bytes."""

import pytest
import torch

from kvzoo.cache.kvquant import quantize
from kvzoo.cache.store import GroupCodec, Window, WindowedStore, device_slots, policy_windows

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


@pytest.mark.parametrize("window", [Window(0, 16, 8), Window(5, 16, 8), Window(0, 0, 8), Window(5, 16, 1)], ids=str)
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


@pytest.mark.parametrize("window", [Window(4, 16, 8), Window(4, 16, 1), Window(0, 5, 1)], ids=str)
def test_device_slot_writes_equal_host_writes(window):
    """The static step's flush (write_at at a device-held slot; a window of G > 1 tokens then moves down, a ring
    of one-token groups does not) stores what the host path stores, and static_rows names the slot each window
    row holds, over steps that wrap around a ring several times."""
    host, dev = store(window), store(window)
    k, v = torch.randn(2, 2, 3, 60, 16, generator=torch.Generator().manual_seed(1))
    length = host.append(0, {"k": k[:, :, :27], "v": v[:, :, :27]})
    dev.append(0, {"k": k[:, :, :27], "v": v[:, :, :27]})
    for t in range(27, 60):                                         # one token at a time, as decode does
        step = type("Step", (), {"slot": torch.tensor([length]), "derived": {}})()
        dev.write_token_at(length, step, {"k": k[:, :, t:t + 1], "v": v[:, :, t:t + 1]})
        slots, live = dev.static_rows(step, "k")
        held = torch.cat([dev.sink("k"), dev.recent("k")], dim=2)                 # the static layout past quantized
        n = dev.codecs["k"].capacity
        for row in range(held.shape[2]):
            if live[n + row]:
                assert torch.equal(held[:, :, row], k[:, :, slots[n + row]]), f"row {row}, step {t}"
        dev.flush_at(length, step)
        length = host.append(length, {"k": k[:, :, t:t + 1], "v": v[:, :, t:t + 1]})
    assert torch.equal(host.read(length, torch.float32)["k"], dev.read(length, torch.float32)["k"])
    assert torch.equal(host.read(length, torch.float32)["v"], dev.read(length, torch.float32)["v"])


def test_device_slots():
    slots, groups = device_slots(torch.tensor([16]), 8, 8)
    assert slots.tolist() == list(range(16, 24)) and groups.tolist() == [2]


def test_window_policies():
    """reference = the strategy's own windows; grouped = Window(S, R, G) for every stream; none = no sink, no
    window, a stream quantized as soon as its group (G tokens along tokens, 1 within a token) is complete."""
    reference = {"k": Window(4, 0, 32), "v": Window(4, 32, 1)}
    spans = {"k": 8, "v": 1}
    assert policy_windows("reference", reference, 4, 32, 8, spans) == reference
    assert policy_windows("grouped", reference, 4, 32, 8, spans) == {"k": Window(4, 32, 8), "v": Window(4, 32, 8)}
    assert policy_windows("none", reference, 4, 32, 8, spans) == {"k": Window(0, 0, 8), "v": Window(0, 0, 1)}
    with pytest.raises(ValueError, match="unknown window policy 'paper'; accepted: reference, grouped, none"):
        policy_windows("paper", reference, 4, 32, 8, spans)


def test_streams_with_their_own_windows():
    """KIVI's reference windows on one store: keys flushed R at a time, exactly R values exact."""
    windows = {"k": Window(0, 0, 16), "v": Window(0, 16, 1)}
    codecs = {"k": GroupCodec((1, 2), 64, 8, 2, 8, True, torch.float32, "cpu"),
              "v": GroupCodec((1, 2), 64, 8, 2, 8, False, torch.float32, "cpu")}
    st = WindowedStore(windows, codecs, (1, 2), torch.float32, "cpu")
    assert st.window is None
    rows = {name: torch.randn(1, 2, 40, 8) for name in "kv"}
    length = 0
    for t in range(40):
        length = st.append(length, {name: x[:, :, t:t + 1] for name, x in rows.items()})
        assert st.counts(length, "k") == (0, (t + 1) // 16 * 16, (t + 1) % 16)
        assert st.counts(length, "v") == (0, max(0, t + 1 - 16), min(t + 1, 16))
    held = st.read(length, torch.float32)
    assert torch.equal(held["k"][:, :, 32:], rows["k"][:, :, 32:])
    assert torch.equal(held["v"][:, :, 24:], rows["v"][:, :, 24:])
    assert not torch.equal(held["k"][:, :, :32], rows["k"][:, :, :32])
    tail = st.read(length, torch.float32, start=16)
    assert torch.equal(tail["k"], held["k"][:, :, 16:]) and torch.equal(tail["v"], held["v"][:, :, 16:])
    assert st.nbytes(length) == st.formula_nbytes(length)
    with pytest.raises(ValueError, match="the streams have different windows"):
        st.phase(length)


# ---- attention from the codes (CPU decode) ----------------------------------------------------------------
def codecs_under_test():
    """Every codec, by layout (groups per channel or per token, InnerQ's unified groups, KV Pareto's blocks and
    tensor ranges): B = 2, H = 3, width 64, room for 96 slots."""
    from kvzoo.cache.innerq import InnerQCodec
    from kvzoo.cache.kvpareto import BlockCodec, TensorCodec

    lead, cap, w = (2, 3), 96, 64
    out = {f"group-{'channel' if pc else 'token'}-{b}{'-first' if ef else ''}":
           GroupCodec(lead, cap, w + int(ef), b, 32, pc, torch.float32, "cpu", exact_first=ef)
           for b in (2, 3, 4, 8, 16) for pc in (True, False) for ef in ((False, True) if pc else (False,))}
    for axis in (-1, -2):
        for mode in ("asym", "sym", "hybrid"):
            out[f"innerq{axis}-{mode}"] = InnerQCodec(lead, cap, w, 2, axis, mode, "cpu")
    out["kvpareto-block"] = BlockCodec(lead, cap, w, 4, 16, "cpu")
    out["kvpareto-tensor"] = TensorCodec(lead, cap, w, 2, "cpu")
    return out


@pytest.mark.parametrize("name", sorted(codecs_under_test()))
def test_scores_and_weighted_sums_from_codes_equal_the_dequantized_products(name):
    """Codec.scores / weigh (codes unpacked and scaled in place, one matmul) equal the products with the rows
    `read` gives from slot 0, sliced at any group boundary, up to fp32 summation order (sums of ~100 terms of
    magnitude 16)."""
    codec = codecs_under_test()[name]
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 3, 96, codec.width, generator=g) * torch.linspace(0.1, 4, codec.width)
    rows[..., 5] += 6                                  # an outlier channel
    codec.write(0, 96, rows)
    whole = codec.read(96, torch.float32)
    for start in (0, 32):
        held = whole[:, :, start:]                                               # (2, 3, 96 - start, w)
        assert torch.equal(codec.read(96, torch.float32, start), held)
        q = torch.randn(2, 3, 4, codec.width, generator=g)
        p = torch.rand(2, 3, 4, 96 - start, generator=g)
        assert torch.allclose(codec.scores(q, 96, start), q @ held.transpose(-1, -2), atol=1e-3, rtol=1e-5)   # fp32 sums of ~100 terms
        assert torch.allclose(codec.weigh(p, 96, start), p @ held, atol=1e-3, rtol=1e-5)   # fp32 sums of ~100 terms


@pytest.mark.parametrize("windows", [Window(0, 16, 8), {"k": Window(5, 0, 32), "v": Window(5, 32, 1)}], ids=str)
def test_store_attend_equals_attention_over_what_is_held(windows):
    """WindowedStore.attend (a decode token's GQA attention over sink | codes | recent window, plus the token
    exact, with a mask) equals plain attention over the rows `read` returns."""
    from kvzoo.cache.base import attend

    lead = (2, 3)
    ws = windows if isinstance(windows, dict) else {"k": windows, "v": windows}
    s = WindowedStore(windows, {"k": GroupCodec(lead, 256, 64, 2, 32 if ws["k"].group > 1 else 8, ws["k"].group > 1,
                                                torch.float32, "cpu"),
                                "v": GroupCodec(lead, 256, 64, 4, 32, False, torch.float32, "cpu")},
                      lead, torch.float32, "cpu")
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 2, 3, 150, 64, generator=g)
    length = s.append(0, {"k": k, "v": v})
    q, k1, v1 = torch.randn(2, 9, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g), \
        torch.randn(2, 3, 1, 64, generator=g)
    mask = torch.ones(2, 1, 1, length + 1, dtype=torch.bool)
    mask[1, ..., :7] = False                           # row 1 left-padded by 7
    held = s.read(length, torch.float32)
    want = attend(q, torch.cat([held["k"], k1], 2), torch.cat([held["v"], v1], 2), mask)
    assert torch.allclose(s.attend(q, length, {"k": k1, "v": v1}, mask), want, atol=1e-5)
    # the history's keys given (KIVI*: dequantized and rotated by the caller) score the same
    assert torch.allclose(s.attend(q, length, {"k": k1, "v": v1}, mask, keys=held["k"]), want, atol=1e-5)
