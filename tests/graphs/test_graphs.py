"""The static decode step behind CUDA-graph decoding (kvzoo/graphs.py): on CPU it runs eagerly and must equal
the eager decode, token for token, with padding and with a sliding window; on CUDA the captured graph must
equal it too."""

import pytest
import torch

from kvzoo.cache.base import StaticStep
from kvzoo.generate import generate, prefill
from kvzoo.graphs import GraphDecoder, PiecewiseDecoder, decoder
from kvzoo.models.loader import load_weights
from tests.model.test_generate import CharTokenizer
from tests.tiny import tiny_llama, tiny_mistral


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_weights(tiny_llama(tmp_path_factory.mktemp("tiny"), head_dim=32))       # InnerQ groups of 32


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Mistral with a sliding window of 6 tokens."""
    model = load_weights(tiny_mistral(tmp_path_factory.mktemp("tinyw")))
    assert model.cfg.sliding_window == 6
    return model


def decode_both(model, prompts: torch.Tensor, pad, steps: int, device="cpu", cache="fp16", make=GraphDecoder):
    """Logits of `steps` greedy decode steps, eager and through `make` (a decoder class), from the same
    prefilled prompt."""
    out = []
    for static in (False, True):
        kv = model.new_cache(cache, prompts.shape[0], prompts.shape[1] + steps)
        token = prefill(model, prompts.to(device), kv, pad).argmax(-1)
        step = make(model, kv, pad) if static else (lambda t: model(t[:, None], kv, pad=pad)[:, -1])
        logits = []
        for _ in range(steps):
            logits.append(step(token).clone())
            token = logits[-1].argmax(-1)
        out.append(torch.stack(logits, 1))
        assert kv.length == prompts.shape[1] + steps
    return out


def test_static_step_equals_eager(model):
    prompts = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    eager, static = decode_both(model, prompts, None, steps=8)
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)


def test_static_step_with_padding_and_sliding_window(model, windowed):
    prompts = torch.randint(3, 97, (3, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([0, 4, 7])
    prompts[1, :4] = prompts[2, :7] = 0
    for m in (model, windowed):
        eager, static = decode_both(m, prompts, pad, steps=9)        # the window binds after a few steps
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["fp16", "kivi:bits=2,group_size=32,residual=32", "innerq:bits=2",
                                   "xquant:bits=4", "alignedkv"])
def test_piecewise_step_equals_eager(model, cache):
    """Every layer's non-attention work through the piecewise decoder, the strategy's decode between: the
    same logits as the eager step, across residual-window flushes (40 steps > a 32-token window)."""
    prompts = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    pad = torch.tensor([0, 2])
    prompts[1, :2] = 0
    eager, piecewise = decode_both(model, prompts, pad, steps=40, cache=cache, make=PiecewiseDecoder)
    torch.testing.assert_close(piecewise, eager, rtol=1e-5, atol=1e-5)


# the paper's windows (keys quantized a token at a time, values 32 at a time: the default) and one window for both
INNERQ_STATIC = ["innerq:bits=2,sink=4,recent=0", "innerq:bits=4,sink=4,recent=0,quant_mode=hybrid_prefill",
                 "innerq:bits=2,sink=0,recent=32,quant_mode=asym,key_norm=false",
                 "innerq:bits=2,sink=4,recent=0,quant_mode=sym,policy=grouped"]


def needs_kernels_on_cpu() -> None:
    """Skip where the Triton interpreter is off: the CPU model's InnerQ cache then has no kernel to run (on a GPU
    machine test_cuda_graph_equals_eager runs these configurations through the compiled kernel)."""
    pytest.importorskip("triton")
    from kvzoo.kernels.quant_matvec import kernels_run_on

    if not kernels_run_on(torch.device("cpu")):
        pytest.skip("InnerQ's kernel runs on CPU tensors only under the Triton interpreter")


@pytest.mark.parametrize("cache", INNERQ_STATIC)
def test_innerq_whole_step_equals_eager(model, cache):
    """InnerQ's static step (its kernel reading the live lengths from a device tensor, under the interpreter on
    CPU) against the eager decode (the torch path), through every phase: tokens joining the sink window, the
    recent window, and filling it so that a group is quantized inside the step (prompt of 2 tokens, 40 steps)."""
    needs_kernels_on_cpu()
    whole_step_equals_eager(model, cache)


def whole_step_equals_eager(model, cache: str) -> None:
    """decoder() picks the whole-step graph for `cache`, and its 40 steps after a 2-token prompt equal eager."""
    prompts = torch.randint(3, 97, (2, 2), generator=torch.Generator().manual_seed(4))
    kv = model.new_cache(cache, 2, 42)
    prefill(model, prompts, kv, None)
    assert isinstance(decoder(model, kv), GraphDecoder)
    eager, static = decode_both(model, prompts, None, steps=40, cache=cache)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cache", ["int8", "kvpareto", "kvpareto:k_bits=4,v_bits=2,group_size=16"])
def test_token_grouped_whole_step_equals_eager(model, cache):
    """int8's and KV Pareto's static step (keys and values in per-token groups, one fused kernel, under the
    interpreter on CPU) against the eager decode (WindowedStore.attend), each token quantized inside the step."""
    needs_kernels_on_cpu()
    whole_step_equals_eager(model, cache)


def test_decoder_picks_the_whole_step_where_it_can(model):
    assert isinstance(decoder(model, model.new_cache("fp16", 1, 8)), GraphDecoder)
    assert isinstance(decoder(model, model.new_cache("kvpareto:granularity=tensor", 1, 8)), PiecewiseDecoder)
    assert isinstance(decoder(model, model.new_cache("kivi-pre", 1, 8)), PiecewiseDecoder)
    # XQuant's latents in the paper's windows (X U_k per channel, X U_v per token) or in one window
    for spec in ("xquant", "xquant-cl", "xquant-cl:policy=grouped"):
        assert isinstance(decoder(model, model.new_cache(spec, 1, 8)), GraphDecoder)
    with pytest.raises(ValueError, match="needs a streaming cache"):
        decoder(model, model.new_cache("kivi", 1, 8, mode="simulated"))


def test_decoder_picks_innerqs_whole_step_where_its_kernel_serves(model):
    needs_kernels_on_cpu()
    kv = model.new_cache("innerq:policy=grouped", 2, 8)
    prefill(model, torch.tensor([[0, 5, 6], [4, 5, 6]]), kv, torch.tensor([1, 0]))
    assert isinstance(decoder(model, kv, torch.tensor([1, 0])), PiecewiseDecoder)      # padding: no kernel
    assert isinstance(decoder(model, kv, torch.tensor([0, 0])), GraphDecoder)
    assert isinstance(decoder(model, model.new_cache("innerq:outer=true,policy=grouped", 1, 8)), PiecewiseDecoder)
    kv = model.new_cache("innerq", 2, 8)                   # the paper's windows: keys and values differ
    prefill(model, torch.tensor([[0, 5, 6], [4, 5, 6]]), kv, None)
    assert isinstance(decoder(model, kv), GraphDecoder)
    kv = model.new_cache("innerq:policy=none", 2, 8)       # no sink, no window: keys a token at a time
    prefill(model, torch.tensor([[0, 5, 6], [4, 5, 6]]), kv, None)
    assert isinstance(decoder(model, kv), GraphDecoder)


def test_generate_compile_gives_the_same_tokens(model):
    tok = CharTokenizer()
    prompts = [[5, 9, 11, 40, 2, 7, 7, 13], [8], [60, 61, 62, 63, 1]]
    for cache in ("fp16", "innerq:bits=2"):
        eager = generate(model, tok, prompts, max_new_tokens=10, temperature=0, cache=cache)
        compiled = generate(model, tok, prompts, max_new_tokens=10, temperature=0, cache=cache, compile=True)
        assert compiled.tokens == eager.tokens and compiled.cache_nbytes == eager.cache_nbytes


def test_refuses_strategies_without_a_static_step(model):
    kv = model.new_cache("kvpareto:granularity=block", 1, 16)
    with pytest.raises(ValueError, match="cache strategy kvpareto has no whole-step decode.*PiecewiseDecoder"):
        GraphDecoder(model, kv)
    kv = model.new_cache("fp16", 1, 4)
    prefill(model, torch.tensor([[3, 4, 5, 6]]), kv, None)
    with pytest.raises(ValueError, match="holds at most 4 tokens and is full"):
        GraphDecoder(model, kv)(torch.tensor([7]))


def test_tail_and_beside_run_in_order_off_a_gpu():
    """Off a GPU a step's `tail` (the window rows an attention's exact part reads) and `beside` blocks run in order
    on the one stream: nothing to fork, nothing to join."""
    step = StaticStep.make(torch.tensor([3]), torch.zeros(2, dtype=torch.long), 8, padded=False)
    x = torch.zeros(2)
    with step.tail(x) as stream:
        assert stream is None
        x += 1
    with step.beside(x):
        x *= 3
    step.join()
    assert x.tolist() == [3.0, 3.0] and not step.forked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_equals_eager(model):
    m = model.to("cuda")
    prompts = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2)).cuda()
    pad = torch.tensor([0, 3], device="cuda")
    prompts[1, :3] = 0
    eager, graphed = decode_both(m, prompts, pad, steps=12, device="cuda")
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    for cache in ("kivi:bits=2,group_size=32,residual=32", "innerq:bits=2"):    # innerq: its fused kernel
        eager, graphed = decode_both(m, prompts, pad, steps=40, device="cuda", cache=cache, make=PiecewiseDecoder)
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    short = prompts[:, :2]
    for cache in INNERQ_STATIC + ["kivi:bits=2,group_size=32,residual=32,policy=grouped",
                                  "kivi:bits=2,group_size=32,residual=32", "squat:bits=2,group_size=32,residual=32",
                                  "kivi-pre:bits=2,group_size=32,residual=32,sink=1"]:
        # one graph per phase, against the eager decode through the same kernels
        eager, graphed = decode_both(m, short, None, steps=40, device="cuda", cache=cache)
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    model.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_step_that_fails_in_its_capture_raises_its_own_error(model, monkeypatch):
    """Out of memory while a step is captured (as the largest-batch search's probes run out): the work that ran
    beside the step is joined, so the error raised is the step's own, not CUDA's "capturing stream has unjoined
    work", and the next decoder captures and decodes as before."""
    m = model.to("cuda")
    try:
        prompts = torch.randint(3, 97, (2, 2), generator=torch.Generator().manual_seed(4)).cuda()
        cache = "kivi:bits=2,group_size=32,residual=32"
        kv = m.new_cache(cache, 2, 40)
        token = prefill(m, prompts, kv, None).argmax(-1)
        norm = m.norm.forward

        def fail_in_capture(x):
            if torch.cuda.is_current_stream_capturing():
                raise torch.OutOfMemoryError("out of memory (test)")
            return norm(x)

        monkeypatch.setattr(m.norm, "forward", fail_in_capture)
        with pytest.raises(torch.OutOfMemoryError, match="test"):
            GraphDecoder(m, kv, None)(token)
        monkeypatch.undo()
        torch.cuda.synchronize()
        eager, graphed = decode_both(m, prompts, None, steps=8, device="cuda", cache=cache)
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    finally:
        model.to("cpu")


def bench_module():
    """scripts/bench_decode.py, as `python scripts/bench_decode.py` loads it."""
    from tests.scripts.scripts_module import load

    return load("bench_decode")


def test_bench_decode_plot(tmp_path):
    """The throughput plot from benchmark rows (the benchmark itself needs CUDA): OOM cells left out."""
    bench = bench_module()
    rows = [{"model": "m", "cache": "fp16", "step": s, "batch": 1, "context": n, "tokens_per_s": t}
            for s, n, t in [("eager", 4096, 15.0), ("eager", 32768, 14.0), ("graph", 4096, 100.0)]]
    rows.append({"model": "m", "cache": "fp16", "step": "graph", "batch": 8, "context": 32768, "oom": True})
    rows.append({"model": "m", "cache": "fp16", "step": "graph", "batch": 12, "context": 32768, "max_batch": 12,
                 "tokens_per_s": 500.0})
    bench.plot(rows, "t", tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_bench_decode_largest_search():
    bench = bench_module()
    assert bench.largest(lambda n: n <= 37, 1, 256) == 37
    assert bench.largest(lambda n: n <= 300, 1, 256) == 256
    assert bench.largest(lambda n: False, 1, 256) == 0
    assert bench.largest(lambda n: n <= 200_000, 131072, 2 ** 24, 1024) == 199_680


def test_bench_decode_cells_run_on_cpu(model, tmp_path):
    """bench_decode's cells on CPU with tiny models: a kvzoo cell (InnerQ's whole-step graph path, eager here),
    a batch filled by copying one prefilled row, and Hugging Face's DynamicCache the same ways."""
    transformers = pytest.importorskip("transformers")

    bench = bench_module()
    runner = bench.Kvzoo(model)
    spec = "innerq:bits=2,sink=4,recent=0,policy=grouped"
    row = bench.run_cell(runner, spec, 20, 2, 3, 8, graphed=True, warmup=2)
    assert row["filled"] == "prefill" and len(row["step_ms"]) == 3 and row["kv_bytes"] > 0
    with torch.inference_mode():
        src = runner.fill(spec, 20, 1, bench.max_len(20, 3, 2), 8, None)
    copied = bench.run_cell(runner, spec, 20, 3, 3, 8, graphed=True, src=src, warmup=2)
    assert copied["filled"] == "row copies" and copied["prefill_s"] is None
    assert runner.fits_context(spec, 200, static=True)
    for piecewise in ("kivi:bits=2,group_size=32,residual=32", "squat", "kvpareto"):
        assert runner.fits_context(piecewise, 200, static=False)

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    hf = bench.HuggingFace(transformers.LlamaForCausalLM(cfg).eval())
    row = bench.run_cell(hf, "fp16", 20, 2, 3, 8, warmup=2)
    assert row["kv_ratio"] == pytest.approx(2.0)          # an fp32 model's cache, against fp16 bytes
    with torch.inference_mode():
        src = hf.fill("fp16", 20, 1, 0, 8, None)
        many = hf.fill("fp16", 20, 3, 0, 8, src)
        torch.testing.assert_close(hf.forward(many.token[:, None], many.cache),
                                   hf.forward(src.token[:, None], src.cache).expand(3, -1))
    assert hf.fits_context("fp16", 300)


def test_bench_decode_profiles_each_cell_after_every_timed_step(model, monkeypatch):
    """--profile N: once every cell is timed, each grid cell runs again for N steps under torch.profiler (on the CPU
    each op's own time), the costliest kernels first, the rest summed in one entry. No timed step follows a
    profile (the profiler slows later graph replays); each timed row gets its kernels."""
    from types import SimpleNamespace

    bench = bench_module()
    args = SimpleNamespace(contexts=[12], batches=[1, 2], steps=2, warmup=1, repeats=1, prefill_chunk=8,
                           find_max_batch=False, find_max_context=False, fill="prefill", profile=3, trace=False)
    events = []
    profile = bench.profile_steps
    monkeypatch.setattr(bench, "profile_steps", lambda *a, **kw: events.append("profile") or profile(*a, **kw))
    rows = []
    keep = lambda row: events.append("timed") or rows.append(row)            # noqa: E731
    bench.cells(bench.Kvzoo(model), args, "tiny", ["fp16"], [False], keep)
    assert events == ["timed", "timed", "profile", "profile"]
    for row in rows:
        times = [k["ms_per_step"] for k in row["kernels"]]
        assert len(times) > 2 and all(t >= 0 for t in times) and times[:-1] == sorted(times[:-1], reverse=True)
        assert row["kernels"][-1]["kernel"].endswith("other kernels)") and row["decode_ms"] > 0


def test_bench_decode_fills_cells_by_row_copies(model):
    """--fill copies: each grid cell's rows are copies of one prefilled row per cache and context (as the largest
    batch's search fills them), timed and profiled so: a batch that fits to decode but not to prefill."""
    from types import SimpleNamespace

    bench = bench_module()
    args = SimpleNamespace(contexts=[12], batches=[2, 3], steps=2, warmup=1, repeats=1, prefill_chunk=8,
                           find_max_batch=False, find_max_context=False, fill="copies", profile=1, trace=False)
    runner = bench.Kvzoo(model)
    fills = []
    fill = runner.fill
    runner.fill = lambda *a: fills.append(a[2]) or fill(*a)                   # the rows each fill makes
    rows = []
    bench.cells(runner, args, "tiny", ["fp16", "kivi:bits=2"], [False], rows.append)
    assert [r["filled"] for r in rows] == ["row copies"] * 4 and all(r["prefill_s"] is None for r in rows)
    assert all(r["kernels"] and r["decode_ms"] > 0 for r in rows)
    # one prefilled row per cache for the timed cells and again for the profiles, each copied into 2 and 3 rows
    assert fills == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]


def test_bench_decode_traces_each_profiled_cell(model, tmp_path, monkeypatch):
    """--trace: each profiled cell's timeline, a gzipped Chrome trace beside OUT named after the cell, its name in
    the row; an existing timeline is not replaced without --overwrite."""
    import gzip
    import json
    import sys
    from types import SimpleNamespace

    bench = bench_module()
    out = str(tmp_path / "run")
    args = SimpleNamespace(contexts=[12], batches=[2], steps=2, warmup=1, repeats=1, prefill_chunk=8,
                           find_max_batch=False, find_max_context=False, fill="prefill", profile=2, trace=True, out=out)
    rows = []
    bench.cells(bench.Kvzoo(model), args, "tiny", ["fp16", "kivi:bits=2"], [False], rows.append)
    assert [r["trace"] for r in rows] == ["run-trace-fp16-12-b2-eager.json.gz",
                                          "run-trace-kivi_bits_2-12-b2-eager.json.gz"]
    for row in rows:
        events = json.loads(gzip.open(tmp_path / row["trace"]).read())["traceEvents"]
        assert any(e.get("ph") == "X" for e in events)
    argv = ["bench_decode.py", "--models", "llama-3.1-8b", "--caches", "fp16", "--device", "cpu", "--out", out]
    for extra, message in (([], "add --profile N"), (["--profile", "2"], "already exists; pass --overwrite")):
        monkeypatch.setattr(sys, "argv", argv + ["--trace"] + extra)
        with pytest.raises(SystemExit, match=message):
            bench.main()


def test_bench_decode_profiles_hugging_face_cells():
    """A Hugging Face row names its cache "hf:<cache>"; its profile runs the cache by its own name."""
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    bench = bench_module()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    args = SimpleNamespace(contexts=[12], batches=[1], steps=2, warmup=1, repeats=1, prefill_chunk=8,
                           find_max_batch=False, find_max_context=False, fill="prefill", profile=2, trace=False)
    rows = []
    bench.cells(bench.HuggingFace(transformers.LlamaForCausalLM(cfg).eval()), args, "tiny", ["fp16"], [False],
                rows.append)
    assert [r["cache"] for r in rows] == ["hf:fp16"] and rows[0]["kernels"]


def test_bench_decode_writes_each_row_as_it_is_measured(model, tmp_path):
    """cells() hands every row to the Rows sink, which rewrites OUT.json (marked partial) after each one."""
    import json
    from types import SimpleNamespace

    bench = bench_module()
    args = SimpleNamespace(contexts=[12], batches=[1, 2], steps=2, warmup=1, repeats=1, prefill_chunk=8,
                           find_max_batch=False, find_max_context=False, fill="prefill", profile=0, trace=False)
    seen = []
    sink = bench.Rows(tmp_path / "out.json", "cpu", "test")

    def keep(row):
        sink(row)
        seen.append(len(json.loads((tmp_path / "out.json").read_text())["rows"]))

    bench.cells(bench.Kvzoo(model), args, "tiny", ["fp16"], [False], keep)
    saved = json.loads((tmp_path / "out.json").read_text())
    assert seen == [1, 2] and saved["partial"] and [r["batch"] for r in saved["rows"]] == [1, 2]


@pytest.mark.parametrize("cache", ["kivi:bits=2,group_size=32,residual=32", "squat:bits=2", "kvpareto",
                                   "kvpareto:granularity=tensor", "alignedkv:block=16,fused=false"])
def test_bench_decode_stores_random_tokens_through_the_strategy(model, cache):
    """A piecewise strategy's largest-context probe fills its buffers with random K/V through the strategy's own
    store path: every layer then holds the tokens, in the bytes its formula gives, and decodes on."""
    bench = bench_module()
    with torch.inference_mode():
        kv = model.new_cache(cache, 1, 256)
        token = prefill(model, torch.randint(3, 97, (1, 64)), kv, None).argmax(-1)
        bench.store_random(kv, 150, chunk=48)
        assert kv.length == 214 and all(layer.length == 214 for layer in kv.layers)
        assert kv.nbytes() == sum(layer.formula_nbytes(214) for layer in kv.layers)
        assert torch.isfinite(bench.decode_one_token(model, token, kv, None)).all() and kv.length == 215


def test_bench_decode_merges_result_files_without_a_gpu(tmp_path):
    """--merge: earlier OUT.json files joined into one table and plot (no GPU needed)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    row = {"model": "m", "impl": "kvzoo", "cache": "fp16", "context": 4096, "batch": 1, "step": "graph",
           "prefill_s": 0.1, "filled": "prefill", "decode_ms": 9.5, "tokens_per_s": 105.0, "peak_gib": 15.9,
           "kv_bytes": 2 ** 29, "kv_ratio": 1.0}
    for i, extra in enumerate([{}, {"batch": 14, "max_batch": 14, "prefill_s": None, "filled": "row copies"}]):
        (tmp_path / f"r{i}.json").write_text(json.dumps({"gpu": "G", "torch": "t", "rows": [{**row, **extra}]}))
    (tmp_path / "r2.json").write_text(json.dumps({"gpu": "G", "torch": "t",
                                                  "rows": [{"model": "m", "impl": "hf", "cache": "fp16",
                                                            "max_context": 501760}]}))
    script = Path(__file__).parents[2] / "scripts" / "bench_decode.py"
    done = subprocess.run([sys.executable, str(script), "--merge", *(str(tmp_path / f"r{i}.json") for i in range(3)),
                           "--out", str(tmp_path / "all"), "--plot"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "all.md").read_text()
    assert "| m | `fp16` | graph | 4096 | 14 (largest) | row copies |" in table and "`hf:fp16` | eager | 501760 |" in table
    again = {**row, "batch": 15, "max_batch": 15, "batch_cap": 15, "prefill_s": None, "filled": "row copies"}  # re-measured
    (tmp_path / "r3.json").write_text(json.dumps({"gpu": "G", "torch": "t", "rows": [again]}))
    done = subprocess.run([sys.executable, str(script), "--merge", *(str(tmp_path / f"r{i}.json") for i in range(4)),
                           "--out", str(tmp_path / "all2")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    table = (tmp_path / "all2.md").read_text()
    assert "15 (the search's cap)" in table and "14 (largest)" not in table and "| m | `fp16` | graph | 4096 | 1 |" in table
    assert (tmp_path / "all.png").stat().st_size > 0
    missing = subprocess.run([sys.executable, str(script), "--merge", str(tmp_path / "nope.json")],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "nope.json not found" in missing.stderr


def test_bench_decode_targets_compare_each_named_cache_with_fp16():
    """--targets: each target's caches (spec with its defaults: a variant is not the paper's cache) against fp16's
    row of the same cell, the largest-batch rows at their own batches; a target with no rows says so."""
    bench = bench_module()

    def row(cache, context, batch, ms, largest=False):
        r = {"model": "m", "impl": "kvzoo", "cache": cache, "context": context, "batch": batch, "step": "graph",
             "decode_ms": ms, "tokens_per_s": batch / ms * 1e3}
        return {**r, "max_batch": batch} if largest else r

    rows = [row("fp16", 32768, 1, 10.0), row("innerq:bits=2", 32768, 1, 10.4), row("kivi:bits=2", 32768, 1, 12.0),
            row("xquant", 32768, 1, 19.0), row("innerq:bits=2,policy=grouped", 32768, 1, 9.0),
            row("fp16", 32768, 14, 35.0, True), row("innerq:bits=2", 32768, 70, 50.0, True)]
    lines = bench.target_lines(rows)
    text = "\n".join(lines)
    assert "| 32K, batch 1: ms/token <= 1.05x fp16 | m | graph | `innerq:bits=2` | 1.04x | <= 1.05x | yes |" in text
    assert "`kivi:bits=2` | 1.20x | <= 1.05x | NO |" in text
    assert "XQuant(-CL) ms/token <= 2x fp16 | m | graph | `xquant` | 1.90x | <= 2.0x | yes |" in text
    assert "1.05x fp16 | m | graph | `xquant`" not in text                      # held to its own 2x target
    assert "`innerq:bits=2` | 3.50x | >= 3.0x | yes |" in text                   # (70 / 50) / (14 / 35)
    assert "128K, batch 1: InnerQ-2 ms/token <= 0.75x fp16 | | | | no row measures it |" in text
    assert "4-bit weights + InnerQ-2 >= 3x faster than 16-bit weights + fp16 | | | | no row measures it |" in text


def test_bench_decode_table_compares_largest_batches_with_fp16s(tmp_path):
    """The table's vs fp16: a row against fp16's of the same cell, and a largest-batch row against fp16's largest
    batch (each at its own batch), as the 32K largest-batch target compares them."""
    bench = bench_module()

    def row(cache, batch, ms, largest=False):
        r = {"model": "m", "impl": "kvzoo", "cache": cache, "context": 32768, "batch": batch, "step": "graph",
             "filled": "row copies", "prefill_s": None, "decode_ms": ms, "tokens_per_s": batch / ms * 1e3,
             "peak_gib": None, "kv_bytes": 2 ** 30, "kv_ratio": 1.0}
        return {**r, "max_batch": batch} if largest else r

    rows = [row("fp16", 1, 10.0), row("kivi:bits=2", 1, 9.0), row("fp16", 14, 35.0, True),
            row("kivi:bits=2", 70, 50.0, True)]
    args = type("Args", (), {"targets": False, "plot": False})()
    bench.write(args, [tmp_path / "r.json", tmp_path / "r.md"], rows, "gpu", "torch", "how")
    text = (tmp_path / "r.md").read_text()
    assert "| m | `kivi:bits=2` | graph | 32768 | 1 | row copies |  | 9.00 | 111.1 | 1.11x |" in text
    assert "| m | `kivi:bits=2` | graph | 32768 | 70 (largest) | row copies |  | 50.00 | 1400.0 | 3.50x |" in text
    assert "a largest-batch row against fp16's at its own largest batch" in text


def test_bench_decode_w4_target_holds_4bit_rows_to_the_16bit_fp16_row():
    """The 4-bit-weights target: a `NAME w4` InnerQ-2 row against fp16's row of NAME at its own weights (rows
    merged from two runs); the w4 rows' own fp16 row serves the other targets."""
    bench = bench_module()

    def row(model, cache, ms):
        return {"model": model, "impl": "kvzoo", "cache": cache, "context": 131072, "batch": 1, "step": "graph",
                "decode_ms": ms, "tokens_per_s": 1e3 / ms}

    rows = [row("m", "fp16", 15.0), row("m w4", "fp16", 12.0), row("m w4", "innerq:bits=2", 12.5),
            row("m", "innerq:bits=2", 16.0)]
    text = "\n".join(bench.target_lines(rows))
    assert "16-bit weights + fp16 | m w4 | graph | `innerq:bits=2` | 1.20x | >= 3.0x | NO |" in text   # 15 / 12.5
    assert "16-bit weights + fp16 | m | graph" not in text
    assert "InnerQ-2 ms/token <= 0.75x fp16 | m w4 | graph | `innerq:bits=2` | 1.04x | <= 0.75x | NO |" in text
    assert "InnerQ-2 ms/token <= 0.75x fp16 | m | graph | `innerq:bits=2` | 1.07x | <= 0.75x | NO |" in text


def test_bench_decode_rows_give_the_bandwidth_they_read(model):
    """A row's read_GBps is (weights a step reads + KV bytes held) / its latency; a tied embedding counts once,
    an untied table not at all (one row per token)."""
    bench = bench_module()
    runner = bench.Kvzoo(model)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.embed.weight.numel() * model.embed.weight.element_size()
    assert runner.weight_bytes == (params if model.lm_head.weight is model.embed.weight else params - table)
    row = bench.run_cell(runner, "fp16", 20, 1, 2, 8, warmup=1)
    assert row["read_GBps"] == pytest.approx((runner.weight_bytes + row["kv_bytes"]) / row["decode_ms"] * 1e3 / 1e9)
    assert bench.copy_bandwidth("cpu", runs=2, warmup=1) > 0


def test_bench_decode_times_4bit_weights_and_counts_their_bytes(model):
    """--weights w4-rtn: the blocks' linear layers as W4Linear; a step reads their codes, scales and zeros."""
    import copy

    from kvzoo.weightquant.awq import group_for, quantize_rtn

    bench = bench_module()
    w4 = quantize_rtn(copy.deepcopy(model), group_for(model))
    full, quantized = bench.Kvzoo(model).weight_bytes, bench.Kvzoo(w4).weight_bytes
    blocks = sum(p.nbytes for block in model.layers for p in block.parameters()
                 if p.dim() == 2)                                                 # fp32 linear weights
    assert full - quantized == blocks - sum(m.w4.nbytes() for m in w4.modules() if hasattr(m, "w4"))
    row = bench.run_cell(bench.Kvzoo(w4), "innerq:bits=2,sink=4,recent=0", 20, 1, 2, 8, warmup=1)
    assert row["decode_ms"] > 0 and row["weight_bytes"] == quantized
