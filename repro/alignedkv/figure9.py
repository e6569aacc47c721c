"""AlignedKV, Figure 9 and Table 1 on any model: bits read per KV element over context length, and the
relative-error distribution of QKᵀ and SV against exact fp16, beside uniform truncation to 13 bits.

    python -m repro.alignedkv.figure9 --json results/alignedkv/analysis.json --plot results/alignedkv/analysis.png

One window of the dataset (--contexts' largest + 1 tokens) runs once without a cache; a decode step at
each context length c (the query of slot c over keys [0, c]) is replayed per layer through
kvzoo.cache.alignedkv's rules (repro/alignedkv/analysis.py says exactly how). Bits are per element
read, counted once per KV head (GQA heads share the read); "aligned" counts only the complete blocks that
AlignedKV truncates, "all" adds the exact tail (the block being filled) at 16 bits.
"""

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from kvzoo.cli import PLOT_SUFFIXES, add_model_args, check_output, load_from_args, run, write_json
from kvzoo.eval.datasets import DATASETS, load_text

from repro.alignedkv.analysis import BUCKET_NAMES, capture_qkv, decode_step


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["contexts"]
    c = [r["context"] for r in rows]
    for key, label in (("k_bits", "K (all)"), ("v_bits", "V (all)"), ("k_bits_aligned", "K (aligned blocks)"),
                       ("v_bits_aligned", "V (aligned blocks)")):
        axes[0].plot(c, [r[key] for r in rows], marker="o", label=label)
    axes[0].set(xscale="log", xlabel="context length", ylabel="bits read per element",
                title="AlignedKV: average bits read (Figure 9)")
    axes[0].legend()
    x = range(len(BUCKET_NAMES))
    width = 0.2
    for i, (gemm, method) in enumerate([(g, m) for g in ("qk", "sv") for m in ("alignedkv", "truncated13")]):
        share = result["table1"][gemm][method]
        axes[1].bar([j + (i - 1.5) * width for j in x], share, width, label=f"{gemm.upper()} {method}")
    axes[1].set(xticks=list(x), ylabel="share of result elements", title="relative error (Table 1)")
    axes[1].set_xticklabels(BUCKET_NAMES, rotation=20)
    axes[1].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.alignedkv.figure9", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--dataset", choices=list(DATASETS), default="wikitext2")
    parser.add_argument("--contexts", default="512,1024,2048,4096,8191",
                        help="context lengths c: the decode step of slot c is replayed")
    parser.add_argument("--block", type=int, default=64, help="AlignedKV's tokens per key block")
    parser.add_argument("--topk", type=int, default=32, help="probabilities in O_est")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="plot Figure 9 and Table 1 (.png, .pdf, .svg)")
    parser.add_argument("--overwrite", action="store_true", help="let --json / --plot replace existing files")
    args = parser.parse_args()
    contexts = sorted(int(c) for c in args.contexts.split(","))
    check_output(args.json, args.overwrite)
    check_output(args.plot, args.overwrite, PLOT_SUFFIXES)
    if contexts[0] < args.block:
        raise ValueError(f"--contexts must be >= --block {args.block}: a step needs a complete block")

    model, tokenizer = load_from_args(args)
    if contexts[-1] >= model.cfg.max_position_embeddings:
        raise ValueError(f"--contexts {contexts[-1]} must be below the model's context of "
                         f"{model.cfg.max_position_embeddings}")
    ids = torch.tensor(tokenizer.encode(load_text(args.dataset)))[:contexts[-1] + 1]
    if ids.numel() < contexts[-1] + 1:
        raise ValueError(f"{args.dataset} has only {ids.numel()} tokens; lower --contexts")
    layers = capture_qkv(model, ids)

    rows, totals = [], {g: {m: [0] * len(BUCKET_NAMES) for m in ("alignedkv", "truncated13")} for g in ("qk", "sv")}
    for c in tqdm(contexts, desc="contexts"):
        steps = [decode_step(q, k, v, c, args.block, args.topk) for q, k, v in layers]
        row = {"context": c}
        for key in ("k_bits", "v_bits", "k_bits_aligned", "v_bits_aligned"):
            row[key] = sum(s[key] for s in steps) / len(steps)
        row["kv_bits"] = (row["k_bits"] + row["v_bits"]) / 2
        rows.append(row)
        for s in steps:
            for g in totals:
                for m in totals[g]:
                    totals[g][m] = [a + b for a, b in zip(totals[g][m], s[g][m])]
    table = {g: {m: [n / sum(counts) for n in counts] for m, counts in totals[g].items()} for g in totals}
    result = {"dataset": args.dataset, "block": args.block, "topk": args.topk, "layers": len(layers),
              "contexts": rows, "table1": table, "buckets": list(BUCKET_NAMES)}

    print(f"\nbits read per element, mean over {len(layers)} layers (decode step of slot c; {args.dataset})")
    print("| context | K | V | K+V | K aligned blocks | V aligned blocks |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['k_bits']:.2f} | {r['v_bits']:.2f} | {r['kv_bits']:.2f} | "
              f"{r['k_bits_aligned']:.2f} | {r['v_bits_aligned']:.2f} |")
    print("\nrelative error of each result element against exact fp16 (Table 1), all contexts and layers")
    print("| GEMM | method | " + " | ".join(BUCKET_NAMES) + " |")
    print("|---|---|" + "---|" * len(BUCKET_NAMES))
    for g in table:
        for m, share in table[g].items():
            print(f"| {'QKᵀ' if g == 'qk' else 'SV'} | {m} | " + " | ".join(f"{100 * x:.2f}%" for x in share) + " |")
    if args.json:
        write_json(args.json, result, args.overwrite)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)


if __name__ == "__main__":
    run(main)
