"""Weight-only 4-bit matmul (W4A16) for AWQ-quantized linear layers (kv-pareto.md §4.3: AWQ, 4-bit unsigned,
asymmetric, group 128 along the input channels).

    out (..., N) = x (..., K) @ dequant(w) (N, K)ᵀ        x fp16/bf16/fp32, out in x's dtype

Layout (W4Weight, built by kvzoo.cache.kvquant.quantize(w, 4, G, axis=-1) on the (out_features, in_features)
weight): groups of G consecutive input channels of one output row share an fp16 scale and zero,
    codes  int32 (N, K/8)    code k of row n sits at bits (k*4) % 32 of word k // 8 (one bit stream along K)
    scale  fp16  (N, K/G)    w'[n, k] = code * scale[n, k // G] + zero[n, k // G]
    zero   fp16  (N, K/G)
so a weight costs 0.5 + 4/G bytes (0.53125 at G = 128). G must be a multiple of 8, so that a word of codes
never straddles two groups, and divide K.

Rounding convention (kernel and reference agree on it): each weight is dequantized in fp32 (code * scale +
zero), rounded to x's dtype (a no-op for fp32), and multiplied with x in fp32 (fp32 accumulation; exact
fp32 products, input_precision "ieee", when x is fp32); the result is rounded once to x's dtype. The only
difference left is the summation order (and a possibly fused multiply-add in the compiled dequantization).

Tiling: x is flattened to (M, K); a program computes a (BLOCK_M, BLOCK_N) tile of out over its share of K
(split-K: the K steps are divided among `split_k` programs, each writing fp32 partial sums that are added and
rounded once afterwards), in BLOCK_K steps. Each step loads a (BLOCK_N, BLOCK_K/8) tile of words and the
scale/zero of each word's group, unpacks the words (BLOCK_N, BLOCK_K/8, 8) -> (BLOCK_N, BLOCK_K) with the
exact 2^23 trick of quant_matvec.unpack_codes, and multiplies by the (BLOCK_M, BLOCK_K) tile of x: tl.dot
against the transposed tile for M > 4, broadcast products summed over K for decode (M <= 4, where a 16-row
tensor-core tile would be mostly padding and the product is bound by reading the weight). Rows past M,
outputs past N and channels past K are masked. Default tiles (`default_tiles`) were picked on an H100 with
repro/kvpareto/bench.py; split_k by default makes about two programs per SM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.cache.kvquant import QTensor, dequantize, quantize
from kvzoo.kernels.quant_matvec import check_runnable, check_tensor, unpack_codes

BITS = 4
CODES_PER_WORD = 32 // BITS
X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class W4Weight:
    """A (N, K) weight as asymmetric 4-bit codes with one fp16 scale and zero per group of G input channels."""

    codes: Tensor            # int32 (N, K/8)
    scale: Tensor            # fp16 (N, K/G)
    zero: Tensor             # fp16 (N, K/G)
    group_size: int
    shape: tuple[int, int]   # (N, K) = (out_features, in_features)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(N, K): dequantized in fp32, then rounded to dtype."""
        q = QTensor(self.codes, self.scale, self.zero, BITS, self.group_size, -1, self.shape)
        return dequantize(q, torch.float32).to(dtype)


def _check_group(K: int, group_size: int) -> None:
    if group_size <= 0 or group_size % CODES_PER_WORD:
        raise ValueError(f"group_size must be a positive multiple of {CODES_PER_WORD} (a word of 4-bit codes "
                         f"never straddles two groups), got {group_size}")
    if K % group_size:
        raise ValueError(f"K = {K} (in_features) is not a multiple of the group size {group_size}")


def quantize_weight(w: Tensor, group_size: int = 128) -> W4Weight:
    """w (N, K) = (out_features, in_features), fp32/fp16/bf16 -> asymmetric 4-bit codes, groups of group_size
    consecutive input channels per output row."""
    if not isinstance(w, Tensor) or w.dim() != 2:
        raise ValueError(f"w must be a 2-D (out_features, in_features) tensor, got "
                         f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
    if w.dtype not in X_DTYPES:
        raise ValueError(f"w must be fp16, bf16 or fp32, got {w.dtype}")
    _check_group(w.shape[1], group_size)
    q = quantize(w, BITS, group_size, axis=-1)
    return W4Weight(q.codes, q.scale, q.zero, group_size, tuple(w.shape))


@triton.jit
def _w4a16_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, STEPS_PER_SPLIT,
                  GROUP: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    CPW: tl.constexpr = 8                            # 4-bit codes per int32 word
    KW: tl.constexpr = BLOCK_K // CPW                # words per weight row per step
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    live_m = m < M
    live_n = n < N
    rows = m.to(tl.int64)
    cols = n.to(tl.int64)
    words_per_row = K // CPW
    groups_per_row = K // GROUP
    shifts = (tl.arange(0, CPW) * 4)[None, None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_first = split * STEPS_PER_SPLIT * BLOCK_K
    k_end = tl.minimum(k_first + STEPS_PER_SPLIT * BLOCK_K, K)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rows[:, None] * K + k[None, :],
                     mask=live_m[:, None] & (k < K)[None, :], other=0)                  # (BLOCK_M, BLOCK_K)
        wi = k0 // CPW + tl.arange(0, KW)                                              # word index in the row
        live_w = live_n[:, None] & (wi < words_per_row)[None, :]
        words = tl.load(codes_ptr + cols[:, None] * words_per_row + wi[None, :], mask=live_w, other=0)
        meta = cols[:, None] * groups_per_row + (wi // (GROUP // CPW))[None, :]         # (BLOCK_N, KW) group
        scale = tl.load(scale_ptr + meta, mask=live_w, other=0).to(tl.float32)
        zero = tl.load(zero_ptr + meta, mask=live_w, other=0).to(tl.float32)
        w = unpack_codes(words[:, :, None], shifts, 4) * scale[:, :, None] + zero[:, :, None]  # (BLOCK_N, KW, CPW)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K), can_reorder=False).to(xt.dtype)           # (BLOCK_N, BLOCK_K)
        if DOT:
            if IEEE:
                acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(w))
        else:                                        # a few rows: broadcast products, no tensor-core tile
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    out_ptr += split.to(tl.int64) * M * N            # this split's partial sums (one plane when not split)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live_m[:, None] & live_n[None, :])


def _check(x: Tensor, w: W4Weight) -> None:
    if not isinstance(w, W4Weight):
        raise ValueError(f"expected a W4Weight (quantize_weight), got {type(w).__name__}")
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor (..., K), got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input channels, the weight {tuple(w.shape)} expects K = {K}")
    _check_group(K, w.group_size)
    check_tensor(w.codes, "codes", (N, K // CODES_PER_WORD), (torch.int32,), x.device)
    check_tensor(w.scale, "scale", (N, K // w.group_size), (torch.float16,), x.device)
    check_tensor(w.zero, "zero", (N, K // w.group_size), (torch.float16,), x.device)


@dataclass(frozen=True)
class Tiles:
    """A launch configuration: rows BLOCK_M (0: by M), outputs BLOCK_N, channels BLOCK_K per step, split_k
    (K divided among that many programs; 0: enough programs to fill the GPU)."""

    block_m: int = 0
    block_n: int = 64
    block_k: int = 64
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 3


GEMV_ROWS = 4                                   # up to this many rows, the broadcast (non-tl.dot) path
# The winners of repro/kvpareto/bench.py's sweep on an H100 (results/kvpareto/bench_w4a16.md):
DECODE_LONG_K = Tiles(block_n=16, block_k=512)             # M <= GEMV_ROWS, K >= 2048 (Llama-2-7B layers)
DECODE = Tiles(block_n=32, block_k=128, num_warps=8)       # M <= GEMV_ROWS, small K (SmolLM2's 576)
SMALL = Tiles(block_m=16, block_n=32, block_k=128)         # M <= 16
PREFILL = Tiles(block_m=128, block_n=64, block_k=64, num_stages=4)   # larger M


def default_tiles(M: int, K: int) -> Tiles:
    if M <= GEMV_ROWS:
        return DECODE_LONG_K if K >= 2048 else DECODE
    return SMALL if M <= 16 else PREFILL


@functools.lru_cache
def _programs_wanted(device: torch.device) -> int:
    """Twice the SM count on CUDA (enough programs in flight to keep the memory system busy), else 1."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def w4a16_matmul(x: Tensor, w: W4Weight, tiles: Tiles | None = None) -> Tensor:
    """x (..., K) @ dequant(w)ᵀ -> (..., N) in x's dtype (see the module docstring for the rounding).
    tiles None: default_tiles(M, K), M = the number of rows of x."""
    _check(x, w)
    check_runnable(_w4a16_kernel, x.device)
    N, K = w.shape
    x2 = x.reshape(-1, K).contiguous()                                  # (M, K), M = prod(leading dims)
    M = x2.shape[0]
    t = tiles or default_tiles(M, K)
    if t.block_k % CODES_PER_WORD:
        raise ValueError(f"block_k must be a multiple of {CODES_PER_WORD} (whole words of codes), got {t.block_k}")
    if not (M and N):
        return torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    dot = M > GEMV_ROWS or t.block_m > GEMV_ROWS
    block_m = t.block_m or (triton.next_power_of_2(M) if not dot else 16 if M <= 16 else 128)
    grid_mn = triton.cdiv(M, block_m) * triton.cdiv(N, t.block_n)
    steps = triton.cdiv(K, t.block_k)
    split = t.split_k or max(1, min(steps, _programs_wanted(x.device) // max(grid_mn, 1)))
    per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, per_split)                               # no empty splits
    out = torch.empty(split, M, N, dtype=x.dtype if split == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, t.block_n), split)
    _w4a16_kernel[grid](x2, w.codes.contiguous(), w.scale.contiguous(), w.zero.contiguous(), out, M, N, K, per_split,
                        GROUP=w.group_size, IEEE=x.dtype == torch.float32, DOT=dot,
                        BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                        num_warps=t.num_warps, num_stages=t.num_stages)
    out = out[0] if split == 1 else out.sum(0).to(x.dtype)              # (M, N): fp32 partials rounded once
    return out.reshape(*x.shape[:-1], N)                                # (..., N)


def w4a16_matmul_ref(x: Tensor, w: W4Weight) -> Tensor:
    """The torch reference: dequantize in fp32, round to x's dtype, multiply in fp32, cast to x's dtype."""
    return (x.float() @ w.dequantize(x.dtype).float().T).to(x.dtype)
