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

Writes OUT.json and OUT.md; refuses to replace them without --overwrite.
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from tqdm import tqdm

from kvzoo.kernels.w4a16 import GROUP_ROWS, Tiles, quantize_weight, w4a16_matmul, w4a16_matmul_ref

from scripts.timing import Timer, output_paths, require_compiled_gpu

LAYERS = {            # model: (group, [(name, N, K)])
    "SmolLM2-135M": (64, [("q/o", 576, 576), ("k/v", 192, 576), ("gate/up", 1536, 576), ("down", 576, 1536)]),
    "Llama-2-7B": (128, [("q/k/v/o", 4096, 4096), ("gate/up", 11008, 4096), ("down", 4096, 11008)]),
    "Llama-3.1-8B": (128, [("q/o", 4096, 4096), ("k/v", 1024, 4096), ("gate/up", 14336, 4096),
                           ("down", 4096, 14336)]),
}


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
def _read_kernel(codes_ptr, out_ptr, N, STEPS, STEPS_PER_SPLIT, KW: tl.constexpr):
    """XOR of a 64-feature tile's code words (KW a step) over this split's steps, and nothing else."""
    rows = tl.program_id(0) * 64 + tl.arange(0, 64)
    live = rows < N
    w = tl.arange(0, KW)
    acc = tl.zeros((64, KW), dtype=tl.int32)
    t0 = tl.program_id(1) * STEPS_PER_SPLIT
    for t in range(t0, tl.minimum(t0 + STEPS_PER_SPLIT, STEPS)):
        acc ^= tl.load(codes_ptr + rows[:, None].to(tl.int64) * (STEPS * KW) + t * KW + w[None, :],
                       mask=live[:, None], other=0)
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
                (triton.cdiv(N, 64), split)](w4.codes, out, N, steps, per, KW=channels // 8, num_warps=warps,
                                             num_stages=stages)))
    return min(times)


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m repro.kvpareto.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/kvpareto/bench_w4a16", help="output path without suffix")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 4096], help="rows M of x")
    parser.add_argument("--models", nargs="+", default=list(LAYERS), choices=list(LAYERS), help="layer sets")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
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


def main() -> None:
    args = parse_args()
    require_compiled_gpu("repro.kvpareto.bench", "TRITON_INTERPRET=1 pytest tests/kernels/test_w4a16.py")
    paths = output_paths(args.out, args.overwrite)
    timer = Timer(args.runs, args.warmup)
    copy_gbs = copy_bandwidth(timer)
    cells = [(model, group, name, N, K, M) for model, (group, layers) in LAYERS.items() if model in args.models
             for name, N, K in layers for M in args.rows]
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
    print("\n".join(lines))
    paths[1].parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "runs": args.runs,
                                    "rows": rows}, indent=2))
    paths[1].write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
