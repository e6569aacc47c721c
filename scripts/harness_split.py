"""A harness run split across two machines: requests recorded and answers scored where lm-evaluation-harness is
installed, the generations made on another machine that needs only kvzoo (a GPU box without lm_eval or the hub).

    # where lm_eval is installed: the requests, in the order the kvzoo model would get them
    python scripts/harness_split.py record --tasks kvzoo_gsm8k_cot --limit 200 --out gsm8k200.json
    # anywhere kvzoo runs: the answers, by the kvzoo model's own code (kvzoo/eval/requests.py)
    python scripts/harness_split.py generate gsm8k200.json --cache xquant-cl:bits=2 --device cuda --dtype float32 \\
        --batch_size 32 --out gen-xquant-cl-2.json
    # back where lm_eval is installed: the answers into a response cache, then the harness scores them from it
    python scripts/harness_split.py fill gen-xquant-cl-2.json --use_cache ~/.cache/kvzoo/xquant-cl-2
    python scripts/harness.py --model kvzoo --model_args cache=xquant-cl:bits=2 --tasks kvzoo_gsm8k_cot --limit 200 \\
        --batch_size 32 --use_cache ~/.cache/kvzoo/xquant-cl-2

`generate` answers with the same batches (--batch_size rows, in the recorded order), truncation and stop strings as
the harness's kvzoo model with that batch size, and writes the KV bytes beside the answers (the harness logs
nothing for answers it reads from its cache). Give `generate` the model arguments the scoring run names
(--model, --dtype, float32 by default as the kvzoo model's, --cache and --batch_size), and the scoring run the
--gen_kwargs `record` was given. Only greedy requests are recorded: lm-eval does not cache sampled answers.
"""

import argparse
import json
import time
from pathlib import Path

from kvzoo.cli import add_model_args, check_output, load_from_args, parse_cache_args, run, write_json


def record(args: argparse.Namespace) -> None:
    try:
        from lm_eval import simple_evaluate
        from lm_eval.api.model import LM, hash_args
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ValueError("record needs EleutherAI's lm-evaluation-harness: pip install \"lm_eval>=0.4.5\" "
                         "(or bash scripts/install.sh)") from None
    from kvzoo.eval.tasks import task_dir

    check_output(args.out, args.overwrite)

    class Recorder(LM):
        """Answers nothing: keeps the generate_until requests and their response-cache keys."""

        def __init__(self):
            super().__init__()
            self.requests: list[dict] = []

        def loglikelihood(self, requests, disable_tqdm=False):
            raise ValueError("record takes generation tasks (generate_until); loglikelihood tasks run quickly "
                             "through scripts/harness.py itself")

        loglikelihood_rolling = loglikelihood

        def generate_until(self, requests, disable_tqdm=False):
            if any(r.args[1].get("do_sample", False) for r in requests):
                raise ValueError("record takes greedy generation only: lm-eval does not cache sampled answers")
            self.requests = [{"key": hash_args("generate_until", r.args), "context": r.args[0],
                              "gen_kwargs": r.args[1]} for r in requests]
            return [""] * len(requests)

    recorder = Recorder()
    simple_evaluate(model=recorder, tasks=args.tasks, limit=args.limit, gen_kwargs=args.gen_kwargs,
                    task_manager=TaskManager(include_path=str(task_dir())))
    write_json(args.out, {"tasks": args.tasks, "limit": args.limit, "requests": recorder.requests}, args.overwrite)
    print(f"{len(recorder.requests)} requests -> {args.out}")


def generate(args: argparse.Namespace) -> None:
    import torch

    from kvzoo.eval.requests import KVReport, generate_requests

    recorded = json.loads(Path(args.requests).read_text()).get("requests")
    if not isinstance(recorded, list):
        raise ValueError(f"{args.requests} holds no requests; give a JSON file `record` wrote")
    check_output(args.out, args.overwrite)
    if args.batch_size < 1:
        raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
    spec = parse_cache_args(args)
    model, tokenizer = load_from_args(args)
    report, t0 = KVReport(), time.perf_counter()
    texts = generate_requests(model, tokenizer, spec, [(r["context"], r["gen_kwargs"]) for r in recorded],
                              args.batch_size, model.cfg.max_position_embeddings, report)
    device = torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu"
    write_json(args.out, {"cache": str(spec), "model": args.model or "SmolLM2-135M-Instruct",
                          "dtype": str(model.dtype).removeprefix("torch."), "device": device,
                          "batch_size": args.batch_size, "seconds": round(time.perf_counter() - t0, 1),
                          "kv_bytes": report.nbytes, "fp16_kv_bytes": report.fp16_nbytes, "kv_ratio": report.ratio,
                          "answers": {r["key"]: text for r, text in zip(recorded, texts)}}, args.overwrite)
    print(f"{len(texts)} answers, KV {report.ratio:.3f} x fp16 (same slots) -> {args.out}")


def fill(args: argparse.Namespace) -> None:
    try:
        from sqlitedict import SqliteDict
    except ImportError:
        raise ValueError("fill needs sqlitedict, which lm_eval installs: pip install \"lm_eval>=0.4.5\"") from None
    answers = json.loads(Path(args.answers).read_text()).get("answers")
    if not isinstance(answers, dict):
        raise ValueError(f"{args.answers} holds no answers; give a JSON file `generate` wrote")
    path = f"{args.use_cache}_rank0.db"                      # the file lm-eval's --use_cache PATH opens
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with SqliteDict(path, autocommit=False) as db:
        clash = [k for k, text in answers.items() if k in db and db[k] != text]
        if clash:
            raise ValueError(f"{path} already holds other answers for {len(clash)} of these requests (another model "
                             "or cache spec?); give each run its own --use_cache PATH")
        for key, text in answers.items():
            db[key] = text
        db.commit()
    print(f"{len(answers)} answers -> {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("record", help="the harness's generate_until requests of --tasks (needs lm_eval)")
    p.add_argument("--tasks", nargs="+", required=True, help="harness task names (kvzoo_* included)")
    p.add_argument("--limit", type=int, default=None, help="the first N documents of each task")
    p.add_argument("--gen_kwargs", default=None,
                   help="the harness's --gen_kwargs (give the scoring run the same: they are part of each request)")
    p.add_argument("--out", required=True, help="requests JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(fn=record)
    p = sub.add_parser("generate", help="answer recorded requests with kvzoo (no lm_eval needed)")
    p.add_argument("requests", help="a JSON file `record` wrote")
    add_model_args(p)
    p.set_defaults(dtype="float32")                         # the harness's kvzoo model's default
    p.add_argument("--batch_size", type=int, default=1, help="rows side by side, as the harness's --batch_size")
    p.add_argument("--out", required=True, help="answers JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.set_defaults(fn=generate)
    p = sub.add_parser("fill", help="answers into lm-eval's response cache (--use_cache PATH)")
    p.add_argument("answers", help="a JSON file `generate` wrote")
    p.add_argument("--use_cache", required=True, help="the PATH the scoring run gives the harness's --use_cache")
    p.set_defaults(fn=fill)
    args = parser.parse_args()
    args.fn(args)


if __name__ == "__main__":
    run(main)
