"""Perplexity of a model + KV-cache strategy on WikiText-2 or C4 (non-overlapping windows, GPTQ protocol).

    python scripts/perplexity.py --dataset wikitext2 --seq-len 2048 --max-windows 8 --cache fp16
"""

import argparse

from kvzoo.cli import add_model_args, check_output, human_bytes, load_from_args, parse_cache_args, run, write_json
from kvzoo.eval.datasets import DATASETS, load_text
from kvzoo.eval.perplexity import FLAGS, MODES, check_args, perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--dataset", choices=list(DATASETS), default="wikitext2")
    parser.add_argument("--data-path", default=None, help="override the dataset file (default: ../shared/data)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--max-windows", type=int, default=None, help="score only the first N windows")
    parser.add_argument("--prompt", type=int, default=None,
                        help="tokens of each window that are the prompt: prefilled exact (streaming: a real prefill), "
                             "statistics taken from them, not scored (default min(256, seq_len / 8))")
    parser.add_argument("--batch-size", type=int, default=1, help="windows run side by side")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="streaming and graph modes: prefill this many tokens at a time (chunked prefill)")
    parser.add_argument("--mode", choices=MODES, default="simulated",
                        help="simulated: each token sees the cache as token-by-token decoding would (the papers' "
                             "protocol); streaming: prefill the prompt, then decode the rest token by token; graph: "
                             "as streaming, through the CUDA-graph step that generation and bench_decode run")
    parser.add_argument("--json", default=None, help="also write the result to this JSON file")
    parser.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    args = parser.parse_args()
    parse_cache_args(args)
    check_args(args.seq_len, args.max_windows, args.prompt, args.batch_size, args.prefill_chunk, args.mode, FLAGS)
    check_output(args.json, args.overwrite)

    text = load_text(args.dataset, args.data_path)
    model, tokenizer = load_from_args(args)
    ids = tokenizer.encode(text)
    result = perplexity(model, ids, seq_len=args.seq_len, max_windows=args.max_windows, cache=args.cache,
                        mode=args.mode, prompt=args.prompt, batch_size=args.batch_size,
                        prefill_chunk=args.prefill_chunk)
    print(f"dataset      {args.dataset}")
    print(f"cache        {args.cache} ({args.mode})")
    print(f"perplexity   {result.perplexity:.3f}")
    print(f"windows      {result.windows} of {result.total_windows} ({result.seq_len} tokens each); "
          f"dataset {result.tokens:,} tokens")
    print(f"prompt       the first {result.prompt} tokens of each window (prefilled exact, statistics from them, "
          f"not scored): {result.scored_tokens:,} predictions scored")
    print(f"KV bytes     {human_bytes(result.kv_nbytes)} per window "
          f"({result.kv_ratio:.3f}x the fp16 cache's {human_bytes(result.fp16_kv_nbytes)})")
    print(f"time         {result.seconds:.1f} s")
    if args.json:
        write_json(args.json, {"dataset": args.dataset, "model": args.model or "smollm2-135m-instruct",
                               "mha": args.mha,
                               "dtype": str(model.dtype).removeprefix("torch."), "mode": args.mode, **result.to_dict()},
                   overwrite=args.overwrite)


if __name__ == "__main__":
    run(main)
