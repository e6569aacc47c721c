"""The W4A16 weight-only matmul on a CUDA GPU (kvzoo/kernels/w4a16.py, KV Pareto's AWQ weights, kv-pareto.md §4.3)
against the fp16 product a w16 model runs (cuBLAS through torch) and the dequantize-then-multiply reference.

    python -m repro.kvpareto.bench --out results/kvpareto/bench_w4a16

Layers (out_features N, in_features K, group G):
    SmolLM2-135M   q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536 (G = 64, the embedded model)
    Llama-2-7B     q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008 (G = 128)
    Llama-3.1-8B   q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336 (G = 128)
Rows M = 1 (decode), 16, 256 and 4096 (prefill chunks). Each cell is the median of --runs CUDA-graph replays
with the L2 flushed first (scripts.timing.Timer): a decode step finds a layer's weights cold. The kernel
runs at its default tiles (kvzoo.kernels.w4a16.default_tiles) and at the best of a small sweep (`candidates`;
the winning tiles are printed).
"weight GB/s" is the 4-bit weight's bytes (codes, scales, zeros) over the kernel's time: at M = 1 the product
is bound by reading the weight, so that is the figure to hold against the GPU's copy bandwidth, also measured.
"read floor" is a kernel that only reads the codes (94% of those bytes at G = 128; the scales and zeros, stored
(N, K/G), are read by none of it), in the kernels' tiles (64 output features, 256 channels a step, split over K as
they are; the fastest of splits 1-16), under the same timer: no W4A16 product can be faster, so fp16 / floor bounds
what any of them can gain over fp16 (a graph replay of one launch costs a few µs whatever it reads, which weighs
on the small layers).

--step times what a decode step runs instead: the 4-bit products of STEP_BLOCKS transformer blocks (q, k, v, o, gate,
up, down; each block's weights its own, so a step finds them cold) in one CUDA graph, with q, k, v and gate, up
apart (seven products a block) and joined (four: kvzoo.weightquant.awq.W4Linear.join, what the model runs), against
the 16-bit products joined (cuBLAS), x in bf16 as the Llama-3.1-8B model runs it, and the joined products' read
floor in the same graph: each product's codes, scales and zeros as one flat buffer, read by a kernel that only
streams it (_stream_kernel, the fastest of STREAM_TILES), one launch a product as the model makes them, so that
16-bit / floor is the most any 4-bit kernel of that step can gain; µs a block:

    python -m repro.kvpareto.bench --step --models Llama-3.1-8B --rows 1 4 16 --out results/kvpareto/w4a16-step

Writes OUT.json and OUT.md; refuses to replace them without --overwrite.
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from tqdm import tqdm

from kvzoo.kernels.w4a16 import (GROUP_ROWS, Tiles, in_panels, panel_offsets, quantize_weight, w4a16_matmul,
                                 w4a16_matmul_ref)

from scripts.timing import Timer, output_paths, require_compiled_gpu

# a block's products: (group, hidden, q outputs, k/v outputs, MLP width)
BLOCKS = {"SmolLM2-135M": (64, 576, 576, 192, 1536), "Llama-2-7B": (128, 4096, 4096, 4096, 11008),
          "Llama-3.1-8B": (128, 4096, 4096, 1024, 14336)}
STEP_BLOCKS = 8                  # --step's blocks in one graph
STREAM_TILES = [(words, warps) for words in (1024, 2048, 4096, 8192) for warps in (4, 8)]   # _stream_kernel's


def block_products(model: str) -> list[tuple[str, int, int]]:
    """A block's seven products (name, N, K), in the order the block runs them."""
    _, hidden, q_out, kv_out, inter = BLOCKS[model]
    return [("q", q_out, hidden), ("k", kv_out, hidden), ("v", kv_out, hidden), ("o", hidden, q_out),
            ("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)]


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    """A block's distinct product shapes, named by the products that share one (e.g. q/o 4096x4096)."""
    names: dict[tuple[int, int], list[str]] = {}
    for name, N, K in block_products(model):
        names.setdefault((N, K), []).append(name)
    return [("/".join(n), N, K) for (N, K), n in names.items()]


def candidates(M: int) -> list[Tiles]:
    """The sweep: one-row kernel tiles at one row (split-K by the default rule), group-kernel tiles up to
    GROUP_ROWS rows (split-K by 1 to 16), general-kernel tl.dot tiles (BLOCK_M by M) above."""
    one_row = [Tiles(block_n=n, block_k=k, num_warps=w, num_stages=1, gemv=True) for n in (16, 32, 64)
               for k in (256, 512) for w in (1, 2, 4)] if M == 1 else []
    if M <= GROUP_ROWS:
        return one_row + [Tiles(block_n=n, block_k=0, split_k=k, num_stages=s) for n in (32, 64)
                          for k in (1, 2, 4, 8, 16) for s in (3, 4)]
    sizes = [64, 128]
    return [Tiles(block_m=m, block_n=n, block_k=k, num_stages=s) for m in sizes for n in (64, 128)
            for k in (64, 128) for s in (3, 4)]


@triton.jit
def _read_kernel(codes_ptr, out_ptr, N, STEPS, STEPS_PER_SPLIT, KW: tl.constexpr, PANELS: tl.constexpr):
    """XOR of a 64-feature tile's code words (KW a step, where they are stored: panel_offsets) over this split's
    steps, and nothing else."""
    rows = tl.program_id(0) * 64 + tl.arange(0, 64)
    live = rows < N
    w = tl.arange(0, KW)
    acc = tl.zeros((64, KW), dtype=tl.int32)
    t0 = tl.program_id(1) * STEPS_PER_SPLIT
    for t in range(t0, tl.minimum(t0 + STEPS_PER_SPLIT, STEPS)):
        at = panel_offsets(rows[:, None].to(tl.int64), t * KW + w[None, :], N, STEPS * KW, PANELS)
        acc ^= tl.load(codes_ptr + at, mask=live[:, None], other=0)
    tl.store(out_ptr + tl.program_id(1) * N + rows, tl.xor_sum(acc, 1), mask=live)


def read_floor(w4, timer: Timer) -> float:
    """ms of the fastest split (1-16) of _read_kernel over w4's codes, in steps of 256 channels (128 bytes of a
    feature) or one group if larger."""
    N, K = w4.shape
    channels = max(256, w4.group_size) if K % max(256, w4.group_size) == 0 else w4.group_size
    steps = K // channels
    out = torch.empty(16, N, dtype=torch.int32, device="cuda")
    times = []
    for split in (1, 2, 4, 8, 16):
        per = triton.cdiv(steps, split)
        if split > 1 and per * (split - 1) >= steps:
            continue
        for warps, stages in ((4, 1), (4, 3)):
            times.append(timer(lambda per=per, split=split, warps=warps, stages=stages: _read_kernel[
                (triton.cdiv(N, 64), split)](w4.codes, out, N, steps, per, KW=channels // 8, PANELS=in_panels(K),
                                             num_warps=warps, num_stages=stages)))
    return min(times)


@triton.jit
def _stream_kernel(words_ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """XOR of a program's BLOCK consecutive int32 words of a flat buffer, and nothing else: a plain stream read."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(tl.load(words_ptr + at, mask=at < n_words, other=0), 0))


def flat_words(w4) -> torch.Tensor:
    """w4's codes, scales and zeros, byte for byte, in one flat int32 buffer (a group's fp16 scale and zero are one
    word)."""
    return torch.cat([t.contiguous().view(torch.uint8).flatten() for t in (w4.codes, w4.scale, w4.zero)]).view(
        torch.int32)


def stream(words: torch.Tensor, out: torch.Tensor, block: int, warps: int) -> None:
    """One _stream_kernel launch over words; out holds a word per program."""
    _stream_kernel[(triton.cdiv(words.numel(), block),)](words, out, words.numel(), BLOCK=block, num_warps=warps)


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m repro.kvpareto.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/kvpareto/bench_w4a16", help="output path without suffix")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096], help="rows M of x")
    parser.add_argument("--models", nargs="+", default=list(BLOCKS), choices=list(BLOCKS), help="layer sets")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
    parser.add_argument("--step", action="store_true",
                        help=f"time a decode step's 4-bit products: {STEP_BLOCKS} blocks in one CUDA graph, their "
                             "projections apart and joined, against 16-bit weights")
    args = parser.parse_args()
    if min(args.rows) < 1 or args.runs < 1 or args.warmup < 0:
        raise SystemExit("--rows and --runs must be >= 1 and --warmup >= 0")
    return args


def copy_bandwidth(timer: Timer) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write bytes)."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def step_rows(args, timer: Timer) -> tuple[list[dict], list[str]]:
    """--step: µs a block of STEP_BLOCKS blocks' products in one CUDA graph, 4-bit apart and joined, 16-bit
    joined; rows and table lines."""
    rows = []
    for model in args.models:
        group, hidden, q_out, _, inter = BLOCKS[model]
        g = torch.Generator(device="cuda").manual_seed(hidden + inter)
        shapes = [(N, K) for _, N, K in block_products(model)]
        joins = [(0, 1, 2), (3,), (4, 5), (6,)]                                     # q/k/v, o, gate/up, down
        blocks16 = [[torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) / K ** 0.5
                     for N, K in shapes] for _ in range(STEP_BLOCKS)]
        apart = [[quantize_weight(w, group) for w in block] for block in blocks16]
        joined = [[quantize_weight(torch.cat([block[i] for i in part]), group) for part in joins]
                  for block in blocks16]
        joined16 = [[torch.cat([block[i] for i in part]) for part in joins] for block in blocks16]
        bytes4 = sum(w.nbytes() for w in joined[0])
        flat = [flat_words(w) for block in joined for w in block]                 # the step's launches, in order
        programs = max(f.numel() for f in flat) // min(words for words, _ in STREAM_TILES) + 1
        out = torch.empty(programs, dtype=torch.int32, device="cuda")                 # a word a program
        floor_us = min(timer(lambda b=block, w=warps, flat=flat: [stream(f, out, b, w) for f in flat])
                       for block, warps in STREAM_TILES) * 1e3 / STEP_BLOCKS
        for M in tqdm(args.rows, desc=f"{model} rows"):
            x = {K: torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16) for K in (hidden, q_out, inter)}

            def run(blocks, product):
                return lambda: [product(x[w.shape[1]], w) for block in blocks for w in block]

            ms = {"w4_apart": timer(run(apart, w4a16_matmul)), "w4_joined": timer(run(joined, w4a16_matmul)),
                  "w16_joined": timer(run(joined16, torch.nn.functional.linear))}
            us = {k: v * 1e3 / STEP_BLOCKS for k, v in ms.items()}
            rows.append({"model": model, "M": M, "group": group, **{f"{k}_us_per_block": v for k, v in us.items()},
                         "joined_vs_w16": us["w16_joined"] / us["w4_joined"],
                         "w4_joined_gbs": bytes4 / us["w4_joined"] / 1e3, "w4_read_floor_us_per_block": floor_us,
                         "floor_vs_w16": us["w16_joined"] / floor_us, "floor_gbs": bytes4 / floor_us / 1e3})
        del blocks16, apart, joined, joined16, flat
    lines = [f"GPU: {torch.cuda.get_device_name()}; {STEP_BLOCKS} blocks' products in one CUDA graph, bf16 x, median "
             f"of {args.runs} replays, L2 flushed; µs a block", "",
             "| model | M | 4-bit, seven products | 4-bit, joined | 16-bit, joined | 4-bit joined vs 16-bit | "
             "4-bit joined GB/s | 4-bit read floor, joined (GB/s) | floor vs 16-bit |", "|" + "---|" * 9]
    lines += [f"| {r['model']} | {r['M']} | {r['w4_apart_us_per_block']:.1f} | {r['w4_joined_us_per_block']:.1f} | "
              f"{r['w16_joined_us_per_block']:.1f} | {r['joined_vs_w16']:.2f}x | {r['w4_joined_gbs']:.0f} | "
              f"{r['w4_read_floor_us_per_block']:.1f} ({r['floor_gbs']:.0f}) | {r['floor_vs_w16']:.2f}x |"
              for r in rows]
    return rows, lines


def main() -> None:
    args = parse_args()
    require_compiled_gpu("repro.kvpareto.bench", "TRITON_INTERPRET=1 pytest tests/kernels/test_w4a16.py")
    paths = output_paths(args.out, args.overwrite)
    timer = Timer(args.runs, args.warmup)
    copy_gbs = copy_bandwidth(timer)
    if args.step:
        rows, lines = step_rows(args, timer)
        write(paths, lines, {"gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "runs": args.runs,
                             "blocks": STEP_BLOCKS, "rows": rows})
        return
    cells = [(model, BLOCKS[model][0], name, N, K, M) for model in BLOCKS if model in args.models
             for name, N, K in layer_shapes(model) for M in args.rows]
    rows = []
    for model, group, name, N, K, M in tqdm(cells, desc="layers x rows"):
        g = torch.Generator(device="cuda").manual_seed(N + K + M)
        w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.float16) / K ** 0.5
        x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.float16)
        w4 = quantize_weight(w, group)
        err = (w4a16_matmul(x, w4).float() - w4a16_matmul_ref(x, w4).float()).abs().max().item()
        fp16 = timer(lambda: x @ w.T)
        ref = timer(lambda: w4a16_matmul_ref(x, w4))
        default = timer(lambda: w4a16_matmul(x, w4))
        floor = read_floor(w4, timer)
        tuned = {t: timer(lambda t=t: w4a16_matmul(x, w4, t)) for t in candidates(M)}
        best_tiles = min(tuned, key=tuned.get)
        best = min(default, tuned[best_tiles])
        rows.append({"model": model, "layer": name, "N": N, "K": K, "M": M, "group": group,
                     "fp16_ms": fp16, "reference_ms": ref, "w4a16_default_ms": default, "w4a16_best_ms": best,
                     "best_tiles": str(best_tiles) if tuned[best_tiles] < default else "default",
                     "speedup_vs_fp16": fp16 / best, "weight_gbs": w4.nbytes() / best / 1e6,
                     "read_floor_ms": floor, "floor_vs_fp16": fp16 / floor, "share_of_floor": floor / best,
                     "max_abs_diff_vs_reference": err})
    header = ("| model | layer | M | fp16 (μs) | dequant+matmul (μs) | w4a16 default (μs) | w4a16 best (μs) | "
              "vs fp16 | weight GB/s | read floor (μs) | floor vs fp16 | best tiles |")
    lines = [f"GPU: {torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s; median of {args.runs} "
             f"CUDA-graph replays, L2 flushed", "", header, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['model']} | {r['layer']} {r['N']}x{r['K']} | {r['M']} | {r['fp16_ms'] * 1e3:.1f} | "
                     f"{r['reference_ms'] * 1e3:.1f} | {r['w4a16_default_ms'] * 1e3:.1f} | "
                     f"{r['w4a16_best_ms'] * 1e3:.1f} | {r['speedup_vs_fp16']:.2f}x | {r['weight_gbs']:.0f} | "
                     f"{r['read_floor_ms'] * 1e3:.1f} | {r['floor_vs_fp16']:.2f}x | {r['best_tiles']} |")
    write(paths, lines, {"gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "runs": args.runs, "rows": rows})


def write(paths, lines: list[str], payload: dict) -> None:
    """Print the table and write OUT.json (payload) and OUT.md (the table)."""
    print("\n".join(lines))
    paths[1].parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps(payload, indent=2))
    paths[1].write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
