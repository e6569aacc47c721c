"""End-to-end decode on a CUDA GPU (or, with --device cpu, on the CPU): prefill time, per-token decode latency, tokens/s, peak memory and KV bytes
for every strategy and for Hugging Face transformers' own caches, on models given by config only (random bf16
weights, no download) and the embedded model; the largest batch and the largest context each strategy fits.

    python scripts/bench_decode.py --models llama-3.1-8b --contexts 4096 32768 --batches 1 8 \
        --caches fp16 innerq:bits=2 --hf fp16 quanto:2 --compile --find-max-batch --out results/decode/run

Models (kvzoo.models.llama.Transformer on the GPU, weights drawn N(0, 0.02); with --hf the same shape as a
transformers LlamaForCausalLM, also random):
    llama-3.1-8b   32 layers, 32 query / 8 KV heads of 128, MLP 14336, vocab 128256, llama3 RoPE
    llama-3.1-70b  80 layers, 64 query / 8 KV heads of 128, MLP 28672, vocab 128256, llama3 RoPE
    llama-2-7b     32 layers, 32 heads of 128 (MHA), MLP 11008, vocab 32000
Both have their context limit raised to 2^24 tokens (Llama-2's is 4096, Llama-3.1's 131072), so that the shapes
can be timed at long context and GPU memory alone bounds the largest context: the numbers are about the shapes.
    smollm2        the embedded SmolLM2-135M-Instruct, its real weights
Cells (model x context x batch x cache): a random prompt of `context` tokens is prefilled (chunks of
--prefill-chunk tokens, so activations stay bounded at 128K), then --warmup untimed decode steps (40: autotuning,
a CUDA graph per phase), then --steps timed ones; the latency is their mean (the steps where a strategy quantizes a
group count), synchronized each step. kvzoo's step is eager, and with --compile also kvzoo.graphs.decoder's
CUDA graphs (the whole step where the strategy has one: fp16, InnerQ, XQuant(-CL), AlignedKV, KIVI, SQuat; all
but attention for the others). Hugging Face caches
(--hf: `fp16` = its default DynamicCache, `quanto:2` / `quanto:4` = QuantizedCache on optimum-quanto, its
defaults: groups of 64, a 128-token residual) run HF's eager forward, the way `generate` does.

--find-max-batch: per model x context x cache, the largest batch that fits (doubling, then bisection, up to
--max-batch; probes run 3 steps), then a cell timed at that batch (a sixteenth fewer rows if the full cell runs
out of memory). Those batches are filled by copying one prefilled row into
every row (kvzoo: ModelCache.repeat_row; HF: the row's K/V given to the new cache's own update()): decoding
costs the same whatever the rows hold, and prefilling 60 x 32K tokens per probe would take minutes. --fill copies
fills the grid's cells so too, from one prefilled row per cache and context: a batch found so can then be profiled,

    python scripts/bench_decode.py --models llama-3.1-8b --compile --graph-only --batches 154 --steps 8 \
        --contexts 32768 --caches kivi:bits=2 --fill copies --profile 4 --trace --out results/decode/kivi-154

--find-max-context: per model x cache, the largest context that fits at batch 1 (doubling from 128K, then
bisection to 1K): kvzoo allocates its buffers for that many tokens, prefills 64 and decodes two tokens. A
strategy with a whole-step graph (with --compile) decodes so at once: its memory does not depend on how full
the buffers are. The others (KV Pareto, KIVI*: their eager decode dequantizes the whole history) first
have the rest of the context stored as random K/V through each layer's own store path (quantization, no
attention), as HF's caches are given that many random K/V tokens through update().

Tensor parallel (kvzoo/models/tp.py): launched by torchrun, each rank builds its slices of the shape on its own GPU
and every cell runs on all of them; rank 0 writes the rows (model `NAME tpN`), KV bytes summed over ranks:

    torchrun --nproc-per-node 2 scripts/bench_decode.py --models llama-3.1-70b --contexts 32768 \
        --caches fp16 innerq:bits=2 kivi:bits=2 --compile --graph-only --find-max-batch --out results/decode/tp2

--device cpu times the same cells on the CPU (fp32 unless --dtype says otherwise, eager steps only), the way chat runs
there: every strategy decodes from its packed codes (kvzoo/cache/store.py's WindowedStore.attend):

    python scripts/bench_decode.py --device cpu --models smollm2 --contexts 4096 --caches fp16 kivi innerq \
        --warmup 4 --steps 16 --out results/decode/cpu

Each row gives the bandwidth it reached on the bytes a step reads (`read (GB/s)`: the weights, an untied embedding
table apart, plus the KV bytes held), beside the device's measured copy bandwidth in the header. --targets adds
the decode-speed targets (TARGETS: each named cache against fp16 in the same cell) as measured / required.

--weights w4-rtn replaces every block's linear layers by 4-bit RTN codes (kvzoo/weightquant/awq.py's W4Linear, the
W4A16 kernel on a GPU) before the cells run: KV Pareto's 4-bit weights beside a compressed cache.

--profile N runs each cell of the grid again once every cell is timed, N steps under torch.profiler, and prints (and
keeps in OUT.json) the GPU time per step of each kernel (on the CPU: each op's own time), the largest first: where
a step's time goes, graph replays included. No timed step follows a profile: once torch.profiler has run, later
replays of a graph with two streams are slower (SQuat, 8B, 128K, batch 1: 12.50 -> 13.74 ms/token after KIVI's
cell was profiled, results/decode/h100/prof-taint). --trace also writes each profiled cell's timeline beside OUT
(OUT-trace-CELL.json.gz, Chrome's trace format, for ui.perfetto.dev): every kernel on its stream, which shows what
sits on the step's path and what runs beside it (docs/decode.md, "InnerQ's window part beside its quantized part").

--plot draws tokens/s against context: a panel per batch (the largest batches in one), a line per cache and
step. --merge joins earlier OUT.json files into one table and plot without a GPU (a cell measured again
keeps its later row).
Writes OUT.json and OUT.md (the GPU named in both); refuses to replace them without --overwrite, before any
work. OUT.json is rewritten after every row ("partial": true until the run ends), so a run cut short leaves
what it measured, which --merge reads.
"""

import argparse
import gc
import gzip
import inspect
import json
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvzoo.cache.base import CacheSpec, fp16_kv_nbytes
from kvzoo.cli import quiet
from kvzoo.config import ModelConfig
from kvzoo.generate import decode_one_token, prefill
from kvzoo.graphs import decoder
from kvzoo.models import tp
from kvzoo.models.llama import Transformer, rope_inv_freq
from kvzoo.weightquant.awq import W4Linear, group_for, quantize_rtn

from timing import copy_bandwidth, output_paths

WARMUP = 40        # untimed decode steps per cell: more than one 32-token period of every strategy's phases

LONGEST = 2 ** 24  # the shapes' context limit, raised so that memory, not the config, bounds the context search

SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=LONGEST,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3.1-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0,
                          max_position_embeddings=LONGEST,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=LONGEST),
}


HF_CACHES = ("fp16", "quanto:2", "quanto:4")

# --targets: the decode-speed targets, each (what, context, batch (0: the largest batch that fits), the caches it
# names (a spec with its defaults; None: every kvzoo cache but fp16), measure ("tokens/s": at least `bound` x fp16's;
# "ms/token": at most `bound` x fp16's; "w4 speedup": a `NAME w4` row (--weights w4-rtn) at least `bound` x faster
# than fp16's row of NAME, the model at its own weights, merged from two runs), bound), checked against fp16's row of
# the same model (for "w4 speedup", NAME), context, batch and step
W4_LABEL = " w4"                                 # the label of a model run with --weights w4-rtn: NAME + W4_LABEL
TARGETS = (
    ("32K, largest batch: tokens/s >= 3x fp16", 32768, 0, ("innerq:bits=2", "kivi:bits=2", "squat"), "tokens/s", 3.0),
    ("128K, batch 1: InnerQ-2 ms/token <= 0.75x fp16", 131072, 1, ("innerq:bits=2",), "ms/token", 0.75),
    ("128K, batch 1: KIVI-2 ms/token <= 0.8x fp16", 131072, 1, ("kivi:bits=2",), "ms/token", 0.8),
    ("32K, batch 1: ms/token <= 1.05x fp16", 32768, 1, None, "ms/token", 1.05),
    ("32K, batch 1: XQuant(-CL) ms/token <= 2x fp16", 32768, 1, ("xquant", "xquant-cl"), "ms/token", 2.0),
    ("128K, batch 1: 4-bit weights + InnerQ-2 >= 3x faster than 16-bit weights + fp16", 131072, 1,
     ("innerq:bits=2",), "w4 speedup", 3.0),
)
NO_TARGET_BELOW = ("xquant", "xquant-cl")     # held to the 2x target, not the 1.05x one
PROBE_TOKENS = 64   # prompt of a largest-context probe


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b"], help=f"{', '.join(SHAPES)}, smollm2")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--batches", type=int, nargs="*", default=[1], help="batches of the grid (none: no grid)")
    parser.add_argument("--caches", nargs="*", default=["fp16", "kivi:bits=2", "kivi:bits=4", "innerq:bits=2",
                                                        "innerq:bits=4"])
    parser.add_argument("--hf", nargs="*", default=[], help=f"Hugging Face caches: {', '.join(HF_CACHES)}")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per cell")
    parser.add_argument("--warmup", type=int, default=WARMUP,
                        help=f"untimed decode steps per cell first (default {WARMUP}: every phase of the strategies)")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the grid this many times, round robin, and keep each cell's fastest run (a shared "
                             "CPU's speed drifts by up to 2x over minutes; the fastest run is the least disturbed)")
    parser.add_argument("--compile", action="store_true", help="also time the CUDA-graph step (kvzoo.graphs)")
    parser.add_argument("--graph-only", action="store_true", help="with --compile: time the CUDA-graph step only")
    parser.add_argument("--fill", default="prefill", choices=["prefill", "copies"],
                        help="how the grid's cells fill their rows: prefill each row, or copy one prefilled row "
                             "into every row as --find-max-batch does (a batch that fits to decode but not to "
                             "prefill, e.g. the largest one, timed or profiled)")
    parser.add_argument("--find-max-batch", action="store_true", help="search the largest batch that fits")
    parser.add_argument("--max-batch", type=int, default=256, help="upper end of the batch search")
    parser.add_argument("--find-max-context", action="store_true", help="search the largest context at batch 1")
    parser.add_argument("--max-context", type=int, default=LONGEST, help="upper end of the context search")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"],
                        help="where to time (default: cuda when there is a GPU)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="weights and activations (auto: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--weights", default="model", choices=["model", "w4-rtn"],
                        help="model: the weights at --dtype; w4-rtn: every block's linear layers as 4-bit RTN codes "
                             "(kvzoo/weightquant, KV Pareto's W4A16 path; rows labelled `NAME w4`)")
    parser.add_argument("--out", default="results/decode/run", help="output path without suffix")
    parser.add_argument("--plot", action="store_true", help="also write OUT.png: tokens/s vs context")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="once every cell is timed, profile N steps of each grid cell (torch.profiler): GPU "
                             "time per kernel")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile: also write each profiled cell's timeline, OUT-trace-CELL.json.gz "
                             "(Chrome trace format: ui.perfetto.dev), every kernel on its stream")
    parser.add_argument("--targets", action="store_true",
                        help="also print the decode-speed targets (TARGETS) as measured / required, from this "
                             "run's rows")
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="no GPU work: merge the rows of earlier OUT.json files into OUT.md, OUT.json (and with "
                             "--plot OUT.png)")
    args = parser.parse_args()
    if args.merge:
        missing = [f for f in args.merge if not Path(f).is_file()]
        if missing:
            raise SystemExit(f"--merge: {missing[0]} not found")
        return args
    unknown = [m for m in args.models if m not in SHAPES and m != "smollm2"]
    if unknown:
        raise SystemExit(f"unknown model {unknown[0]!r}; accepted: {', '.join(SHAPES)}, smollm2")
    if min(args.contexts + args.batches) < 1 or min(args.steps, args.prefill_chunk, args.warmup, args.repeats) < 1:
        raise SystemExit("--contexts, --batches, --steps, --warmup, --prefill-chunk and --repeats must be >= 1")
    for c in args.caches:
        try:
            CacheSpec.parse(c)
        except ValueError as e:
            raise SystemExit(f"--caches: {e}") from None
    bad = [c for c in args.hf if c not in HF_CACHES]
    if bad:
        raise SystemExit(f"--hf: unknown Hugging Face cache {bad[0]!r}; accepted: {', '.join(HF_CACHES)}")
    if not args.caches and not args.hf:
        raise SystemExit("nothing to run: give --caches and/or --hf")
    if args.graph_only and not args.compile:
        raise SystemExit("--graph-only needs --compile")
    if args.trace and not args.profile:
        raise SystemExit("--trace writes the timelines of --profile's steps: add --profile N")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no CUDA GPU; pass --device cpu")
    if args.device == "cpu" and (args.compile or args.hf or args.find_max_batch or args.find_max_context):
        raise SystemExit("--device cpu times kvzoo's eager step only: --compile (CUDA graphs), --hf and the "
                         "memory searches need a GPU")
    if args.max_batch < 1:
        raise SystemExit(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_context < 1024:
        raise SystemExit(f"--max-context must be >= 1024 (the context search's step), got {args.max_context}")
    return args


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    import platform
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def randomize(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)


def build(name: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
          shard: tp.Shard | None = None) -> Transformer:
    """A kvzoo model: random weights for a config-only shape, the real ones for smollm2; with `shard`, this
    tensor-parallel rank's slices only."""
    if name == "smollm2":
        from kvzoo import load_model
        return load_model(None, device=device, dtype=dtype, shard=shard)[0]
    cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **SHAPES[name]})
    with torch.device("meta"):
        model = Transformer(cfg)
    if shard is not None:
        tp.shard_modules(model, shard)
    model = model.to_empty(device=device).to(dtype)
    randomize(model)
    model.rope.inv_freq = rope_inv_freq(cfg).to(device)              # fp32, as the loader sets it (to_empty blanked it)
    return model.join_projections().eval()


def build_hf(name: str):
    """The same shape as a transformers LlamaForCausalLM in bf16 on the GPU (smollm2: its converted weights)."""
    import transformers

    if name == "smollm2":
        from kvzoo.models.gguf_import import ensure_default_model
        return transformers.LlamaForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.bfloat16).cuda().eval()
    cfg = transformers.LlamaConfig(**SHAPES[name])
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    randomize(model)
    return model.eval()


@dataclass
class Filled:
    cache: object          # a kvzoo ModelCache or a transformers Cache
    token: torch.Tensor    # (B,) the next token to decode


class Kvzoo:
    """kvzoo's model and caches behind the calls a cell makes."""

    impl = "kvzoo"

    def __init__(self, model: Transformer):
        self.model, self.device = model, model.device
        cfg = model.cfg
        self.shape = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size)
        self.weight_bytes = tp.all_sum(weights_read(model, model.embed.weight, model.lm_head.weight))   # all ranks
        self.context_limit = cfg.max_position_embeddings

    def fill(self, cache: str, context: int, batch: int, max_len: int, chunk: int, src: Filled | None) -> Filled:
        kv = self.model.new_cache(cache, batch_size=batch, max_len=max_len)
        if src is not None:                                  # one prefilled row copied into every row
            kv.repeat_row(src.cache)
            return Filled(kv, src.token.expand(batch))
        ids = torch.randint(0, self.shape[3], (batch, context), device=self.device)
        return Filled(kv, prefill(self.model, ids, kv, None, chunk).argmax(-1))

    def stepper(self, filled: Filled, graphed: bool):
        if graphed:
            return decoder(self.model, filled.cache)
        return lambda t: decode_one_token(self.model, t, filled.cache, None)

    def stored(self, filled: Filled) -> tuple[int, int]:
        """(KV bytes held, tokens per row)."""
        return filled.cache.nbytes(), filled.cache.length

    def fits_context(self, cache: str, context: int, static: bool) -> bool:
        """Buffers for `context` tokens, a short prompt, two decodes: through the whole-step graph (`static`), or
        eagerly once the buffers are full."""
        kv = self.model.new_cache(cache, batch_size=1, max_len=context)
        ids = torch.randint(0, self.shape[3], (1, PROBE_TOKENS), device=self.device)
        token = prefill(self.model, ids, kv, None).argmax(-1)
        if static:
            step = decoder(self.model, kv)
        else:
            store_random(kv, context - PROBE_TOKENS - 2)
            step = lambda t: decode_one_token(self.model, t, kv, None)  # noqa: E731
        for _ in range(2):
            token = step(token).argmax(-1)
        sync()
        return True


def weights_read(model: torch.nn.Module, embedding: torch.Tensor, head: torch.Tensor) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied table counts once) and every 4-bit
    layer's codes, scales and zeros, less an untied embedding table, of which a step reads one row per token."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(m.w4.nbytes() for m in model.modules() if isinstance(m, W4Linear))
    return total if head is embedding else total - embedding.numel() * embedding.element_size()


def store_random(kv, tokens: int, chunk: int = 65536) -> None:
    """Store `tokens` random K/V tokens (B = 1) in every layer through the strategy's windowed store
    (kvzoo/cache/store.py: windows, quantization), or AlignedKV's own fp16 planes (`_append`), with no attention:
    a largest-context probe of a strategy without a whole-step graph, whose eager decode's memory grows with the
    tokens held."""
    for layer in kv.layers:
        weight, n_kv, d = layer.attn.q_proj.weight, layer.attn.n_kv_heads, layer.attn.head_dim
        for start in range(0, tokens, chunk):
            k, v = torch.randn(2, 1, n_kv, min(chunk, tokens - start), d, dtype=weight.dtype, device=weight.device)
            if hasattr(layer, "store"):
                layer.length = layer.store.append(layer.length, {"k": k, "v": v})
            else:
                layer._append(k, v)
    kv.length += tokens


class HuggingFace:
    """transformers' LlamaForCausalLM with its DynamicCache or its QuantizedCache (optimum-quanto)."""

    impl = "hf"

    def __init__(self, model):
        self.model, self.device = model, model.device
        self.weight_bytes = weights_read(model, model.get_input_embeddings().weight,
                                         model.get_output_embeddings().weight)
        cfg = model.config
        self.shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                      cfg.vocab_size)
        self.context_limit = cfg.max_position_embeddings
        # the cache argument's name: `cache` in recent transformers, `past_key_values` (now deprecated) before
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def new_cache(self, cache: str):
        from transformers import DynamicCache, QuantizedCache

        if cache == "fp16":
            return DynamicCache(config=self.model.config)
        return QuantizedCache(backend="quanto", config=self.model.config, nbits=int(cache.split(":")[1]))

    def forward(self, ids: torch.Tensor, cache) -> torch.Tensor:
        return self.model(input_ids=ids, **{self.cache_arg: cache}, use_cache=True, logits_to_keep=1).logits[:, -1]

    def fill(self, cache: str, context: int, batch: int, max_len: int, chunk: int, src: Filled | None) -> Filled:
        kv = self.new_cache(cache)
        if src is not None:                                  # the row's K/V through the new cache's update()
            for i, layer in enumerate(src.cache.layers):
                k, v = layer_kv(layer)
                kv.update(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous(), i)
            return Filled(kv, src.token.expand(batch))
        ids = torch.randint(0, self.shape[3], (batch, context), device=self.device)
        for start in range(0, context, chunk):
            logits = self.forward(ids[:, start:start + chunk], kv)
        return Filled(kv, logits.argmax(-1))

    def stepper(self, filled: Filled, graphed: bool):
        assert not graphed, "Hugging Face's caches run eagerly"
        return lambda t: self.forward(t[:, None], filled.cache)

    def stored(self, filled: Filled) -> tuple[int, int]:
        held = sum(tensor_bytes(t) for layer in filled.cache.layers for t in vars(layer).values()
                   if isinstance(t, torch.Tensor))
        return held, filled.cache.get_seq_length()

    def fits_context(self, cache: str, context: int) -> bool:
        """`context` random K/V tokens through update(), then two decode steps."""
        kv = self.new_cache(cache)
        n_layers, n_kv, d, vocab = self.shape
        for i in range(n_layers):
            k = torch.randn(1, n_kv, context, d, device=self.device, dtype=self.model.dtype)
            kv.update(k, torch.randn_like(k), i)
            del k
        token = torch.zeros(1, dtype=torch.long, device=self.device)
        for _ in range(2):
            token = self.forward(token[:, None], kv).argmax(-1)
        sync()
        return True


def layer_kv(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers cache layer's keys and values (B, H, T, d), dequantized where it is quantized."""
    if hasattr(layer, "_quantized_keys"):
        keys = torch.cat([layer._dequantize(layer._quantized_keys), layer.keys], dim=-2)
        return keys, torch.cat([layer._dequantize(layer._quantized_values), layer.values], dim=-2)
    return layer.keys, layer.values


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes held by a tensor, or by the inner tensors of a tensor subclass (optimum-quanto's packed codes,
    scales and shifts)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def max_len(context: int, steps: int, warmup: int = WARMUP) -> int:
    """Tokens a cell's cache is sized for: the prompt, the warm-up and the timed steps."""
    return context + warmup + steps + 1


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def trace_path(out: str, row: dict) -> Path:
    """Where --trace writes a profiled cell's timeline: OUT-trace-<cache>-<context>-b<batch>-<step>.json.gz."""
    cell = re.sub(r"[^A-Za-z0-9.-]+", "_", f"{row['cache']}-{row['context']}-b{row['batch']}-{row['step']}")
    return Path(f"{out}-trace-{cell}.json.gz")


@torch.inference_mode()
def run_cell(runner, cache: str, context: int, batch: int, steps: int, chunk: int, graphed: bool = False,
             src: Filled | None = None, warmup: int = WARMUP, size: int | None = None, profile: int = 0,
             trace: Path | None = None) -> dict:
    """Fill a cache (prefill, or copies of src's row), run `warmup` untimed decode steps, time `steps`; the
    cache is sized for `size` tokens (default: max_len(context, steps)). steps = 0: profile `profile` steps
    instead (profile_steps, its timeline written to `trace` where given), and return only {"kernels": ...}."""
    free_memory()
    sync()
    t0 = time.perf_counter()
    filled = runner.fill(cache, context, batch, size or max_len(context, steps + profile, warmup), chunk, src)
    sync()
    prefill_s = time.perf_counter() - t0
    step = runner.stepper(filled, graphed)
    token = filled.token
    for _ in range(warmup):                # untimed: autotuning, a CUDA graph captured for every phase
        token = step(token).argmax(-1)
    sync()
    if not steps:
        return {"kernels": profile_steps(step, token, profile, trace=trace)}
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = step(token).argmax(-1)
        sync()
        times.append(time.perf_counter() - t0)
    latency = statistics.mean(times)       # a mean: the steps that quantize a group count
    held, length = runner.stored(filled)
    n_layers, n_kv, d, _ = runner.shape
    return {"prefill_s": None if src is not None else prefill_s, "filled": "row copies" if src is not None else "prefill",
            "decode_ms": latency * 1e3, "median_ms": statistics.median(times) * 1e3, "tokens_per_s": batch / latency,
            "step_ms": [round(t * 1e3, 3) for t in times], "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None,
            "kv_bytes": held, "kv_ratio": held / fp16_kv_nbytes(n_layers, n_kv, d, batch * length),
            "weight_bytes": runner.weight_bytes, "read_GBps": (runner.weight_bytes + held) / latency / 1e9}


def profile_steps(step, token: torch.Tensor, n: int, top: int = 12, trace: Path | None = None) -> list[dict]:
    """Time per step of each kernel (torch.profiler over n decode steps; on the CPU, each op's own time), the
    largest first; the rest summed into one entry. Kernels inside a replayed CUDA graph are seen too. trace: also
    write the steps' timeline there (gzipped Chrome trace: each kernel on its stream, so what sits on the step's
    path and what runs beside it can be read off)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = token.is_cuda
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            token = step(token).argmax(-1)
        sync()
    if trace is not None:
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    spent: dict[str, list] = {}
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                entry = spent.setdefault(e.name if len(e.name) <= 80 else e.name[:77] + "...", [0.0, 0])
                entry[0] += e.device_time / 1e3 / n                               # ms per step
                entry[1] += 1
    else:
        for e in prof.key_averages():
            spent[e.key] = [e.self_cpu_time_total / 1e3 / n, e.count]
    rows = sorted(({"kernel": k, "ms_per_step": round(t, 4), "calls_per_step": c / n}
                   for k, (t, c) in spent.items()), key=lambda r: -r["ms_per_step"])
    rest = rows[top:]
    if rest:
        rows = rows[:top] + [{"kernel": f"({len(rest)} other kernels)",
                              "ms_per_step": round(sum(r["ms_per_step"] for r in rest), 4),
                              "calls_per_step": sum(r["calls_per_step"] for r in rest)}]
    total = sum(r["ms_per_step"] for r in rows)
    tqdm.write(f"  {'GPU' if cuda else 'CPU'} time per step {total:.2f} ms in {sum(r['calls_per_step'] for r in rows):.0f} kernels:")
    for r in rows:
        tqdm.write(f"    {r['ms_per_step']:8.3f} ms  {r['calls_per_step']:6.0f} x  {r['kernel']}")
    return rows


def out_of_memory(error: Exception) -> bool:
    """torch's OutOfMemoryError, or a CUDA extension's RuntimeError saying the same (optimum-quanto's)."""
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def fits(probe) -> bool:
    """Whether probe() runs within GPU memory (under tensor parallelism: on every rank)."""
    try:
        with torch.inference_mode():
            probe()
        ok = True
    except RuntimeError as error:      # OutOfMemoryError is one
        if not out_of_memory(error):
            raise
        ok = False
    finally:                                 # the failed probe's tensors are gone with its frames
        free_memory()
    return tp.all_sum(int(not ok)) == 0


def largest(fits_at, lo: int, limit: int, step: int = 1) -> int:
    """The largest n in [lo, limit] (multiples of `step`) with fits_at(n), assuming fits_at(lo) (0 if not):
    doubling from lo, then bisection."""
    if not fits_at(lo):
        return 0
    hi = lo * 2
    while hi <= limit and fits_at(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + step)
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid)
    return lo


def cells(runner, args, label: str, caches: list[str], graph_modes: list[bool], keep) -> None:
    """Every cell of the grid, then the searches; keep(row) gets each row as it is measured."""
    grid = [(c, n, b, g) for c in caches for n in args.contexts for b in args.batches for g in graph_modes]
    cell_size = lambda context: max_len(context, args.steps + args.profile, args.warmup)     # noqa: E731
    prefilled = {}             # --fill copies: the last (cache, context)'s prefilled row

    def source(cache: str, context: int) -> Filled | None:
        if args.fill != "copies":
            return None
        if (cache, context) not in prefilled:
            prefilled.clear()
            free_memory()
            with torch.inference_mode():
                prefilled[(cache, context)] = runner.fill(cache, context, 1, cell_size(context),
                                                          args.prefill_chunk, None)
        return prefilled[(cache, context)]

    timed = []
    for cache, context, batch, graphed in tqdm(grid * args.repeats, desc=f"{label} {runner.impl}"):
        src = source(cache, context)
        timed.append(cell_row(runner, args, label, cache, context, batch, graphed, src,
                              cell_size(context) if src is not None else None))
        keep(timed[-1])
    prefilled.clear()
    if args.find_max_batch:
        for cache in caches:
            graphed = graph_modes[-1]
            for context in args.contexts:
                with torch.inference_mode():
                    src = runner.fill(cache, context, 1, max_len(context, args.steps, args.warmup), args.prefill_chunk,
                                      None)
                size = max_len(context, args.steps, args.warmup)
                best = largest(lambda b: fits(lambda: run_cell(runner, cache, context, b, 1, args.prefill_chunk,
                                                               graphed, src, warmup=2, size=size)), 1, args.max_batch)
                row = {"model": label, "impl": runner.impl, "cache": cache, "context": context, "batch": 0, "oom": True}
                for _ in range(3):       # the timed cell also records every phase's graph: a little more memory
                    if best:
                        row = cell_row(runner, args, label, cache, context, best, graphed, src)
                    if not row.get("oom"):
                        break
                    best = best * 15 // 16
                row["max_batch"], row["batch_cap"] = best, args.max_batch
                keep(row)
                del src
                free_memory()
    if args.find_max_context:
        for cache in caches:
            if runner.impl == "kvzoo":
                static = args.compile and static_step(runner, cache)
                probe, how = (lambda n: runner.fits_context(cache, n, static)), ("graph" if static else "eager")
            else:
                probe, how = (lambda n: runner.fits_context(cache, n)), "eager"
            with torch.inference_mode():
                limit = min(runner.context_limit, args.max_context)
                best = largest(lambda n: fits(lambda: probe(n)), min(131072, limit), limit, 1024)
            row = {"model": label, "impl": runner.impl, "cache": cache, "max_context": best, "step": how}
            keep(row)
            tqdm.write(json.dumps(row))
    if args.profile:       # after every timed step: the profiler slows later replays of two-stream graphs
        for (cache, context, batch, graphed), row in tqdm(list(zip(grid, timed[-len(grid):])), desc="profiles"):
            if "decode_ms" not in row:
                continue
            tqdm.write(f"{row['cache']}, {context} tokens, batch {batch}, {row['step']} step:")
            trace = trace_path(args.out, row) if args.trace else None
            src = source(cache, context)
            try:
                row["kernels"] = run_cell(runner, cache, context, batch, 0, args.prefill_chunk, graphed, src,
                                          warmup=args.warmup, size=cell_size(context) if src is not None else None,
                                          profile=args.profile, trace=trace)["kernels"]  # written with the table
                if trace is not None:
                    row["trace"] = trace.name
            except RuntimeError as error:
                if not out_of_memory(error):
                    raise
            free_memory()
        prefilled.clear()


def static_step(runner: Kvzoo, cache: str) -> bool:
    """Whether the strategy decodes through the whole-step graph (its memory independent of the fill)."""
    from kvzoo.graphs import GraphDecoder

    with torch.inference_mode():
        kv = runner.model.new_cache(cache, batch_size=1, max_len=PROBE_TOKENS + 1)
        prefill(runner.model, torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=runner.device), kv, None)
        return isinstance(decoder(runner.model, kv), GraphDecoder)


def cell_row(runner, args, label, cache, context, batch, graphed, src=None, size=None) -> dict:
    name = cache if runner.impl == "kvzoo" else f"hf:{cache}"
    row = {"model": label, "impl": runner.impl, "cache": name, "context": context, "batch": batch,
           "step": "graph" if graphed else "eager"}
    try:
        row.update(run_cell(runner, cache, context, batch, args.steps, args.prefill_chunk, graphed, src,
                            warmup=args.warmup, size=size))
    except RuntimeError as error:
        if not out_of_memory(error):
            raise
        row["oom"] = True
    free_memory()
    tqdm.write(json.dumps({k: v for k, v in row.items() if k not in ("step_ms", "kernels")}))
    return row


def plot(rows: list[dict], title: str, path: Path) -> None:
    """tokens/s against context: a panel per batch (the largest-batch cells in their own), a colour per cache,
    solid for the CUDA-graph step and dashed for eager (OOM cells left out)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def panel(r):
        return "largest batch" if "max_batch" in r else f"batch {r['batch']}"

    timed = [r for r in rows if "tokens_per_s" in r]
    panels = sorted({panel(r) for r in timed}, key=lambda p: (p == "largest batch", len(p), p))
    caches = sorted({(r["model"], r["cache"]) for r in timed}, key=str)
    colour = {c: plt.cm.tab20(i % 20) for i, c in enumerate(caches)}
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 3, 5), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], panels):
        lines: dict[tuple, list[tuple[int, float]]] = {}
        for r in timed:
            if panel(r) == name:
                lines.setdefault((r["model"], r["cache"], r.get("step", "eager")), []).append(
                    (r["context"], r["tokens_per_s"]))
        for (model, cache, step), pts in sorted(lines.items(), key=str):
            pts.sort()
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", ls="-" if step == "graph" else "--",
                    color=colour[model, cache], label=f"{model} {cache} ({step})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="context (tokens)", title=name)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6, loc="lower left")
    axes[0][0].set_ylabel("decode tokens/s (batch total)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merged_rows(runs: list[dict]) -> list[dict]:
    """The rows of several result files; a cell measured again (same model, implementation, cache, step,
    context, and batch or largest-batch / largest-context search) keeps only its later row, in its place."""
    cells = {}
    for run in runs:
        for r in run["rows"]:
            key = tuple(r.get(k) for k in ("model", "impl", "cache", "step", "context")) + \
                (("largest batch",) if "max_batch" in r else ("largest context",) if "max_context" in r
                 else (r.get("batch"),))
            cells.pop(key, None)
            cells[key] = r
    return list(cells.values())


def main() -> None:
    args = parse_args()
    paths = output_paths(args.out, args.overwrite)             # refuses before any work
    traces = sorted(Path(args.out).parent.glob(Path(args.out).name + "-trace-*.json.gz")) if args.trace else []
    if traces and not args.overwrite:
        raise SystemExit(f"{traces[0]} already exists; pass --overwrite to replace --trace's timelines")
    shard = tp.init(args.device)
    if shard is not None:
        if args.hf or args.weights != "model":
            raise SystemExit("--hf and --weights w4-rtn run in one process; leave them out under torchrun")
        if shard.rank:
            quiet()
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge]
        write(args, paths, merged_rows(runs), runs[0]["gpu"], runs[0]["torch"],
              f"merged from {', '.join(Path(f).name for f in args.merge)} (a later file's row replaces an earlier "
              f"one of the same cell)")
        return
    if args.hf:
        try:
            import optimum.quanto  # noqa: F401  (transformers' QuantizedCache backend)
        except ImportError:
            if any(c != "fp16" for c in args.hf):
                raise SystemExit("--hf quanto:N needs optimum-quanto (pip install optimum-quanto)") from None
    dtype = {"auto": torch.bfloat16 if args.device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({cpu_name()}, {torch.get_num_threads()} threads)"
    if shard is not None:
        gpu = f"{shard.world} x {gpu}, tensor parallel (KV bytes and read GB/s summed over ranks, peak memory per rank)"
    how = f"{str(dtype).removeprefix('torch.')} weights; mean of {args.steps} decode steps after {args.warmup} untimed"
    if args.repeats > 1:
        how += f"; each cell's fastest of {args.repeats} runs, round robin"
    how += f"; a device copy moves {copy_bandwidth(args.device):.0f} GB/s (read + written)"
    keep = Rows(paths[0], gpu, how)
    for name in args.models:
        label = name + ("" if shard is None else f" tp{shard.world}") + (W4_LABEL if args.weights == "w4-rtn" else "")
        if args.caches:
            model = build(name, args.device, dtype, shard)
            if args.weights == "w4-rtn":
                quantize_rtn(model, group_for(model))
            runner = Kvzoo(model)
            del model
            modes = ([True] if args.graph_only else [False, True]) if args.compile else [False]
            cells(runner, args, label, args.caches, modes, keep)
            del runner
            free_memory()
        if args.hf:
            runner = HuggingFace(build_hf(name))
            cells(runner, args, name, args.hf, [False], keep)
            del runner
            free_memory()
    write(args, paths, fastest(keep.rows), gpu, torch.__version__, how)


def fastest(rows: list[dict]) -> list[dict]:
    """One row per timed cell (--repeats): the run with the lowest mean latency, in the grid's order."""
    best: dict = {}
    for r in rows:
        timed = "decode_ms" in r and "max_batch" not in r
        key = tuple(r.get(k) for k in ("model", "impl", "cache", "step", "context", "batch")) if timed else id(r)
        if key not in best or r["decode_ms"] < best[key]["decode_ms"]:
            best[key] = r
    return list(best.values())


class Rows:
    """The rows of a run, each written into OUT.json as soon as it is measured ("partial": true until the run
    ends), so that a run cut short (a time limit, a crash) leaves what it measured for --merge."""

    def __init__(self, path: Path, gpu: str, how: str):
        self.path, self.gpu, self.how, self.rows = path, gpu, how, []

    def __call__(self, row: dict) -> None:
        self.rows.append(row)
        if tp.rank():
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"gpu": self.gpu, "torch": torch.__version__, "how": self.how,
                                         "partial": True, "rows": self.rows}, indent=1))


def write(args, paths: list[Path], rows: list[dict], gpu: str, torch_version: str, how: str) -> None:
    """The table (OUT.md, printed), the rows (OUT.json) and with --plot the throughput plot (OUT.png)."""
    lines = [f"device: {gpu}; {how}; torch {torch_version}", "",
             "| model | cache | step | context | batch | filled by | prefill (s) | decode (ms/token) | tokens/s | "
             "vs fp16 | read (GB/s) | peak (GiB) | KV (GiB) | KV ratio |", "|" + "---|" * 14]

    def cell(r):        # vs fp16: fp16's row of the same cell; a largest-batch row fp16's at its own largest batch
        return r["model"], r.get("step"), r["context"], "largest" if "max_batch" in r else r["batch"]

    fp16 = {cell(r): r["tokens_per_s"] for r in rows if r.get("cache") == "fp16" and "tokens_per_s" in r}
    for r in rows:
        if "max_context" in r:
            continue
        head = f"| {r['model']} | `{r['cache']}` | {r.get('step', '')} | {r['context']} | {r['batch']}"
        if r.get("oom"):
            lines.append(head + " | | OOM |  |  |  |  |  |  |  |")
            continue
        prefill_s = "" if r["prefill_s"] is None else f"{r['prefill_s']:.2f}"
        largest = " (the search's cap)" if r.get("batch_cap") == r.get("max_batch") else " (largest)"
        lines.append(head + f"{largest if 'max_batch' in r else ''} | {r['filled']} | {prefill_s} | "
                     f"{r['decode_ms']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{format(r['tokens_per_s'] / fp16[cell(r)], '.2f') + 'x' if cell(r) in fp16 else ''} | "
                     f"{format(r['read_GBps'], '.0f') if 'read_GBps' in r else ''} | "
                     f"{'' if r['peak_gib'] is None else format(r['peak_gib'], '.1f')} | "
                     f"{r['kv_bytes'] / 2 ** 30:.2f} | {r['kv_ratio']:.3f} |")
    if any("max_batch" in r for r in rows):
        lines += ["", "vs fp16: tokens/s against fp16's in the same cell; a largest-batch row against fp16's at its "
                  "own largest batch."]
    found = [r for r in rows if "max_context" in r]
    if found:
        lines += ["", "| model | cache | step | largest context at batch 1 |", "|---|---|---|---|"]
        lines += [f"| {r['model']} | `{r['cache'] if r['impl'] == 'kvzoo' else 'hf:' + r['cache']}` | "
                  f"{r.get('step', 'graph' if r['impl'] == 'kvzoo' else 'eager')} | {r['max_context']} |" for r in found]
    if args.targets:
        lines += ["", "read (GB/s): the weights a step reads (an untied embedding table apart) plus the KV bytes held, "
                  "over the step's time.", ""] + target_lines(rows)
    if tp.rank():
        return
    print("\n".join(lines))
    paths[1].parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps({"gpu": gpu, "torch": torch_version, "how": how, "rows": rows}, indent=1))
    paths[1].write_text("\n".join(lines) + "\n")
    if args.plot:
        plot(rows, f"decode throughput on {gpu}", paths[0].with_suffix(".png"))


def target_lines(rows: list[dict]) -> list[str]:
    """TARGETS as a table: each cache a target names (as measured in `rows`) against fp16's row of the same model,
    context, batch (the largest-batch rows: each cache at its own largest batch) and step."""
    def spec(text: str) -> str:
        return str(CacheSpec.parse(text))

    def key(r):
        return r["model"], r.get("step"), r["context"], 0 if "max_batch" in r else r["batch"]

    timed = [r for r in rows if "decode_ms" in r and r.get("impl", "kvzoo") == "kvzoo"]
    fp16 = {key(r): r for r in timed if r["cache"] == "fp16"}
    out = ["| target | model | step | cache | measured | required | met |", "|---|---|---|---|---|---|---|"]
    for what, context, batch, caches, measure, bound in TARGETS:
        named = None if caches is None else {spec(c) for c in caches}
        found = False
        w4 = measure == "w4 speedup"
        for r in timed:
            if w4 and not r["model"].endswith(W4_LABEL):
                continue
            at = (r["model"].removesuffix(W4_LABEL), *key(r)[1:]) if w4 else key(r)   # the fp16 row it is held to
            if r["context"] != context or key(r)[3] != batch or r["cache"] == "fp16" or at not in fp16:
                continue
            name = spec(r["cache"])
            if named is not None and name not in named or named is None and name.split(":")[0] in NO_TARGET_BELOW:
                continue
            base = fp16[at]
            ratio = (r["tokens_per_s"] / base["tokens_per_s"] if measure == "tokens/s"
                     else base["decode_ms"] / r["decode_ms"] if w4 else r["decode_ms"] / base["decode_ms"])
            at_least = measure != "ms/token"
            met = ratio >= bound if at_least else ratio <= bound
            out.append(f"| {what} | {r['model']} | {r.get('step')} | `{r['cache']}` | {ratio:.2f}x | "
                       f"{'>=' if at_least else '<='} {bound}x | {'yes' if met else 'NO'} |")
            found = True
        if not found:
            out.append(f"| {what} | | | | no row measures it | | |")
    return out


if __name__ == "__main__":
    main()
