"""Total inference memory, estimated (KV Pareto Appendix I) beside measured, for caches x prefill chunking.

    python -m repro.kvpareto.memory --device cuda --dtype float16 --tokens 8000 \
        --caches fp16 kvpareto:k_bits=4,v_bits=4 --chunks 0 256 --json results/kvpareto/memory.json

For each (cache, chunk) a batch-1 prompt of --tokens random ids is prefilled (repro/kvpareto/memory_model.py):
model bytes, KV bytes and peak activation bytes, each as the formula gives it and as measured (the
activation is measured on CUDA only). chunk 0 = one unchunked prefill.
"""

import argparse

from tqdm import tqdm

from kvzoo.cache.base import CacheSpec
from kvzoo.cli import add_model_args, check_output, load_from_args, run, write_json

from repro.kvpareto.memory_model import estimate, measure

MB = 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.kvpareto.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--caches", nargs="+", default=["fp16"], help="cache specs name[:key=value,...]")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length M")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256], help="prefill chunk sizes (0 = none)")
    parser.add_argument("--json", default=None, help="write the table to this JSON file")
    parser.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    args = parser.parse_args()
    specs = [CacheSpec.parse(c) for c in args.caches]
    if any(c < 0 for c in args.chunks) or args.tokens < 1:
        raise ValueError("--tokens must be >= 1 and --chunks >= 0")
    check_output(args.json, args.overwrite)
    model, _ = load_from_args(args)
    if args.tokens > model.cfg.max_position_embeddings:
        raise ValueError(f"--tokens {args.tokens} exceeds the model's context of {model.cfg.max_position_embeddings}")
    rows = []
    for spec in tqdm(specs, desc="caches"):
        for chunk in args.chunks:
            est, got = estimate(model, spec, args.tokens, chunk or None), measure(model, spec, args.tokens, chunk or None)
            rows.append({"cache": str(spec), "chunk": chunk, "estimate": est.to_dict(), "measured": got.to_dict()})
    print(f"\nmemory at M = {args.tokens} tokens, batch 1, {model.dtype}, {model.device} (MiB; estimate / measured)")
    print("| cache | chunk | model | KV | peak activation | total |")
    print("|---|---|---|---|---|---|")
    fmt = lambda v: "–" if v is None else f"{v / MB:.1f}"      # noqa: E731
    for r in rows:
        e, m = r["estimate"], r["measured"]
        cells = [f"{fmt(e[k])} / {fmt(m[k])}" for k in ("model", "kv", "activation", "total")]
        print(f"| `{r['cache']}` | {r['chunk'] or 'none'} | " + " | ".join(cells) + " |")
    if args.json:
        write_json(args.json, {"tokens": args.tokens, "dtype": str(model.dtype), "device": str(model.device),
                               "rows": rows}, args.overwrite)


if __name__ == "__main__":
    run(main)
