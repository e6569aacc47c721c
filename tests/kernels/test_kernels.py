"""Triton kernels (kvzoo/kernels) against their pure-torch references, under the Triton interpreter.

TRITON_INTERPRET=1 is set before triton is first imported, so the kernels run on CPU tensors. On a GPU
machine, `TRITON_INTERPRET=0 python -m pytest tests/test_kernels.py` runs the compiled kernels on CUDA instead.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.cache.kvquant import pack_sym_mask, quantize, quantize_unified  # noqa: E402
from kvzoo.kernels.innerq_attention import (combine, innerq_decode_attention, innerq_decode_attention_ref,  # noqa: E402
                                            one_wave, whole_waves)
from kvzoo.kernels.quant_matvec import (pv_inner, pv_inner_ref, pv_outer, pv_outer_ref, qk_inner,  # noqa: E402
                                        qk_inner_ref, qk_outer, qk_outer_ref)
from kvzoo.kernels.quantize_pack import quantize_inner, quantize_inner_ref  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}        # relative to the largest reference magnitude


def name(value) -> str:
    """Readable test ids: float16, not dtype3."""
    return str(value).replace("torch.", "").replace(" ", "")


def assert_close(got, want, dtype):
    scale = want.float().abs().max().item() or 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype] * scale)


def unified(x, bits, axis, mode):
    """Inner-layout tensors of x in `mode`; the dense sym flags the matvec kernels take (None: all-asymmetric)."""
    q = quantize_unified(x, bits, axis, mode)
    return q.codes, q.scale, q.slot, None if mode == "asym" else q.sym


def packed(x, bits, axis, mode):
    """Inner-layout tensors of x in `mode` as the InnerQ cache holds them, for the fused attention: packed
    mask bits (None: all-asymmetric; no bits at all in the sym mode, whose groups are all symmetric)."""
    q = quantize_unified(x, bits, axis, mode)
    B, H, n, d = q.shape
    if mode == "asym":
        mask = None
    elif mode == "sym":
        mask = torch.zeros((B, H, d // 32, 0) if axis == -1 else (B, H, 0, d // 32), dtype=torch.int32, device=x.device)
    else:   # bits along tokens (B, H, d/32, n/32) for per-token groups, along channels (B, H, n/32, d/32) for values
        mask = pack_sym_mask(q.sym, axis)
    return q.codes, q.scale, q.slot, mask


def upto(mode, n):
    """mask_upto as the cache gives it: every token has a bit (hybrid), none (sym)."""
    return 0 if mode == "sym" else n


# ----------------------------------------------------------------------------------------------------
# q·Kᵀ and p·V, inner and outer layouts
# ----------------------------------------------------------------------------------------------------
MATVEC = [(bits, d, n, dtype, bh, mode) for (bits, d, n, dtype), bh, mode in zip(
    itertools.product((2, 4), (64, 128), (32, 96, 160), (torch.float32, torch.float16)),
    itertools.cycle([(1, 1), (2, 2), (1, 2), (2, 1)]), itertools.cycle(["hybrid", "asym", "sym"]))]


@pytest.mark.parametrize("bits,d,n,dtype,bh,mode", MATVEC, ids=name)
def test_matvec_matches_reference(bits, d, n, dtype, bh, mode):
    torch.manual_seed(n + d + bits)
    B, H = bh
    k, v = torch.randn(2, B, H, n, d, device=DEVICE)
    q = torch.randn(B, H, d, device=DEVICE).to(dtype)
    p = torch.softmax(torch.randn(B, H, n, device=DEVICE), -1).to(dtype)
    kq, vq = unified(k, bits, -1, mode), unified(v, bits, -2, mode)
    assert_close(qk_inner(q, *kq, bits, block_n=32), qk_inner_ref(q, *kq, bits), dtype)
    assert_close(pv_inner(p, *vq, bits, num_splits=2), pv_inner_ref(p, *vq, bits), dtype)
    ko, vo = quantize(k, bits, 32, axis=-2), quantize(v, bits, 32, axis=-1)
    assert_close(qk_outer(q, ko.codes, ko.scale, ko.zero, bits), qk_outer_ref(q, ko.codes, ko.scale, ko.zero, bits),
                 dtype)
    assert_close(pv_outer(p, vo.codes, vo.scale, vo.zero, bits, block_n=32, num_splits=2),
                 pv_outer_ref(p, vo.codes, vo.scale, vo.zero, bits), dtype)


@pytest.mark.parametrize("bits,rep", [(2, 4), (4, 3)])
def test_outer_matvec_serves_gqa_query_rows(bits, rep):
    """q / p with rep query heads per KV head (query head h*rep + j reads KV head h), from cache slices: each
    row equals the one-query-per-head kernel on its KV head, and the reference."""
    torch.manual_seed(bits + rep)
    B, H, n, d = 2, 2, 96, 64
    k, v = torch.randn(2, B, H, 128, d, device=DEVICE)
    ko, vo = quantize(k, bits, 32, axis=-2), quantize(v, bits, 32, axis=-1)
    kq = (ko.codes[:, :, :n], ko.scale[:, :, :n // 32], ko.zero[:, :, :n // 32])          # sliced, strided
    vq = (vo.codes[:, :, :n], vo.scale[:, :, :n], vo.zero[:, :, :n])
    q = torch.randn(B, H * rep, d, device=DEVICE)
    p = torch.softmax(torch.randn(B, H * rep, n, device=DEVICE), -1)
    scores, out = qk_outer(q, *kq, bits), pv_outer(p, *vq, bits, block_n=32, num_splits=2)
    assert scores.shape == (B, H * rep, n) and out.shape == (B, H * rep, d)
    assert_close(scores, qk_outer_ref(q, *kq, bits), torch.float32)
    assert_close(out, pv_outer_ref(p, *vq, bits), torch.float32)
    for j in range(rep):                                        # query heads j, rep + j, ... of every KV head
        torch.testing.assert_close(scores[:, j::rep], qk_outer(q[:, j::rep], *kq, bits), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"q has shape \(2, 5, 64\), expected \(2, a multiple of 2, 64\)"):
        qk_outer(q[:, :5], *kq, bits)


@pytest.mark.parametrize("bits", [2, 4])
def test_outer_matvec_half_dots_are_the_reference_within_fp16_rounding(bits):
    """half=True (an fp16/bf16 model's step): q, p and the dequantized tiles rounded to fp16 for the tensor-core
    dots, fp32 accumulation: the reference within fp16 rounding, GQA rows included."""
    torch.manual_seed(bits)
    B, H, rep, n, d = 1, 2, 4, 96, 128
    k, v = torch.randn(2, B, H, n, d, device=DEVICE)
    ko, vo = quantize(k, bits, 32, axis=-2), quantize(v, bits, 32, axis=-1)
    q = torch.randn(B, H * rep, d, device=DEVICE)
    p = torch.softmax(torch.randn(B, H * rep, n, device=DEVICE), -1)
    kq, vq = (ko.codes, ko.scale, ko.zero), (vo.codes, vo.scale, vo.zero)
    assert_close(qk_outer(q, *kq, bits, half=True), qk_outer_ref(q, *kq, bits), torch.float16)
    assert_close(pv_outer(p, *vq, bits, half=True), pv_outer_ref(p, *vq, bits), torch.float16)


def test_matvec_reads_cache_slices_without_copies_going_wrong():
    """Cache buffers are allocated for max_len tokens and sliced along the token dim: strided rows."""
    k = torch.randn(2, 3, 128, 64, device=DEVICE)
    full = quantize_unified(k, 2, -1, "hybrid")
    sliced = (full.codes[:, :, :64], full.scale[:, :, :64], full.slot[:, :, :64], full.sym[:, :, :64])
    dense = tuple(t.contiguous() for t in sliced)
    q = torch.randn(2, 3, 64, device=DEVICE)
    assert not sliced[0].is_contiguous()
    torch.testing.assert_close(qk_inner(q, *sliced, 2), qk_inner(q, *dense, 2), rtol=0, atol=0)
    torch.testing.assert_close(qk_inner(q, *sliced, 2), qk_inner_ref(q, *dense, 2), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# Fused decode attention
# ----------------------------------------------------------------------------------------------------
ATTENTION = [(bits, d, dtype, *case) for (bits, d, dtype), case in zip(
    itertools.product((2, 4), (64, 128), (torch.float32, torch.float16)),
    itertools.cycle([  # B, H, n_rep, N, W, mode, num_splits
        (1, 1, 1, 32, 0, "asym", None), (2, 2, 3, 160, 5, "hybrid", 2), (2, 1, 2, 96, 5, "sym", None),
        (1, 2, 1, 160, 0, "hybrid", 5), (1, 2, 3, 96, 0, "asym", 3), (2, 1, 1, 32, 5, "hybrid", None),
        (1, 1, 2, 0, 5, "hybrid", None)]))] + [
    (2, 64, torch.float16, 1, 2, 4, 160, 5, "hybrid", None), (4, 128, torch.float32, 2, 2, 2, 96, 5, "sym", 2),
    (2, 128, torch.bfloat16, 2, 2, 4, 160, 5, "hybrid", 3), (4, 64, torch.bfloat16, 1, 2, 2, 96, 5, "asym", None),
    (2, 64, torch.bfloat16, 1, 1, 3, 288, 5, "sym", None), (4, 128, torch.float16, 1, 2, 4, 288, 5, "hybrid", 1),
    (2, 128, torch.float16, 1, 1, 3, 32, 5, "asym", None), (4, 64, torch.float32, 1, 2, 1, 160, 5, "hybrid", 4)]


@pytest.mark.parametrize("bits,d,dtype,B,H,rep,n,w,mode,splits", ATTENTION, ids=name)
def test_fused_attention_matches_reference(bits, d, dtype, B, H, rep, n, w, mode, splits):
    torch.manual_seed(n + w + rep)
    k, v = torch.randn(2, B, H, n, d, device=DEVICE)
    k_win, v_win = torch.randn(2, B, H, w, d, device=DEVICE).to(dtype)
    q = torch.randn(B, H * rep, d, device=DEVICE).to(dtype)
    kq, vq = packed(k, bits, -1, mode), packed(v, bits, -2, mode)
    args = (q, *kq, *vq, k_win, v_win, bits)
    got = innerq_decode_attention(*args, num_splits=splits, mask_upto=upto(mode, n))
    assert got.dtype == dtype and got.shape == (B, H * rep, d)
    assert_close(got, innerq_decode_attention_ref(*args, mask_upto=upto(mode, n)), dtype)


@pytest.mark.parametrize("mode", ["asym", "hybrid", "sym"])
@pytest.mark.parametrize("bits", [2, 4])
def test_fp16_attention_is_the_reference_within_output_rounding(bits, mode):
    """fp16 inputs, keys and values far from zero (large fp32 zero points): compiled, the kernel dequantizes with
    one fp16 fused multiply-add (the zero point rounded to fp16), interpreted in fp32; either way its output stays
    within two fp16 ulps of the fp32 reference at the output's magnitude."""
    torch.manual_seed(bits)
    n, d, H, rep = (64, 64, 1, 2) if DEVICE == "cpu" else (2048, 128, 8, 4)
    k, v = torch.randn(2, 1, H, n, d, device=DEVICE) + 12.0
    q = torch.randn(1, H * rep, d, device=DEVICE).half()
    win = (torch.randn(1, H, 5, d, device=DEVICE) + 12.0).half()
    kq, vq = packed(k, bits, -1, mode), packed(v, bits, -2, mode)
    got = innerq_decode_attention(q, *kq, *vq, win, win, bits, mask_upto=upto(mode, n)).float()
    want = innerq_decode_attention_ref(q.float(), *kq, *vq, win.float(), win.float(), bits, mask_upto=upto(mode, n))
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().max())) - 10)
    assert (got - want).abs().max() <= 2 * ulp


@pytest.mark.parametrize("bits,dtype,mode,live,mask_upto", [
    (2, torch.float32, "hybrid", (96, 3, 5), 160), (4, torch.float16, "hybrid", (160, 4, 8), 64),
    (2, torch.float32, "asym", (32, 0, 1), 160), (2, torch.float16, "sym", (0, 4, 1), 0),
    (2, torch.bfloat16, "hybrid", (128, 4, 3), 96)], ids=name)
def test_fused_attention_reads_live_lengths_from_the_device(bits, dtype, mode, live, mask_upto):
    """The CUDA-graph form: buffers sized for 160 quantized tokens, a 4-token sink and an 8-token recent
    window, of which `live` = (quantized, sink, recent) are in use, given as a device tensor; tokens from
    mask_upto on are symmetric without a mask bit (hybrid_prefill); the query scaled per KV head inside the
    kernel (q_scale). Splits past the live tokens add nothing."""
    torch.manual_seed(bits + live[0])
    B, H, rep, N, d = 2, 2, 3, 160, 64
    k, v = torch.randn(2, B, H, N, d, device=DEVICE)
    sink_k, sink_v = torch.randn(2, B, H, 4, d, device=DEVICE).to(dtype)
    res_k, res_v = torch.randn(2, B, H, 8, d, device=DEVICE).to(dtype)
    q = torch.randn(B, H * rep, d, device=DEVICE).to(dtype)
    lengths = torch.tensor(live, dtype=torch.int32, device=DEVICE)
    args = (q, *packed(k, bits, -1, mode), *packed(v, bits, -2, mode), sink_k, sink_v, bits)
    q_scale = (torch.rand(B, H, d, device=DEVICE) + 0.5).to(dtype)          # InnerQ's key normalization
    extra = dict(k_win2=res_k, v_win2=res_v, lengths=lengths, mask_upto=mask_upto, q_scale=q_scale)
    want = innerq_decode_attention_ref(*args, **extra)
    assert_close(innerq_decode_attention(*args, num_splits=5, **extra), want, dtype)
    n, w, w2 = live                        # the same as slicing the live tokens out
    sliced = innerq_decode_attention_ref(q, *(t[:, :, :n] for t in packed(k, bits, -1, mode)[:3]), args[4],
                                         *(t[:, :, :n] for t in packed(v, bits, -2, mode)[:1]),
                                         *(t[:, :, :n // 32] for t in packed(v, bits, -2, mode)[1:3]), args[8],
                                         sink_k[:, :, :w], sink_v[:, :, :w], bits, k_win2=res_k[:, :, :w2],
                                         v_win2=res_v[:, :, :w2], mask_upto=mask_upto, q_scale=q_scale)
    assert_close(sliced, want, dtype)


@pytest.mark.parametrize("dtype,live,delta", [(torch.float32, (96, 4, 40), 5), (torch.float16, (64, 4, 33), 0),
                                              (torch.bfloat16, (128, 4, 64), 31)], ids=name)
def test_fused_attention_reads_the_second_windows_keys_from_a_ring(dtype, live, delta):
    """k_ring2: the second window's row j takes k_win2's row j (the lagging keys) for j < delta, else row
    (n + j) mod KW of the key ring, n the quantized tokens (InnerQ's paper windows); kernel and reference equal the
    same keys laid out in the value window's order."""
    torch.manual_seed(delta)
    B, H, rep, N, d, KW = 2, 2, 3, 160, 64, 41
    k, v = torch.randn(2, B, H, N, d, device=DEVICE)
    sink_k, sink_v = torch.randn(2, B, H, 4, d, device=DEVICE).to(dtype)
    ring, lag = torch.randn(B, H, KW, d, device=DEVICE).to(dtype), torch.randn(B, H, 32, d, device=DEVICE).to(dtype)
    res_v = torch.randn(B, H, 64, d, device=DEVICE).to(dtype)
    n = live[0]
    rows = torch.arange(64, device=DEVICE)
    aligned = torch.where((rows < delta)[:, None], lag.index_select(2, rows.clamp_max(31)),
                          ring.index_select(2, (n + rows) % KW))
    q = torch.randn(B, H * rep, d, device=DEVICE).to(dtype)
    args = (q, *packed(k, 2, -1, "hybrid"), *packed(v, 2, -2, "hybrid"), sink_k, sink_v, 2)
    lengths = torch.tensor(live, dtype=torch.int32, device=DEVICE)
    want = innerq_decode_attention_ref(*args, k_win2=aligned, v_win2=res_v, lengths=lengths)
    ringed = dict(k_win2=lag, v_win2=res_v, k_ring2=ring, lengths=torch.tensor((*live, delta), dtype=torch.int32,
                                                                             device=DEVICE))
    assert_close(innerq_decode_attention(*args, num_splits=3, **ringed), want, dtype)
    assert_close(innerq_decode_attention_ref(*args, **ringed), want, dtype)
    with pytest.raises(ValueError, match="k_ring2 needs k_win2"):
        innerq_decode_attention(*args, v_win2=res_v, k_win2=lag, k_ring2=ring)


@pytest.mark.parametrize("rows,splits", [(8, 33), (256, 2), (384, 2), (536, 6), (632, 5), (64, 8), (80, 6)])
def test_split_count_fills_whole_waves(rows, splits):
    """An H100's 264 program slots (132 SMs, 2 programs each): no split count up to twice one wave's takes fewer
    waves per split."""
    assert whole_waves(rows, 264, 10_000) == splits
    one_wave = -(-264 // rows)
    assert all(-(-rows * s // 264) / s >= -(-rows * splits // 264) / splits for s in range(1, 2 * one_wave + 5))


def test_split_count_is_capped_by_the_groups():
    assert whole_waves(8, 264, 5) <= 5 and whole_waves(632, 264, 1) == 1 and whole_waves(1, 4, 0) == 1


@pytest.mark.parametrize("rows,n_groups,plan", [(8, 1020, (43, 24, 4)), (8, 4092, (45, 92, 4)), (16, 1020, (22, 48, 4)),
                                                (32, 1020, (11, 96, 4)), (8, 124, (31, 4, 4)), (8, 3, (3, 1, 1))])
def test_one_wave_plans_whole_steps_within_the_cap(rows, n_groups, plan):
    """2.75 programs an SM on 132 SMs (363 programs): the most splits a row whose whole steps (4 groups, fewer where
    a split holds fewer) cover the groups, every program in one wave."""
    splits, per_split, gs = one_wave(n_groups, rows, 132, 2.75, 4, 8)
    assert (splits, per_split, gs) == plan
    assert rows * splits <= 363 and per_split % gs == 0 and splits * per_split >= n_groups > (splits - 1) * per_split
    assert per_split == gs or rows * -(-n_groups // (per_split - gs)) > 363      # a step shorter: too many programs


def test_one_wave_leaves_larger_batches_to_whole_waves():
    assert one_wave(1020, 64, 132, 2.75, 4, 8) is None and one_wave(1020, 64, 132, 2.85, 4, 4) == (5, 204, 4)
    assert one_wave(1020, 256, 132, 2.85, 4, 4) is None


def test_fused_attention_scale_and_peaked_softmax():
    """A large softmax scale: one key dominates, so the online max and the split merge must be right."""
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 160, 64, device=DEVICE)
    k_win, v_win = torch.randn(2, 1, 2, 5, 64, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    args = (q, *packed(k, 2, -1, "hybrid"), *packed(v, 2, -2, "hybrid"), k_win, v_win, 2)
    for splits in (1, 5):
        assert_close(innerq_decode_attention(*args, sm_scale=3.0, num_splits=splits),
                     innerq_decode_attention_ref(*args, sm_scale=3.0), torch.float32)


@pytest.mark.parametrize("rep,columns,d,token", [(4, 3, 64, True), (4, 94, 128, True), (4, 300, 64, False),
                                                   (5, 130, 128, True), (1, 70, 64, False)])
def test_combine_merges_any_number_of_splits(rep, columns, d, token):
    """The shared combine against a torch merge of the partials (base-2 online softmax), with empty splits (m = -inf,
    l = 0), and the token given apart attended last: as many splits as 128K at batch 1 makes, where a program takes
    fewer channels so that every split fits one step."""
    torch.manual_seed(0)
    H = 2
    m = torch.randn(H * rep, columns, device=DEVICE) * 4
    m[:, 1::7] = float("-inf")
    l = torch.rand(H * rep, columns, device=DEVICE) * 8 + 1
    l[m == float("-inf")] = 0
    acc = torch.randn(H * rep, columns, d, device=DEVICE) * l[..., None]
    out = torch.empty(1, H * rep, d, device=DEVICE)
    q, k_t, v_t = torch.randn(1, H * rep, d, device=DEVICE), *torch.randn(2, 1, H, 1, d, device=DEVICE)
    qk_scale = 0.2
    combine(m, l, acc, out, H, rep, 4, (q, (k_t, k_t.stride(1)), (v_t, v_t.stride(1)), qk_scale) if token else None)
    if token:                                          # the token as one more split: its score, weight 1, its value
        s = (q[0] * k_t[0, :, 0].repeat_interleave(rep, 0)).sum(-1) * qk_scale
        m, l = torch.cat([m, s[:, None]], 1), torch.cat([l, torch.ones_like(s)[:, None]], 1)
        acc = torch.cat([acc, v_t[0, :, 0].repeat_interleave(rep, 0)[:, None]], 1)
    w = torch.exp2(m - m.max(1, keepdim=True).values)
    want = (w[..., None] * acc).sum(1) / (w * l).sum(1, keepdim=True)
    assert_close(out[0], want, torch.float32)


# ----------------------------------------------------------------------------------------------------
# Quantize and pack
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,d,dtype,mode", list(itertools.product(
    (2, 4), (64, 128), (torch.float32, torch.float16), ("asym", "sym", "hybrid"))), ids=name)
def test_quantize_is_bit_identical_to_quantize_unified(bits, d, dtype, mode):
    torch.manual_seed(bits * d)
    x = torch.randn(2, 3, 37, d, device=DEVICE) * torch.rand(2, 3, 37, 1, device=DEVICE) * 3
    x = (x + torch.randn(2, 3, 37, 1, device=DEVICE)).to(dtype)         # offsets: both modes get picked
    x[0, 0, 0] = 0                                                      # all-zero groups: scale 0
    x[0, 0, 1, :32] = 1.5                                               # a constant group
    got, want = quantize_inner(x, bits, mode), quantize_inner_ref(x, bits, mode)
    for part in ("codes", "scale", "slot", "sym"):
        assert torch.equal(getattr(got, part), getattr(want, part)), part
    if mode == "hybrid":
        assert 0 < want.sym.float().mean() < 1


# ----------------------------------------------------------------------------------------------------
# Launcher errors
# ----------------------------------------------------------------------------------------------------
def test_unsupported_bits_are_rejected():
    x = torch.randn(1, 1, 32, 64, device=DEVICE)
    q = torch.randn(1, 1, 64, device=DEVICE)
    for bits in (3, 8):
        kq, vq = unified(x, bits, -1, "asym"), unified(x, bits, -2, "asym")
        ko = quantize(x, bits, 32, axis=-2)
        calls = [lambda: qk_inner(q, *kq, bits), lambda: pv_inner(q[..., :32], *vq, bits),
                 lambda: qk_outer(q, ko.codes, ko.scale, ko.zero, bits),
                 lambda: innerq_decode_attention(q, *kq, *vq, x[:, :, :0], x[:, :, :0], bits),
                 lambda: quantize_inner(x, bits)]
        for call in calls:
            with pytest.raises(ValueError, match="bits"):
                call()


def test_mismatched_inputs_are_rejected():
    k = torch.randn(1, 2, 64, 64, device=DEVICE)
    kq = unified(k, 2, -1, "hybrid")
    win = torch.randn(1, 2, 3, 64, device=DEVICE)
    q = torch.randn(1, 4, 64, device=DEVICE)
    codes, scale, slot, sym = kq
    with pytest.raises(ValueError, match="k_scale has shape"):
        qk_inner(q[:, :2], codes, scale[:, :, :32], slot, sym, 2)
    with pytest.raises(ValueError, match="k_slot has dtype"):
        qk_inner(q[:, :2], codes, scale, slot.float(), sym, 2)
    with pytest.raises(ValueError, match="q has shape"):
        qk_inner(q, *kq, 2)
    with pytest.raises(ValueError, match="whole groups"):
        qk_inner(q[:, :2], codes[:, :, :40], scale[:, :, :40], slot[:, :, :40], sym[:, :, :40], 2)
    with pytest.raises(ValueError, match="power of two"):
        qk_inner(q[:, :2, :48], codes[..., :3], scale, slot, sym, 2)
    kp, vp = packed(k, 2, -1, "hybrid"), packed(k, 2, -2, "hybrid")
    with pytest.raises(ValueError, match="not a multiple"):
        innerq_decode_attention(q[:, :3], *kp, *vp, win, win, 2)
    with pytest.raises(ValueError, match="k_win has dtype"):
        innerq_decode_attention(q, *kp, *vp, win.half(), win.half(), 2)
    with pytest.raises(ValueError, match="v_scale has shape"):
        innerq_decode_attention(q, *kp, *kp, win, win, 2)
    with pytest.raises(ValueError, match="both k_mask and v_mask"):
        innerq_decode_attention(q, *kp, *vp[:3], None, win, win, 2)
    with pytest.raises(ValueError, match="k_mask has shape"):
        innerq_decode_attention(q, *kp[:3], kp[3][..., :1], *vp, win, win, 2)
    with pytest.raises(ValueError, match="both k_win2 and v_win2"):
        innerq_decode_attention(q, *kp, *vp, win, win, 2, k_win2=win)
    with pytest.raises(ValueError, match="lengths has shape"):
        innerq_decode_attention(q, *kp, *vp, win, win, 2, lengths=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="nothing to attend"):
        ka, va = packed(k, 2, -1, "asym"), packed(k, 2, -2, "asym")
        innerq_decode_attention(q, *(t if t is None else t[:, :, :0] for t in ka),
                                *(t if t is None else t[:, :, :0] for t in va), win[:, :, :0], win[:, :, :0], 2)
    with pytest.raises(ValueError, match="unknown quantization mode"):
        quantize_inner(k, 2, "hybrid_prefill")
    with pytest.raises(ValueError, match="power of two"):
        quantize_inner(k[..., :48], 2)


@pytest.mark.parametrize("bits,mode,dtype", [(2, "hybrid", torch.float32), (4, "asym", torch.float16),
                                             (2, "sym", torch.float32), (4, "hybrid", torch.bfloat16)], ids=name)
def test_flush_kernel_writes_what_the_cache_writes(bits, mode, dtype):
    """innerq_flush (the CUDA-graph step's group quantization, reading its slot from a device tensor) leaves
    InnerQ's buffers bit-identical to the cache's torch path (InnerQCodec.write) for the same 32 tokens."""
    from kvzoo.kernels.quantize_pack import innerq_flush
    from tests.cache.test_kivi import smollm_shaped_layer_cache

    spec = f"innerq:bits={bits},sink=0,recent=32,quant_mode={mode},key_norm=false,policy=grouped"   # the static step's
    ours, ref = (smollm_shaped_layer_cache(spec, 192, dtype) for _ in range(2))
    torch.manual_seed(bits)
    for cache in (ours, ref):
        cache.to(DEVICE)
    k, v = (torch.randn(2, 1, 3, 64, 64, device=DEVICE) * 2 + 0.5).to(dtype)
    for n in (0, 64):                                # two groups, the second at a later slot
        k_res, v_res = ours.store.recent("k"), ours.store.recent("v")
        k_res[:, :, :32], v_res[:, :, :32] = k[:, :, :32], v[:, :, :32]
        oc, ov = ours.store.codecs["k"], ours.store.codecs["v"]
        innerq_flush(k_res, v_res, torch.tensor([n], device=DEVICE), oc.codes, oc.scale, oc.slot, oc.mask, ov.codes,
                     ov.scale, ov.slot, ov.mask, bits, mode, write_mask=mode == "hybrid")
        for kv, x in (("k", k), ("v", v)):
            ref.store.codecs[kv].write(n, n + 32, x[:, :, :32])
        k, v = k.roll(7, dims=2) * 1.5, v.roll(5, dims=2) - 0.25
    for name in ("codes", "scale", "slot", "mask"):
        for kv in "kv":
            got, want = getattr(ours.store.codecs[kv], name), getattr(ref.store.codecs[kv], name)
            assert torch.equal(got, want), f"{kv}_{name}"


@pytest.mark.parametrize("bits,mode,dtype", [(2, "hybrid", torch.float32), (4, "asym", torch.float16),
                                             (2, "sym", torch.float32), (2, "hybrid_prefill", torch.bfloat16)],
                         ids=name)
def test_key_step_kernel_equals_the_torch_path(monkeypatch, bits, mode, dtype):
    """innerq_aligned_keys and innerq_key_flush (the static step's per-token key work at the paper's windows)
    against the torch path they replace (InnerQCache._lagging_keys and _flush_keys with FUSED_KEY_STEP off): the
    lagging keys, the key codes, scales, slots and
    mask bits, and the key window (a ring), bit for bit, over 72 steps (keys leaving a token at a time, values 32
    at a time, so every lag of keys behind values from 0 to 31 occurs)."""
    import kvzoo.cache.innerq as innerq
    from kvzoo.cache.base import StaticStep
    from tests.cache.test_kivi import smollm_shaped_layer_cache, store

    spec = f"innerq:bits={bits},sink=4,recent=32,quant_mode={mode},key_norm=false"     # the paper's windows
    ours, ref = (smollm_shaped_layer_cache(spec, 112, dtype).to(DEVICE) for _ in range(2))
    torch.manual_seed(bits)
    k, v = (torch.randn(2, 1, 3, 112, 64, device=DEVICE) * 2 + 0.5).to(dtype)
    for cache in (ours, ref):                        # a prompt of 40 tokens: 4 keys quantized, no value yet
        cache.store.codecs["k"].first_call = cache.store.codecs["v"].first_call = True
        store(cache, k[:, :, :40], v[:, :, :40])
        cache.store.codecs["k"].first_call = cache.store.codecs["v"].first_call = False
    for t in range(40, 112):
        for cache, fused in ((ours, True), (ref, False)):
            monkeypatch.setattr(innerq, "FUSED_KEY_STEP", fused)
            step = StaticStep.make(torch.tensor([t], device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE),
                                   112)
            st = cache.store
            st.write_token_at(t, step, {"k": k[:, :, t:t + 1], "v": v[:, :, t:t + 1]})
            cache.keys = cache._lagging_keys(step, st.window_row(step, "v")[0])
            cache._flush_keys(step)
            st.flush_at(t, step, ("v",))
            cache.length += 1
        assert torch.equal(ours.keys, ref.keys), f"aligned keys, step {t}"
        assert torch.equal(ours.store.recent("k"), ref.store.recent("k")), f"key window, step {t}"
        for buf in ("codes", "scale", "slot", "mask"):
            got, want = (getattr(c.store.codecs["k"], buf) for c in (ours, ref))
            assert torch.equal(got, want), f"key {buf}, step {t}"


@pytest.mark.parametrize("kw,mode", [(1, "hybrid"), (33, "asym")])
def test_key_flush_at_any_window_length(kw, mode):
    """innerq_key_flush with a key window of one row (recent=0) or of a partial block of rows, a ring: slot n holds
    row n mod KW as quantize_unified quantizes it, and no row moves."""
    from kvzoo.kernels.quantize_pack import innerq_key_flush

    torch.manual_seed(kw)
    B, H, d, capacity, n = 1, 2, 64, 40, 37
    win = torch.randn(B, H, kw, d, device=DEVICE) * 2 + 0.5
    before = win.clone()
    want = quantize_unified(win[:, :, n % kw:n % kw + 1], 2, -1, mode)
    codes = torch.zeros(B, H, capacity, d // 16, dtype=torch.int32, device=DEVICE)
    scale = torch.zeros(B, H, capacity, d // 32, dtype=torch.float16, device=DEVICE)
    slot = torch.zeros(B, H, capacity, d // 32, dtype=torch.int32, device=DEVICE)
    mask = None if mode == "asym" else torch.zeros(B, H, d // 32, capacity // 32 + 1, dtype=torch.int32,
                                                   device=DEVICE)
    innerq_key_flush(win, torch.tensor([n], device=DEVICE), codes, scale, slot, mask, 2, mode)
    assert torch.equal(codes[:, :, n], want.codes[:, :, 0]) and torch.equal(scale[:, :, n], want.scale[:, :, 0])
    assert torch.equal(slot[:, :, n], want.slot[:, :, 0])
    if mask is not None:
        assert torch.equal((mask[..., n // 32] >> (n % 32)) & 1, want.sym[:, :, 0].int())
    assert torch.equal(win, before)


@pytest.mark.parametrize("bits,group,dtype", [(2, 32, torch.float32), (4, 16, torch.bfloat16), (8, 128, torch.float16),
                                              (2, 64, torch.bfloat16)], ids=name)
def test_token_write_kernel_equals_the_torch_path(monkeypatch, bits, group, dtype):
    """GroupCodec.write_at of one token (a static step's value, KIVI's layout) through group_token_write equals
    its torch path (kvzoo.cache.kvquant.quantize, pack, index copies) bit for bit, a constant group included."""
    import kvzoo.cache.store as store
    from kvzoo.cache.store import GroupCodec

    torch.manual_seed(bits)
    ours, ref = (GroupCodec((2, 3), 8, 256, bits, group, False, dtype, DEVICE) for _ in range(2))
    assert ours._token_kernel(torch.zeros(1, device=DEVICE))
    for slot in (0, 5, 7):
        row = (torch.randn(2, 3, 1, 256, device=DEVICE) * 3 + 0.7).to(dtype)
        row[0, 1, 0, :group] = 1.25                                              # scale 0: every code 0
        for codec, fused in ((ours, True), (ref, False)):
            monkeypatch.setattr(store, "FUSED_TOKEN_WRITE", fused)
            codec.write_at(torch.tensor([slot], device=DEVICE), row)
    for buf in ("codes", "scale", "zero"):
        assert torch.equal(getattr(ours, buf), getattr(ref, buf)), buf


@pytest.mark.parametrize("bits,group,recent,dtype", [(2, 32, 128, torch.float16), (4, 16, 5, torch.bfloat16),
                                                     (8, 64, 0, torch.float32), (2, 16, 300, torch.float32)],
                         ids=name)
def test_window_flush_kernel_equals_the_torch_path(monkeypatch, bits, group, recent, dtype):
    """GroupCodec.flush_at of a window whose oldest row leaves each step (KIVI's values under the authors'
    windows, a ring: slot s's token in row s mod (R + 1)) in one kernel equals its torch path (write_at's quantize,
    pack and index copies of that row) bit for bit: the codes, scales and zeros, over consecutive steps that wrap
    around the ring, and the window left as it was."""
    import kvzoo.cache.store as store
    from kvzoo.cache.store import GroupCodec

    torch.manual_seed(bits + recent)
    ours, ref = (GroupCodec((2, 3), 8, 64, bits, group, False, dtype, DEVICE) for _ in range(2))
    window = (torch.randn(2, 3, recent + 1, 64, device=DEVICE) * 3 + 0.7).to(dtype)
    window[1, 2, 0, :group] = -2.5                                             # scale 0: every code 0
    windows = {True: window.clone(), False: window.clone()}
    for slot in (0, 1, 6, 7):
        token = (torch.randn(2, 3, 64, device=DEVICE) + slot).to(dtype)
        row = slot % (recent + 1)
        want = quantize(windows[True][..., row:row + 1, :], bits, group, axis=-1)       # the token of slot `slot`
        for codec, fused in ((ours, True), (ref, False)):
            monkeypatch.setattr(store, "FUSED_TOKEN_WRITE", fused)
            before = windows[fused].clone()
            codec.flush_at(torch.tensor([slot], device=DEVICE), windows[fused], 1)
            assert torch.equal(windows[fused], before), f"the ring's rows stay, slot {slot}"
            windows[fused][..., (slot + recent) % (recent + 1), :] = token        # the next step's token
        assert torch.equal(ours.codes[..., slot:slot + 1, :], want.codes), f"codes of slot {slot}"
    for buf in ("codes", "scale", "zero"):
        assert torch.equal(getattr(ours, buf), getattr(ref, buf)), buf
    for buf in ("codes", "scale", "zero"):
        assert torch.equal(getattr(ours, buf), getattr(ref, buf)), buf


def test_token_write_refuses_bad_inputs():
    """group_token_write names what it cannot take: a bit width, a group, several rows outside a ring, and views
    where it writes (in a ring, the window itself)."""
    from kvzoo.kernels.quantize_pack import group_token_write

    codes = torch.zeros(2, 8, 4, dtype=torch.int32, device=DEVICE)
    scale, zero = (torch.zeros(2, 8, 2, dtype=torch.float16, device=DEVICE) for _ in range(2))
    window = torch.randn(2, 5, 64, device=DEVICE)
    slot = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="2-, 4- or 8-bit"):
        group_token_write(window[:, :1], slot, codes, scale, zero, 3, 32)
    with pytest.raises(ValueError, match="power of two"):
        group_token_write(window[:, :1], slot, codes, scale, zero, 2, 24)
    with pytest.raises(ValueError, match="one row unless ring=True"):
        group_token_write(window, slot, codes, scale, zero, 2, 32)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        group_token_write(window[..., :32], slot, codes, scale, zero, 2, 32, ring=True)
    with pytest.raises(ValueError, match="codes must be contiguous"):
        group_token_write(window[:, :1], slot, codes[:, ::2], scale, zero, 2, 32)


def test_flush_kernel_refuses_views():
    from kvzoo.kernels.quantize_pack import innerq_flush
    from tests.cache.test_kivi import smollm_shaped_layer_cache

    c = smollm_shaped_layer_cache("innerq:sink=0,recent=32,key_norm=false,policy=grouped", 96, torch.float32)
    c = c.to(DEVICE)
    with pytest.raises(ValueError, match="k_res must be contiguous"):
        k, v = c.store.codecs["k"], c.store.codecs["v"]
        innerq_flush(c.store.recent("k")[:, :, :32], c.store.recent("v"), torch.zeros(1, dtype=torch.long, device=DEVICE),
                     k.codes, k.scale, k.slot, k.mask, v.codes, v.scale, v.slot, v.mask, 2, "hybrid", True)


def test_key_kernels_refuse_bad_inputs():
    from kvzoo.kernels.quantize_pack import innerq_aligned_keys, innerq_key_flush

    win = torch.zeros(1, 2, 33, 64, device=DEVICE)
    n = torch.zeros(1, dtype=torch.long, device=DEVICE)
    codes = torch.zeros(1, 2, 64, 4, dtype=torch.int32, device=DEVICE)
    scale = torch.zeros(1, 2, 64, 2, dtype=torch.float16, device=DEVICE)
    slot = torch.zeros(1, 2, 64, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="unknown read mode 'nope'; accepted: asym, sym, mask"):
        innerq_aligned_keys(win, n, n, codes, scale, slot, None, 64, 2, "nope", 0)
    with pytest.raises(ValueError, match="hybrid groups need the mask bits"):
        innerq_aligned_keys(win, n, n, codes, scale, slot, None, 64, 2, "mask", 0)
    with pytest.raises(ValueError, match="unknown quantization mode 'nope'"):
        innerq_key_flush(win, n, codes, scale, slot, None, 2, "nope")
    with pytest.raises(ValueError, match="hybrid groups need the mask bits"):
        innerq_key_flush(win, n, codes, scale, slot, None, 2, "hybrid")
    with pytest.raises(ValueError, match="win must be contiguous"):
        innerq_key_flush(win[:, :, :32], n, codes, scale, slot, None, 2, "asym")
    with pytest.raises(ValueError, match="bits"):
        innerq_aligned_keys(win, n, n, codes, scale, slot, None, 64, 3, "asym", 0)


HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)


# (d, dtype, rep, B, N, live, mode, mask_upto): partial steps and splits, 16 query rows, tokens past mask_upto
# symmetric without a bit (hybrid_prefill), every group symmetric (sym), none (asym)
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("d,dtype,rep,B,N,live,mode,mask_upto", [
    (128, torch.float16, 4, 2, 1024, 1024, "hybrid", 1024), (64, torch.bfloat16, 3, 3, 800, 736, "hybrid", 800),
    (128, torch.bfloat16, 1, 1, 160, 160, "asym", 160), (64, torch.float16, 16, 1, 4096, 4064, "hybrid", 4096),
    (128, torch.float16, 4, 1, 640, 608, "hybrid", 320), (128, torch.float16, 2, 1, 640, 640, "sym", 0),
    (64, torch.float16, 4, 2, 640, 576, "asym", 640)], ids=name)
def test_hopper_kernel_matches_reference_and_triton_kernel(d, dtype, rep, B, N, live, mode, mask_upto, monkeypatch):
    innerq_hopper = pytest.importorskip("kvzoo.kernels.innerq_hopper")
    torch.manual_seed(d + rep + N)
    H = 2
    k, v = torch.randn(2, B, H, N, d, device=DEVICE) + torch.randn(d, device=DEVICE)   # channels off zero
    kq, vq = packed(k, 2, -1, mode), packed(v, 2, -2, mode)
    if mode == "hybrid" and mask_upto < N:          # hybrid_prefill: bits only below mask_upto
        kq = (*kq[:3], kq[3][..., :mask_upto // 32])
        vq = (*vq[:3], vq[3][:, :, :mask_upto // 32])
    k_win, v_win = torch.randn(2, B, H, 8, d, device=DEVICE).to(dtype)
    q = torch.randn(B, H * rep, d, device=DEVICE).to(dtype)
    q_scale = (torch.rand(B, H, d, device=DEVICE) + 0.5).to(dtype)
    lengths = torch.tensor([live, 8, 0], dtype=torch.int32, device=DEVICE)
    args = (q, *kq, *vq, k_win, v_win, 2)
    kw = dict(lengths=lengths, mask_upto=mask_upto, q_scale=q_scale)
    calls = []
    run = innerq_hopper.split_partials
    monkeypatch.setattr(innerq_hopper, "split_partials", lambda *a: calls.append(1) or run(*a))
    splits = max(1, min(3, N // 128))             # whole steps of 4 groups in a split
    got = innerq_decode_attention(*args, num_splits=splits, **kw)
    assert calls, "the Gluon kernel was not taken"
    assert_close(got, innerq_decode_attention_ref(*args, **kw), dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = innerq_decode_attention(*args, num_splits=splits, **kw)
    graph.replay()
    assert torch.equal(replayed, got)
    monkeypatch.setattr(innerq_hopper, "ENABLED", False)
    assert_close(got, innerq_decode_attention(*args, num_splits=splits, **kw), dtype)
    assert len(calls) == 2                     # eager and captured; none with the kernel disabled


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("mode", ["hybrid", "asym"])
def test_hopper_kernel_under_the_register_cap_gives_the_same_output(mode, monkeypatch):
    """Three programs an SM (programs_per_sm at large batches, forced here for 4 KV rows): the kernel compiled under
    register_cap computes what the uncapped one does, bit for bit."""
    innerq_hopper = pytest.importorskip("kvzoo.kernels.innerq_hopper")
    torch.manual_seed(3)
    B, H, N, d, rep = 2, 2, 2048, 128, 4
    k, v = torch.randn(2, B, H, N, d, device=DEVICE) + torch.randn(d, device=DEVICE)
    args = (torch.randn(B, H * rep, d, device=DEVICE).half(), *packed(k, 2, -1, mode), *packed(v, 2, -2, mode),
            *torch.randn(2, B, H, 8, d, device=DEVICE).half(), 2)
    programs = []
    run = innerq_hopper.split_partials
    monkeypatch.setattr(innerq_hopper, "split_partials", lambda *a: programs.append(a[-1]) or run(*a))
    uncapped = innerq_decode_attention(*args, num_splits=4)
    monkeypatch.setattr(innerq_hopper, "BUSY_ROWS_PER_SM", 0)
    capped = innerq_decode_attention(*args, num_splits=4)
    assert programs == [innerq_hopper.PROGRAMS_PER_SM, innerq_hopper.BUSY_PROGRAMS_PER_SM]
    assert torch.equal(capped, uncapped)


def test_hopper_programs_per_sm_and_register_cap():
    """Two programs an SM (no register cap) below a KV row per SM, three (168 registers, 4 warps) from there."""
    innerq_hopper = pytest.importorskip("kvzoo.kernels.innerq_hopper")
    assert [innerq_hopper.programs_per_sm(rows, 132) for rows in (8, 131, 132, 488)] == [2, 2, 3, 3]
    assert innerq_hopper.register_cap(2) is None and innerq_hopper.register_cap(3) == 168


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("mode", ["hybrid", "asym"])
@pytest.mark.parametrize("B,N", [(1, 32768), (4, 32768), (8, 32768), (16, 16384), (32, 8192)], ids=name)
def test_hopper_kernel_plans_one_wave_at_small_batches(mode, B, N, monkeypatch):
    """The split kernel's plan on Llama-3.1-8B's heads: one wave of PROGRAMS_PER_SM programs an SM
    (innerq_attention.one_wave at innerq_hopper.WAVE) where it holds enough splits a KV row, else whole waves of
    programs_per_sm's."""
    innerq_hopper = pytest.importorskip("kvzoo.kernels.innerq_hopper")
    from kvzoo.kernels.innerq_attention import _plan_splits, one_wave
    from kvzoo.kernels.quant_matvec import sm_count
    H, d, hybrid = 8, 128, mode == "hybrid"
    plans = []       # (groups a split, splits, programs an SM) of each launch; none run
    monkeypatch.setattr(innerq_hopper, "split_partials", lambda *a: plans.append((a[9], a[10], a[-1])))
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def words(*shape):
        return torch.randint(-2 ** 31, 2 ** 31, shape, dtype=torch.int32, device=DEVICE, generator=g)

    def halves(*shape):
        return torch.rand(shape, device=DEVICE, generator=g).half()

    keys = words(B, H, N, d // 16), halves(B, H, N, d // 32), words(B, H, N, d // 32), \
        words(B, H, d // 32, N // 32) if hybrid else None
    values = words(B, H, N, d // 16), halves(B, H, N // 32, d), words(B, H, N // 32, d), \
        words(B, H, N // 32, d // 32) if hybrid else None
    q, win = halves(B, H * 4, d), halves(B, H, 8, d)
    innerq_decode_attention(q, *keys, *values, win, win, 2)
    n_groups, step, sms = N // 32, innerq_hopper.GROUPS_PER_STEP, sm_count(q.device)
    per_sm, least = innerq_hopper.WAVE
    wave = one_wave(n_groups, B * H, sms, per_sm, step, least)
    busy = innerq_hopper.programs_per_sm(B * H, sms)
    splits, per_split, _ = wave or _plan_splits(n_groups, B * H, q.device, None, step, busy)
    assert plans == [(per_split, splits, per_sm if wave else busy)]
    assert (wave is None) == (B >= 8)


def test_hopper_kernel_is_not_taken_off_its_shapes():
    """4-bit codes, head_dim 32 or 256, more than 16 query rows a KV head, fp32, and anything off an H100 take the
    Triton split kernel."""
    innerq_hopper = pytest.importorskip("kvzoo.kernels.innerq_hopper")
    q = torch.zeros(1, 8, 128, dtype=torch.float16, device=DEVICE)
    assert not innerq_hopper.eligible(q, 4, 4)
    assert not innerq_hopper.eligible(q, 2, 17)
    assert not innerq_hopper.eligible(q[..., :32], 2, 4)
    assert not innerq_hopper.eligible(torch.zeros(1, 8, 256, dtype=torch.float16, device=DEVICE), 2, 4)
    assert not innerq_hopper.eligible(q.float(), 2, 4)
    assert innerq_hopper.eligible(q, 2, 4) == HOPPER


@pytest.mark.parametrize("choice,enabled", [("triton", "False"), ("gluon", "True"), ("auto", "True")])
def test_kvzoo_innerq_kernel_picks_the_kernel(choice, enabled):
    """KVZOO_INNERQ_KERNEL, read when innerq_hopper is imported: triton never takes the Gluon kernel."""
    pytest.importorskip("kvzoo.kernels.innerq_hopper")
    run = subprocess.run([sys.executable, "-c", "from kvzoo.kernels import innerq_hopper as h; print(h.ENABLED)"],
                         env={**os.environ, "KVZOO_INNERQ_KERNEL": choice}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [enabled]


@pytest.mark.parametrize("choice,enabled,least", [("triton", "False", "2016"), ("gluon", "True", "0"),
                                                  ("auto", "True", "2016")])
def test_kvzoo_token_kernel_picks_the_kernel(choice, enabled, least):
    """KVZOO_TOKEN_KERNEL, read when token_hopper is imported: triton never takes the per-token Gluon kernel (int8,
    KV Pareto k8v8), gluon takes it at any amount of work."""
    pytest.importorskip("kvzoo.kernels.token_hopper")
    run = subprocess.run([sys.executable, "-c",
                          "from kvzoo.kernels import token_hopper as h; print(h.ENABLED, h.MIN_GROUP_ROWS)"],
                         env={**os.environ, "KVZOO_TOKEN_KERNEL": choice}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [enabled, least]


@pytest.mark.parametrize("value,held", [("0", "False"), ("1", "True"), ("yes", None)])
def test_early_launch_setting_takes_0_or_1(value, held):
    """KVZOO_EARLY_LAUNCH, read when quant_matvec is imported: "0" keeps the tail's program on a second stream, "1"
    (the default) lets it go first; anything else is refused by name."""
    run = subprocess.run([sys.executable, "-c", "from kvzoo.kernels import quant_matvec as q; print(q.EARLY_LAUNCH)"],
                         capture_output=True, text=True, env={**os.environ, "KVZOO_EARLY_LAUNCH": value})
    if held is None:
        assert run.returncode != 0 and "KVZOO_EARLY_LAUNCH must be one of ('1', '0'), got 'yes'" in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [held]


@pytest.mark.parametrize("variable,module", [("KVZOO_INNERQ_KERNEL", "kvzoo.kernels.innerq_hopper"),
                                             ("KVZOO_OUTER_KERNEL", "kvzoo.kernels.outer_hopper"),
                                             ("KVZOO_TOKEN_KERNEL", "kvzoo.kernels.token_hopper"),
                                             ("KVZOO_W4A16_KERNEL", "kvzoo.kernels.w4a16"),
                                             ("KVZOO_WEIGH_KERNEL", "kvzoo.kernels.xquant_remat")])
def test_kvzoo_kernel_choices_refuse_other_values(variable, module):
    pytest.importorskip("kvzoo.kernels.outer_hopper")            # a Triton with Gluon
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                         env={**os.environ, variable: "cuda"})
    assert run.returncode != 0
    assert f"{variable} must be one of ('auto', 'triton', 'gluon'), got 'cuda'" in run.stderr
