"""Needle-in-a-haystack over a context-length x depth grid, offline (KV Pareto Figure 8).

    python scripts/needle.py --cache kvpareto:k_bits=4,v_bits=4 --json results/needle.json --plot results/needle.png

Haystacks are cut from --dataset (default WikiText-2, read from ../shared/data); a random 7-digit number is
hidden at each depth and asked for after the text; a cell scores 1 when the greedy answer contains it
(kvzoo/eval/needle.py). Prints the grid and the mean score; --plot draws the heat map.
"""

import argparse
import dataclasses
from pathlib import Path

from tqdm import tqdm

from kvzoo.cli import (PLOT_SUFFIXES, add_model_args, check_output, load_from_args, numbers,
                       parse_cache_args, run, write_json)
from kvzoo.eval.datasets import DATASETS, load_text
from kvzoo.eval.needle import FLAGS, check_grid, needle_grid


def plot(cells: list[dict], lengths: list[int], depths: list[float], title: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[cells[i * len(depths) + j]["found"] for i in range(len(lengths))] for j in range(len(depths))]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2, 0.6 * len(depths) + 1.5))
    ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set(xlabel="context length (tokens)", ylabel="needle depth", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--dataset", choices=list(DATASETS), default="wikitext2", help="the haystack's text")
    parser.add_argument("--lengths", default="1024,2048,4096,8000", help="prompt lengths in tokens")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1]")
    parser.add_argument("--prefill-chunk", type=int, default=None, help="prefill this many tokens at a time")
    parser.add_argument("--seed", type=int, default=0, help="seed of the hidden numbers")
    parser.add_argument("--batch-size", type=int, default=1, help="cells generated side by side")
    parser.add_argument("--json", default=None, help="write the grid to this JSON file")
    parser.add_argument("--plot", default=None, help="heat map (.png, .pdf, .svg)")
    parser.add_argument("--overwrite", action="store_true", help="let --json / --plot replace existing files")
    args = parser.parse_args()
    cache = parse_cache_args(args)
    lengths, depths = numbers(args.lengths, int, "lengths"), numbers(args.depths, float, "depths")
    check_grid(lengths, depths, args.batch_size, args.prefill_chunk, FLAGS)
    check_output(args.json, args.overwrite)
    check_output(args.plot, args.overwrite, PLOT_SUFFIXES)
    model, tokenizer = load_from_args(args)
    filler = tokenizer.encode(load_text(args.dataset), bos=False)
    cells = needle_grid(model, tokenizer, filler, lengths, depths, cache=cache, seed=args.seed,
                        prefill_chunk=args.prefill_chunk, progress=lambda c: tqdm(c, desc="needle batches"),
                        batch_size=args.batch_size)
    rows = [dataclasses.asdict(c) for c in cells]
    score = sum(c.found for c in cells) / len(cells)
    print(f"\nneedle retrieval, cache {cache}: {score:.2%} of {len(cells)} cells")
    print("| depth | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for j, d in enumerate(depths):
        print(f"| {d:.0%} | " + " | ".join("✓" if cells[i * len(depths) + j].found else "✗"
                                           for i in range(len(lengths))) + " |")
    if args.json:
        write_json(args.json, {"cache": str(cache), "dataset": args.dataset, "lengths": lengths, "depths": depths,
                               "score": score, "cells": rows}, args.overwrite)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rows, lengths, depths, f"needle retrieval, {cache.name} ({score:.0%})", args.plot)


if __name__ == "__main__":
    run(main)
