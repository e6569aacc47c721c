"""End-to-end decode on a CUDA GPU: prefill time, per-token decode latency, tokens/s, peak memory and KV bytes
for every strategy, on models given by config only (random bf16 weights, no download) and the embedded model.

    python scripts/bench_decode.py --models llama-3.1-8b --contexts 4096 32768 --batches 1 8 \
        --caches fp16 kivi:bits=2 innerq:bits=2 --out results/decode/eager

Models (kvzoo.models.llama.Transformer built on the GPU, weights drawn N(0, 0.02)):
    llama-3.1-8b   32 layers, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256, llama3 RoPE
    llama-2-7b     32 layers, 32 heads of 128 (MHA), MLP 11008, vocab 32000 (context raised past its 4096
                   so the shape can be timed at long context; the numbers are about the shape, not the model)
    smollm2        the embedded SmolLM2-135M-Instruct, its real weights
For every model x context x batch x cache: a random prompt of `context` tokens is prefilled (chunks of
--prefill-chunk tokens, so activations stay bounded at 128K), then --steps tokens are decoded one at a time
(the kvzoo.generate decode step, eager; with --compile also kvzoo.graphs.decoder's CUDA graphs: the whole
step for fp16, all but attention for the other strategies); one untimed step first, then the decode latency is the median step,
synchronized. A cell that runs
out of GPU memory is reported as OOM, and the largest batch that fits (--max-batch, by doubling) is searched
per model x context x cache when --find-max-batch is given.

--plot draws tokens/s against context, a line per cache x step x batch (log-2 context axis).
Not built yet (issue 9): whole-step graphs for the quantized strategies, the Hugging Face QuantizedCache
comparison.

Writes OUT.json and OUT.md; refuses to replace them without --overwrite.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvzoo.cache.base import CacheSpec, fp16_kv_nbytes  # noqa: E402
from kvzoo.config import ModelConfig  # noqa: E402
from kvzoo.generate import decode_one_token, prefill  # noqa: E402
from kvzoo.graphs import decoder  # noqa: E402
from kvzoo.kernels.bench import output_paths  # noqa: E402
from kvzoo.models.llama import Transformer, rope_inv_freq  # noqa: E402

WARMUP = 40        # untimed decode steps per cell: more than one 32-token period of every strategy's phases

SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=131072 + 1024,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=131072 + 1024),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b"], help=f"{', '.join(SHAPES)}, smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--caches", nargs="+", default=["fp16", "kivi:bits=2", "kivi:bits=4", "innerq:bits=2",
                                                        "innerq:bits=4"])
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per cell")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--compile", action="store_true", help="also time the CUDA-graph step (kvzoo.graphs)")
    parser.add_argument("--find-max-batch", action="store_true", help="search the largest batch that fits")
    parser.add_argument("--max-batch", type=int, default=256, help="upper end of the batch search")
    parser.add_argument("--out", default="results/decode/eager", help="output path without suffix")
    parser.add_argument("--plot", action="store_true", help="also write OUT.png: tokens/s vs context")
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in SHAPES and m != "smollm2"]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}; accepted: {', '.join(SHAPES)}, smollm2")
    if min(args.contexts + args.batches) < 1 or args.steps < 1 or args.prefill_chunk < 1:
        raise SystemExit("--contexts, --batches, --steps and --prefill-chunk must be >= 1")
    for c in args.caches:
        try:
            CacheSpec.parse(c)
        except ValueError as e:
            raise SystemExit(f"--caches: {e}") from None
    return args


def build(name: str) -> Transformer:
    """A bf16 model on the GPU: random weights for a config-only shape, the real ones for smollm2."""
    if name == "smollm2":
        from kvzoo import load_model
        return load_model(None, device="cuda", dtype=torch.bfloat16)[0]
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **SHAPES[name]})
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    model.rope.inv_freq = rope_inv_freq(cfg).to("cuda")              # fp32, as the loader sets it (to_empty blanked it)
    return model.eval()


@torch.inference_mode()
def run_cell(model, cache: str, context: int, batch: int, steps: int, chunk: int, graphed: bool = False) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.cfg.vocab_size, (batch, context), device="cuda")
    kv = model.new_cache(cache, batch_size=batch, max_len=context + WARMUP + steps + 1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits = prefill(model, ids, kv, None, chunk)
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t0
    token = logits.argmax(-1)
    step = decoder(model, kv) if graphed else (lambda t: decode_one_token(model, t, kv, None))
    for _ in range(WARMUP):                # untimed: autotuning, a CUDA graph captured for every phase
        token = step(token).argmax(-1)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = step(token).argmax(-1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    latency = statistics.mean(times)       # a mean: the steps that quantize a group count
    cfg = model.cfg
    return {"prefill_s": prefill_s, "decode_ms": latency * 1e3, "median_ms": statistics.median(times) * 1e3,
            "tokens_per_s": batch / latency, "step_ms": [round(t * 1e3, 3) for t in times],
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30, "kv_bytes": kv.nbytes(),
            "kv_ratio": kv.nbytes() / fp16_kv_nbytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, batch * kv.length)}


def fits(model, cache, context, batch, chunk) -> bool:
    try:
        run_cell(model, cache, context, batch, 1, chunk)
        return True
    except torch.cuda.OutOfMemoryError:
        return False


def max_batch(model, cache, context, chunk, limit) -> int:
    """The largest batch that prefills and decodes: doubling, then bisection."""
    lo, hi = 0, 1
    while hi <= limit and fits(model, cache, context, hi, chunk):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(model, cache, context, mid, chunk) else (lo, mid)
    return lo


def plot(rows: list[dict], title: str, path: Path) -> None:
    """tokens/s against context, one line per model x cache x step x batch (OOM cells left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple, list[tuple[int, float]]] = {}
    for r in rows:
        if "tokens_per_s" in r:
            key = (r["model"], r["cache"], r.get("step", "eager"), r["batch"])
            lines.setdefault(key, []).append((r["context"], r["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, ((model, cache, step, batch), pts) in enumerate(sorted(lines.items())):
        pts.sort()
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", ls="-" if step == "graph" else "--",
                color=plt.cm.tab20(i % 20), label=f"{model} {cache} {step} b{batch}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set(xlabel="context (tokens)", ylabel="decode tokens/s (batch total)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py times decoding on a CUDA GPU and found none")
    paths = output_paths(args.out, args.overwrite)
    rows = []
    for name in args.models:
        model = build(name)
        cells = [(c, n, b, g) for c in args.caches for n in args.contexts for b in args.batches
                 for g in ([False, True] if args.compile else [False])]
        for cache, context, batch, graphed in tqdm(cells, desc=name):
            row = {"model": name, "cache": cache, "context": context, "batch": batch, "step": "graph" if graphed else "eager"}
            try:
                row.update(run_cell(model, cache, context, batch, args.steps, args.prefill_chunk, graphed))
            except torch.cuda.OutOfMemoryError:
                row["oom"] = True
            rows.append(row)
            tqdm.write(json.dumps(row))
        if args.find_max_batch:
            for cache in args.caches:
                for context in args.contexts:
                    rows.append({"model": name, "cache": cache, "context": context,
                                 "max_batch": max_batch(model, cache, context, args.prefill_chunk, args.max_batch)})
                    tqdm.write(json.dumps(rows[-1]))
        del model
    gpu = torch.cuda.get_device_name()
    lines = [f"GPU: {gpu}; bf16 weights; decode step eager or CUDA graph; median of {args.steps} steps", "",
             "| model | cache | step | context | batch | prefill (s) | decode (ms/token) | tokens/s | peak (GiB) | KV (GiB) | KV ratio |",
             "|" + "---|" * 11]
    for r in rows:
        if "max_batch" in r:
            continue
        if r.get("oom"):
            lines.append(f"| {r['model']} | `{r['cache']}` | {r['step']} | {r['context']} | {r['batch']} | OOM |  |  |  |  |  |")
        else:
            lines.append(f"| {r['model']} | `{r['cache']}` | {r['step']} | {r['context']} | {r['batch']} | {r['prefill_s']:.2f} | "
                         f"{r['decode_ms']:.2f} | {r['tokens_per_s']:.1f} | {r['peak_gib']:.1f} | "
                         f"{r['kv_bytes'] / 2 ** 30:.2f} | {r['kv_ratio']:.3f} |")
    found = [r for r in rows if "max_batch" in r]
    if found:
        lines += ["", "| model | cache | context | largest batch |", "|---|---|---|---|"]
        lines += [f"| {r['model']} | `{r['cache']}` | {r['context']} | {r['max_batch']} |" for r in found]
    print("\n".join(lines))
    paths[1].parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps({"gpu": gpu, "steps": args.steps, "rows": rows}, indent=2))
    paths[1].write_text("\n".join(lines) + "\n")
    if args.plot:
        plot(rows, f"decode throughput on {gpu}", paths[0].with_suffix(".png"))


if __name__ == "__main__":
    main()
