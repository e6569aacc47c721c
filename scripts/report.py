"""Run a matrix of cache strategies on one model and write a results table (markdown + JSON + plot).

    python scripts/report.py --windows 16 --device cuda --dtype float16      # the README's table

Every row: perplexity on WikiText-2 and C4 (the first N windows of --seq-len tokens, GPTQ protocol),
the evaluation mode, and the KV size ratio to an fp16 cache measured from the strategy's tensors.
"""

import argparse
import dataclasses
import json
from pathlib import Path

from kvzoo.cache.base import CacheSpec
from kvzoo.cli import add_model_args, load_from_args, run
from kvzoo.eval.datasets import DATASETS, load_text
from kvzoo.eval.perplexity import perplexity

# fp16, then KIVI and KIVI* at 4 and 2 bits with the two (group size, residual) settings of the papers.
DEFAULT_MATRIX = ["fp16"] + [f"{name}:bits={bits},group_size={g},residual=128"
                             for name in ("kivi", "kivi-pre") for bits in (4, 2) for g in (32, 128)]


def with_prompt(texts: list[str], prompt_frac: float | None) -> tuple[list[CacheSpec], float]:
    """Parse cache specs and settle the prompt share of each window. A strategy whose subspace comes from a
    prompt (SQuat) gets --prompt-frac as its prompt_frac, so the tokens it treats as the prompt are exactly
    the ones left unscored; every other row is scored on the same tokens. Without --prompt-frac, the
    prompt strategies' own prompt_frac is used (they must agree), or 0 when there is none."""
    specs = [CacheSpec.parse(text) for text in texts]
    own = {spec.options.prompt_frac for spec in specs if hasattr(spec.options, "prompt_frac")}
    if prompt_frac is None:
        if len(own) > 1:
            raise ValueError(f"the caches set different prompt_frac values {sorted(own)}: rows would be scored "
                             f"on different tokens; pass --prompt-frac")
        prompt_frac = own.pop() if own else 0.0
    for text, spec in zip(texts, specs):
        if "prompt_frac" in text and spec.options.prompt_frac != prompt_frac:
            raise ValueError(f"{text!r} sets prompt_frac={spec.options.prompt_frac} but --prompt-frac is "
                             f"{prompt_frac}: the prompt and the unscored tokens must be the same")
    return [CacheSpec(s.name, dataclasses.replace(s.options, prompt_frac=prompt_frac))
            if hasattr(s.options, "prompt_frac") else s for s in specs], prompt_frac


def markdown(rows: list[dict], datasets: list[str], meta: dict) -> str:
    head = "| cache | mode | " + " | ".join(f"{d} ppl" for d in datasets) + " | KV ratio to fp16 |"
    lines = [head, "|" + "---|" * (len(datasets) + 3)]
    for row in rows:
        ppl = " | ".join(f"{row[d]['perplexity']:.3f}" for d in datasets)
        lines.append(f"| `{row['cache']}` | {row['mode']} | {ppl} | {row['kv_ratio']:.4f} |")
    scored = (f"; the first {meta['score_from']} tokens of each window are the prompt and are not scored"
              if meta["score_from"] else "")
    note = (f"\n{meta['model']}, {meta['dtype']}, {meta['device']}; first {meta['windows']} windows of "
            f"{meta['seq_len']} tokens per dataset{scored}; KV ratio = nbytes() / fp16 K+V bytes at {meta['seq_len']} tokens.\n")
    return "\n".join(lines) + "\n" + note


def plot(rows: list[dict], datasets: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4.5), squeeze=False)
    for ax, d in zip(axes[0], datasets):
        for row in rows:
            ax.scatter(row["kv_ratio"], row[d]["perplexity"])
            ax.annotate(row["cache"].replace(",residual=128", ""), (row["kv_ratio"], row[d]["perplexity"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("KV cache size / fp16")
        ax.set_ylabel("perplexity")
        ax.set_title(d)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--caches", nargs="+", default=DEFAULT_MATRIX, help="cache specs name[:key=value,...]")
    parser.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    parser.add_argument("--windows", type=int, default=16, help="windows per dataset")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=256, help="streaming mode: tokens prefilled before decoding")
    parser.add_argument("--batch-size", type=int, default=1, help="windows run side by side")
    parser.add_argument("--mode", choices=["simulated", "streaming"], default="simulated")
    parser.add_argument("--prompt-frac", type=float, default=None,
                        help="the first share of each window is a prompt and is not scored (SQuat's protocol: 0.5); "
                             "streaming mode prefills it, and caches with a prompt_frac option get this value "
                             "(default: their own prompt_frac when such a cache is listed, else 0)")
    parser.add_argument("--out", default="results", help="folder for report.md, report.json, report.png")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report in --out")
    args = parser.parse_args()
    if args.prompt_frac is not None and not 0 <= args.prompt_frac < 1:
        raise ValueError(f"--prompt-frac must be in [0, 1), got {args.prompt_frac}")
    specs, prompt_frac = with_prompt(args.caches, args.prompt_frac)   # refuse bad specs before any work
    score_from = int(prompt_frac * args.seq_len)
    out = Path(args.out)
    targets = [out / f"report.{ext}" for ext in ("md", "json", "png")]
    if not args.overwrite and any(t.exists() for t in targets):
        raise FileExistsError(f"a report already exists in {out}; pass --overwrite or another --out")

    model, tokenizer = load_from_args(args)
    ids = {d: tokenizer.encode(load_text(d)) for d in args.datasets}
    rows = []
    for spec in specs:
        row = {"cache": str(spec), "mode": args.mode}
        for d in args.datasets:
            result = perplexity(model, ids[d], seq_len=args.seq_len, max_windows=args.windows, cache=spec,
                                mode=args.mode, prefill=score_from or args.prefill, batch_size=args.batch_size,
                                score_from=score_from)
            row[d] = result.to_dict()
            row["kv_ratio"] = result.kv_ratio
        print(f"{row['cache']:<45} " + " ".join(f"{d}={row[d]['perplexity']:.3f}" for d in args.datasets)
              + f"  kv_ratio={row['kv_ratio']:.4f}", flush=True)
        rows.append(row)

    meta = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device), "windows": args.windows, "seq_len": args.seq_len, "mode": args.mode,
            "score_from": score_from}
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, args.datasets, meta)
    targets[0].write_text(table)
    targets[1].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, args.datasets, targets[2])
    print("\n" + table)
    print(f"wrote {', '.join(map(str, targets))}")


if __name__ == "__main__":
    run(main)
