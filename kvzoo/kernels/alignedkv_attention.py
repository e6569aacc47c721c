"""AlignedKV's two decode products (alignedkv.md, kvzoo/cache/alignedkv.py): each element of the fp16 cache is
read at 8, 12 or 16 of its bits, decided inside the kernel from magnitudes only, before its low bits are
loaded. One query token per sequence; Hq = G*H query heads, query head h reading KV head h // G.

    scores = q · k̃ᵀ   aligned_qk   q (B, Hq, d) fp16/bf16/fp32              -> (B, Hq, n_blocks*BT) fp32
    out    = p · ṽ    aligned_pv   p (B, Hq, S) fp32, o_est (B, Hq, d) fp32  -> (B, Hq, d) fp32
Scores are unscaled (no 1/sqrt(d)); p is already softmaxed. Products and sums are fp32.

Layouts (the cache's buffers, per layer; B rows, H KV heads, d head_dim, BT tokens per key block, NB blocks):
    k_hi  uint8 (B, H, NB, d, BT)         bits 15..8 of every key, channel-major inside a block
    k_mid, k_lo uint8 (B, H, NB, d, BT/2)  bits 7..4 / 3..0, token 2t in the low nibble of byte t
    k_exp int8 (B, H, NB, d)              floor(log2 max|k|) per channel of a block (K_colmax)
    v_hi  uint8 (B, H, N, d)              bits 15..8 of every value, token-major
    v_mid, v_lo uint8 (B, H, N, d/2)       channel 2c in the low nibble of byte c
    v_exp int8 (B, H, N)                  floor(log2 max_c |v|) per token (the row maximum)
An element read at 16 bits is the fp16 value; at 12 bits its low nibble is 0x8, at 8 bits its low byte 0x80
(the middle of what was not read). Reading 8 / 12 / 16 bits reads 1 / 1.5 / 2 bytes of the element.

Decisions, e(x) = floor(log2 |x|) from the fp32 exponent field (0 -> -127), level(diff) = 8 bits once
diff >= DIFF_FOR_8, 12 once diff >= DIFF_FOR_12, else 16, never fewer than min_bits:
    Rule 1 (addend alignment, keys): for block n, a[g, i] = e(q[g, i]) + k_exp[n, i], A[g] = max_i a[g, i],
      bits[n, i] = level(min_g (A[g] - a[g, i])): one decision per (block, channel), shared by its BT tokens.
    Rule 2 (result alignment, values): bits[j, c] = level(min_g (e(o_est[g, c]) - e(p[g, j])) - v_exp[j]).
The minimum over the G query heads of a group gives every head at least the bits it asks for, since they all
share the KV head's bytes.

Tiling.
    aligned_qk  grid (B*H, n_blocks): a program takes one block of one KV head, all G query heads padded to
                G_P = max(16, next_pow2(G)) rows. It decides the d channel levels from q and k_exp, loads the
                k_hi tile (d, BT), then k_mid only for channels at >= 12 bits and k_lo only for channels at
                16 bits (masked loads: a skipped channel issues no memory request), rebuilds the fp16 keys
                in fp32 and multiplies with tl.dot (G_P, d) x (d, BT) at fp32 ("ieee") precision.
    aligned_pv  grid (B*H, splits), split-K over the tokens: a program walks its tokens BLOCK_N at a time,
                decides the (BLOCK_N, d) levels, loads v_hi and, element by element, the v_mid / v_lo byte
                of an element that needs it (so a byte is fetched when either of its two channels needs it;
                each element still gets its own level's fill), and accumulates tl.dot (G_P, BLOCK_N) x
                (BLOCK_N, d). The partials (B*H, splits, G, d) are summed by torch.

Every launcher checks shapes, dtypes and devices and raises ValueError; each has a pure-torch `*_ref` built on
kvzoo.cache.alignedkv's key_levels / value_levels / read_levels. CPU tensors need TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kvzoo.cache.alignedkv import DIFF_FOR_8, DIFF_FOR_12, LEVELS, join_planes, key_levels, read_levels, value_levels
from kvzoo.kernels.quant_matvec import check_runnable, check_tensor, head_rows, split_groups

_D8 = tl.constexpr(DIFF_FOR_8)
_D12 = tl.constexpr(DIFF_FOR_12)
_FAR = tl.constexpr(1 << 20)          # a diff no level threshold reaches: padded query heads never decide


@triton.jit
def _exponent(x):
    """floor(log2 |x|) as int32 from the fp32 exponent field (0 and fp32 subnormals -> -127)."""
    return ((x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _level(diff, MIN_BITS: tl.constexpr):
    bits = tl.where(diff >= _D8, 8, tl.where(diff >= _D12, 12, 16))
    return tl.maximum(bits, MIN_BITS)


@triton.jit
def _rebuild(hi, mid, lo, bits):
    """High byte, middle and low nibbles (int32) read at `bits` -> the element as fp32. The nibbles an element
    does not read are ignored (they are the masked loads' zeros) and replaced by the fill 100..."""
    low = tl.where(bits == 8, 0x80, tl.where(bits == 12, (mid << 4) | 0x8, (mid << 4) | lo))
    return ((hi << 8) | low).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _qk_kernel(q_ptr, hi_ptr, mid_ptr, lo_ptr, exp_ptr, out_ptr, S_OUT, s_hi, s_mid, s_lo, s_exp,
               G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, MIN_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                # b*H + KV head
    n = tl.program_id(1)                               # block
    g = tl.arange(0, G_P)
    live_g = g < G
    i = tl.arange(0, D)
    t = tl.arange(0, BT)
    heads = row * G + g                                # query rows b*Hq + kv*G + g
    q = tl.load(q_ptr + heads[:, None] * D + i[None, :], mask=live_g[:, None], other=0).to(tl.float32)  # (G_P, D)
    # Rule 1, from q and the block's colmax exponents only
    a = _exponent(q) + tl.load(exp_ptr + row * s_exp + n * D + i).to(tl.int32)[None, :]             # (G_P, D)
    diff = tl.where(live_g[:, None], tl.max(a, axis=1)[:, None] - a, _FAR)
    bits = _level(tl.min(diff, axis=0), MIN_BITS)[:, None]                                           # (D, 1)
    hi = tl.load(hi_ptr + row * s_hi + n * (D * BT) + i[:, None] * BT + t[None, :]).to(tl.int32)     # (D, BT)
    pair = n * (D * (BT // 2)) + i[:, None] * (BT // 2) + (t // 2)[None, :]     # (D, BT): each token's byte
    shift = ((t & 1) * 4)[None, :]
    mid = (tl.load(mid_ptr + row * s_mid + pair, mask=bits >= 12, other=0).to(tl.int32) >> shift) & 0xF
    lo = (tl.load(lo_ptr + row * s_lo + pair, mask=bits == 16, other=0).to(tl.int32) >> shift) & 0xF
    k = _rebuild(hi, mid, lo, bits)                                                                  # (D, BT)
    s = tl.dot(q, k, input_precision="ieee")                                                         # (G_P, BT)
    tl.store(out_ptr + heads[:, None] * S_OUT + n * BT + t[None, :], s, mask=live_g[:, None])


@triton.jit
def _pv_kernel(p_ptr, o_ptr, hi_ptr, mid_ptr, lo_ptr, exp_ptr, part_ptr, N, S_P, PER_SPLIT, s_hi, s_mid, s_lo, s_exp,
               G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, MIN_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                # b*H + KV head
    split = tl.program_id(1)
    g = tl.arange(0, G_P)
    live_g = g < G
    c = tl.arange(0, D)
    heads = row * G + g                                # query rows b*Hq + kv*G + g
    shift = ((c & 1) * 4)[None, :]
    acc = tl.zeros((G_P, D), dtype=tl.float32)
    for start in range(0, PER_SPLIT, BLOCK_N):
        j = split * PER_SPLIT + start + tl.arange(0, BLOCK_N)
        live = j < N
        # Rule 2: the least diff over the group's query heads, from o_est, p and the rowmax exponents
        e_pv = tl.full((BLOCK_N, D), _FAR, tl.int32)
        for h in tl.static_range(G):
            e_o = _exponent(tl.load(o_ptr + (row * G + h) * D + c))                                  # (D,)
            e_p = _exponent(tl.load(p_ptr + (row * G + h) * S_P + j, mask=live, other=0))            # (BLOCK_N,)
            e_pv = tl.minimum(e_pv, e_o[None, :] - e_p[:, None])
        e_v = tl.load(exp_ptr + row * s_exp + j, mask=live, other=0).to(tl.int32)
        bits = _level(e_pv - e_v[:, None], MIN_BITS)                                                 # (BLOCK_N, D)
        hi = tl.load(hi_ptr + row * s_hi + j[:, None] * D + c[None, :], mask=live[:, None], other=0).to(tl.int32)
        byte = j[:, None] * (D // 2) + (c // 2)[None, :]                            # (BLOCK_N, D): each element's byte
        mid = tl.load(mid_ptr + row * s_mid + byte, mask=live[:, None] & (bits >= 12), other=0)
        lo = tl.load(lo_ptr + row * s_lo + byte, mask=live[:, None] & (bits == 16), other=0)
        mid = (mid.to(tl.int32) >> shift) & 0xF
        lo = (lo.to(tl.int32) >> shift) & 0xF
        v = _rebuild(hi, mid, lo, bits)                                                              # (BLOCK_N, D)
        p = tl.load(p_ptr + heads[:, None] * S_P + j[None, :], mask=live_g[:, None] & live[None, :], other=0)
        acc += tl.dot(p, v, input_precision="ieee")                                                  # (G_P, D)
    tl.store(part_ptr + ((row * tl.num_programs(1) + split) * G + g[:, None]) * D + c[None, :], acc,
             mask=live_g[:, None])


def _check_common(name: str, t: Tensor, dims: int, min_bits: int) -> None:
    if min_bits not in LEVELS:
        raise ValueError(f"min_bits must be one of {LEVELS}, got {min_bits}")
    if not isinstance(t, Tensor) or t.dim() != dims:
        raise ValueError(f"{name} must be a tensor with {dims} dims")


def _check_dim(name: str, n: int, least: int = 16) -> None:
    if n < least or n & (n - 1):
        raise ValueError(f"the kernels need {name} a power of two >= {least}, got {n}")


def _group(Hq: int, H: int) -> tuple[int, int]:
    """(G, G_P): query heads per KV head and the tl.dot rows they are padded to."""
    if H == 0 or Hq % H:
        raise ValueError(f"{Hq} query heads are not a multiple of {H} KV heads")
    G = Hq // H
    return G, max(16, triton.next_power_of_2(G))


def aligned_qk(q: Tensor, k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, k_exp: Tensor, n_blocks: int,
               min_bits: int) -> Tensor:
    """Unscaled scores q · k̃ᵀ (B, Hq, n_blocks*BT) fp32 over the first n_blocks key blocks, each key channel of
    each block read at the bits Rule 1 gives it. q (B, Hq, d) fp16/bf16/fp32; the planes may hold NB >= n_blocks
    blocks (the cache's whole buffers)."""
    _check_common("k_hi", k_hi, 5, min_bits)
    B, H, NB, d, BT = k_hi.shape
    if not isinstance(q, Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor (B, Hq, d)")
    dev = q.device
    check_runnable(_qk_kernel, dev)
    _check_dim("head_dim", d)
    _check_dim("block tokens BT", BT)
    Hq = q.shape[1]
    G, G_P = _group(Hq, H)
    check_tensor(q, "q", (B, Hq, d), (torch.float16, torch.bfloat16, torch.float32), dev)
    for name, t, shape, dtype in (("k_hi", k_hi, (B, H, NB, d, BT), torch.uint8),
                                  ("k_mid", k_mid, (B, H, NB, d, BT // 2), torch.uint8),
                                  ("k_lo", k_lo, (B, H, NB, d, BT // 2), torch.uint8),
                                  ("k_exp", k_exp, (B, H, NB, d), torch.int8)):
        check_tensor(t, name, shape, (dtype,), dev)
    if not 0 <= n_blocks <= NB:
        raise ValueError(f"n_blocks = {n_blocks} is outside the {NB} stored blocks")
    out = torch.empty(B, Hq, n_blocks * BT, dtype=torch.float32, device=dev)
    if B == 0 or n_blocks == 0:
        return out
    (hi, s_hi), (mid, s_mid), (lo, s_lo), (ex, s_exp) = map(head_rows, (k_hi, k_mid, k_lo, k_exp))
    _qk_kernel[(B * H, n_blocks)](q.contiguous(), hi, mid, lo, ex, out, n_blocks * BT, s_hi, s_mid, s_lo, s_exp,
                                  G=G, G_P=G_P, D=d, BT=BT, MIN_BITS=min_bits)
    return out


def aligned_qk_ref(q: Tensor, k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, k_exp: Tensor, n_blocks: int,
                   min_bits: int) -> Tensor:
    """The torch reference: key_levels, join_planes, read_levels, fp32 einsum."""
    B, Hq, d = q.shape
    H, BT = k_hi.shape[1], k_hi.shape[-1]
    blocks = slice(0, n_blocks)
    keys = join_planes(k_hi[:, :, blocks], k_mid[:, :, blocks], k_lo[:, :, blocks])      # (B, H, n, d, BT) fp16
    bits = key_levels(q[:, :, None], k_exp[:, :, blocks], min_bits)[:, :, 0]            # (B, H, n, d)
    k = read_levels(keys, bits[..., None])                                              # (B, H, n, d, BT) fp32
    scores = torch.einsum("bhgi,bhnit->bhgnt", q.float().view(B, H, Hq // H, d), k)     # (B, H, G, n, BT)
    return scores.reshape(B, Hq, n_blocks * BT)


def aligned_pv(p: Tensor, o_est: Tensor, v_hi: Tensor, v_mid: Tensor, v_lo: Tensor, v_exp: Tensor, n_tokens: int,
               min_bits: int, block_n: int = 32, num_splits: int | None = None) -> Tensor:
    """p · ṽ (B, Hq, d) fp32 over the first n_tokens value rows, each element read at the bits Rule 2 gives it.
    p (B, Hq, S) fp32 probabilities, S >= n_tokens (only the first n_tokens are read); o_est (B, Hq, d) fp32;
    the planes may hold N >= n_tokens rows. num_splits (split-K over tokens) defaults to filling the device."""
    _check_common("v_hi", v_hi, 4, min_bits)
    B, H, N, d = v_hi.shape
    if not isinstance(p, Tensor) or p.dim() != 3:
        raise ValueError("p must be a tensor (B, Hq, S)")
    dev = p.device
    check_runnable(_pv_kernel, dev)
    _check_dim("head_dim", d)
    _check_dim("block_n", block_n)
    Hq, S = p.shape[1], p.shape[2]
    G, G_P = _group(Hq, H)
    check_tensor(p, "p", (B, Hq, S), (torch.float32,), dev)
    check_tensor(o_est, "o_est", (B, Hq, d), (torch.float32,), dev)
    for name, t, shape, dtype in (("v_hi", v_hi, (B, H, N, d), torch.uint8),
                                  ("v_mid", v_mid, (B, H, N, d // 2), torch.uint8),
                                  ("v_lo", v_lo, (B, H, N, d // 2), torch.uint8),
                                  ("v_exp", v_exp, (B, H, N), torch.int8)):
        check_tensor(t, name, shape, (dtype,), dev)
    if not 0 <= n_tokens <= min(N, S):
        raise ValueError(f"n_tokens = {n_tokens} exceeds the {N} stored values or the {S} probabilities")
    if B == 0 or n_tokens == 0:
        return torch.zeros(B, Hq, d, dtype=torch.float32, device=dev)
    splits, per_split = split_groups(triton.cdiv(n_tokens, block_n), B * H, dev, num_splits)
    partials = torch.empty(B * H, splits, G, d, dtype=torch.float32, device=dev)
    p = p.contiguous()
    (hi, s_hi), (mid, s_mid), (lo, s_lo), (ex, s_exp) = map(head_rows, (v_hi, v_mid, v_lo, v_exp))
    _pv_kernel[(B * H, splits)](p, o_est.contiguous(), hi, mid, lo, ex, partials, n_tokens, S, per_split * block_n,
                                s_hi, s_mid, s_lo, s_exp, G=G, G_P=G_P, D=d, BLOCK_N=block_n, MIN_BITS=min_bits)
    return partials.sum(1).view(B, Hq, d)                                       # (B*H, G, d) -> (B, Hq, d)


def aligned_pv_ref(p: Tensor, o_est: Tensor, v_hi: Tensor, v_mid: Tensor, v_lo: Tensor, v_exp: Tensor,
                   n_tokens: int, min_bits: int) -> Tensor:
    """The torch reference: value_levels, join_planes, read_levels, fp32 einsum."""
    B, Hq, d = o_est.shape
    H = v_hi.shape[1]
    p = p[..., :n_tokens]                                                               # (B, Hq, n)
    values = join_planes(v_hi[:, :, :n_tokens], v_mid[:, :, :n_tokens], v_lo[:, :, :n_tokens])   # (B, H, n, d)
    bits = value_levels(p[:, :, None], o_est[:, :, None], v_exp[:, :, :n_tokens], min_bits)[:, :, 0]  # (B, H, n, d)
    out = torch.einsum("bhgj,bhjc->bhgc", p.view(B, H, Hq // H, n_tokens), read_levels(values, bits))
    return out.reshape(B, Hq, d)


def aligned_decode(q: Tensor, k_hi: Tensor, k_mid: Tensor, k_lo: Tensor, k_exp: Tensor, v_hi: Tensor, v_mid: Tensor,
                   v_lo: Tensor, v_exp: Tensor, n_blocks: int, tail_k: Tensor, tail_v: Tensor, topk: int,
                   min_bits: int) -> Tensor:
    """One decode step of AlignedKV attention, as kvzoo.cache.alignedkv runs it on CUDA: q (B, Hq, d) over the
    first n_blocks complete blocks (read aligned by the two kernels) and an exact tail (B, H, W, d) of the
    tokens after them (the block being filled and the new token). Returns (B, Hq, d) fp32.

    scores = [aligned_qk | q·tail] / sqrt(d); p = softmax (fp32); O_est = the top-k probabilities times
    their exact values (gathered from the planes or the tail); out = aligned_pv(p, O_est) + p_tail·tail."""
    B, Hq, d = q.shape
    H = tail_k.shape[1]
    G, NA = Hq // H, n_blocks * k_hi.shape[-1]
    s_tail = torch.einsum("bhgd,bhwd->bhgw", q.float().view(B, H, G, d), tail_k.float()).reshape(B, Hq, -1)
    scores = torch.cat([aligned_qk(q, k_hi, k_mid, k_lo, k_exp, n_blocks, min_bits), s_tail], dim=-1)
    p = (scores * d ** -0.5).softmax(-1)                                              # (B, Hq, S)
    o_est = _estimate(p, v_hi, v_mid, v_lo, tail_v, NA, topk)
    out = aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, NA, min_bits)
    return out + torch.einsum("bhgw,bhwd->bhgd", p[..., NA:].view(B, H, G, -1), tail_v.float()).reshape(B, Hq, d)


def _estimate(p: Tensor, v_hi: Tensor, v_mid: Tensor, v_lo: Tensor, tail_v: Tensor, NA: int, topk: int) -> Tensor:
    """O_est (B, Hq, d): each head's top-k probabilities times their exact values, gathered from the planes
    (slots < NA) or the exact tail, without copying the cache."""
    B, Hq, S = p.shape
    H, d = tail_v.shape[1], tail_v.shape[-1]
    G = Hq // H
    top_p, idx = p.topk(min(topk, S), dim=-1)                                         # (B, Hq, k)
    idx = idx.view(B, H, G, -1, 1)

    def rows(t: Tensor, i: Tensor) -> Tensor:                                         # (B, H, G, k, width)
        return t[:, :, None].expand(B, H, G, *t.shape[2:]).gather(3, i.expand(*i.shape[:4], t.shape[-1]))

    planes = idx.clamp_max(max(NA - 1, 0))
    stored = join_planes(rows(v_hi, planes), rows(v_mid, planes), rows(v_lo, planes)).float()
    vals = torch.where(idx < NA, stored, rows(tail_v, (idx - NA).clamp_min(0)).float())   # (B, H, G, k, d)
    return (top_p.view(B, H, G, -1, 1) * vals).sum(3).view(B, Hq, d)
