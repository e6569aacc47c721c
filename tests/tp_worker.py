"""What the tensor-parallel tests run, in one process or in each rank under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 tests/tp_worker.py DEVICE CHECKPOINT OUT SPEC [SPEC ...]

Each rank loads its slices of CHECKPOINT (kvzoo/models/tp.py) and runs, for every cache spec, a streaming prefill
and greedy decode (eager, then through kvzoo.graphs.decoder) and a simulated forward, on DEVICE (cpu: gloo; cuda: NCCL, one GPU per rank, CUDA graphs); rank 0 saves the logits,
tokens and KV bytes (summed over ranks) to OUT, which the test compares with `run_all` in a single process."""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.interpreted import skip_repeated_patching  # noqa: E402

skip_repeated_patching()
from kvzoo.graphs import decoder  # noqa: E402
from kvzoo.models import tp  # noqa: E402
from kvzoo.models.loader import load_weights  # noqa: E402

PROMPT, NEW, SIMULATED = 12, 10, 28


@torch.inference_mode()
def run_one(model, spec: str) -> dict:
    """Logits and greedy tokens of one cache spec: streaming eager, streaming through the decoder, simulated."""
    ids = torch.randint(0, model.cfg.vocab_size, (2, SIMULATED), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)
    out = {}
    for how in ("eager", "decoder"):
        cache = model.new_cache(spec, 2, PROMPT + NEW)
        logits = [model(ids[:, :PROMPT], cache)[:, -1]]
        step = decoder(model, cache) if how == "decoder" else None
        tokens = []
        for _ in range(NEW - 1):
            tokens.append(logits[-1].argmax(-1))
            logits.append(step(tokens[-1]).clone() if step else model(tokens[-1][:, None], cache)[:, -1])
        out[how] = (torch.stack(logits, 1).cpu(), torch.stack(tokens, 1).cpu())
        out[f"{how}_nbytes"] = cache.nbytes()
    out["simulated"] = model(ids, model.new_cache(spec, 2, SIMULATED, mode="simulated", prompt=4)).cpu()
    return out


def run_all(model, specs: list[str]) -> dict:
    return {spec: run_one(model, spec) for spec in specs}


def main() -> None:
    device, checkpoint, out, *specs = sys.argv[1:]
    torch.manual_seed(0)
    shard = tp.init(device)
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    results = run_all(load_weights(checkpoint, device=device, shard=shard), specs)
    if shard is None or shard.rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
