"""Weight-only 4-bit cost on perplexity: w16 against plain round-to-nearest and AWQ (KV Pareto §4.3).

    python -m repro.kvpareto.weights_ppl --windows 2 --calib-windows 8 --json results/kvpareto/weights.json

Each method is applied to a fresh copy of the model (kvzoo/weightquant/awq.py): RTN and AWQ at 4 bits, asymmetric,
groups of 128 input channels (64 where 128 does not divide the layer widths, as SmolLM2's 576); AWQ
calibrates on --calib-windows windows of 512 tokens from the end of the C4 sample. Perplexity: the first
--windows windows of --seq-len tokens of WikiText-2 and C4, fp16 KV cache, simulated mode.
"""

import argparse
import copy
import time

from kvzoo.cli import add_model_args, check_output, load_from_args, run, write_json
from kvzoo.eval.datasets import load_text
from kvzoo.eval.perplexity import perplexity
from kvzoo.weightquant.awq import METHODS, group_for, quantize_weights


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m repro.kvpareto.weights_ppl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, cache=False)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--calib-windows", type=int, default=8)
    parser.add_argument("--json", default=None)
    parser.add_argument("--overwrite", action="store_true", help="let --json replace an existing file")
    args = parser.parse_args()
    check_output(args.json, args.overwrite)
    model, tokenizer = load_from_args(args)
    texts = {name: tokenizer.encode(load_text(name)) for name in ("wikitext2", "c4")}
    rows = []
    for method in METHODS:
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        chosen = quantize_weights(m, tokenizer, method, calib_windows=args.calib_windows)
        seconds = time.perf_counter() - t0
        ppl = {name: perplexity(m, ids, seq_len=args.seq_len, max_windows=args.windows, progress=False).perplexity
               for name, ids in texts.items()}
        weight_bytes = sum(b.nbytes for layer in m.layers for b in list(layer.parameters()) + list(layer.buffers()))
        rows.append({"method": method, **ppl, "block_bytes": weight_bytes, "seconds": seconds, "awq_alpha": chosen})
        print(f"{method:7s} wikitext2={ppl['wikitext2']:.3f} c4={ppl['c4']:.3f} block weights "
              f"{weight_bytes / 2 ** 20:.1f} MiB ({seconds:.0f} s)", flush=True)
    if args.json:
        write_json(args.json, {"group_size": group_for(model), "windows": args.windows, "seq_len": args.seq_len,
                               "dtype": str(model.dtype), "rows": rows}, args.overwrite)


if __name__ == "__main__":
    run(main)
