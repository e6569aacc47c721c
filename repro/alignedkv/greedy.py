"""AlignedKV's Table 3 claim on any model: greedy generation with AlignedKV is token-for-token the fp16 one.

    python -m repro.alignedkv.greedy --device cuda --dtype float16 --json results/alignedkv/greedy.json

Prompts: the paper's ("I have just received a letter from my brother,") and the opening words of the
next C4 documents, --prompts in all. Each is continued greedily for --new-tokens tokens with
--baseline and with --cache (--batch prompts per call; one at a time by default, so that no row is padded
and decode runs through the CUDA kernels on a GPU); a row that diverges is reported at its first
differing token. The paper's setting is an fp16 model (--dtype float16): AlignedKV's format is fp16, so
in an fp32 model its K/V are rounded to fp16 and the fair baseline is `alignedkv:min_bits=16`.
"""

import argparse
import json
import sys
import time

from tqdm import tqdm

from kvzoo.cli import add_model_args, check_output, load_from_args, run, write_json
from kvzoo.eval.datasets import dataset_path
from kvzoo.generate import generate

PAPER_PROMPT = "I have just received a letter from my brother,"


def prompts(n: int, words: int) -> list[str]:
    """The paper's prompt, then the first `words` words of C4 documents."""
    out = [PAPER_PROMPT]
    with dataset_path("c4").open(encoding="utf-8") as f:
        for line in f:
            if len(out) == n:
                break
            text = json.loads(line)["text"].split()
            if len(text) >= words:
                out.append(" ".join(text[:words]))
    if len(out) < n:
        raise ValueError(f"the C4 sample has only {len(out) - 1} documents of >= {words} words; lower --prompts")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.alignedkv.greedy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--cache", default="alignedkv", help="the strategy under test (with options)")
    parser.add_argument("--baseline", default="fp16", help="the reference cache")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--words", type=int, default=16, help="words of each C4 prompt")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1,
                        help="prompts per generate() call; 1 (no padding) decodes through the CUDA kernels")
    parser.add_argument("--json", default=None, help="write the comparison to this JSON file")
    parser.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    args = parser.parse_args()
    if min(args.prompts, args.new_tokens, args.batch) < 1:
        raise ValueError("--prompts, --new-tokens and --batch must be >= 1")
    check_output(args.json, args.overwrite)
    model, tokenizer = load_from_args(args)
    texts = prompts(args.prompts, args.words)
    runs = {}
    for spec in (args.baseline, args.cache):
        t0 = time.perf_counter()
        runs[spec] = [row for i in tqdm(range(0, len(texts), args.batch), desc=spec)
                      for row in generate(model, tokenizer, texts[i:i + args.batch], max_new_tokens=args.new_tokens,
                                          temperature=0.0, cache=spec).tokens]
        print(f"{spec}: {sum(map(len, runs[spec]))} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    base, ours = runs[args.baseline], runs[args.cache]
    rows = []
    for i, (a, b) in enumerate(zip(base, ours)):
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"prompt": texts[i], "tokens": len(a), "identical": first is None, "first_divergence": first,
                     "baseline": tokenizer.decode(a[:first + 8] if first is not None else a[:24]),
                     "ours": tokenizer.decode(b[:first + 8] if first is not None else b[:24])})
    same = sum(r["identical"] for r in rows)
    print(f"\n{same} of {len(rows)} prompts identical over {args.new_tokens} greedy tokens "
          f"({args.cache} vs {args.baseline}, {model.dtype})")
    for i, r in enumerate(rows):
        if not r["identical"]:
            print(f"  prompt {i} diverges at token {r['first_divergence']}: {r['baseline']!r} vs {r['ours']!r}")
    if args.json:
        write_json(args.json, {"cache": args.cache, "baseline": args.baseline, "dtype": str(model.dtype),
                               "new_tokens": args.new_tokens, "identical": same, "rows": rows}, args.overwrite)


if __name__ == "__main__":
    run(main)
