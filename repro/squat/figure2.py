"""SQuat, Figure 2 on any model: query subspaces and the attention-score error of SQuat vs KIVI.

    python -m repro.squat.figure2 --json results/squat/figure2.json --plot results/squat/figure2.png

One window of --seq-len tokens of --dataset: the first --prompt-frac of it is the prompt, the rest the
response (teacher-forced). Pre-RoPE queries and keys, as the paper's Appendix D.1. Prints, per layer and
averaged over layers, (left) the mean deviation of the response queries from subspaces of rank r built
from all tokens / the prompt only / another window of the dataset / a window of the other dataset, and
(middle, right) |q·k - q·k̂|/sqrt(d) for the prompt's keys quantized by KIVI and by SQuat, with the
subspace error ||Q̂(k - k̂)|| that SQuat minimizes.
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from kvzoo.cli import PLOT_SUFFIXES, add_model_args, check_output, load_from_args, run
from kvzoo.eval.datasets import DATASETS, load_text

from repro.squat.analysis import capture_qk, deviation_curves, score_errors


def plot(result: dict, path: str, layer: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, values in result["deviation_mean"].items():
        axes[0].plot(result["ranks"], values, marker="o", label=name)
    axes[0].set(xlabel="subspace dimension r", ylabel="mean deviation of response queries",
                title="queries vs subspaces (mean over layers)")
    axes[0].legend()
    hist = result["layers"][layer]["histogram"]
    for name in ("kivi", "squat"):
        axes[1].stairs(hist[name], hist["edges"], label=name.upper())
    axes[1].set(xlabel="|q·k - q·k̂| / sqrt(d)", ylabel="fraction of (query, key) pairs", yscale="log",
                title=f"attention-score error, layer {layer}")
    axes[1].legend()
    layers = range(len(result["layers"]))
    for name in ("kivi", "squat"):
        axes[2].plot(layers, [r["score_error"][name]["mean"] for r in result["layers"]], marker=".", label=name.upper())
    axes[2].set(xlabel="layer", ylabel="mean |q·k - q·k̂| / sqrt(d)", title="score error per layer")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(values: torch.Tensor) -> dict:
    return {"mean": values.mean().item(), "p50": values.quantile(0.5).item(), "p99": values.quantile(0.99).item()}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.squat.figure2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--dataset", choices=list(DATASETS), default="wikitext2")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens in the window")
    parser.add_argument("--prompt-frac", type=float, default=0.5, help="share of the window that is the prompt")
    parser.add_argument("--ranks", default="1,2,5,10,20,30,40", help="subspace dimensions r for the deviation curves")
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=32, help="tokens per per-channel key group")
    parser.add_argument("--rank", type=int, default=5, help="SQuat's subspace dimension r")
    parser.add_argument("--lam", type=float, default=0.001, help="SQuat's λ")
    parser.add_argument("--block", type=int, default=0,
                        help="SQuat's elements per iteration g (0: head_dim / 2, the paper's two iterations)")
    parser.add_argument("--layer", type=int, default=None, help="layer for the histogram (default: the middle one)")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="plot Figure 2 (.png, .pdf, .svg)")
    parser.add_argument("--overwrite", action="store_true", help="let --json / --plot replace existing files")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    if not 0 < args.prompt_frac < 1:
        raise ValueError(f"--prompt-frac must be in (0, 1), got {args.prompt_frac}")
    check_output(args.json, args.overwrite)
    check_output(args.plot, args.overwrite, PLOT_SUFFIXES)

    model, tokenizer = load_from_args(args)
    L, prompt = args.seq_len, int(args.prompt_frac * args.seq_len)
    if L > model.cfg.max_position_embeddings:
        raise ValueError(f"--seq-len {L} exceeds the model's context of {model.cfg.max_position_embeddings}")
    if not 0 < max(ranks) <= model.cfg.head_dim:
        raise ValueError(f"--ranks must lie in [1, head_dim={model.cfg.head_dim}], got {args.ranks}")
    other = "c4" if args.dataset == "wikitext2" else "wikitext2"
    ids = torch.tensor(tokenizer.encode(load_text(args.dataset)))
    far = torch.tensor(tokenizer.encode(load_text(other)))
    if ids.numel() < 2 * L or far.numel() < L:
        raise ValueError(f"the texts are too short for two windows of {L} tokens")
    q_text, k_text = capture_qk(model, ids[:L])
    q_other, _ = capture_qk(model, ids[L:2 * L])
    q_far, _ = capture_qk(model, far[:L])
    n_kv = model.cfg.n_kv_heads
    args.block = args.block or model.cfg.head_dim // 2
    if model.cfg.head_dim % args.block:
        raise ValueError(f"--block {args.block} must divide the head dimension {model.cfg.head_dim}")
    layer_for_hist = args.layer if args.layer is not None else len(q_text) // 2

    layers = []
    for i in tqdm(range(len(q_text)), desc="layers"):
        curves = deviation_curves(q_text[i], q_other[i], q_far[i], prompt, n_kv, ranks)
        errors = score_errors(q_text[i], k_text[i], prompt, args.bits, args.group_size, args.rank, args.lam, args.block)
        top = errors["kivi_score"].quantile(0.999).item()
        edges = torch.linspace(0, top, 41)
        hist = {name: (torch.histc(errors[f"{name}_score"].clamp_max(top), 40, 0, top) / errors[f"{name}_score"].numel())
                .tolist() for name in ("kivi", "squat")}
        layers.append({"deviation": curves, "histogram": {"edges": edges.tolist(), **hist},
                       "score_error": {name: summary(errors[f"{name}_score"]) for name in ("kivi", "squat")},
                       "subspace_error": {name: summary(errors[f"{name}_subspace"]) for name in ("kivi", "squat")}})
    mean_dev = {name: [sum(r["deviation"][name][j] for r in layers) / len(layers) for j in range(len(ranks))]
                for name in layers[0]["deviation"]}
    result = {"dataset": args.dataset, "other_dataset": other, "seq_len": L, "prompt": prompt, "ranks": ranks,
              "bits": args.bits, "group_size": args.group_size, "rank": args.rank, "lam": args.lam, "block": args.block,
              "deviation_mean": mean_dev, "layers": layers}

    print(f"\nmean deviation of the response queries (tokens {prompt}..{L - 1}) over {len(layers)} layers")
    print("| subspace from | " + " | ".join(f"r={r}" for r in ranks) + " |")
    print("|---|" + "---|" * len(ranks))
    for name, values in mean_dev.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
    print(f"\nprompt keys at {args.bits} bits, groups of {args.group_size}; SQuat r={args.rank}, λ={args.lam}, "
          f"g={args.block}; mean over layers")
    print("| quantizer | mean |q·k - q·k̂|/√d | p99 | mean ||Q̂(k - k̂)|| |")
    print("|---|---|---|---|")
    for name in ("kivi", "squat"):
        mean = sum(r["score_error"][name]["mean"] for r in layers) / len(layers)
        p99 = sum(r["score_error"][name]["p99"] for r in layers) / len(layers)
        sub = sum(r["subspace_error"][name]["mean"] for r in layers) / len(layers)
        print(f"| {name.upper()} | {mean:.4f} | {p99:.4f} | {sub:.4f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot, layer_for_hist)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    run(main)
