"""Tensor parallelism over torch.distributed: one model split across N processes (ranks), one GPU each (gloo on a CPU).

The layout is Megatron-LM's, written as gpt-fast's tp.py writes it: every rank holds 1/N of each layer.

    q_proj, k_proj, v_proj   column-parallel: the output rows of the rank's heads, n_heads/N query heads and
                             n_kv_heads/N KV heads, each a contiguous block
    gate_proj, up_proj       column-parallel: intermediate_size/N output rows
    o_proj, down_proj        row-parallel: the matching input columns; each rank's output is a partial sum, and one
                             all-reduce (a forward hook on the module) adds them, after attention and after the MLP
    embed, norms, lm_head    replicated: every rank computes the same hidden state and the same logits

Query head h reads KV head h // n_rep, so a contiguous block of KV heads and the query heads that read them stays
on one rank: each rank's Attention is an ordinary GQA attention over its own heads, and its cache strategy
(kvzoo/cache/) sees nothing else. A strategy's per-head state is simply the rank's heads' (InnerQ's per-channel key
norms, KV Pareto's smoothing means, SQuat's query subspace, KIVI's groups). State that spans heads:

- XQuant on an MHA model caches the layer input X, which every rank has whole: every rank holds the same X codes
  and rematerializes its own heads' K and V from them, so the X cache is replicated (N times one process's bytes).
- XQuant's GQA latents and XQuant-CL's delta basis are SVDs of the rank's own W_k, W_v rows: the latents of all
  ranks together are as wide as one process's, but the basis differs, so quantized codes differ from one
  process's (a lossless setting, bits=16, gives the same logits).
- KV Pareto's tensor granularity (one range per token over all heads) takes its range over the rank's heads.

`ModelCache.nbytes()` of a sharded model is the sum over ranks. `model.cfg` stays the whole model's config;
the attention and MLP modules carry the rank's sizes. Each rank reads only its slices of the safetensors
(kvzoo/models/loader.py). Launch: `torchrun --nproc-per-node N scripts/chat.py ...`; `init()` reads torchrun's
environment.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kvzoo.config import ModelConfig

# module name -> the weight dimension split across ranks: 0 = output rows (column-parallel), 1 = input columns
# (row-parallel, followed by an all-reduce)
SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group."""

    rank: int
    world: int

    def part(self, size: int) -> slice:
        """This rank's contiguous block of `size` entries (size a multiple of world)."""
        n = size // self.world
        return slice(self.rank * n, (self.rank + 1) * n)


def init(device: str | torch.device = "cpu") -> Shard | None:
    """Join the process group torchrun set up (WORLD_SIZE > 1 in the environment): NCCL on CUDA, gloo on a CPU.
    Returns None in a plain single process. On CUDA each rank takes GPU LOCAL_RANK. The ranks then share rank 0's
    random seed, so that sampled tokens (drawn from the same logits on every rank) agree."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
        if not cuda:    # NCCL is left to the process's exit: destroying it while CUDA graphs hold its work hangs
            atexit.register(dist.destroy_process_group)
    seed = [torch.seed() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(seed, src=0)
    torch.manual_seed(seed[0])
    return Shard(dist.get_rank(), dist.get_world_size())


def broadcast(value):
    """Rank 0's `value` (any picklable object: a line the user typed, a prompt) on every rank; the value itself in
    a single process."""
    if current() is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def current() -> Shard | None:
    """The group this process joined (init), or None when it runs alone."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return Shard(dist.get_rank(), dist.get_world_size())


def rank() -> int:
    """This process's rank (0 when it runs alone): rank 0 reads input and prints."""
    shard = current()
    return 0 if shard is None else shard.rank


def check(cfg: ModelConfig, world: int) -> None:
    """Refuse a split that does not divide the model: every rank needs whole KV heads and an equal MLP share."""
    if cfg.n_kv_heads % world:
        raise ValueError(f"tensor parallelism over {world} ranks needs the KV heads to divide evenly: this model has "
                         f"{cfg.n_kv_heads} KV heads ({cfg.n_heads} query heads); use a number of ranks that divides "
                         f"{cfg.n_kv_heads}")
    if cfg.intermediate_size % world:
        raise ValueError(f"tensor parallelism over {world} ranks needs intermediate_size ({cfg.intermediate_size}) "
                         f"to divide evenly; use a number of ranks that divides it")


def _all_reduce(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)      # in place: a CUDA graph records the NCCL call like any kernel
    return output


@torch.no_grad()
def shard_modules(model: nn.Module, shard: Shard) -> None:
    """Give `model` (a Transformer, typically still on the meta device) the rank's sizes: its projections become
    the rank's slices (new, uninitialized nn.Linear of the sliced shape, on the weights' device) and o_proj /
    down_proj add their partial sums over ranks. The loader then fills the slices (`rank_slice`)."""
    cfg = model.cfg
    check(cfg, shard.world)
    for block in model.layers:
        for owner in (block.attn, block.mlp):
            for name, dim in SPLIT_DIM.items():
                old = getattr(owner, name, None)
                if old is None:
                    continue
                shape = list(old.weight.shape)                        # (out, in)
                shape[dim] //= shard.world
                new = nn.Linear(shape[1], shape[0], bias=False, device=old.weight.device, dtype=old.weight.dtype)
                if dim == 1:
                    new.register_forward_hook(_all_reduce)
                setattr(owner, name, new)
        block.attn.n_heads = cfg.n_heads // shard.world
        block.attn.n_kv_heads = cfg.n_kv_heads // shard.world
    model.shard = shard


def rank_slice(name: str, shard: Shard | None, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """Which part of the whole checkpoint tensor `name` (a kvzoo parameter name, whole shape `shape`) this rank
    holds: a tuple of slices, or None for a replicated tensor (read whole)."""
    parts = name.split(".")
    if shard is None or len(parts) < 2 or parts[-2] not in SPLIT_DIM:
        return None
    dim = SPLIT_DIM[parts[-2]]
    return (slice(None),) * dim + (shard.part(shape[dim]),)


def all_sum(value: int) -> int:
    """An integer summed over every rank (the value itself in a single process): the KV bytes of a sharded cache."""
    if current() is None:
        return value
    t = torch.tensor([value], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return int(t.item())
