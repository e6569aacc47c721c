"""EleutherAI's lm-evaluation-harness with kvzoo's model and offline tasks (kvzoo/eval/harness.py):

    python scripts/harness.py --model kvzoo --model_args cache=innerq:bits=2 --tasks kvzoo_gsm8k_cot --limit 200
    python scripts/harness.py --model kvzoo --model_args cache=kivi:bits=2,residual=32 --tasks kvzoo_wikitext
    python scripts/harness.py ls tasks          # every task, kvzoo_* included

Every argument is lm-eval's (`run` is implied); `--model_args` takes the kvzoo model's arguments (pretrained,
cache and its options, dtype, max_length, prefill_chunk); --device and --batch_size are lm-eval's flags.
"""

import sys

from kvzoo.cli import run

if __name__ == "__main__":
    def main() -> None:
        try:
            from kvzoo.eval.harness import main as harness
        except ImportError as err:          # lm_eval not installed: one line with the install command
            raise ValueError(str(err)) from err
        harness(sys.argv[1:])

    run(main)
