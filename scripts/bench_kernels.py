"""Kernel latencies of InnerQ's §5.3 on a CUDA GPU: Tables 3-4 (decode vector-matrix products), Figure 4
(hybrid vs symmetric quantization) and fused 2-bit decode attention against fp16 SDPA.

    python scripts/bench_kernels.py --out results/kernels            # the full sweep, N = 512 ... 131072
    python scripts/bench_kernels.py --out results/kernels-quick --quick

Head shapes (batch 1): Llama 3.2-1B (8 KV heads of 64, 32 query heads), Llama 3.1-8B (8 KV heads of 128, 32
query heads), Llama 2-13B (40 heads of 128, MHA). For each N:
  q·Kᵀ and p·V: fp16 torch.matmul (one vector per KV head, as the paper) vs the 2-bit inner-grouped kernel
    (InnerQ layout, asymmetric groups) vs the 2-bit outer-grouped kernel (KIVI layout)
  quantize: InnerQ's 2-bit key quantizer, symmetric vs hybrid, on N fp16 keys per KV head
  attention: one decode query per query head; fp16 F.scaled_dot_product_attention (GQA) over N tokens vs the
    fused 2-bit kernels (InnerQ's inner layout and KIVI's outer one) over N - 128 quantized tokens plus a
    128-token exact window (sink 32 + recent 96), and for each the read floor: a kernel that only streams the
    fused kernel's input bytes (one contiguous buffer of the same size, 16-byte loads, XOR-reduced), the fastest
    any kernel over that cache could be on this GPU
Each latency is the median of --runs CUDA-graph replays (CUDA events) after --warmup replays, with L2 flushed
before each one (a decode step finds a layer's cache cold). Bandwidth is the bytes each method must read
(inputs, not outputs) divided by its latency. Before timing, every kernel is checked against its torch
reference on real quantized data; a mismatch stops the run.

    python scripts/bench_kernels.py --floors --out results/kernels/floors   # every fused attention vs its floor

--floors: every fused decode attention kvzoo runs in its graph step, on the Llama-3.1-8B heads at 32K and 128K
tokens, batch 1 and 32, each against the read floor of the bytes it reads (the issue's target: at least 70%):
InnerQ-2 (asymmetric and hybrid groups), KIVI-2's outer layout (SQuat's too), KIVI*'s (keys rotated in the
kernel), KV Pareto's per-token groups (8-bit, groups of 32) and int8's (groups of d), all with a 128-token exact
window, and AlignedKV's planes (aligned_decode: its two kernels and the torch softmax, top-k and estimate between
them), whose bytes are those its levels read (from random Gaussian keys and values: the bits read depend on the
data), XQuant's two (the scores over its rematerialized keys, rotated as they are read, their fp32 scores counted
with the bytes; the weighing of its 4-bit value latents by the probabilities, its rows shuffled or in order as the
graph step reads them), and fp16 SDPA for scale. On an H100 the InnerQ rows take the Gluon split kernel of
kvzoo/kernels/innerq_hopper.py and KIVI-2's the one of kvzoo/kernels/outer_hopper.py for its quantized runs; a second
row of InnerQ-2 hybrid and of KIVI-2 times the Triton kernel alone, in the same run. --cases keeps the kernels whose
name holds one of the given texts; --shapes replaces the four (batch, tokens) rows, for --stages too:

    python scripts/bench_kernels.py --floors --cases "outer" --shapes 79x32768 1x8192 --out results/kernels/x

--stages: where the 2-bit outer kernel's time goes, on the same shapes: its split kernel's loop with the
tensor-core dots and the online softmax left out (the codes of both streams unpacked and scaled as the kernel does,
summed into registers so nothing is dead), at 4 and 8 warps, against the whole kernel and the read floor.

--timeline: where each --floors kernel's graph replay goes, kernel by kernel (--cases, --shapes as for --floors):
the torch profiler over --runs replays, L2 flushed before each; per kernel launch (by name, and order among launches
of that name: two streams' launches may come in either order), its median start after the replay's first kernel
starts and its median duration, with the replay's median span (first start to last end) and its time by CUDA events
(as --floors times it), in µs:

    python scripts/bench_kernels.py --timeline --cases "KV Pareto" --shapes 1x32768 --out results/kernels/x

--profile CASE: one --floors kernel at one --shapes shape, launched twice, then once between cudaProfilerStart and
cudaProfilerStop, so that Nsight Compute profiles that launch's kernels alone (nothing is timed or written):

    ncu --profile-from-start off --set full --import-source yes -o innerq \
        python scripts/bench_kernels.py --profile "InnerQ-2 hybrid" --shapes 1x131072

Writes OUT.json and OUT.md (GPU, versions, settings, tables); refuses to replace them without --overwrite.
"""

import argparse
import json
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from tqdm import tqdm

from kvzoo.kernels import outer_attention
from timing import Timer, copy_bandwidth, output_paths, require_compiled_gpu

MODELS = {                      # name: (KV heads, head_dim, query heads)
    "Llama 3.2-1B": (8, 64, 32),
    "Llama 3.1-8B": (8, 128, 32),
    "Llama 2-13B": (40, 128, 40),
}
FULL_N = [512 * 2 ** i for i in range(9)]          # 512 ... 131072
QUICK_N = [1024, 16384, 131072]
BITS = 2
WINDOW = 128                                       # InnerQ's sink 32 + recent 96, exact
DEVICE = "cuda"

# (op, baseline method, compared method, comparison row, table title); the paper's "speedup" is the latency
# reduction 1 - t / t_baseline
TABLES = [
    ("qk", "fp16 matmul", "inner 2-bit", "reduction", "Table 3: q·Kᵀ, fp16 torch.matmul vs 2-bit inner-grouped"),
    ("qk", "outer 2-bit", "inner 2-bit", "reduction",
     "Table 4: q·Kᵀ, 2-bit outer-grouped (KIVI) vs inner-grouped (InnerQ)"),
    ("pv", "fp16 matmul", "inner 2-bit", "reduction",
     "Table 3 (values): p·V, fp16 torch.matmul vs 2-bit inner-grouped"),
    ("pv", "outer 2-bit", "inner 2-bit", "reduction", "Table 4 (values): p·V, 2-bit outer-grouped vs inner-grouped"),
    ("quantize", "sym", "hybrid", "ratio", "Figure 4: 2-bit key quantization (InnerQ layout), symmetric vs hybrid"),
    ("attention", "fp16 SDPA", "fused 2-bit", "speedup",
     f"Decode attention: fp16 SDPA (GQA) over N tokens vs fused 2-bit InnerQ kernel over N - {WINDOW} quantized "
     f"+ {WINDOW} exact tokens"),
    ("attention", "fp16 SDPA", "fused 2-bit hybrid", "speedup",
     "Decode attention with hybrid groups (InnerQ's default: random symmetric flags read from packed mask bits)"),
    ("attention", "fp16 SDPA", "read floor", "speedup",
     "Decode attention bound: fp16 SDPA vs a kernel that only reads the fused kernel's input bytes"),
    ("attention", "fp16 SDPA", "fused 2-bit outer", "speedup",
     f"Decode attention, KIVI's layout: fp16 SDPA vs the fused outer-grouped kernel over N - {WINDOW} quantized "
     f"+ {WINDOW} exact tokens"),
    ("attention", "fp16 SDPA", "read floor outer", "speedup",
     "Decode attention bound, KIVI's layout: fp16 SDPA vs a kernel that only reads the outer kernel's input bytes"),
]
COMPARISONS = {   # row label, formatter of t_baseline / t_compared
    "reduction": ("latency reduction", lambda r: f"{100 * (1 - 1 / r):.1f}%"),
    "ratio": ("latency ratio hybrid / sym", lambda r: f"{1 / r:.3f}"),
    "speedup": ("speedup (×)", lambda r: f"{r:.2f}×"),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/kernels", help="output path without suffix: OUT.json, OUT.md")
    parser.add_argument("--quick", action="store_true", help=f"N in {QUICK_N} instead of {FULL_N[0]}..{FULL_N[-1]}")
    table = parser.add_mutually_exclusive_group()
    table.add_argument("--floors", action="store_true",
                       help="every fused attention at 32K/128K, batch 1 and 32, against its read floor")
    table.add_argument("--stages", action="store_true",
                       help="the 2-bit outer kernel's unpacking alone against the whole kernel and the floor")
    table.add_argument("--timeline", action="store_true",
                       help="each --floors kernel's graph replay, kernel by kernel: median start and duration")
    table.add_argument("--profile", metavar="CASE",
                       help="one --floors kernel (its whole name) at one --shapes shape, launched once for a profiler")
    parser.add_argument("--cases", nargs="+", metavar="TEXT",
                        help="--floors, --timeline: only the kernels whose name holds one of these (e.g. outer SDPA)")
    parser.add_argument("--shapes", nargs="+", metavar="BxN", type=shape,
                        help="--floors, --stages, --timeline: batch x tokens of each table row (default "
                             f"{' '.join(f'{b}x{n}' for b, n in FLOOR_SHAPES)}; N a multiple of {SHAPE_TOKENS})")
    parser.add_argument("--runs", type=int, default=100, help="timed replays per latency (median; at least 100)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed replays first")
    parser.add_argument("--overwrite", action="store_true", help="replace existing OUT.json / OUT.md")
    args = parser.parse_args()
    if args.runs < 100:
        parser.error("--runs must be at least 100")
    if args.cases and not (args.floors or args.timeline):
        parser.error("--cases selects --floors kernels; add --floors or --timeline")
    if args.shapes and not (args.floors or args.stages or args.timeline or args.profile):
        parser.error("--shapes sets the --floors, --stages and --timeline tables' rows; add one of them")
    if args.profile is not None and args.profile not in FLOOR_CASES:
        parser.error(f"--profile {args.profile!r} is not a kernel's whole name; the kernels: {'; '.join(FLOOR_CASES)}")
    if args.profile is not None and len(args.shapes or ()) != 1:
        parser.error("--profile takes one --shapes BxN, the shape it launches")
    unmatched = [c for c in args.cases or () if not any(wanted(name, [c]) for name in FLOOR_CASES)]
    if unmatched:
        parser.error(f"--cases {unmatched} names no kernel; the kernels: {'; '.join(FLOOR_CASES)}")
    return args


@triton.jit
def _stream_read_kernel(ptr, out_ptr, n_words, BLOCK: tl.constexpr):
    """XOR of every int32 word of ptr[:n_words], read in BLOCK-word tiles by a grid-stride loop."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        acc ^= tl.load(ptr + start + offs, mask=start + offs < n_words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def read_floor(n_bytes: int):
    """A launch that reads n_bytes from device memory and nothing else: the floor of any kernel that must
    read them (one launch, like the fused kernel's split pass)."""
    words = torch.randint(-2 ** 31, 2 ** 31, (-(-n_bytes // 4),), dtype=torch.int32, device=DEVICE)
    programs = 4 * torch.cuda.get_device_properties(DEVICE).multi_processor_count
    out = torch.empty(programs, dtype=torch.int32, device=DEVICE)
    return lambda: _stream_read_kernel[(programs,)](words, out, words.numel(), BLOCK=4096, num_warps=8)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def synthetic_inner(H: int, N: int, d: int, gen: torch.Generator, B: int = 1):
    """Random codes, fp16 scales and fp32 zero points (as slots) in the inner layout, B rows: latency does not
    depend on the values, and random data spares quantizing gigabytes."""
    def codes():
        return torch.randint(-2 ** 31, 2 ** 31, (B, H, N, d * BITS // 32), dtype=torch.int32, device=DEVICE,
                             generator=gen)

    def groups(shape):
        scale = (torch.rand(shape, device=DEVICE, generator=gen) * 0.1).half()
        return scale, torch.randn(shape, device=DEVICE, generator=gen).view(torch.int32)

    return (codes(), *groups((B, H, N, d // 32))), (codes(), *groups((B, H, N // 32, d)))


def synthetic_outer(H: int, N: int, d: int, gen: torch.Generator, B: int = 1):
    """The same in KIVI's outer layout: keys per channel (groups of 32 tokens), values per token."""
    def codes():
        return torch.randint(-2 ** 31, 2 ** 31, (B, H, N, d * BITS // 32), dtype=torch.int32, device=DEVICE,
                             generator=gen)

    def groups(shape):
        return (torch.rand(shape, device=DEVICE, generator=gen) * 0.1).half(), \
            torch.randn(shape, device=DEVICE, generator=gen).half()

    return (codes(), *groups((B, H, N // 32, d))), (codes(), *groups((B, H, N, d // 32)))


def sanity_check(H: int, d: int, Hq: int) -> dict:
    """Max relative error of each kernel against its torch reference at N = 1024 (real quantized data)."""
    from kvzoo.cache.kvquant import pack_sym_mask, quantize, quantize_unified
    from kvzoo.kernels import innerq_attention as att, outer_attention as oa, quant_matvec as mv, quantize_pack as qp

    torch.manual_seed(0)
    N = 1024
    k, v = torch.randn(2, 1, H, N, d, device=DEVICE)
    q, p = torch.randn(1, H, d, device=DEVICE).half(), torch.softmax(torch.randn(1, H, N, device=DEVICE), -1).half()

    def rel(got, want):
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()

    ku, vu = quantize_unified(k, BITS, -1, "hybrid"), quantize_unified(v, BITS, -2, "hybrid")
    kin, vin = (ku.codes, ku.scale, ku.slot, ku.sym), (vu.codes, vu.scale, vu.slot, vu.sym)
    # the fused attention reads the cache's packed mask bits: along tokens for keys, along channels for values
    kat, vat = (*kin[:3], pack_sym_mask(ku.sym, -1)), (*vin[:3], pack_sym_mask(vu.sym, -2))
    ko, vo = quantize(k, BITS, 32, axis=-2), quantize(v, BITS, 32, axis=-1)
    kout, vout = (ko.codes, ko.scale, ko.zero), (vo.codes, vo.scale, vo.zero)
    win = torch.randn(2, 1, H, WINDOW, d, device=DEVICE).half()
    qa = torch.randn(1, Hq, d, device=DEVICE).half()
    outer_lengths = (N - 32, N - 64, N + 40, 0)     # keys quantized past values, as KIVI's windows leave them
    errors = {
        "qk inner": rel(mv.qk_inner(q, *kin, BITS), mv.qk_inner_ref(q, *kin, BITS)),
        "qk outer": rel(mv.qk_outer(q, *kout, BITS), mv.qk_outer_ref(q, *kout, BITS)),
        "pv inner": rel(mv.pv_inner(p, *vin, BITS), mv.pv_inner_ref(p, *vin, BITS)),
        "pv outer": rel(mv.pv_outer(p, *vout, BITS), mv.pv_outer_ref(p, *vout, BITS)),
        "attention": rel(att.innerq_decode_attention(qa, *kat, *vat, *win, BITS),
                         att.innerq_decode_attention_ref(qa, *kat, *vat, *win, BITS)),
        "attention outer": rel(oa.outer_decode_attention(qa, *kout, *vout, BITS, *win, outer_lengths),
                               oa.outer_decode_attention_ref(qa, *kout, *vout, BITS, *win, outer_lengths)),
    }
    bad = {name: err for name, err in errors.items() if err > 2e-3}
    for mode in ("sym", "hybrid"):
        got, want = qp.quantize_inner(k.half(), BITS, mode), qp.quantize_inner_ref(k.half(), BITS, mode)
        same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("codes", "scale", "slot", "sym"))
        errors[f"quantize {mode} bit-identical"] = same
        if not same:
            bad[f"quantize {mode}"] = "differs from quantize_unified"
    if bad:
        raise SystemExit(f"kernel check failed for H={H}, d={d}: {bad}")
    return errors


def measure(model: str, N: int, timer: Timer, gen: torch.Generator) -> list[dict]:
    from kvzoo.kernels import innerq_attention as att, outer_attention as oa, quant_matvec as mv, quantize_pack as qp

    H, d, Hq = MODELS[model]
    rows = []

    def record(op, method, fn, read):
        ms = timer(fn)
        rows.append({"model": model, "N": N, "op": op, "method": method, "ms": ms, "bytes": read,
                     "GBps": read / ms / 1e6})

    k16, v16 = torch.randn(2, 1, H, N, d, device=DEVICE, generator=gen).half()
    q16 = torch.randn(1, H, 1, d, device=DEVICE, generator=gen).half()
    p16 = torch.softmax(torch.randn(1, H, 1, N, device=DEVICE, generator=gen), -1).half()
    (kc, ks, kz), (vc, vs, vz) = synthetic_inner(H, N, d, gen)
    (okc, oks, okz), (ovc, ovs, ovz) = synthetic_outer(H, N, d, gen)
    q, p = q16.view(1, H, d), p16.view(1, H, N)

    kt = k16.transpose(-1, -2)
    record("qk", "fp16 matmul", lambda: torch.matmul(q16, kt), nbytes(q16, k16))
    record("qk", "inner 2-bit", lambda: mv.qk_inner(q, kc, ks, kz, None, BITS), nbytes(q, kc, ks, kz))
    record("qk", "outer 2-bit", lambda: mv.qk_outer(q, okc, oks, okz, BITS), nbytes(q, okc, oks, okz))
    record("pv", "fp16 matmul", lambda: torch.matmul(p16, v16), nbytes(p16, v16))
    record("pv", "inner 2-bit", lambda: mv.pv_inner(p, vc, vs, vz, None, BITS), nbytes(p, vc, vs, vz))
    record("pv", "outer 2-bit", lambda: mv.pv_outer(p, ovc, ovs, ovz, BITS), nbytes(p, ovc, ovs, ovz))
    for mode in ("sym", "hybrid"):
        record("quantize", mode, lambda mode=mode: qp.quantize_inner(k16, BITS, mode), nbytes(k16))

    qa = torch.randn(1, Hq, 1, d, device=DEVICE, generator=gen).half()
    record("attention", "fp16 SDPA", lambda: F.scaled_dot_product_attention(qa, k16, v16, enable_gqa=Hq != H),
           nbytes(qa, k16, v16))
    n_q = N - WINDOW
    cut = (kc[:, :, :n_q], ks[:, :, :n_q], kz[:, :, :n_q], None,
           vc[:, :, :n_q], vs[:, :, :n_q // 32], vz[:, :, :n_q // 32], None)
    k_win, v_win = k16[:, :, n_q:].contiguous(), v16[:, :, n_q:].contiguous()
    fused_bytes = nbytes(qa, *cut, k_win, v_win)
    record("attention", "fused 2-bit", lambda: att.innerq_decode_attention(qa.view(1, Hq, d), *cut, k_win, v_win, BITS),
           fused_bytes)
    masks = (torch.randint(-2 ** 31, 2 ** 31, (1, H, d // 32, n_q // 32), dtype=torch.int32, device=DEVICE,
                           generator=gen),
             torch.randint(-2 ** 31, 2 ** 31, (1, H, n_q // 32, d // 32), dtype=torch.int32, device=DEVICE,
                           generator=gen))
    hybrid = (*cut[:3], masks[0], *cut[4:7], masks[1])
    record("attention", "fused 2-bit hybrid",
           lambda: att.innerq_decode_attention(qa.view(1, Hq, d), *hybrid, k_win, v_win, BITS),
           nbytes(qa, *hybrid, k_win, v_win))
    record("attention", "read floor", read_floor(fused_bytes), fused_bytes)
    outer = (okc, oks, okz, ovc, ovs, ovz)
    lengths = torch.tensor([n_q, n_q, N, 0, 0, 0], dtype=torch.int32, device=DEVICE)     # the graph step gives six
    outer_bytes = nbytes(qa, okc[:, :, :n_q], oks[:, :, :n_q // 32], okz[:, :, :n_q // 32], ovc[:, :, :n_q],
                         ovs[:, :, :n_q], ovz[:, :, :n_q], k_win, v_win)
    record("attention", "fused 2-bit outer",
           lambda: oa.outer_decode_attention(qa.view(1, Hq, d), *outer, BITS, k_win, v_win, lengths), outer_bytes)
    record("attention", "read floor outer", read_floor(outer_bytes), outer_bytes)
    return rows


FLOOR_SHAPES = [(1, 32768), (1, 131072), (32, 32768), (32, 131072)]      # (batch, tokens)
SHAPE_TOKENS = 128                 # a shape's tokens: the window, then whole AlignedKV blocks and 32-token groups
FLOOR_TARGET = 0.70
FLOOR_CASES = ("InnerQ-2 asymmetric", "InnerQ-2 hybrid", "InnerQ-2 hybrid (Triton kernel only)",
               "KIVI-2, SQuat (outer)", "KIVI-2, SQuat (outer, Triton kernel only)",
               "KIVI*-2 (keys rotated in the kernel)", "KV Pareto k8v8 (per-token groups of 32)",
               "int8 (per-token groups of d)", "AlignedKV (planes; aligned_decode)",
               "XQuant scores (keys rotated in the kernel)", "XQuant weigh (4-bit value latents)",
               "XQuant weigh (4-bit value latents, rows in order)", "fp16 SDPA")


def shape(text: str) -> tuple[int, int]:
    """--shapes' "BxN" -> (B, N): B >= 1 rows, N > WINDOW tokens, a multiple of SHAPE_TOKENS."""
    b, _, n = text.partition("x")
    if not (b.isdigit() and n.isdigit() and int(b) >= 1 and int(n) > WINDOW and int(n) % SHAPE_TOKENS == 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not BxN with a batch B >= 1 and tokens N > {WINDOW}, a multiple "
                                         f"of {SHAPE_TOKENS} (e.g. 79x32768)")
    return int(b), int(n)


def aligned_planes(B: int, H: int, N: int, d: int, block: int, gen: torch.Generator):
    """AlignedKV's planes (kvzoo/kernels/alignedkv_attention.py layouts) of random Gaussian keys and values, one
    row at a time (a whole fp16 batch and its int32 temporaries would not fit), and those keys and values."""
    from kvzoo.cache.alignedkv import exponent, split_planes

    NB = N // block
    k_hi = torch.empty(B, H, NB, d, block, dtype=torch.uint8, device=DEVICE)
    k_mid, k_lo = (torch.empty(B, H, NB, d, block // 2, dtype=torch.uint8, device=DEVICE) for _ in range(2))
    v_hi = torch.empty(B, H, N, d, dtype=torch.uint8, device=DEVICE)
    v_mid, v_lo = (torch.empty(B, H, N, d // 2, dtype=torch.uint8, device=DEVICE) for _ in range(2))
    k_exp = torch.empty(B, H, NB, d, dtype=torch.int8, device=DEVICE)
    v_exp = torch.empty(B, H, N, dtype=torch.int8, device=DEVICE)
    for b in range(B):
        k, v = torch.randn(2, H, N, d, device=DEVICE, generator=gen).half()
        blocks = k.view(H, NB, block, d).transpose(-1, -2)                            # (H, NB, d, block)
        k_hi[b], k_mid[b], k_lo[b] = split_planes(blocks)
        v_hi[b], v_mid[b], v_lo[b] = split_planes(v)
        k_exp[b] = exponent(blocks.abs().amax(-1)).to(torch.int8)
        v_exp[b] = exponent(v.abs().amax(-1)).to(torch.int8)
    return (k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp)


def aligned_read_bytes(q: Tensor, planes, topk: int, min_bits: int, block: int) -> int:
    """Bytes AlignedKV's kernels read for q over the planes: each element's high byte, its middle nibble at 12
    bits and up, its low nibble at 16 (the levels of kvzoo.cache.alignedkv's reference, row by row), the
    exponents and q."""
    from kvzoo.cache.alignedkv import estimate_output, join_planes, key_levels, value_levels

    k_hi, k_mid, k_lo, k_exp, v_hi, v_mid, v_lo, v_exp = planes
    B, H, NB, d, _ = k_hi.shape
    bits = 0
    for b in range(B):
        qb = q[b:b + 1, :, None]                                                      # (1, Hq, 1, d)
        k = join_planes(k_hi[b], k_mid[b], k_lo[b]).transpose(-1, -2).reshape(1, H, NB * block, d)
        v = join_planes(v_hi[b], v_mid[b], v_lo[b])[None]                            # (1, H, N, d)
        G = q.shape[1] // H
        scores = torch.einsum("bhgd,bhnd->bhgn", qb.view(1, H, G, d).float(), k.float()) * d ** -0.5
        p = scores.softmax(-1).view(1, H * G, 1, -1)
        o_est = estimate_output(p, v[:, :, None], topk)
        # each level read once per block and channel for keys, per element for values
        bits += int(key_levels(qb, k_exp[b:b + 1], min_bits).sum(dtype=torch.int64)) * block
        bits += int(value_levels(p, o_est, v_exp[b:b + 1], min_bits).sum(dtype=torch.int64))
    return bits // 8 + nbytes(q, k_exp, v_exp)


def floor_cases(B: int, N: int, gen: torch.Generator):
    """(name, build) of every fused attention over B rows x N tokens of the 8B heads; build() makes the case's
    buffers and returns (launch, bytes read): one case at a time (at batch 32 and 128K some hold 17 GB). The
    outer-layout kernels (KIVI, KIVI*, KV Pareto, int8) take the token being decoded apart, as the graph step gives
    it: their last program attends it after the window."""
    from kvzoo.cache.alignedkv import AlignedKVOptions
    from kvzoo.cache.kvquant import QTensor
    from kvzoo.kernels import alignedkv_attention as al, innerq_attention as att
    from kvzoo.kernels.scores import gqa_scores
    from kvzoo.kernels.xquant_remat import weigh_gather

    H, d, Hq = MODELS["Llama 3.1-8B"]
    n_q = N - WINDOW
    q = torch.randn(B, Hq, d, device=DEVICE, generator=gen).half()
    k_win, v_win = torch.randn(2, B, H, WINDOW, d, device=DEVICE, generator=gen).half()
    tok = torch.randn(2, B, H, 1, d, device=DEVICE, generator=gen).half()   # the outer kernel's token, given apart
    # six lengths, as the graph step gives them (the windows' rows from 0): four would take a concatenation a launch
    lengths = torch.tensor([n_q, n_q, N, 0, 0, 0], dtype=torch.int32, device=DEVICE)

    def words(bits):
        return torch.randint(-2 ** 31, 2 ** 31, (B, H, n_q, d * bits // 32), dtype=torch.int32, device=DEVICE,
                             generator=gen)

    def halves(shape):
        return (torch.rand(shape, device=DEVICE, generator=gen) * 0.1).half()

    def masks(shape):
        return torch.randint(-2 ** 31, 2 ** 31, shape, dtype=torch.int32, device=DEVICE, generator=gen)

    def innerq(hybrid, hopper=True):
        k_mask, v_mask = (masks((B, H, d // 32, n_q // 32)), masks((B, H, n_q // 32, d // 32))) if hybrid else \
            (None, None)
        keys, values = synthetic_inner(H, n_q, d, gen, B)
        args = (q, *keys, k_mask, *values, v_mask, k_win, v_win, BITS)

        def launch():
            return att.innerq_decode_attention(*args)
        return launch if hopper else triton_only(att.innerq_hopper, launch), nbytes(*args[:-1])

    def outer(rotated, hopper=True):
        keys, values = synthetic_outer(H, n_q, d, gen, B)
        codes = (*keys, *values)
        tables = (torch.randn(N, d, device=DEVICE, generator=gen).half(),) * 2 if rotated else None
        read = nbytes(q, *codes, k_win, v_win, *tok) + (nbytes(tables[0]) // 2 if rotated else 0)  # cos, sin: half rows

        def launch():
            return outer_attention.outer_decode_attention(q, *codes, BITS, k_win, v_win, lengths, rope=tables,
                                                          k_token=tok[0], v_token=tok[1])
        return launch if hopper else triton_only(outer_attention.outer_hopper, launch), read

    def token(group):
        k_codes, v_codes = words(8), words(8)
        scales = [halves((B, H, n_q, d // group)) for _ in range(4)]
        codes = (k_codes, scales[0], scales[1], v_codes, scales[2], scales[3])
        return lambda: outer_attention.outer_decode_attention(q, *codes, 8, k_win, v_win, lengths, key_groups="token",
                                                              group=group, k_token=tok[0], v_token=tok[1]), \
            nbytes(q, *codes, k_win, v_win, *tok)

    def aligned():
        opts = AlignedKVOptions()
        planes = aligned_planes(B, H, N - opts.block, d, opts.block, gen)
        tail_k, tail_v = k_win[:, :, :opts.block], v_win[:, :, :opts.block]
        read = aligned_read_bytes(q, planes, opts.topk, opts.min_bits, opts.block) + nbytes(tail_k, tail_v)
        return lambda: al.aligned_decode(q, *planes, planes[0].shape[2], tail_k, tail_v, opts.topk,
                                         opts.min_bits), read

    def xquant_scores():
        """XQuant's rematerialized keys (B, N, H*d) before RoPE, rotated by the (cos, sin) tables as they are read;
        its fp32 scores (B, Hq, N) are written, and count with the bytes read."""
        keys = torch.randn(B, N, H * d, device=DEVICE, generator=gen).half()
        tables = tuple((torch.rand(B, 1, N, d, device=DEVICE, generator=gen) * 2 - 1).half() for _ in range(2))
        return lambda: gqa_scores(q, keys, d ** -0.5, tables), nbytes(q, keys, *tables) + B * Hq * N * 4

    def xquant_weigh(shuffled: bool):
        """XQuant's value latents (B, N, H*d) of 4-bit codes in per-token groups of 128 weighed by fp32
        probabilities (B, Hq, N) (weigh_gather), the rows in a shuffled order or in order (as the graph step reads
        them: value rows by slot, the key rows' order); no window rows."""
        r = H * d
        latent = QTensor(torch.randint(-2 ** 31, 2 ** 31, (B, N, r // 8), dtype=torch.int32, device=DEVICE,
                                       generator=gen), halves((B, N, r // 128)), halves((B, N, r // 128)), 4, 128,
                         -1, (B, N, r))
        p = torch.rand(B, Hq, N, device=DEVICE, generator=gen)
        src = torch.randperm(N, device=DEVICE, generator=gen) if shuffled else torch.arange(N, device=DEVICE)
        window = torch.zeros(B, 0, r, dtype=torch.float16, device=DEVICE)
        return lambda: weigh_gather(latent, window, src, p), nbytes(latent.codes, latent.scale, latent.zero, p, src)

    def sdpa():
        k16, v16 = torch.randn(2, B, H, N, d, device=DEVICE, generator=gen).half()
        return lambda: F.scaled_dot_product_attention(q[:, :, None], k16, v16, enable_gqa=True), nbytes(q, k16, v16)

    builders = (lambda: innerq(False), lambda: innerq(True), lambda: innerq(True, hopper=False), lambda: outer(False),
                lambda: outer(False, hopper=False),
                lambda: outer(True), lambda: token(32), lambda: token(d), aligned, xquant_scores,
                lambda: xquant_weigh(True), lambda: xquant_weigh(False), sdpa)
    yield from zip(FLOOR_CASES, builders)                                # in FLOOR_CASES' order


def profile_once(case: str, B: int, N: int, gen: torch.Generator, start=torch.cuda.profiler.start,
                 stop=torch.cuda.profiler.stop) -> None:
    """The floor case named `case` over B rows x N tokens, built and launched twice (compiled, caches warm), then
    launched once between start and stop, the profiler's range."""
    for name, build in floor_cases(B, N, gen):
        if name == case:
            launch, _ = build()
            launch()
            launch()
            torch.cuda.synchronize()
            start()
            launch()
            torch.cuda.synchronize()
            stop()
            print(f"profiled one launch of {name}: batch {B}, {N} tokens")
            return


def triton_only(hopper, launch):
    """launch with the Gluon kernel of module `hopper` (kvzoo/kernels/*_hopper.py; None: a Triton without Gluon)
    switched off while it runs, so the Triton kernel alone is what the timer's graph captures."""
    def run():
        enabled = hopper is not None and hopper.ENABLED
        if hopper is not None:
            hopper.ENABLED = False
        try:
            return launch()
        finally:
            if hopper is not None:
                hopper.ENABLED = enabled
    return run


def add_row(rows: list[dict], B: int, N: int, column: str, name: str, ms: float, floor: float, read: int) -> None:
    """One timed kernel (or stage) `name` against the read floor of its `read` bytes, printed as it comes."""
    rows.append({"batch": B, "N": N, column: name, "bytes": read, "ms": ms, "floor_ms": floor,
                 "GBps": read / ms / 1e6, "share": floor / ms})
    print(f"batch {B}, N {N}, {name}: {ms * 1e3:.1f} us, floor {floor * 1e3:.1f} us, {floor / ms:.0%} of the floor",
          flush=True)


def wanted(name: str, cases: list[str] | None) -> bool:
    """Whether --cases keeps kernel `name`: no --cases, or one of them in its name (case-insensitive)."""
    return not cases or any(c.lower() in name.lower() for c in cases)


def selected_cases(gen: torch.Generator, cases: list[str] | None, shapes: list[tuple[int, int]]):
    """(B, N, name, launch, read) of each --floors case --cases keeps, shape by shape; the cache's memory emptied after
    each (the caller drops its launch first)."""
    for B, N in tqdm(shapes, desc="shapes"):
        for name, build in floor_cases(B, N, gen):
            if wanted(name, cases):
                yield B, N, name, *build()
                torch.cuda.empty_cache()


def measure_floors(timer: Timer, gen: torch.Generator, cases: list[str] | None,
                   shapes: list[tuple[int, int]] = FLOOR_SHAPES) -> list[dict]:
    rows = []
    for B, N, name, launch, read in selected_cases(gen, cases, shapes):
        add_row(rows, B, N, "kernel", name, timer(launch), timer(read_floor(read)), read)
        del launch                                          # its tensors freed before the next case is built
    return rows


def replay_kernels(timer: Timer, launch) -> list[list[dict]]:
    """The kernels of timer.runs graph replays of launch, L2 flushed before each, under the torch profiler: each
    replay's trace events (name, ts and dur in µs) in order of start."""
    from torch.profiler import ProfilerActivity, profile

    graph = timer.graph(launch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(timer.runs):
            timer.flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    return split_replays(sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"]))


def split_replays(kernels: list[dict]) -> list[list[dict]]:
    """Kernel events in order of start, grouped per replay: each replay's follow a launch of the flush (the first
    event's name, at least half its duration; a short kernel of that name is the replay's own)."""
    flush, replays = kernels[0], []
    for e in kernels:
        if e["name"] == flush["name"] and e["dur"] >= flush["dur"] / 2:
            replays.append([])
        elif replays:
            replays[-1].append(e)
    return [r for r in replays if r]


def kernel_name(name: str) -> str:
    """A trace's kernel name without its return type, template arguments and parameters."""
    return name.removeprefix("void ").split("<")[0].split("(")[0]


def timeline_rows(replays: list[list[dict]]) -> tuple[list[dict], float]:
    """Per kernel launch of a replay (its name, and its order among that name's launches in the replay): the median
    start after the replay's first kernel starts and the median duration, µs, in order of start; and the replays'
    median span, first start to last end."""
    starts, durations, spans = {}, {}, []
    for kernels in replays:
        t0, seen = kernels[0]["ts"], Counter()
        for e in kernels:
            name = kernel_name(e["name"])
            key = (name, seen[name])
            seen[name] += 1
            starts.setdefault(key, []).append(e["ts"] - t0)
            durations.setdefault(key, []).append(e["dur"])
        spans.append(max(e["ts"] + e["dur"] for e in kernels) - t0)
    rows = [{"kernel": name, "launch": i, "replays": len(starts[name, i]),
             "start_us": statistics.median(starts[name, i]), "duration_us": statistics.median(durations[name, i])}
            for name, i in starts]
    return sorted(rows, key=lambda r: r["start_us"]), statistics.median(spans)


def measure_timelines(timer: Timer, gen: torch.Generator, cases: list[str] | None,
                      shapes: list[tuple[int, int]] = FLOOR_SHAPES) -> list[dict]:
    rows = []
    for B, N, name, launch, _ in selected_cases(gen, cases, shapes):
        replay_us = timer(launch) * 1e3                     # timed before its profile (see docs/decode.md)
        kernels, span = timeline_rows(replay_kernels(timer, launch))
        rows.append({"batch": B, "N": N, "case": name, "replay_us": replay_us, "span_us": span, "kernels": kernels})
        print(f"batch {B}, N {N}, {name}: replay {replay_us:.1f} us, kernels {span:.1f} us", flush=True)
        del launch
    return rows


def timelines_markdown(rows: list[dict], meta: dict) -> str:
    out = header(meta, "Where each fused attention's graph replay goes",
                 f"{WINDOW}-token exact window. Per kernel launch: median start after the replay's first kernel "
                 f"starts, median duration (torch profiler, {meta['runs']} replays); replay: CUDA events around it, as "
                 f"--floors times it") + [
           "| batch | tokens | case | replay (µs) | first start to last end (µs) | kernel | start (µs) "
           "| duration (µs) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        case = [r["batch"], r["N"], r["case"], f"{r['replay_us']:.1f}", f"{r['span_us']:.1f}"]
        for i, k in enumerate(r["kernels"]):        # the case's cells on its first kernel's row only
            cells = [*(case if i == 0 else [""] * 5), f"`{k['kernel']}`", f"{k['start_us']:.1f}",
                     f"{k['duration_us']:.1f}"]
            out.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(out) + "\n"


def header(meta: dict, title: str, setting: str) -> list[str]:
    """A table's title and the line of versions and settings above it."""
    return [f"# {title} ({meta['gpu']})", "",
            f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; Llama-3.1-8B heads; {setting}; "
            f"median of {meta['runs']} CUDA-graph replays after {meta['warmup']}, L2 flushed before each.", ""]


def floors_markdown(rows: list[dict], meta: dict) -> str:
    out = header(meta, "Fused decode attention against its read floor",
                 f"{WINDOW}-token exact window. Floor: a kernel that only reads the same number of bytes. "
                 f"Device-to-device copy of 1 GiB: {meta['copy_GBps']:.0f} GB/s (bytes read + written). Target: at "
                 f"least {FLOOR_TARGET:.0%} of the floor") + [
           "| batch | tokens | kernel | MB read | floor (µs) | kernel (µs) | GB/s | share of floor | target |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "" if r["kernel"] == "fp16 SDPA" else ("met" if r["share"] >= FLOOR_TARGET else "NO")
        out.append(f"| {r['batch']} | {r['N']} | {r['kernel']} | {r['bytes'] / 1e6:.1f} | {r['floor_ms'] * 1e3:.1f} | "
                   f"{r['ms'] * 1e3:.1f} | {r['GBps']:.0f} | {r['share']:.0%} | {met} |")
    return "\n".join(out) + "\n"


@triton.jit
def _unpack_only_kernel(kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, out_ptr, N, PER_SPLIT, D: tl.constexpr,
                        GS: tl.constexpr, ASM: tl.constexpr, CON: tl.constexpr):
    """The outer split kernel's loop over one KV head's groups [split * PER_SPLIT, + PER_SPLIT) without its dots and
    softmax: each step's keys and values unpacked and scaled by outer_attention's own helpers, summed into a
    register tile, and one sum stored a program."""
    head = tl.program_id(0).to(tl.int64)
    W: tl.constexpr = D // 16
    kc_ptr += head * N * W
    vc_ptr += head * N * W
    ks_ptr += head * (N // 32) * D
    kz_ptr += head * (N // 32) * D
    vs_ptr += head * N * (D // 32)
    vz_ptr += head * N * (D // 32)
    start = tl.program_id(1) * PER_SPLIT
    stop = tl.minimum(start + PER_SPLIT, N // 32)
    tile = tl.zeros((GS * 32, D), tl.float16)
    for t in range(start, stop, GS):
        n = t * 32 + tl.arange(0, GS * 32)
        live = n < N
        k = outer_attention._group_keys(kc_ptr, ks_ptr, kz_ptr, t, n, live, stop, D, 2, GS, True, ASM, CON, False,
                                        32, 0, 1)
        codes = outer_attention._codes(vc_ptr, n, live, D, 2, True, ASM, CON, 0, 1)
        v = outer_attention._values(codes, vs_ptr, vz_ptr, n, live, D, 32)
        tile += k + v
    tl.store(out_ptr + head * tl.num_programs(1) + tl.program_id(1), tl.sum(tile.to(tl.float32)))


def measure_stages(timer: Timer, gen: torch.Generator, shapes: list[tuple[int, int]] = FLOOR_SHAPES) -> list[dict]:
    from kvzoo.kernels.innerq_attention import _plan_splits
    from kvzoo.kernels.quant_matvec import unpack_asm

    H, d, Hq = MODELS["Llama 3.1-8B"]
    asm, con = unpack_asm(BITS)
    rows = []
    for B, N in tqdm(shapes, desc="shapes"):
        keys, values = synthetic_outer(H, N, d, gen, B)
        q = torch.randn(B, Hq, d, device=DEVICE, generator=gen).half()
        empty = torch.zeros(B, H, 0, d, device=DEVICE).half()
        lengths = torch.tensor([N, N, N, 0], dtype=torch.int32, device=DEVICE)
        args = (*keys, *values)
        read = nbytes(q, *args)
        splits, per_split, gs = _plan_splits(N // 32, B * H, torch.device(DEVICE), None,
                                             outer_attention.GROUPS_PER_STEP, outer_attention.PROGRAMS_PER_SM)
        out = torch.empty(B * H * splits, device=DEVICE)
        times = {"read floor": timer(read_floor(read)),
                 "fused kernel": timer(lambda: outer_attention.outer_decode_attention(q, *args, BITS, empty, empty,
                                                                                     lengths))}
        for warps in (4, 8):
            times[f"unpack and scale only, {warps} warps"] = timer(
                lambda warps=warps: _unpack_only_kernel[(B * H, splits)](*args, out, N, per_split, D=d, GS=gs, ASM=asm,
                                                                         CON=con, num_warps=warps,
                                                                         num_stages=outer_attention.SPLIT_STAGES))
        for name, ms in times.items():
            add_row(rows, B, N, "stage", name, ms, times["read floor"], read)
        keys = values = args = None             # the shape's tensors freed before the next shape
        torch.cuda.empty_cache()
    return rows


def stages_markdown(rows: list[dict], meta: dict) -> str:
    out = header(meta, "The 2-bit outer kernel's unpacking against the whole kernel",
                 "2-bit keys (per-channel groups of 32 tokens) and values (per-token groups of 32 channels), every "
                 "slot quantized") + ["| batch | tokens | stage | µs | share of the read floor |",
                                      "|---|---|---|---|---|"]
    out += [f"| {r['batch']} | {r['N']} | {r['stage']} | {r['ms'] * 1e3:.1f} | {r['share']:.0%} |" for r in rows]
    return "\n".join(out) + "\n"


def cell(row: dict) -> str:
    return f"{row['ms']:.4f} ({row['GBps']:.0f})"


def markdown(rows: list[dict], meta: dict) -> str:
    ns = sorted({r["N"] for r in rows})
    by = {(r["model"], r["N"], r["op"], r["method"]): r for r in rows}
    out = [f"# Kernel latencies ({meta['gpu']})", "",
           f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; batch 1, {BITS}-bit codes, "
           f"groups of 32; median of {meta['runs']} CUDA-graph replays after {meta['warmup']}, L2 flushed before "
           f"each. Cells: latency in ms (bandwidth in GB/s = bytes read / latency). Device-to-device copy of 1 GiB: "
           f"{meta['copy_GBps']:.0f} GB/s (bytes read + written).", ""]
    for op, base, new, comparison, title in TABLES:
        label, show = COMPARISONS[comparison]
        out += [f"## {title}", "", "| model | method | " + " | ".join(map(str, ns)) + " |",
                "|---|---|" + "---|" * len(ns)]
        for model in MODELS:
            if (model, ns[0], op, new) not in by:
                continue
            for method in (base, new):
                out.append(f"| {model} | {method} | " + " | ".join(cell(by[model, n, op, method]) for n in ns) + " |")
            ratios = [by[model, n, op, base]["ms"] / by[model, n, op, new]["ms"] for n in ns]
            out.append(f"| {model} | {label} | " + " | ".join(map(show, ratios)) + " |")
        out.append("")
    return "\n".join(out) + "\n"


def main() -> None:
    args = parse_args()
    require_compiled_gpu("bench_kernels.py", "tests/kernels/test_kernels.py")
    if args.profile is not None:
        profile_once(args.profile, *args.shapes[0], torch.Generator(device=DEVICE).manual_seed(0))
        return
    paths = output_paths(args.out, args.overwrite)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "bits": BITS, "window": WINDOW, "runs": args.runs, "warmup": args.warmup,
            "models": {m: {"kv_heads": h, "head_dim": d, "q_heads": hq} for m, (h, d, hq) in MODELS.items()}}
    meta["copy_GBps"] = copy_bandwidth(DEVICE, args.runs, args.warmup)
    sanity = {model: sanity_check(*MODELS[model]) for model in tqdm(MODELS, desc="checking kernels")}
    timer, gen = Timer(args.runs, args.warmup), torch.Generator(device=DEVICE).manual_seed(0)
    if args.stages:
        rows = measure_stages(timer, gen, args.shapes or FLOOR_SHAPES)
        write(paths, {**meta, "sanity_max_rel_error": sanity, "rows": rows}, stages_markdown(rows, meta))
        return
    if args.timeline:
        rows = measure_timelines(timer, gen, args.cases, args.shapes or FLOOR_SHAPES)
        write(paths, {**meta, "rows": rows}, timelines_markdown(rows, meta))
        return
    if args.floors:
        rows = measure_floors(timer, gen, args.cases, args.shapes or FLOOR_SHAPES)
        write(paths, {**meta, "sanity_max_rel_error": sanity, "target_share": FLOOR_TARGET, "rows": rows},
              floors_markdown(rows, meta))
        return
    rows = []
    tasks = [(model, n) for model in MODELS for n in (QUICK_N if args.quick else FULL_N)]
    for model, n in tqdm(tasks, desc="timing"):
        rows += measure(model, n, timer, gen)
        torch.cuda.empty_cache()
    write(paths, {**meta, "sanity_max_rel_error": sanity, "rows": rows}, markdown(rows, meta))


def write(paths, record: dict, text: str) -> None:
    print(text)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
    paths[0].write_text(json.dumps(record, indent=1) + "\n")
    paths[1].write_text(text)
    print(f"wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    main()
