"""KV Pareto's frontier search (kv-pareto.md Figure 2): weights x KV quantization x granularity x prefill
chunking, total memory against accuracy, the non-dominated set starred.

    python -m repro.kvpareto.frontier --device cuda --dtype float16 --context 4096 --task wikitext \
        --json results/kvpareto/pareto-wikitext.json --plot results/kvpareto/pareto-wikitext.png

Configurations: every --weights format (w16; w4-rtn and w4-awq quantize a copy of the model's linear layers
to 4 bits, AWQ calibrating on --calib-windows windows of C4) with the fp16 cache and
`kvpareto:k_bits=K,v_bits=V,granularity=...,group_size=G` for every --kv pair (k8v8 ...), --granularity and
--group-sizes, each with every --chunks value (0 = no chunking). The baseline is w16, fp16 cache, no chunking.
repro/kvpareto/analysis.py defines memory, the tasks, the frontier and the chosen point.
"""

import argparse
import copy
from pathlib import Path

import torch
from tqdm import tqdm

from kvzoo.cli import PLOT_SUFFIXES, add_model_args, check_output, load_from_args, numbers, run, write_json
from kvzoo.eval.datasets import DATASETS, load_text
from kvzoo.weightquant.awq import METHODS, quantize_weights

from repro.kvpareto.analysis import TASKS, choose, evaluate, frontier

MB = 2 ** 20
MARKERS = {"w16": "o", "w4-rtn": "^", "w4-awq": "s"}


def configurations(kv: list[str], granularities: list[str], groups: list[int]) -> list[str]:
    specs = ["fp16"]
    for pair in kv:
        if len(pair) < 4 or pair[0] != "k" or "v" not in pair:
            raise ValueError(f"--kv takes pairs like k8v4, got {pair!r}")
        k, v = pair[1:].split("v")
        for g in granularities:
            for size in ([0] if g == "tensor" else groups):
                group = f",group_size={size}" if size else ""
                specs.append(f"kvpareto:k_bits={k},v_bits={v},granularity={g}{group}")
    return specs


def plot(points: list[dict], baseline: dict, chosen: dict, task: str, title: str, path: str) -> None:
    """Memory vs accuracy; for wikitext the y axis is perplexity on a log scale, inverted (up is better)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y = (lambda p: -p["accuracy"]) if task == "wikitext" else (lambda p: p["accuracy"])
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for weights, marker in MARKERS.items():
        mine = [p for p in points if p["weights"] == weights]
        if mine:
            ax.scatter([p["memory"] / MB for p in mine], [y(p) for p in mine], marker=marker, s=30,
                       color="tab:blue" if weights == "w16" else "tab:green", alpha=0.7, label=weights)
    front = sorted((p for p in points if p["frontier"]), key=lambda p: p["memory"])
    ax.scatter([p["memory"] / MB for p in front], [y(p) for p in front], marker="*", s=160,
               color="tab:red", label="frontier", zorder=3)
    ax.plot([p["memory"] / MB for p in front], [y(p) for p in front], color="tab:red", lw=1)
    ax.axhline(y(baseline), color="gray", ls="--", label="w16, fp16 cache, no chunking")
    ax.annotate(f"chosen: {chosen['short']}", (chosen["memory"] / MB, y(chosen)), textcoords="offset points",
                xytext=(8, 8), fontsize=8, arrowprops={"arrowstyle": "-", "color": "gray"})
    if task == "wikitext":
        ax.set_yscale("log")
        ax.invert_yaxis()
    ax.set(xlabel="total memory (MiB): model + KV + peak activation",
           ylabel="WikiText-2 perplexity (log; lower is better)" if task == "wikitext" else "needle score",
           title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.kvpareto.frontier", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--task", choices=TASKS, default="wikitext")
    parser.add_argument("--dataset", choices=list(DATASETS), default="wikitext2",
                        help="the text of the perplexity task (--task wikitext) and of the needle's haystack")
    parser.add_argument("--weights", default="w16,w4-awq", help=f"comma-separated weight formats: {', '.join(METHODS)}")
    parser.add_argument("--calib-windows", type=int, default=32, help="w4-awq: calibration windows of 512 C4 tokens")
    parser.add_argument("--context", type=int, default=4096, help="tokens per window / haystack")
    parser.add_argument("--windows", type=int, default=2, help="wikitext: windows scored")
    parser.add_argument("--kv", default="k8v8,k8v4,k8v2,k4v4,k4v2,k2v2", help="KV precision pairs")
    parser.add_argument("--granularity", default="token", help="comma-separated: token, block, tensor")
    parser.add_argument("--group-sizes", default="32", help="comma-separated group sizes (token / block)")
    parser.add_argument("--chunks", default="0,256", help="comma-separated prefill chunk sizes, 0 = none")
    parser.add_argument("--depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
                        help="needle: comma-separated needle depths in [0, 1], one haystack of --context tokens each")
    parser.add_argument("--tolerance", type=float, default=0.03, help="relative accuracy loss allowed for the chosen point")
    parser.add_argument("--json", default=None, help="write every point and the frontier to this JSON file")
    parser.add_argument("--plot", default=None, help="memory vs accuracy (.png, .pdf, .svg)")
    parser.add_argument("--overwrite", action="store_true", help="let --json / --plot replace existing files")
    args = parser.parse_args()
    try:
        chunks = [int(c) for c in args.chunks.split(",")]
        groups = [int(g) for g in args.group_sizes.split(",")]
    except ValueError:
        raise ValueError("--chunks and --group-sizes take comma-separated integers") from None
    depths = numbers(args.depths, float, "depths")
    if any(not 0 <= d <= 1 for d in depths):
        raise ValueError(f"--depths must lie in [0, 1], got {args.depths!r}")
    formats = args.weights.split(",")
    unknown = [w for w in formats if w not in METHODS]
    if unknown or "w16" not in formats:
        raise ValueError(f"--weights takes a comma-separated list of {', '.join(METHODS)} that includes w16 (the "
                         f"baseline), got {args.weights!r}")
    if args.calib_windows < 1:
        raise ValueError(f"--calib-windows must be >= 1, got {args.calib_windows}")
    specs = configurations(args.kv.split(","), args.granularity.split(","), groups)
    check_output(args.json, args.overwrite)
    check_output(args.plot, args.overwrite, PLOT_SUFFIXES)
    model, tokenizer = load_from_args(args)
    text = load_text(args.dataset)
    ids = torch.tensor(tokenizer.encode(text)) if args.task == "wikitext" else None
    filler = tokenizer.encode(text, bos=False) if args.task == "needle" else None
    points = []
    for weights in formats:
        quantized = model
        if weights != "w16":
            quantized = copy.deepcopy(model)
            quantize_weights(quantized, tokenizer, weights, calib_windows=args.calib_windows)
        for spec, chunk in tqdm([(s, c) for s in specs for c in chunks], desc=f"{weights} configurations"):
            points.append(evaluate(quantized, tokenizer, spec, chunk, args.task, args.context, windows=args.windows,
                                   wikitext_ids=ids, filler=filler, depths=depths, weights=weights))
            tqdm.write(f"{points[-1].label}: {points[-1].memory / MB:.1f} MiB, accuracy {points[-1].accuracy:.3f}")
        del quantized
    baseline = next((p for p in points if p.weights == "w16" and p.cache == "fp16" and p.chunk == 0), points[0])
    front = frontier(points)
    chosen = choose(front, baseline, args.tolerance)
    reduction = 1 - chosen.memory / baseline.memory
    label = "-perplexity" if args.task == "wikitext" else "needle score"
    print(f"\n{args.task} ({args.dataset}), context {args.context}, {model.dtype} on {model.device}; memory {points[0].memory_source}")
    print(f"| weights | cache | chunk | total memory (MiB) | {label} | frontier |")
    print("|---|---|---|---|---|---|")
    for p in sorted(points, key=lambda p: p.memory):
        print(f"| {p.weights} | `{p.cache}` | {p.chunk or 'none'} | {p.memory / MB:.1f} | {p.accuracy:.3f} | "
              f"{'★' if p.frontier else ''} |")
    print(f"\nchosen (frontier, within {args.tolerance:.0%} of the baseline's accuracy): `{chosen.label}`: "
          f"{chosen.memory / MB:.1f} MiB, {reduction:.1%} less than `{baseline.label}` ({baseline.memory / MB:.1f} "
          f"MiB); accuracy {chosen.accuracy:.3f} vs {baseline.accuracy:.3f}")
    result = {"task": args.task, "dataset": args.dataset, "context": args.context, "windows": args.windows,
              "weights": formats, "dtype": str(model.dtype), "device": str(model.device),
              "points": [p.to_dict() for p in points], "baseline": baseline.to_dict(), "chosen": chosen.to_dict(),
              "memory_reduction": reduction, "tolerance": args.tolerance}
    if args.json:
        write_json(args.json, result, args.overwrite)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result["points"], result["baseline"], result["chosen"], args.task,
             f"KV Pareto on {args.model or 'the embedded model'}: {args.task} at {args.context} tokens", args.plot)


if __name__ == "__main__":
    run(main)
