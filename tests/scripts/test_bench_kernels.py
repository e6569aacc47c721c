"""scripts/bench_kernels.py's --floors cases and tables (the benchmark itself times on a CUDA GPU): every case
builds and runs at a small shape on the tests' device (a CPU: the Triton interpreter, tests/conftest.py), and
AlignedKV's bytes are what its levels read."""

import sys

import pytest
import torch

from tests.scripts.scripts_module import load

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bench_module():
    """scripts/bench_kernels.py, its tensors on the tests' device."""
    bench = load("bench_kernels")
    bench.DEVICE = DEVICE
    return bench


def test_every_floor_case_runs():
    bench = bench_module()
    cases = list(bench.floor_cases(1, 1024, torch.Generator(device=DEVICE).manual_seed(0)))
    assert [name for name, _ in cases] == list(bench.FLOOR_CASES) == [
        "InnerQ-2 asymmetric", "InnerQ-2 hybrid", "InnerQ-2 hybrid (Triton kernel only)", "KIVI-2, SQuat (outer)",
        "KIVI-2, SQuat (outer, Triton kernel only)",
        "KIVI*-2 (keys rotated in the kernel)", "KV Pareto k8v8 (per-token groups of 32)",
        "int8 (per-token groups of d)", "AlignedKV (planes; aligned_decode)",
        "XQuant scores (keys rotated in the kernel)", "XQuant weigh (4-bit value latents)",
        "XQuant weigh (4-bit value latents, rows in order)", "fp16 SDPA"]
    read = {}
    for name, build in cases:
        launch, n_bytes = build()
        out = launch()
        width = 1024 if name.startswith("XQuant") else 128       # scores of 1,024 keys, weighed 1,024-wide latents
        assert out.shape[-1] == width and bool(torch.isfinite(out.float()).all()), name
        read[name] = n_bytes
    q, kv = 32 * 128 * 2, 8 * 1024 * 128 * 2                     # fp16 query rows; one fp16 stream
    assert read["fp16 SDPA"] == q + 2 * kv
    assert read["XQuant scores (keys rotated in the kernel)"] == q + kv + 2 * 1024 * 128 * 2 + 32 * 1024 * 4
    codes, groups = 1024 * 1024 // 2, 1024 * 8 * 2 * 2          # 4-bit codes; an fp16 scale and zero a group
    assert read["XQuant weigh (4-bit value latents)"] == codes + groups + 32 * 1024 * 4 + 1024 * 8
    assert read["XQuant weigh (4-bit value latents, rows in order)"] == read["XQuant weigh (4-bit value latents)"]
    assert read["KIVI-2, SQuat (outer)"] < read["InnerQ-2 asymmetric"] < read["int8 (per-token groups of d)"]
    assert read["InnerQ-2 hybrid (Triton kernel only)"] == read["InnerQ-2 hybrid"]
    slots, window, token = 8 * 896, 2 * 8 * 128 * 128 * 2, 2 * 8 * 128 * 2   # 896 quantized slots a head; fp16 rows
    assert read["int8 (per-token groups of d)"] == q + 2 * slots * 128 + 4 * slots * 2 + window + token   # + token apart
    exponents = 8 * 1024 // 64 * 128 + 8 * 1024                   # at most one a block and channel, one a token
    assert read["AlignedKV (planes; aligned_decode)"] <= 2 * kv + q + exponents


def test_triton_only_switches_the_gluon_kernel_off_while_it_runs():
    bench = bench_module()
    hopper = type("Hopper", (), {"ENABLED": True})
    seen = []
    assert bench.triton_only(hopper, lambda: seen.append(hopper.ENABLED) or 7)() == 7
    assert seen == [False] and hopper.ENABLED
    with pytest.raises(ZeroDivisionError):
        bench.triton_only(hopper, lambda: 1 // 0)()
    assert hopper.ENABLED
    assert bench.triton_only(None, lambda: 3)() == 3                 # a Triton without Gluon: nothing to switch


def test_cases_select_kernels_by_name():
    bench = bench_module()
    assert bench.wanted("KIVI-2, SQuat (outer)", None) and bench.wanted("fp16 SDPA", ["outer)", "sdpa"])
    assert bench.wanted("KIVI-2, SQuat (outer)", ["outer)"])
    assert not bench.wanted("KIVI-2, SQuat (outer, Triton kernel only)", ["outer)"])


@pytest.mark.parametrize("argv,message", [
    (["--cases", "outer"], "add --floors"), (["--floors", "--cases", "outer", "nope"], "['nope'] names no kernel"),
    (["--shapes", "1x1024"], "add one of them"), (["--floors", "--shapes", "79"], "'79' is not BxN"),
    (["--stages", "--shapes", "1x100"], "a multiple of 128"), (["--floors", "--shapes", "0x1024"], "B >= 1"),
    (["--profile", "InnerQ", "--shapes", "1x1024"], "'InnerQ' is not a kernel's whole name"),
    (["--profile", "fp16 SDPA"], "takes one --shapes"), (["--profile", "fp16 SDPA", "--floors"], "not allowed"),
    (["--timeline", "--floors"], "not allowed"), (["--timeline", "--cases", "nope"], "['nope'] names no kernel")])
def test_bad_cases_and_shapes_are_refused_by_name(argv, message, monkeypatch, capsys):
    bench = bench_module()
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", *argv])
    with pytest.raises(SystemExit):
        bench.parse_args()
    assert message in capsys.readouterr().err


def test_shapes_replace_the_table_rows(monkeypatch):
    bench = bench_module()
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--floors", "--shapes", "79x32768", "1x256"])
    assert bench.parse_args().shapes == [(79, 32768), (1, 256)]


def test_timeline_takes_cases_and_shapes(monkeypatch):
    bench = bench_module()
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--timeline", "--cases", "Pareto", "--shapes", "1x32768"])
    args = bench.parse_args()
    assert args.timeline and args.cases == ["Pareto"] and args.shapes == [(1, 32768)]


def test_floor_and_timeline_rows_come_from_the_selected_cases(monkeypatch):
    """--floors and --timeline measure the cases --cases keeps, at each shape (the timer, the read floor and the
    profile stood in: they need a GPU)."""
    bench = bench_module()
    monkeypatch.setattr(bench, "read_floor", lambda n_bytes: lambda: n_bytes)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = bench.measure_floors(lambda fn: 0.004, gen, ["Pareto", "int8"], [(1, 1024)])
    assert [(r["kernel"], r["share"]) for r in rows] == [("KV Pareto k8v8 (per-token groups of 32)", 1.0),
                                                         ("int8 (per-token groups of d)", 1.0)]
    monkeypatch.setattr(bench, "replay_kernels", lambda timer, launch: [[{"name": "k", "ts": 5.0, "dur": 3.0}]])
    rows = bench.measure_timelines(lambda fn: 0.004, gen, ["SDPA"], [(1, 1024), (2, 1024)])
    assert [(r["batch"], r["case"], r["replay_us"], r["span_us"]) for r in rows] == [
        (1, "fp16 SDPA", 4.0, 3.0), (2, "fp16 SDPA", 4.0, 3.0)]


def test_timeline_groups_each_replays_kernels_by_name():
    """Replays split at the flush's launches (a short launch of the flush's kernel is the replay's own); a kernel's
    launches matched by name and order within the replay, whichever stream's launch came first."""
    bench = bench_module()
    fill = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char> >(int, T)"

    def replay(t, first, second):
        return [{"name": fill, "ts": t, "dur": 100.0}, {"name": fill, "ts": t + 103, "dur": 1.0},
                {"name": first, "ts": t + 105, "dur": 30.0 if first == "_token_kernel" else 10.0},
                {"name": second, "ts": t + 106, "dur": 30.0 if second == "_token_kernel" else 12.0},
                {"name": "combine_kernel", "ts": t + 140, "dur": 3.0}]

    events = replay(0, "_token_kernel", "_split_kernel") + replay(1000, "_split_kernel", "_token_kernel") + \
        replay(2000, "_token_kernel", "_split_kernel")
    replays = bench.split_replays(events)
    assert [len(r) for r in replays] == [4, 4, 4]
    rows, span = bench.timeline_rows(replays)
    assert [(r["kernel"], r["start_us"], r["duration_us"], r["replays"]) for r in rows] == [
        ("at::native::vectorized_elementwise_kernel", 0, 1.0, 3), ("_token_kernel", 2, 30.0, 3),
        ("_split_kernel", 3, 12.0, 3), ("combine_kernel", 37, 3.0, 3)]
    assert span == 40
    text = bench.timelines_markdown([{"batch": 1, "N": 32768, "case": "KV Pareto", "replay_us": 42.0, "span_us": span,
                                      "kernels": rows}], {"gpu": "GPU", "torch": "t", "triton": "tr", "cuda": "c",
                                                          "runs": 100, "warmup": 20})
    assert text.splitlines()[-4:] == [
        "| 1 | 32768 | KV Pareto | 42.0 | 40.0 | `at::native::vectorized_elementwise_kernel` | 0.0 | 1.0 |",
        "|  |  |  |  |  | `_token_kernel` | 2.0 | 30.0 |", "|  |  |  |  |  | `_split_kernel` | 3.0 | 12.0 |",
        "|  |  |  |  |  | `combine_kernel` | 37.0 | 3.0 |"]


def test_profile_launches_its_case_once_inside_the_range(monkeypatch):
    bench = bench_module()
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--profile", "fp16 SDPA", "--shapes", "2x256"])
    args = bench.parse_args()
    assert args.profile == "fp16 SDPA" and args.shapes == [(2, 256)]
    events = []
    monkeypatch.setattr(bench.F, "scaled_dot_product_attention", lambda *a, **k: events.append("launch"))
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    bench.profile_once("fp16 SDPA", 2, 256, torch.Generator(device=DEVICE).manual_seed(0),
                       lambda: events.append("start"), lambda: events.append("stop"))
    assert events == ["launch", "launch", "start", "launch", "stop"]


def test_aligned_bytes_follow_the_levels():
    """At min_bits = 16 every element is read whole (2 bytes); at 8 some read 1 or 1.5."""
    bench = bench_module()
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    planes = bench.aligned_planes(1, 2, 256, 32, 64, gen)
    q = torch.randn(1, 4, 32, device=DEVICE, generator=gen).half()
    extra = bench.nbytes(q, planes[3], planes[7])                 # q and the exponents
    whole = bench.aligned_read_bytes(q, planes, 32, 16, 64)
    assert whole == 2 * (2 * 2 * 256 * 32) + extra
    assert extra + whole // 2 < bench.aligned_read_bytes(q, planes, 32, 8, 64) < whole


def test_floor_table_marks_the_target():
    bench = bench_module()
    meta = {"gpu": "GPU", "torch": "t", "triton": "tr", "cuda": "c", "runs": 100, "warmup": 20, "copy_GBps": 2000.0}
    rows = []
    for name, share in (("a", 0.75), ("b", 0.5), ("fp16 SDPA", 0.95)):
        bench.add_row(rows, 1, 1024, "kernel", name, 1.0, share, 10 ** 6)
    table = bench.floors_markdown(rows, meta)
    assert "| 1 | 1024 | a | 1.0 | 750.0 | 1000.0 | 1 | 75% | met |" in table
    assert "| b |" in table and "| 50% | NO |" in table and "| 95% |  |" in table
