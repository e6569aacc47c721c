"""AlignedKV's decode kernels (kvzoo/kernels/alignedkv_attention.py) against their torch references, under the
Triton interpreter on CPU (`TRITON_INTERPRET=0` on a GPU machine runs them compiled on CUDA)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.cache.alignedkv import LEVELS, exponent, key_levels, split_planes, value_levels  # noqa: E402
from kvzoo.kernels.alignedkv_attention import (aligned_decode, aligned_decode_static, aligned_pv,  # noqa: E402
                                              aligned_pv_ref, aligned_qk, aligned_qk_ref)

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"
B, H = 2, 2


def outliers(x, g):
    """x with three channels (last dim) scaled by 30 and three by 1/30, so that all three read levels occur."""
    channels = torch.randperm(x.shape[-1], generator=g)
    x[..., channels[:3]] *= 30
    x[..., channels[3:6]] /= 30
    return x


def key_planes(keys, BT):
    """keys (B, H, NB*BT, d) fp16 -> k_hi, k_mid, k_lo (B, H, NB, d, BT[/2]) and k_exp (B, H, NB, d) int8."""
    b, h, n, d = keys.shape
    blocks = keys.view(b, h, n // BT, BT, d).transpose(-1, -2)                     # (B, H, NB, d, BT)
    k_exp = exponent(blocks.abs().amax(-1)).to(torch.int8)                         # (B, H, NB, d)
    return (*(t.contiguous() for t in split_planes(blocks)), k_exp)


def value_planes(values):
    """values (B, H, N, d) fp16 -> v_hi (B, H, N, d), v_mid, v_lo (B, H, N, d/2), v_exp (B, H, N) int8."""
    return (*split_planes(values), exponent(values.abs().amax(-1)).to(torch.int8))


def check(got, want, tol=1e-5):
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def assert_all_levels(bits, min_bits):
    assert set(bits.unique().tolist()) == {b for b in LEVELS if b >= min_bits}


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("d", [16, 32, 64])
@pytest.mark.parametrize("BT", [16, 32])
@pytest.mark.parametrize("min_bits", [8, 12, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_qk_matches_reference(G, d, BT, min_bits, dtype):
    g = torch.Generator().manual_seed(G * 1000 + d * 10 + BT)
    NB, n_blocks = 4, 3                                       # the buffer holds a block more than is read
    keys = outliers(torch.randn(B, H, NB * BT, d, generator=g), g).half().to(DEVICE)
    q = torch.randn(B, H * G, d, generator=g).to(DEVICE, dtype)
    k_hi, k_mid, k_lo, k_exp = key_planes(keys, BT)
    assert_all_levels(key_levels(q[:, :, None], k_exp[:, :, :n_blocks], min_bits), min_bits)
    got = aligned_qk(q, k_hi, k_mid, k_lo, k_exp, n_blocks, min_bits)
    check(got, aligned_qk_ref(q, k_hi, k_mid, k_lo, k_exp, n_blocks, min_bits))


def test_qk_at_16_bits_is_the_fp16_product():
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(B, H, 64, 32, generator=g).half().to(DEVICE)
    q = torch.randn(B, 2 * H, 32, generator=g).half().to(DEVICE)
    got = aligned_qk(q, *key_planes(keys, 16), 4, 16)
    want = torch.einsum("bhgd,bhsd->bhgs", q.float().view(B, H, 2, 32), keys.float()).reshape(B, 2 * H, 64)
    check(got, want)


def pv_inputs(G, d, N, n_tokens, g):
    values = outliers(torch.randn(B, H, N, d, generator=g), g).half().to(DEVICE)
    S = N + 5                                                 # p has more slots than are read
    p = (3 * torch.randn(B, H * G, S, generator=g)).softmax(-1).to(DEVICE)
    v = values[:, :, None].expand(B, H, G, N, d).reshape(B, H * G, N, d).float()   # (B, Hq, N, d) per query head
    o_est = torch.einsum("bhj,bhjc->bhc", p[..., :n_tokens], v[:, :, :n_tokens])     # (B, Hq, d)
    return p, o_est, value_planes(values)


@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("BT", [16, 32])
@pytest.mark.parametrize("min_bits", [8, 12, 16])
def test_pv_matches_reference(G, d, BT, min_bits):
    g = torch.Generator().manual_seed(G * 1000 + d * 10 + BT + 1)
    N, n_tokens = 4 * BT, 3 * BT
    p, o_est, (v_hi, v_mid, v_lo, v_exp) = pv_inputs(G, d, N, n_tokens, g)
    bits = value_levels(p[:, :, None, :n_tokens], o_est[:, :, None], v_exp[:, :, :n_tokens], min_bits)
    assert_all_levels(bits, min_bits)
    got = aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, n_tokens, min_bits, block_n=32)
    check(got, aligned_pv_ref(p, o_est, v_hi, v_mid, v_lo, v_exp, n_tokens, min_bits))


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_pv_splits_and_a_partial_tile(num_splits):
    """80 tokens in tiles of 32: the last tile is half masked, and 5 splits leave some programs without tokens."""
    g = torch.Generator().manual_seed(num_splits)
    p, o_est, planes = pv_inputs(3, 32, 96, 80, g)
    got = aligned_pv(p, o_est, *planes, 80, 8, block_n=32, num_splits=num_splits)
    check(got, aligned_pv_ref(p, o_est, *planes, 80, 8))


def test_bad_input_is_named():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(B, H, 64, 32, generator=g).half().to(DEVICE)
    k_hi, k_mid, k_lo, k_exp = key_planes(keys, 16)
    q = torch.randn(B, 4, 32).to(DEVICE)
    with pytest.raises(ValueError, match="k_exp has dtype"):
        aligned_qk(q, k_hi, k_mid, k_lo, k_exp.int(), 4, 8)
    with pytest.raises(ValueError, match="k_mid has shape"):
        aligned_qk(q, k_hi, k_mid[..., :4], k_lo, k_exp, 4, 8)
    with pytest.raises(ValueError, match="query heads are not a multiple"):
        aligned_qk(q[:, :3], k_hi, k_mid, k_lo, k_exp, 4, 8)
    with pytest.raises(ValueError, match="n_blocks"):
        aligned_qk(q, k_hi, k_mid, k_lo, k_exp, 5, 8)
    with pytest.raises(ValueError, match="min_bits"):
        aligned_qk(q, k_hi, k_mid, k_lo, k_exp, 4, 10)
    p, o_est, (v_hi, v_mid, v_lo, v_exp) = pv_inputs(2, 32, 64, 64, g)
    with pytest.raises(ValueError, match="p has dtype"):
        aligned_pv(p.half(), o_est, v_hi, v_mid, v_lo, v_exp, 64, 8)
    with pytest.raises(ValueError, match="o_est has shape"):
        aligned_pv(p, o_est[..., :16], v_hi, v_mid, v_lo, v_exp, 64, 8)
    with pytest.raises(ValueError, match="v_lo has dtype"):
        aligned_pv(p, o_est, v_hi, v_mid, v_lo.to(torch.int8), v_exp, 64, 8)
    with pytest.raises(ValueError, match="n_tokens"):
        aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, 65, 8)
    with pytest.raises(ValueError, match="block_n a power of two >= 32"):
        aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, 64, 8, block_n=16)
    live = torch.tensor([1], device=DEVICE)
    with pytest.raises(ValueError, match="tail_v .the static step. needs live"):
        aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, 64, 8, tail_v=torch.zeros(B, H, 16, 32, device=DEVICE))
    with pytest.raises(ValueError, match="live_rows must be a positive int"):
        aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, 64, 8, live=live, live_rows=0)
    with pytest.raises(ValueError, match="tail_v has shape"):
        aligned_pv(p, o_est, v_hi, v_mid, v_lo, v_exp, 64, 8, live=live,
                   tail_v=torch.zeros(B, H, 16, 16, device=DEVICE))
    tail_k = torch.zeros(B, H, 16, 32, device=DEVICE)
    mask = torch.ones(B, 64, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="tail_k .the static step. needs live, a mask"):
        aligned_qk(q, k_hi, k_mid, k_lo, k_exp, 4, 8, tail_k=tail_k, mask=mask)
    with pytest.raises(ValueError, match="mask has shape"):
        aligned_qk(q, k_hi, k_mid, k_lo, k_exp, 4, 8, out=torch.empty(B, 4, 64, device=DEVICE), live=live,
                   tail_k=tail_k, mask=mask[:, :32])


def test_wide_groups_and_row_mask():
    """G = 16 query heads per KV head fill the products' 16 rows; row_mask=False fetches single bytes, same result."""
    g = torch.Generator().manual_seed(16)
    keys = outliers(torch.randn(1, 1, 64, 32, generator=g), g).half().to(DEVICE)
    q = torch.randn(1, 16, 32, generator=g).half().to(DEVICE)
    planes = key_planes(keys, 32)
    check(aligned_qk(q, *planes, 2, 8), aligned_qk_ref(q, *planes, 2, 8))
    for G, row_mask in ((16, True), (3, False), (1, False)):
        p, o_est, planes = pv_inputs(G, 32, 64, 48, g)
        got = aligned_pv(p, o_est, *planes, 48, 8, block_n=32, row_mask=row_mask)
        check(got, aligned_pv_ref(p, o_est, *planes, 48, 8))



def test_live_counts_from_a_device_tensor():
    """live (CUDA graphs): the grid sized by the whole buffer, the kernels reading how many blocks / tokens count."""
    g = torch.Generator().manual_seed(21)
    keys = outliers(torch.randn(B, H, 4 * 16, 32, generator=g), g).half().to(DEVICE)
    q = torch.randn(B, 2 * H, 32, generator=g).to(DEVICE)
    planes = key_planes(keys, 16)
    live = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    check(aligned_qk(q, *planes, 4, 8, live=live)[..., :48], aligned_qk(q, *planes, 3, 8))
    p, o_est, planes = pv_inputs(2, 32, 96, 96, g)
    for n in (0, 37, 96):
        live = torch.tensor([n], dtype=torch.int32, device=DEVICE)
        check(aligned_pv(p, o_est, *planes, 96, 8, block_n=32, num_splits=3, live=live),
              aligned_pv(p, o_est, *planes, n, 8, block_n=32) if n else torch.zeros_like(o_est))
    with pytest.raises(ValueError, match="live has dtype"):
        aligned_pv(p, o_est, *planes, 96, 8, live=live.float())
    with pytest.raises(ValueError, match="live has shape"):
        aligned_qk(q, *key_planes(keys, 16), 4, 8, live=live.expand(2))


@pytest.mark.parametrize("n_full, W", [(0, 5), (2, 1), (2, 16), (3, 9)])
def test_decode_static_equals_decode(n_full, W):
    """aligned_decode_static (scores over every stored slot, the tail a whole block, the rest masked) against
    aligned_decode (scores over the complete blocks and a tail of W tokens)."""
    g = torch.Generator().manual_seed(n_full * 100 + W)
    G, d, BT, NB = 3, 32, 16, 4
    keys = outliers(torch.randn(B, H, NB * BT, d, generator=g), g).half().to(DEVICE)
    values = outliers(torch.randn(B, H, NB * BT, d, generator=g), g).half().to(DEVICE)
    q = torch.randn(B, H * G, d, generator=g).to(DEVICE)
    k_planes, v_planes = key_planes(keys, BT), value_planes(values)
    tail_k = torch.randn(B, H, BT, d, generator=g).to(DEVICE)          # rows past W: whatever, masked
    tail_v = torch.randn(B, H, BT, d, generator=g).to(DEVICE)
    tail_v[:, :, W:] = 0
    want = aligned_decode(q, *k_planes, *v_planes, n_full, tail_k[:, :, :W], tail_v[:, :, :W], 8, 8)
    mask = (torch.arange(NB * BT, device=DEVICE) < n_full * BT + W).expand(B, -1)
    got = aligned_decode_static(q, *k_planes, *v_planes, torch.tensor([n_full], device=DEVICE), tail_k, tail_v,
                                mask, 8, 8)
    check(got, want)
    with pytest.raises(ValueError, match="mask has shape"):
        aligned_decode_static(q, *k_planes, *v_planes, torch.tensor([n_full], device=DEVICE), tail_k, tail_v,
                              mask[:, :8], 8, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("t", [0, 5, 6, 15])
def test_token_matches_reference(t, dtype):
    """The static step's token kernel: the block's exact tail and the planes after the token is written (its key
    nibbles shared with the even or odd neighbour; t = 15 closes the block of 16 and records its colmax exponents)
    bit for bit as the torch reference (kvzoo.cache.alignedkv.token_tail, store_token)."""
    from kvzoo.kernels.alignedkv_attention import aligned_token, aligned_token_ref

    BT, d, NB = 16, 32, 3
    g = torch.Generator().manual_seed(t)
    keys = outliers(torch.randn(B, H, NB * BT, d, generator=g), g).half().to(DEVICE)
    values = torch.randn(B, H, NB * BT, d, generator=g).half().to(DEVICE)
    planes = (*key_planes(keys, BT), *(p.contiguous() for p in value_planes(values)))
    k, v = (torch.randn(B, H, 1, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    slot = torch.tensor([BT + t], device=DEVICE)                                   # block 1, place t
    want_planes = tuple(p.clone() for p in planes)
    got = aligned_token(planes, k, v, slot, close=t == BT - 1)
    want = aligned_token_ref(want_planes, k, v, slot, close=t == BT - 1)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    for a, b in zip(planes, want_planes):
        assert torch.equal(a, b)
    assert t == BT - 1 or torch.equal(planes[3], key_planes(keys, BT)[3])          # exponents move only on close


@pytest.mark.parametrize("NA", [0, 16, 48, torch.tensor([32])])
def test_estimate_matches_reference(NA):
    """O_est in its kernels (the top k chunk by chunk, or torch's; the gather of their exact values from the planes or
    the tail, weighted sum) against the torch gathers, the count of stored slots given as an int or a device tensor."""
    from kvzoo.kernels.alignedkv_attention import _estimate, _estimate_ref

    g = torch.Generator().manual_seed(7)
    G, d, S, W = 3, 32, 64, 16
    values = outliers(torch.randn(B, H, S, d, generator=g), g).half().to(DEVICE)
    v_hi, v_mid, v_lo, _ = value_planes(values)
    tail_v = torch.randn(B, H, W, d, generator=g).to(DEVICE)
    p = torch.softmax(torch.randn(B, H * G, S + W, generator=g) * 3, -1).to(DEVICE)
    NA = NA.to(DEVICE) if isinstance(NA, torch.Tensor) else NA
    for chunked in (True, False):
        got = _estimate(p, v_hi, v_mid, v_lo, tail_v, NA, 8, chunked=chunked)
        torch.testing.assert_close(got, _estimate_ref(p, v_hi, v_mid, v_lo, tail_v, NA, 8), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("topk", [5, 8, 32])
def test_estimate_over_chunks(topk, monkeypatch):
    """The top k taken chunk by chunk (chunks of 16 slots here, the last one partial; k up to twice a chunk), then
    over the chunks' candidates, against torch's topk over the whole row."""
    from kvzoo.kernels import alignedkv_attention as al

    monkeypatch.setattr(al, "TOPK_CHUNK", 16)
    g = torch.Generator().manual_seed(9)
    G, d, S, W = 3, 32, 64, 16
    values = outliers(torch.randn(B, H, S, d, generator=g), g).half().to(DEVICE)
    v_hi, v_mid, v_lo, _ = value_planes(values)
    tail_v = torch.randn(B, H, W, d, generator=g).to(DEVICE)
    p = torch.softmax(torch.randn(B, H * G, S + W - 7, generator=g) * 3, -1).to(DEVICE)     # 73 slots
    got = al._estimate(p, v_hi, v_mid, v_lo, tail_v, 48, topk, chunked=True)
    torch.testing.assert_close(got, al._estimate_ref(p, v_hi, v_mid, v_lo, tail_v, 48, topk), rtol=1e-6, atol=1e-6)


def test_estimate_reads_strided_planes():
    """O_est over value planes that are a slice of a larger buffer (not contiguous across heads) equals O_est over
    the same planes contiguous."""
    from kvzoo.kernels.alignedkv_attention import _estimate

    g = torch.Generator().manual_seed(8)
    G, d, S, W = 3, 32, 64, 16
    values = outliers(torch.randn(B, H, S + 32, d, generator=g), g).half().to(DEVICE)
    wide = value_planes(values)[:3]                                                  # (B, H, S + 32, .) each
    sliced = [t[:, :, :S] for t in wide]
    assert not sliced[0].is_contiguous()
    tail_v = torch.randn(B, H, W, d, generator=g).to(DEVICE)
    p = torch.softmax(torch.randn(B, H * G, S + W, generator=g) * 3, -1).to(DEVICE)
    got = _estimate(p, *sliced, tail_v, 48, 8)
    torch.testing.assert_close(got, _estimate(p, *(t.contiguous() for t in sliced), tail_v, 48, 8), rtol=0, atol=0)
