"""XQuant's decode step on a CUDA GPU (xquant.md §3.4): attention with K/V rematerialized from the cached
quantized X (MHA) or latents X·U (GQA), against the fp16 KV cache and KIVI* at the same bits, over context
length, with the paper's roofline estimate beside each measurement.

    python -m repro.xquant.bench --out results/xquant/bench          # N = 1K ... 128K
    python -m repro.xquant.bench --out results/xquant/bench-quick --quick

One layer, batch 1, one decode query per query head, fp16; random weights and codes (latency does not
depend on the values). Head shapes:
    Llama-2-7B    MHA, d = 4096, 32 heads of 128: XQuant caches X (N, d) per-token quantized and
                  rematerializes [K | V] = X̂ [W_k | W_v] in one kernel call (n_out = 2d)
    Llama-3.1-8B  GQA, d = 4096, 8 KV heads of 128 (r = 1024): caches X·U_k (per-channel) and X·U_v
                  (per-token) and rematerializes K = (X·U_k)^ Σ_k B_kᵀ, V = (X·U_v)^ Σ_v B_vᵀ (r x r each)
    SmolLM2-135M  GQA, d = 576, 3 KV heads of 64 (r = 192), the embedded model
Methods (every one ends in F.scaled_dot_product_attention over fp16 K/V; RoPE on the keys at their positions):
    fp16 KV       SDPA over the stored K, V
    XQuant        kvzoo.kernels.xquant_remat.dequant_matmul (dequantize + project, fused) + RoPE + SDPA
    cuBLAS bound  the projections alone as fp16 cuBLAS matmuls on already-dequantized X (no attention): what
                  rematerialization would cost if dequantizing were free
    KIVI*         pre-RoPE keys per-channel, values per-token at the same bits, dequantized by
                  kvzoo.cache.kvquant.dequantize (torch) + RoPE + SDPA: the strategy as kvzoo runs it
Roofline (§3.4, eq. 3-4): FLOPs = 2*N*r_in*n_out per projection, bytes = codes + scales + zeros + weights;
the estimate is max(FLOPs / matrix rate, bytes / copy bandwidth) with both ceilings measured in this run
(a bf16 8192^3 matmul; a 1 GiB device copy, bytes read + written), plus the SDPA time over the result. The
paper's l* (the longest context rematerialized before compute binds, weights overlapped) is printed too.
Each latency: median of --runs CUDA-graph replays after --warmup, L2 flushed before each.

Writes OUT.json and OUT.md; refuses to replace them without --overwrite.
"""

import argparse
import json

import torch
import torch.nn.functional as F
from tqdm import tqdm

from scripts.timing import Timer, output_paths, require_compiled_gpu

SHAPES = {            # name: (hidden d, KV heads, head_dim, query heads)
    "Llama-2-7B (MHA)": (4096, 32, 128, 32),
    "Llama-3.1-8B (GQA)": (4096, 8, 128, 32),
    "SmolLM2-135M (GQA)": (576, 3, 64, 9),
}
FULL_N = [1024 * 2 ** i for i in range(8)]       # 1K ... 128K
QUICK_N = [4096, 32768, 131072]
GROUP = 128           # the paper's quantization group (§4: 128 for every method); per-token groups of a
                      # width that 128 does not divide (SmolLM2's r = 192) use one head (64) instead
DEVICE = "cuda"


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m repro.xquant.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/xquant/bench", help="output path without suffix")
    parser.add_argument("--quick", action="store_true", help=f"N in {QUICK_N}")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 4], help="code widths (2, 4 or 8)")
    parser.add_argument("--runs", type=int, default=100, help="timed replays per latency (median; >= 100)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
    args = parser.parse_args()
    if args.runs < 100:
        parser.error("--runs must be at least 100")
    bad = [b for b in args.bits if b not in (2, 4, 8)]
    if bad:
        parser.error(f"--bits {bad}: the rematerialization kernel takes 2, 4 or 8")
    return args


def rope(x, cos, sin):
    """Rotate-half RoPE of x (1, H, N, hd) with cos/sin (N, hd)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_tables(n: int, hd: int):
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=DEVICE).float() / hd))
    angles = torch.outer(torch.arange(n, device=DEVICE).float(), inv)          # (N, hd/2)
    angles = torch.cat([angles, angles], dim=-1)                                # (N, hd)
    return angles.cos().half(), angles.sin().half()


def qbytes(q) -> int:
    return q.nbytes()


def measure(shape: str, n: int, bits: int, timer: Timer, ceilings: dict) -> list[dict]:
    from kvzoo.cache.kvquant import dequantize, quantize
    from kvzoo.kernels.xquant_remat import dequant_matmul

    d, h, hd, hq = SHAPES[shape]
    r = h * hd
    mha = r == d
    group = GROUP if r % GROUP == 0 else hd
    g = torch.Generator(device=DEVICE).manual_seed(n + bits)
    q = torch.randn(1, hq, 1, hd, device=DEVICE, generator=g).half()
    cos, sin = rope_tables(n, hd)
    rows = []

    def record(method, fn, read, flops=0):
        ms = timer(fn)
        est = max(flops / ceilings["flops"], read / ceilings["bytes_per_s"]) * 1e3 if flops else None
        rows.append({"shape": shape, "N": n, "bits": bits, "method": method, "ms": ms, "bytes": read,
                     "flops": flops, "roofline_ms": est})

    def heads(x):                                                              # (N, r) -> (1, H, N, hd)
        return x.view(n, h, hd).transpose(0, 1).unsqueeze(0)

    def attend(k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=hq != h)

    k16 = torch.randn(1, h, n, hd, device=DEVICE, generator=g).half()
    v16 = torch.randn_like(k16)
    record("fp16 KV", lambda: attend(k16, v16), 2 * k16.nbytes)
    sdpa_ms = rows[-1]["ms"]

    # XQuant: quantized X (MHA) or latents (GQA), rematerialized by the fused kernel
    x = torch.randn(n, d, device=DEVICE, generator=g)
    if mha:
        xq = quantize(x, bits, GROUP, axis=-1)                                 # per-token X (N, d)
        w_kv = (torch.randn(d, 2 * d, device=DEVICE, generator=g) / d ** 0.5).half()   # [W_k | W_v]

        def xquant():
            kv = dequant_matmul(xq, w_kv)                                      # (N, 2d)
            return attend(rope(heads(kv[:, :d]), cos, sin), heads(kv[:, d:]))
        read = qbytes(xq) + w_kv.nbytes
        flops = 2 * n * d * 2 * d
        x16 = x.half()

        def bound():
            return x16 @ w_kv
    else:
        lk = quantize(torch.randn(n, r, device=DEVICE, generator=g), bits, GROUP, axis=-2)   # X·U_k per-channel
        lv = quantize(torch.randn(n, r, device=DEVICE, generator=g), bits, group, axis=-1)   # X·U_v per-token
        m_k, m_v = (torch.randn(2, r, r, device=DEVICE, generator=g) / r ** 0.5).half()     # fused Σ Bᵀ

        def xquant():
            return attend(rope(heads(dequant_matmul(lk, m_k)), cos, sin), heads(dequant_matmul(lv, m_v)))
        read = qbytes(lk) + qbytes(lv) + m_k.nbytes + m_v.nbytes
        flops = 2 * 2 * n * r * r
        x16 = torch.randn(n, r, device=DEVICE, generator=g).half()

        def bound():
            return x16 @ m_k, x16 @ m_v
    del x
    record("XQuant", xquant, read, flops)
    rows[-1]["roofline_ms"] += sdpa_ms                                          # + attention over the result
    record("cuBLAS bound", bound, x16.nbytes, flops)
    del x16

    # KIVI*: pre-RoPE keys per-channel, values per-token, same bits and group
    kq = quantize(k16.float(), bits, GROUP, axis=-2)
    vq = quantize(v16.float(), bits, group if hd % group == 0 else hd, axis=-1)

    def kivi_star():
        return attend(rope(dequantize(kq, torch.float16), cos, sin), dequantize(vq, torch.float16))
    record("KIVI* (torch dequantize)", kivi_star, qbytes(kq) + qbytes(vq))
    return rows


def ceilings(timer: Timer) -> dict:
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    ms = timer(lambda: a @ a)
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    return {"flops": 2 * 8192 ** 3 / (ms / 1e3), "bytes_per_s": 2 * src.numel() / (copy_ms / 1e3)}


def paper_lstar(d: int, g: int, bits: int, ridge: float) -> float:
    """The paper's longest rematerialized context before compute binds (eq. 3 for MHA, eq. 4 for GQA)."""
    if g == 1:          # P = 4 l d^2 / (e/8 l d + 24 d^2)  ->  l = 24 P d^2 / (4 d^2 - P e/8 d)
        denom = 4 * d * d - ridge * bits / 8 * d
        return float("inf") if denom <= 0 else 24 * ridge * d * d / denom
    r = d / g           # P = 4 l r^2 / (e/8 l r + 26 d^2 + 4 r^2)
    denom = 4 * r * r - ridge * bits / 8 * r
    return float("inf") if denom <= 0 else ridge * (26 * d * d + 4 * r * r) / denom


def markdown(rows: list[dict], meta: dict) -> str:
    ns = sorted({r["N"] for r in rows})
    by = {(r["shape"], r["N"], r["bits"], r["method"]): r for r in rows}
    out = [f"# XQuant decode step ({meta['gpu']})", "",
           f"torch {meta['torch']}, triton {meta['triton']}; one layer, batch 1, fp16, groups of {GROUP}; median of "
           f"{meta['runs']} CUDA-graph replays, L2 flushed. Measured ceilings: {meta['tflops']:.0f} TFLOP/s (bf16 "
           f"matmul), {meta['copy_GBps']:.0f} GB/s (device copy, read + written); ridge point "
           f"{meta['ridge']:.0f} FLOP/byte. Cells: latency in ms; XQuant's roofline estimate in brackets.", ""]
    for bits in meta["bits"]:
        out += [f"## {bits}-bit", "", "| shape | method | " + " | ".join(f"{n // 1024}K" for n in ns) + " |",
                "|---|---|" + "---|" * len(ns)]
        for shape in SHAPES:
            for method in ("fp16 KV", "XQuant", "cuBLAS bound", "KIVI* (torch dequantize)"):
                cells = []
                for n in ns:
                    row = by[shape, n, bits, method]
                    est = f" [{row['roofline_ms']:.3f}]" if row["roofline_ms"] is not None else ""
                    cells.append(f"{row['ms']:.3f}{est}")
                out.append(f"| {shape} | {method} | " + " | ".join(cells) + " |")
            speed = [by[shape, n, bits, "fp16 KV"]["ms"] / by[shape, n, bits, "XQuant"]["ms"] for n in ns]
            out.append(f"| {shape} | XQuant speed vs fp16 | " + " | ".join(f"{s:.2f}x" for s in speed) + " |")
        out.append("")
        out.append(f"Paper's l* at {bits} bits with this GPU's ridge point: " + ", ".join(
            f"{shape}: {meta['lstar'][str(bits)][shape]:,.0f}" for shape in SHAPES) + "")
        out.append("")
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    require_compiled_gpu("repro.xquant.bench", "tests/kernels/test_xquant_remat.py")
    import triton

    from kvzoo.cache.kvquant import quantize
    from kvzoo.kernels.xquant_remat import dequant_matmul, dequant_matmul_ref

    paths = output_paths(args.out, args.overwrite)
    for bits in args.bits:                         # the kernel against its reference before any timing
        for axis in (-1, -2):
            qx = quantize(torch.randn(2, 256, 192, device=DEVICE), bits, 64, axis=axis)
            w = torch.randn(192, 320, device=DEVICE).half() / 14
            got, want = dequant_matmul(qx, w).float(), dequant_matmul_ref(qx, w).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            if err > 5e-3:
                raise SystemExit(f"rematerialization kernel differs from its reference ({bits}-bit, axis {axis}): "
                                 f"max relative error {err:.2e}")
    timer = Timer(args.runs, args.warmup)
    ceil = ceilings(timer)
    ridge = ceil["flops"] / ceil["bytes_per_s"]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "runs": args.runs, "warmup": args.warmup, "bits": args.bits, "group": GROUP,
            "tflops": ceil["flops"] / 1e12, "copy_GBps": ceil["bytes_per_s"] / 1e9, "ridge": ridge,
            "lstar": {str(b): {s: paper_lstar(d, hq // h, b, ridge) for s, (d, h, hd, hq) in SHAPES.items()}
                      for b in args.bits}}
    rows = []
    tasks = [(s, n, b) for b in args.bits for s in SHAPES for n in (QUICK_N if args.quick else FULL_N)]
    for shape, n, bits in tqdm(tasks, desc="timing"):
        rows += measure(shape, n, bits, timer, ceil)
        torch.cuda.empty_cache()
    text = markdown(rows, meta)
    print(text)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    paths[1].write_text(text)
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
