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
from kvzoo.cache.store import POLICIES, check_policy
from kvzoo.cli import ListCaches, add_model_args, load_from_args, run
from kvzoo.eval.datasets import DATASETS, load_text
from kvzoo.eval.perplexity import FLAGS, MODES, check_args, perplexity

# fp16, then KIVI and KIVI* at 4 and 2 bits with the two (group size, residual) settings of the papers.
DEFAULT_MATRIX = ["fp16"] + [f"{name}:bits={bits},group_size={g},residual=128"
                             for name in ("kivi", "kivi-pre") for bits in (4, 2) for g in (32, 128)]


def with_policy(texts: list[str], policy: str) -> list[CacheSpec]:
    """Parse cache specs and give every strategy with windows the same window policy (kvzoo/cache/store.py), so
    that the rows of one table are compared under one policy; a spec that names another policy is refused."""
    check_policy(policy)
    specs = []
    for text in texts:
        spec = CacheSpec.parse(text)
        if hasattr(spec.options, "policy"):
            if "policy=" in text and spec.options.policy != policy:
                raise ValueError(f"{text!r} sets policy={spec.options.policy} but the table's --policy is {policy}: "
                                 f"every row of a table uses one window policy")
            spec = CacheSpec(spec.name, dataclasses.replace(spec.options, policy=policy))
        specs.append(spec)
    return specs


def markdown(rows: list[dict], datasets: list[str], meta: dict) -> str:
    head = "| cache | mode | " + " | ".join(f"{d} ppl" for d in datasets) + " | KV ratio to fp16 |"
    lines = [head, "|" + "---|" * (len(datasets) + 3)]
    for row in rows:
        ppl = " | ".join(f"{row[d]['perplexity']:.3f}" for d in datasets)
        lines.append(f"| `{row['cache']}` | {row['mode']} | {ppl} | {row['kv_ratio']:.4f} |")
    model = meta["model"] + (" expanded to multi-head attention (--mha)" if meta.get("mha") else "")
    note = (f"\n{model}, {meta['dtype']}, {meta['device']}, {meta['mode']} mode; first {meta['windows']} windows "
            f"of {meta['seq_len']} tokens per dataset; every row: window policy `{meta['policy']}`, a prompt of "
            f"{meta['prompt']} tokens per window (prefilled exact, statistics from it, not scored); "
            f"KV ratio = nbytes() / fp16 K+V bytes at {meta['seq_len']} tokens.\n")
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
    parser.add_argument("--caches", nargs="+", default=DEFAULT_MATRIX,
                        help="cache specs name[:key=value,...] (--list-caches lists strategies, options and defaults)")
    parser.add_argument("--list-caches", action=ListCaches, help="every strategy with its options and defaults")
    parser.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    parser.add_argument("--windows", type=int, default=16, help="windows per dataset")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1, help="windows run side by side")
    parser.add_argument("--mode", choices=MODES, default="simulated",
                        help="simulated (the papers' protocol), streaming (token-by-token decode) or graph (streaming "
                             "through the CUDA-graph step the benchmarks time); see scripts/perplexity.py")
    parser.add_argument("--prompt", type=int, default=None,
                        help="tokens of each window that are the prompt: prefilled exact, statistics taken from them, "
                             "not scored (default min(256, seq_len / 8), the same for every row)")
    parser.add_argument("--policy", choices=POLICIES, default="reference",
                        help="window policy of every row (kvzoo/cache/store.py): reference = each paper's / its "
                             "authors' code; grouped = R..R+G-1 newest exact; none = every token quantized")
    parser.add_argument("--out", default="results", help="folder for report.md, report.json, report.png")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing report in --out")
    args = parser.parse_args()
    specs = with_policy(args.caches, args.policy)                       # refuse bad specs before any work
    prompt = check_args(args.seq_len, args.windows, args.prompt, args.batch_size, mode=args.mode,
                        names=FLAGS | {"max_windows": "--windows"})
    out = Path(args.out)
    targets = [out / f"report.{ext}" for ext in ("md", "json", "png")]
    if not args.overwrite and any(t.exists() for t in targets):
        raise FileExistsError(f"a report already exists in {out}; pass --overwrite or another --out")

    model, tokenizer = load_from_args(args)
    ids = {d: tokenizer.encode(load_text(d)) for d in args.datasets}
    meta = {"model": args.model or "SmolLM2-135M-Instruct (embedded)", "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device), "windows": args.windows, "seq_len": args.seq_len, "mode": args.mode,
            "policy": args.policy, "prompt": prompt, "mha": getattr(args, "mha", False)}
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in specs:
        row = {"cache": str(spec), "mode": args.mode}
        for d in args.datasets:
            result = perplexity(model, ids[d], seq_len=args.seq_len, max_windows=args.windows, cache=spec,
                                mode=args.mode, prompt=prompt, batch_size=args.batch_size)
            row[d] = result.to_dict()
            row["kv_ratio"] = result.kv_ratio
        print(f"{row['cache']:<45} " + " ".join(f"{d}={row[d]['perplexity']:.3f}" for d in args.datasets)
              + f"  kv_ratio={row['kv_ratio']:.4f}", flush=True)
        rows.append(row)
        targets[1].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")   # the rows so far

    table = markdown(rows, args.datasets, meta)
    targets[0].write_text(table)
    targets[1].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, args.datasets, targets[2])
    print("\n" + table)
    print(f"wrote {', '.join(map(str, targets))}")


if __name__ == "__main__":
    run(main)
