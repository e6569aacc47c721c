"""The W4A16 weight-only matmul (kvzoo/kernels/w4a16.py) against its torch reference, under the Triton
interpreter on CPU (`TRITON_INTERPRET=0` on a GPU machine runs it compiled on CUDA)."""

import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kvzoo.kernels.w4a16 as w4a16  # noqa: E402
from kvzoo.kernels.w4a16 import (GROUPED, ONE_ROW, Tiles, W4Weight, default_tiles, from_panels,  # noqa: E402
                                 panel_offsets, quantize_weight, to_panels, w4a16_matmul, w4a16_matmul_ref)
from kvzoo.cache.kvquant import quantize  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def check(x, w, tol, tiles=None):
    got, want = w4a16_matmul(x, w, tiles), w4a16_matmul_ref(x, w)
    assert got.shape == want.shape == (*x.shape[:-1], w.shape[0]) and got.dtype == x.dtype
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def weight(n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    w[:, 3] *= 10                                                    # an outlier input channel, as AWQ targets
    return quantize_weight(w.to(DEVICE), group)


# the interpreter's bf16 tl.dot is wrong (numpy has no bf16), so bf16 runs only compiled on CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("n,k", [(48, 256), (96, 384)])
@pytest.mark.parametrize("m", [1, 3, 5, 40, 70])
def test_matches_reference(m, n, k, group, dtype):
    """M = 1 (the one-row kernel), 3 and 5 (the group kernel, a 16-row tile), 40 (its 64-row tile) and 70 (the
    general kernel's prefill tile, partial);
    N not a multiple of the tile."""
    w = weight(n, k, group, seed=m + n + group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    check(x, w, TOL[dtype])


@pytest.mark.parametrize("m", [1, 3, 20])
@pytest.mark.parametrize("split", [2, 3, 7])
def test_split_k_matches_reference(m, split):
    """K = 448 in 64-channel steps (7) split among 2, 3 (uneven: 3 + 3 + 1) or 7 programs; fp32 partial sums
    rounded once, so fp16 stays within the unsplit tolerance."""
    w = weight(40, 448, 64, seed=split)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(m, 448, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        check(x, w, TOL[dtype], Tiles(block_n=32, block_k=64, split_k=split))


@pytest.mark.parametrize("m", [1, 40])
def test_default_tiles_for_long_k(m):
    """K = 2048, G = 128: the group kernel at M = 1, the general kernel's prefill tile at M = 40."""
    w = weight(24, 2048, 128, seed=11)
    x = torch.randn(m, 2048, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    check(x, w, TOL[torch.float32])


def test_tile_choices_agree():
    """The broadcast path forced into a tl.dot tile, and large K steps past the end of K, give the same."""
    w = weight(24, 320, 64, seed=9)
    x = torch.randn(2, 320, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    check(x, w, TOL[torch.float32], Tiles(block_m=16, block_n=16, block_k=128))
    check(x, w, TOL[torch.float32], Tiles(block_n=16, block_k=256, split_k=2))


def test_leading_dims_and_k_edge():
    """x (2, 3, K) with K = 200, G = 8: the last 64-channel step is partly past K, masked."""
    w = weight(40, 200, 8, seed=3)
    x = torch.randn(2, 3, 200, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    check(x, w, TOL[torch.float32])


@pytest.mark.parametrize("m,split,group", [(1, 1, 128), (1, 3, 16), (16, 2, 32), (16, 5, 16), (33, 5, 128)])
def test_group_kernel_split_k(m, split, group):
    """The group kernel with its in-kernel split-K: the last split of each tile sums the fp32 partials in split
    order and resets its counter, so a second call gives the same bits and leaves every counter at zero."""
    k = 640 if group < 128 else 1280
    w = weight(40, k, group, seed=split + group)
    for dtype in (torch.float32, torch.float16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        tiles = Tiles(block_n=32, block_k=0, split_k=split)
        check(x, w, TOL[dtype], tiles)
        assert torch.equal(w4a16_matmul(x, w, tiles), w4a16_matmul(x, w, tiles))
        assert not w4a16._COUNTERS[x.device].any()


@pytest.mark.parametrize("block_k,split,group,k", [(256, 0, 128, 1280), (256, 3, 64, 576), (128, 2, 128, 640),
                                                   (512, 0, 64, 1088), (64, 5, 16, 160)])
def test_one_row_kernel(block_k, split, group, k):
    """The one-row kernel: steps of one, two or four groups (the last partly past K: K/G = 9, 17 or 10 groups),
    split over K inside the kernel (the default split and 2, 3 or 5 programs), N not a multiple of the tile;
    a second call gives the same bits and leaves every counter at zero."""
    w = weight(40, k, group, seed=block_k + split)
    tiles = Tiles(block_n=32, block_k=block_k, split_k=split, num_warps=2, num_stages=1, gemv=True)
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if DEVICE == "cuda" else ())
    for dtype in dtypes:
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
        check(x, w, TOL[dtype], tiles)
        assert torch.equal(w4a16_matmul(x, w, tiles), w4a16_matmul(x, w, tiles))
        assert not w4a16._COUNTERS[x.device].any()


def test_routing():
    """One row: the one-row kernel (a step of 256 channels, or one group if larger); up to 64 rows the group
    kernel; both at power-of-two groups >= 16. The general kernel otherwise."""
    assert default_tiles(1, 4096, 128) == default_tiles(1, 576, 64) == ONE_ROW
    assert default_tiles(1, 4096, 512) == Tiles(**{**vars(ONE_ROW), "block_k": 512})
    assert default_tiles(2, 4096, 128) == default_tiles(64, 4096, 32) == GROUPED
    assert default_tiles(65, 4096, 128).block_k > 0 and default_tiles(1, 4096, 8).block_k > 0
    assert default_tiles(1, 4096, 96).block_k > 0 and not default_tiles(1, 4096, 96).gemv


@pytest.mark.skipif(DEVICE != "cuda", reason="compiles the W4A16 kernels at Llama-3.1-8B's layer shapes (a GPU)")
@pytest.mark.parametrize("n,k", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)])
def test_8b_layer_shapes(n, k):
    """The default tiles at the shapes the benchmarks use (bf16 x, G = 128): q/o, k/v, gate/up and down; the
    one-row kernel at M = 1; at 4 and 16 the Gluon kernel on an H100 (the group kernel for k/v and elsewhere); the group
    kernel at 64."""
    w = quantize_weight(torch.randn(n, k, device=DEVICE) * 0.02, 128)
    for m in (1, 4, 16, 64):
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        check(x, w, TOL[torch.bfloat16])


def test_empty_batch():
    w = weight(16, 128, 128, seed=4)
    assert w4a16_matmul(torch.zeros(0, 128, device=DEVICE), w).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [128, 64])
def test_round_trip_error(dtype, group):
    """|w - w'| <= scale/2, plus the fp16 rounding of the zero point (the group's min) and fp32 slack."""
    w = (torch.randn(32, 256, generator=torch.Generator().manual_seed(group)) * 0.05).to(dtype)
    q = quantize_weight(w, group)
    assert q.codes.shape == (32, 32) and q.codes.dtype == torch.int32
    assert q.scale.shape == q.zero.shape == (32, 256 // group) and q.scale.dtype == q.zero.dtype == torch.float16
    err = (w.float() - q.dequantize()).abs().unflatten(-1, (-1, group))                # (N, K/G, G)
    _, scale, zero = (t.float()[..., None] for t in q.rows())                          # (N, K/G, 1) in rows' order
    bound = scale / 2 + 2.0 ** -11 * zero.abs() + 1e-6 * (zero.abs() + 15 * scale)
    assert (err <= bound).all()
    assert q.dequantize(torch.float16).dtype == torch.float16


@triton.jit
def _gather_kernel(src_ptr, out_ptr, N, C, PANELS: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
    """out (N, C) in rows' order = src's elements at panel_offsets."""
    n = tl.arange(0, BN)[:, None]
    c = tl.arange(0, BC)[None, :]
    live = (n < N) & (c < C)
    tl.store(out_ptr + n * C + c, tl.load(src_ptr + panel_offsets(n, c, N, C, PANELS), mask=live), mask=live)


@pytest.mark.parametrize("n", [64, 130, 40])
@pytest.mark.parametrize("k,group", [(256, 128), (384, 32), (96, 32)])
def test_panel_order(n, k, group):
    """quantize_weight keeps kvquant.quantize's codes, in panel order where K is a multiple of 128 (a panel step's
    64 rows x 16 words in one piece, the last panel's rows past the whole panels), else in rows' order, and its scales
    and zeros as they are; panel_offsets finds every word where to_panels put it, and from_panels undoes it."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)).to(DEVICE)
    q, want = quantize_weight(w, group), quantize(w, 4, group, axis=-1)
    for got, rows in zip(q.rows(), (want.codes, want.scale, want.zero)):
        assert torch.equal(got, rows)
    panels = k % 128 == 0
    if panels:
        if n >= 64:
            assert torch.equal(q.codes.flatten()[:64 * 16], want.codes[:64, :16].flatten())    # one 4 KB piece
        tail = n // 64 * 64
        assert torch.equal(q.codes[tail:].flatten()[:(n - tail) * 16], want.codes[tail:, :16].flatten())
    else:
        assert torch.equal(q.codes, want.codes)
    assert torch.equal(q.scale, want.scale) and torch.equal(q.zero, want.zero)              # rows in order
    C = q.codes.shape[1]
    if panels:
        assert torch.equal(to_panels(from_panels(q.codes)), q.codes)
    out = torch.empty_like(q.codes)
    _gather_kernel[(1,)](q.codes, out, n, C, PANELS=panels, BN=triton.next_power_of_2(n),
                         BC=triton.next_power_of_2(C))
    assert torch.equal(out, want.codes)


@pytest.mark.parametrize("group", [128, 64, 32])
def test_nbytes(group):
    n, k = 48, 256
    q = quantize_weight(torch.randn(n, k), group)
    assert q.nbytes() == q.codes.nbytes + q.scale.nbytes + q.zero.nbytes
    assert q.nbytes() == n * k // 2 + 4 * n * k // group                            # 0.5 + 4/G bytes per weight


def test_bad_input_is_named():
    w = weight(16, 256, 128, seed=5)
    x = torch.randn(4, 256).to(DEVICE)
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        quantize_weight(torch.randn(16, 192), 128)
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_weight(torch.randn(16, 192), 12)
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(192), 64)
    with pytest.raises(ValueError, match="w must be fp16, bf16 or fp32"):
        quantize_weight(torch.randn(16, 256, dtype=torch.float64), 128)
    with pytest.raises(ValueError, match="x must be fp16, bf16 or fp32"):
        w4a16_matmul(x.double(), w)
    with pytest.raises(ValueError, match="input channels"):
        w4a16_matmul(torch.randn(4, 128).to(DEVICE), w)
    with pytest.raises(ValueError, match="W4Weight"):
        w4a16_matmul(x, torch.randn(16, 256).to(DEVICE))
    bad = W4Weight(w.codes, w.scale, w.zero, 96, w.shape)                            # 256 % 96 != 0
    with pytest.raises(ValueError, match="not a multiple of the group size"):
        w4a16_matmul(x, bad)
    with pytest.raises(ValueError, match="power of two >= 16"):
        w4a16_matmul(torch.randn(4, 192).to(DEVICE), weight(16, 192, 48, seed=6), Tiles(block_k=0))
    with pytest.raises(ValueError, match="one row of x, got 4"):
        w4a16_matmul(x, w, ONE_ROW)
    with pytest.raises(ValueError, match="power-of-two multiple of it, got group 128, block_k 384"):
        w4a16_matmul(x[:1], w, Tiles(block_k=384, gemv=True))
    bad = W4Weight(w.codes, w.scale.float(), w.zero, 128, w.shape)
    with pytest.raises(ValueError, match="scale has dtype"):
        w4a16_matmul(x, bad)


HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)


# (m, n, k, group, split): x's rows at every width the kernel stores them (1, 2, 4, 8, 16; 3, 5, 9 and 12 padded),
# features past the last whole tile of 64, groups of one and two steps, split-K uneven (5 steps over 2), one split,
# one step a split, the 8B joined q/k/v, gate/up and down shapes, and splits over more steps than x's shared memory
# holds at a time (7 steps at 5 rows, 32 at 12, 70 at one)
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,group,split", [(1, 200, 640, 128, 2), (3, 64, 256, 128, 1), (8, 130, 512, 256, 0),
                                               (9, 256, 1024, 128, 8), (16, 96, 640, 128, 5), (16, 4096, 4096, 128, 0),
                                               (1, 6144, 4096, 128, 0), (1, 4096, 14336, 128, 0), (1, 64, 896, 128, 1),
                                               (1, 64, 8960, 128, 1), (2, 200, 640, 128, 3), (4, 4096, 14336, 128, 0),
                                               (5, 6144, 4096, 128, 0), (12, 28672, 4096, 128, 0)])
def test_hopper_kernel_matches_reference(m, n, k, group, split, dtype, monkeypatch):
    w4a16_hopper = pytest.importorskip("kvzoo.kernels.w4a16_hopper")
    w = weight(n, k, group, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    calls = []
    monkeypatch.setattr(w4a16_hopper, "MIN_FEATURES", 0)     # small layers too (by default the group kernel's)
    run = w4a16_hopper.w4a16_hopper
    monkeypatch.setattr(w4a16_hopper, "w4a16_hopper", lambda *a: calls.append(1) or run(*a, split_k=split))
    got = w4a16_matmul(x, w)
    assert calls, "the Gluon kernel was not taken"
    check(x, w, TOL[dtype])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = w4a16_matmul(x, w)
    graph.replay()
    assert torch.equal(replayed, got)                # split order fixed: the same sums whichever split ends last
    assert not w4a16._COUNTERS[x.device].any()
    monkeypatch.setattr(w4a16_hopper, "ENABLED", False)
    check(x, w, TOL[dtype])
    assert len(calls) == 3                           # eager, checked and captured; none with the kernel disabled


def test_hopper_kernel_is_not_taken_off_its_shapes():
    """Rows past 16, fewer than MIN_FEATURES outputs, groups that are not whole steps of 128 channels, fp32 x and
    other devices take the Triton kernels; one row to 16 on an H100/H200 take the Gluon kernel."""
    w4a16_hopper = pytest.importorskip("kvzoo.kernels.w4a16_hopper")
    x = torch.zeros(4, 256, device=DEVICE, dtype=torch.float16)
    n = w4a16_hopper.MIN_FEATURES
    assert w4a16_hopper.eligible(x[:1], 128, n, 256) == HOPPER
    assert not w4a16_hopper.eligible(torch.zeros(17, 256, device=DEVICE, dtype=torch.float16), 128, n, 256)
    assert not w4a16_hopper.eligible(x, 128, n - 1, 256)
    assert not w4a16_hopper.eligible(x, 64, n, 256)
    assert not w4a16_hopper.eligible(x.float(), 128, n, 256)
    assert w4a16_hopper.eligible(x, 128, n, 256) == HOPPER


@pytest.mark.parametrize("choice,enabled,features", [("triton", False, 2048), ("gluon", True, 0),
                                                     ("auto", True, 2048)])
def test_kvzoo_w4a16_kernel_picks_the_kernel(choice, enabled, features):
    """KVZOO_W4A16_KERNEL, read when w4a16_hopper is imported: triton never takes the Gluon kernels, gluon drops
    their floor of outputs, auto keeps it."""
    pytest.importorskip("kvzoo.kernels.w4a16_hopper")
    code = "from kvzoo.kernels import w4a16_hopper as h; print(h.ENABLED, h.MIN_FEATURES)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVZOO_W4A16_KERNEL": choice},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(enabled), str(features)]
