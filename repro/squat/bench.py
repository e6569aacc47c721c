"""SQuat's quantization cost on a CUDA GPU (squat.md Appendix C): what it adds to KIVI, per quantized group.

    python -m repro.squat.bench --out results/squat/bench

Keys only (values are quantized per token exactly as KIVI does, in both). One layer, fp16 keys, batch B,
the paper's settings: 2-bit, G = 32, r = 5, λ = 0.001, g = head_dim / 2 (two iterations). Head shapes:
    SmolLM2-135M   3 KV heads of 64, 9 query heads (the embedded model)
    Llama-3.1-8B   8 KV heads of 128, 32 query heads (GQA)
    Llama-2-7B     32 heads of 128 (MHA)
Timed steps (kvzoo/cache/squat.py is what runs; nothing here is a copy of it):
    setup          once per prompt: query_subspace (Gram matrix of the prompt's P queries per KV head,
                   eigendecomposition) + update_matrices (Woodbury, Lemma 3); eager, CUDA events
    KIVI group     one group of G tokens leaving the residual window: per-channel quantize + pack
    SQuat group    squat_adjust (the block loop of eq. 6) then the same quantize + pack
    KIVI prompt / SQuat prompt   the whole prompt quantized at prefill (P / G groups at once)
Group and prompt steps are medians of --runs CUDA-graph replays (scripts.timing.Timer, L2 flushed).
"per decode token" divides a group's cost by G: a group is quantized once every G decoded tokens.

Writes OUT.json and OUT.md; refuses to replace them without --overwrite.
"""

import argparse
import json
import statistics
import sys

import torch
from tqdm import tqdm

from kvzoo.cache.kvquant import quantize
from kvzoo.cache.squat import grouped_queries, query_subspace, squat_adjust, update_matrices
from kvzoo.cache.store import SCALE_DTYPE

from scripts.timing import Timer, output_paths

SHAPES = {            # name: (KV heads, head_dim, query heads)
    "SmolLM2-135M": (3, 64, 9),
    "Llama-3.1-8B": (8, 128, 32),
    "Llama-2-7B": (32, 128, 32),
}
BITS, GROUP, RANK, LAM = 2, 32, 5, 0.001
MAX_PROMPT_ELEMENTS = 2 ** 30   # the prompt step is skipped above this (B*H*P*d): packing stages int64 words
DEVICE = "cuda"


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m repro.squat.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/squat/bench", help="output path without suffix")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="batch sizes B")
    parser.add_argument("--prompt", type=int, nargs="+", default=[1024, 8192], help="prompt lengths P")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
    return parser.parse_args()


def time_eager(fn, runs: int) -> float:
    """Median ms of fn with CUDA events; for steps a CUDA graph cannot hold (the eigensolver syncs)."""
    fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(shape: str, batch: int, prompt: int, timer: Timer, runs: int) -> dict:
    H, d, Hq = SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(1, Hq, prompt, d, device=DEVICE, dtype=torch.float16, generator=gen)      # the first row's
    keys = torch.randn(batch, H, prompt, d, device=DEVICE, dtype=torch.float16, generator=gen)
    group = keys[:, :, :GROUP].contiguous()                                                  # (B, H, G, d)

    def setup():
        return update_matrices(query_subspace(grouped_queries(q, H), RANK), LAM, d // 2)

    mats = setup()

    def kivi(k):
        return lambda: quantize(k, BITS, GROUP, axis=-2, scale_dtype=SCALE_DTYPE)

    def squat(k):
        return lambda: quantize(squat_adjust(k, mats, BITS, GROUP), BITS, GROUP, axis=-2, scale_dtype=SCALE_DTYPE)

    row = {"shape": shape, "batch": batch, "prompt": prompt, "kv_heads": H, "head_dim": d,
           "setup_ms": time_eager(setup, runs),
           "kivi_group_ms": timer(kivi(group)), "squat_group_ms": timer(squat(group)),
           "kivi_prompt_ms": None, "squat_prompt_ms": None, "prompt_overhead": None}
    if keys.numel() <= MAX_PROMPT_ELEMENTS:
        row.update(kivi_prompt_ms=timer(kivi(keys)), squat_prompt_ms=timer(squat(keys)))
        row["prompt_overhead"] = row["squat_prompt_ms"] / row["kivi_prompt_ms"]
    row["group_overhead"] = row["squat_group_ms"] / row["kivi_group_ms"]
    row["squat_per_token_us"] = 1000 * row["squat_group_ms"] / GROUP
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# SQuat quantization cost ({meta['gpu']})", "",
             f"2-bit keys, G = {GROUP}, r = {RANK}, λ = {LAM}, g = head_dim / 2; one layer; fp16 keys; "
             f"medians of {meta['runs']} runs (ms; μs where named). Command: `{meta['command']}`", "",
             "| shape | B | P | setup | KIVI group | SQuat group | SQuat/KIVI | SQuat per decode token (μs) "
             "| KIVI prompt | SQuat prompt | SQuat/KIVI |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        prompt = ("| — | — | — |" if r["prompt_overhead"] is None else
                  f"| {r['kivi_prompt_ms']:.3f} | {r['squat_prompt_ms']:.3f} | {r['prompt_overhead']:.2f}x |")
        lines.append(f"| {r['shape']} | {r['batch']} | {r['prompt']} | {r['setup_ms']:.3f} | {r['kivi_group_ms']:.4f} "
                     f"| {r['squat_group_ms']:.4f} | {r['group_overhead']:.2f}x | {r['squat_per_token_us']:.2f} "
                     + prompt)
    if any(r["prompt_overhead"] is None for r in rows):
        lines += ["", "— : prompt step not timed, B·H·P·d > 2^30 elements (packing stages int64 words)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("repro.squat.bench times GPU work and found no CUDA GPU (tests/cache/test_squat.py checks the "
                         "same code on the CPU)")
    paths = output_paths(args.out, args.overwrite)
    timer = Timer(args.runs, args.warmup, DEVICE)
    cases = [(s, b, p) for s in SHAPES for b in args.batch for p in args.prompt]
    rows = []
    for s, b, p in tqdm(cases, desc="squat bench"):
        rows.append(measure(s, b, p, timer, args.runs))
        torch.cuda.empty_cache()                   # release the captured graphs' pools before a larger case
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": args.runs,
            "command": "python -m repro.squat.bench " + " ".join(sys.argv[1:])}
    text = markdown(rows, meta)
    print(text)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    paths[1].write_text(text)


if __name__ == "__main__":
    main()
