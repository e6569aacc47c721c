"""AlignedKV decode attention on a CUDA GPU (alignedkv.md Figure 10): latency over context length against
fp16 SDPA and the KIVI-layout kernels, with the bytes each step reads.

    python -m repro.alignedkv.bench --out results/alignedkv/bench

One layer's decode step, batch 1, fp16, head shapes:
    Llama-2-7B     32 heads of 128 (MHA, the paper's model)
    Llama-3.1-8B   8 KV heads of 128, 32 query heads
    SmolLM2-135M   3 KV heads of 64, 9 query heads (the embedded model)
Methods (each a CUDA graph; median of --runs replays, L2 flushed before each, scripts.timing.Timer):
    fp16 SDPA           F.scaled_dot_product_attention over N fp16 keys/values (GQA)
    AlignedKV           kvzoo.kernels.alignedkv_attention.aligned_decode, what the cache runs: aligned_qk,
                        softmax, top-k O_est, aligned_pv over N/BT complete blocks, plus the new token exact
    AlignedKV 16-bit    the same code with min_bits=16 (every bit read): the paper's control group
    KIVI 4-bit          KIVI's outer layout (per-channel keys, per-token values, groups of 32) through
                        kvzoo.kernels.quant_matvec qk_outer / softmax / pv_outer; MHA only (one query per KV head)
Data: fp16 keys with per-channel scales 2^U(-2,2) and 4 outlier channels x16, values with per-token scales
2^U(-1,1), queries with per-channel scales 2^U(-2,2): the columnar keys the paper's Figure 7 shows. The bits
AlignedKV reads depend on the data; `KV bytes read` counts what its kernels fetch at this data (K: 1, 1.5 or
2 bytes per element by (block, channel) decision, plus k_exp; V: the high byte, and a token's whole middle /
low nibble row when any of its elements needs 12 / 16 bits (aligned_pv's default row_mask), plus v_exp),
against 4 bytes per token-channel for fp16 K+V. `bits per element` is what each element uses.

Writes OUT.json and OUT.md; refuses to replace them without --overwrite.
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvzoo.cache.alignedkv import exponent, key_levels, split_planes, value_levels

from scripts.timing import Timer, output_paths, require_compiled_gpu

SHAPES = {            # name: (KV heads, head_dim, query heads)
    "Llama-2-7B (MHA)": (32, 128, 32),
    "Llama-3.1-8B (GQA)": (8, 128, 32),
    "SmolLM2-135M (GQA)": (3, 64, 9),
}
BLOCK, TOPK, KIVI_BITS, KIVI_GROUP = 64, 32, 4, 32
DEVICE = "cuda"
METHODS = ("fp16 SDPA", "AlignedKV", "AlignedKV 16-bit", "KIVI 4-bit")


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m repro.alignedkv.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/alignedkv/bench", help="output path without suffix")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 131072])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
    return parser.parse_args()


def synthetic(H: int, Hq: int, N: int, d: int, gen: torch.Generator):
    """q (1, Hq, d), keys and values (1, H, N, d), fp16, with the scales the module docstring gives."""
    u = lambda *shape: torch.rand(*shape, device=DEVICE, generator=gen) * 2 - 1       # noqa: E731  U(-1, 1)
    channel = 2.0 ** (2 * u(1, H, 1, d))
    channel[..., :4] *= 16
    keys = torch.randn(1, H, N, d, device=DEVICE, generator=gen) * channel
    values = torch.randn(1, H, N, d, device=DEVICE, generator=gen) * 2.0 ** u(1, H, N, 1)
    q = torch.randn(1, Hq, d, device=DEVICE, generator=gen) * 2.0 ** (2 * u(1, Hq, d))
    return q.half(), keys.half(), values.half()


def planes(keys, values):
    """The cache's buffers for N tokens (N a multiple of BLOCK)."""
    _, H, N, d = keys.shape
    by_channel = keys.view(1, H, N // BLOCK, BLOCK, d).transpose(-1, -2)               # (1, H, NB, d, BT)
    k_hi, k_mid, k_lo = (t.contiguous() for t in split_planes(by_channel))
    k_exp = exponent(by_channel.float().abs().amax(-1)).to(torch.int8)                 # (1, H, NB, d)
    v_hi, v_mid, v_lo = split_planes(values)
    v_exp = exponent(values.float().abs().amax(-1)).to(torch.int8)                     # (1, H, N)
    return (k_hi, k_mid, k_lo, k_exp), (v_hi, v_mid, v_lo, v_exp)


def bytes_read(q, keys, values, k_exp, v_exp) -> dict:
    """What the AlignedKV kernels fetch for this data, and the mean bits per element, K and V apart."""
    from kvzoo.cache.alignedkv import estimate_output

    _, H, N, d = keys.shape
    Hq = q.shape[1]
    k_bits = key_levels(q[:, :, None], k_exp, 8)[:, :, 0].float()                      # (1, H, NB, d)
    k_bytes = (BLOCK * (1 + 0.5 * (k_bits >= 12) + 0.5 * (k_bits == 16))).sum() + k_exp.numel()
    scores = (q.float()[:, :, None] @ keys.repeat_interleave(Hq // H, dim=1).float().transpose(-1, -2))
    p = (scores * d ** -0.5).softmax(-1)                                                # (1, Hq, 1, N)
    o_est = estimate_output(p, values[:, :, None].float(), TOPK)                        # (1, Hq, 1, d)
    v_bits = value_levels(p, o_est, v_exp, 8)[:, :, 0]                                  # (1, H, N, d)
    row = v_bits.amax(-1)                                                               # (1, H, N): rows fetched whole
    v_bytes = H * N * d + d // 2 * ((row >= 12).sum() + (row == 16).sum()) + v_exp.numel()
    fp16 = 2 * keys.numel() * 2
    return {"k_bits": k_bits.mean().item(), "v_bits": v_bits.float().mean().item(),
            "kv_bytes": int(k_bytes + v_bytes), "fp16_bytes": fp16, "bytes_ratio": float((k_bytes + v_bytes) / fp16)}


def kivi_step(q, keys, values):
    """KIVI's 4-bit outer layout for MHA: (fn, bytes)."""
    from kvzoo.cache.kvquant import quantize
    from kvzoo.kernels.quant_matvec import pv_outer, qk_outer

    kq = quantize(keys, KIVI_BITS, KIVI_GROUP, axis=-2)
    vq = quantize(values, KIVI_BITS, KIVI_GROUP, axis=-1)
    scale = q.shape[-1] ** -0.5

    def fn():
        p = (qk_outer(q, kq.codes, kq.scale, kq.zero, KIVI_BITS).float() * scale).softmax(-1).half()
        return pv_outer(p, vq.codes, vq.scale, vq.zero, KIVI_BITS)

    held = sum(t.nbytes for t in (kq.codes, kq.scale, kq.zero, vq.codes, vq.scale, vq.zero))
    return fn, held


def measure(shape: str, N: int, timer: Timer, gen: torch.Generator) -> dict:
    from kvzoo.kernels.alignedkv_attention import aligned_decode

    H, d, Hq = SHAPES[shape]
    q, keys, values = synthetic(H, Hq, N, d, gen)
    (k_hi, k_mid, k_lo, k_exp), (v_hi, v_mid, v_lo, v_exp) = planes(keys, values)
    new_k, new_v = keys[:, :, -1:].clone(), values[:, :, -1:].clone()                  # the token being decoded

    def aligned(min_bits):
        return lambda: aligned_decode(q, k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp, N // BLOCK,
                                      new_k, new_v, TOPK, min_bits)

    q4 = q[:, :, None]                                                                  # (1, Hq, 1, d)
    sdpa = lambda: F.scaled_dot_product_attention(q4, keys, values, enable_gqa=Hq != H)  # noqa: E731
    want = F.scaled_dot_product_attention(q4, torch.cat([keys, new_k], 2), torch.cat([values, new_v], 2),
                                          enable_gqa=Hq != H)[:, :, 0].float()
    got = aligned(16)()
    error = ((got - want).abs().max() / want.abs().max()).item()
    if error > 1e-2:
        raise SystemExit(f"AlignedKV 16-bit differs from SDPA by {error:.2e} at {shape}, N={N}")
    row = {"shape": shape, "N": N, "check_vs_sdpa": error, **bytes_read(q, keys, values, k_exp, v_exp),
           "ms": {"fp16 SDPA": timer(sdpa), "AlignedKV": timer(aligned(8)), "AlignedKV 16-bit": timer(aligned(16))}}
    if H == Hq:
        fn, held = kivi_step(q, keys, values)
        row["ms"]["KIVI 4-bit"], row["kivi_bytes"] = timer(fn), held
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    contexts = sorted({r["N"] for r in rows})
    head = "| method | " + " | ".join(f"{n // 1024}K" for n in contexts) + " |"
    lines = [f"# AlignedKV decode attention ({meta['gpu']})", "",
             f"{meta['torch']}, triton {meta['triton']}; one layer, batch 1, fp16, BT = {BLOCK}, top-k = {TOPK}; "
             f"median ms of {meta['runs']} CUDA-graph replays, L2 flushed. Command: `{meta['command']}`"]
    for shape in SHAPES:
        mine = {r["N"]: r for r in rows if r["shape"] == shape}
        lines += ["", f"## {shape}", "", head, "|---|" + "---|" * len(contexts)]
        for m in METHODS:
            if all(m in mine[n]["ms"] for n in contexts):
                lines.append(f"| {m} | " + " | ".join(f"{mine[n]['ms'][m]:.3f}" for n in contexts) + " |")
        for label, fn in (
                ("AlignedKV speed vs SDPA", lambda r: f"{r['ms']['fp16 SDPA'] / r['ms']['AlignedKV']:.2f}x"),
                ("AlignedKV vs its 16-bit control", lambda r: f"{r['ms']['AlignedKV 16-bit'] / r['ms']['AlignedKV']:.2f}x"),
                ("KV bytes read / fp16", lambda r: f"{r['bytes_ratio']:.3f}"),
                ("bits per element K / V", lambda r: f"{r['k_bits']:.1f} / {r['v_bits']:.1f}"),
                ("AlignedKV GB/s (bytes read)", lambda r: f"{r['kv_bytes'] / r['ms']['AlignedKV'] / 1e6:.0f}"),
                ("SDPA GB/s", lambda r: f"{r['fp16_bytes'] / r['ms']['fp16 SDPA'] / 1e6:.0f}")):
            lines.append(f"| {label} | " + " | ".join(fn(mine[n]) for n in contexts) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    require_compiled_gpu("repro.alignedkv.bench", "tests/kernels/test_alignedkv_kernel.py")
    if any(n % BLOCK or n < BLOCK for n in args.contexts):
        raise SystemExit(f"--contexts must be positive multiples of the block size {BLOCK}")
    paths = output_paths(args.out, args.overwrite)
    timer = Timer(args.runs, args.warmup, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for shape, N in tqdm([(s, n) for s in SHAPES for n in args.contexts], desc="alignedkv bench"):
        rows.append(measure(shape, N, timer, gen))
        torch.cuda.empty_cache()
    import triton
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "runs": args.runs, "command": "python -m repro.alignedkv.bench " + " ".join(sys.argv[1:])}
    text = markdown(rows, meta)
    print(text)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    paths[1].write_text(text)


if __name__ == "__main__":
    main()
