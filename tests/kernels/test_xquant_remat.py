"""XQuant's rematerialization (kvzoo/kernels/xquant_remat.py), the fused kernel and the two passes (dequant_rows,
then torch.mm), against its torch reference, under the Triton interpreter on CPU (`TRITON_INTERPRET=0` on a GPU
machine runs them compiled on CUDA)."""

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.cache.kvquant import quantize  # noqa: E402
from kvzoo.kernels.xquant_remat import dequant_matmul, dequant_matmul_ref, dequant_rows  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"


def check(q, weight, tol, two_pass=None):
    got, want = dequant_matmul(q, weight, two_pass=two_pass), dequant_matmul_ref(q, weight)
    assert got.shape == want.shape and got.dtype == weight.dtype
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("axis,group", [(-1, 32), (-1, 64), (-2, 16)])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("two_pass", [False, True])
def test_matches_reference_fp32(bits, axis, group, symmetric, two_pass):
    g = torch.Generator().manual_seed(bits * 10 + group)
    # two sequences of 48 rows (not a multiple of the 64-row tile), r = 192 as SmolLM2's latent, 40 outputs
    x = torch.randn(2, 48, 192, generator=g).to(DEVICE)
    x[..., 0] *= 20                                                  # an outlier channel, as X·U_k has
    w = torch.randn(192, 40, generator=g).to(DEVICE)
    check(quantize(x, bits, group, axis=axis, symmetric=symmetric), w, 1e-5, two_pass)


# the interpreter's bf16 tl.dot is wrong (numpy has no bf16), so bf16 runs only compiled on CUDA
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
@pytest.mark.parametrize("two_pass", [False, True])
def test_half_weights(dtype, two_pass):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, 96, generator=g).to(DEVICE)
    w = (torch.randn(96, 72, generator=g) / 10).to(DEVICE, dtype)
    check(quantize(x, 4, 32, axis=-1), w, 2e-2 if dtype == torch.bfloat16 else 3e-3, two_pass)


@pytest.mark.parametrize("axis,group", [(-1, 32), (-2, 16)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dequant_rows_reads_each_code_once_into_the_dtype(axis, group, bits):
    """The two-pass path's first pass: every row dequantized (r = 200: the last 128-channel step masked) and
    rounded once to the asked dtype."""
    g = torch.Generator().manual_seed(bits + group)
    q = quantize(torch.randn(3, 80, 200, generator=g).to(DEVICE), bits, group if axis == -2 else 40, axis=axis)
    from kvzoo.cache.kvquant import dequantize
    want = dequantize(q, torch.float32)
    for dtype in (torch.float32, torch.float16):
        got = dequant_rows(q, dtype)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want.to(dtype), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dtype must be"):
        dequant_rows(q, torch.int32)


def test_r_not_a_multiple_of_the_step():
    """r = 48 with 2-bit codes: the second 64-channel step reads past the row's 3 words, masked."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 48, generator=g).to(DEVICE)
    check(quantize(x, 2, 16, axis=-1), torch.randn(48, 8, generator=g).to(DEVICE), 1e-5)


def test_bad_input_is_named():
    x = torch.randn(32, 64).to(DEVICE)
    with pytest.raises(ValueError, match="bits in"):
        dequant_matmul(dataclasses.replace(quantize(x, 2, 32), bits=5), torch.randn(64, 8).to(DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        dequant_matmul(quantize(x, 2, 32), torch.randn(32, 8).to(DEVICE))
    with pytest.raises(ValueError, match="QTensor"):
        dequant_matmul(x, torch.randn(64, 8).to(DEVICE))


def test_tiles_step_down_until_one_fits(monkeypatch):
    """Tiles whose kernel would need more shared memory than the device has (Triton's OutOfResources at launch)
    step down (fewer stages, then narrower tiles) until one fits; the fitting tiles are remembered."""
    from triton.runtime.errors import OutOfResources

    from kvzoo.kernels import xquant_remat

    assert xquant_remat.tile_configs(64, 256, 3)[:4] == [(64, 256, 3), (64, 256, 2), (64, 256, 1), (64, 128, 2)]
    assert xquant_remat.tile_configs(64, 256, 3)[-1] == (16, 32, 1)
    real, tried = xquant_remat._remat_kernel, []

    class SmallDevice:             # a device whose shared memory holds BLOCK_N * stages <= 128 (a stand-in rule)
        def __getitem__(self, grid):
            def launch(*args, **meta):
                tried.append((meta["BLOCK_M"], meta["BLOCK_N"], meta["num_stages"]))
                if meta["BLOCK_N"] * meta["num_stages"] > 128:
                    raise OutOfResources(meta["BLOCK_N"] * meta["num_stages"] * 1024, 128 * 1024, "shared memory")
                return real[grid](*args, **meta)
            return launch

    monkeypatch.setattr(xquant_remat, "_remat_kernel", SmallDevice())
    monkeypatch.setattr(xquant_remat, "check_runnable", lambda kernel, device: None)
    monkeypatch.setattr(xquant_remat, "_FITTING", {})
    g = torch.Generator().manual_seed(3)
    q, w = quantize(torch.randn(40, 64, generator=g).to(DEVICE), 4, 32), torch.randn(64, 300, generator=g).to(DEVICE)
    check(q, w, 1e-5, two_pass=False)
    assert tried == [(64, 256, 3), (64, 256, 2), (64, 256, 1), (64, 128, 2), (64, 128, 1)]
    tried.clear()
    check(q, w, 1e-5, two_pass=False)
    assert tried == [(64, 128, 1)]                                   # remembered: no failing launch again


@pytest.mark.skipif(DEVICE != "cuda", reason="the device's shared memory limit is a GPU's (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("n_out", [1024, 4096])
def test_fits_the_gpu_at_the_8b_shape(n_out):
    """Llama-3.1-8B's GQA latent (r = 8 x 128) rematerialized over 32K tokens with fp32 up-projections (tf32x3
    dots), the call that once asked an H100 for 331,776 bytes of shared memory."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(1, 32768, 1024, generator=g, device="cuda")
    w = torch.randn(1024, n_out, generator=g, device="cuda") / 32
    check(quantize(x, 4, 128, axis=-2), w, 1e-3)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled at the shapes a GPU decode step calls it with")
@pytest.mark.parametrize("two_pass", [False, True])
def test_bf16_at_the_8b_shape(two_pass):
    """Llama-3.1-8B's latents (r = 1,024) over 32K tokens with the model's bf16 up-projection, both paths."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1, 32768, 1024, generator=g, device="cuda")
    w = (torch.randn(1024, 1024, generator=g, device="cuda") / 32).bfloat16()
    q = quantize(x, 4, 128, axis=-1)
    got = dequant_matmul(q, w, two_pass=two_pass).float()
    want = dequant_matmul_ref(q, w).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled at the shapes a GPU decode step calls it with")
@pytest.mark.parametrize("B,Hq,r,group,dtype", [(1, 32, 1024, 128, torch.bfloat16),
                                                (4, 32, 1024, 128, torch.float16), (2, 9, 192, 96, torch.float16)])
def test_weigh_gather_at_the_model_shapes(B, Hq, r, group, dtype):
    """XQuant's value latents weighed over 32K rows at Llama-3.1-8B's shape (r = 1,024, groups of 128, 32 query
    heads) and SmolLM2's (r = 192, groups of 96: channel blocks of 32, 9 query heads), with window rows."""
    from kvzoo.kernels.xquant_remat import dequant_gather, weigh_gather

    g = torch.Generator(device="cuda").manual_seed(6)
    N, W = 32768, 40
    q = quantize(torch.randn(B, N, r, generator=g, device="cuda"), 4, group, axis=-1)
    window = torch.randn(B, W, r, generator=g, device="cuda").to(dtype)
    src = torch.cat([torch.randperm(N + W, generator=g, device="cuda"), torch.full((8,), N + W, device="cuda")])
    p = torch.randn(B, Hq, src.numel(), generator=g, device="cuda").softmax(-1)
    want = torch.bmm(p.to(dtype).float(), dequant_gather(q, window, src, dtype).float())
    got = weigh_gather(q, window, src, p)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0), reason="an sm_90 GPU's kernel")
@pytest.mark.parametrize("B,Hq,r,group,N,W,S", [(1, 32, 1024, 128, 32768, 40, 32816), (3, 20, 512, 256, 1000, 7, 1203),
                                                (2, 9, 768, 128, 3000, 130, 3131), (1, 16, 256, 128, 64, 0, 64),
                                                (2, 32, 1024, 64, 200, 3, 203), (2, 16, 768, 192, 500, 5, 505)])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("programs", [1, 7, None])
def test_gluon_weighing_equals_the_fold_path(monkeypatch, B, Hq, r, group, N, W, S, symmetric, programs):
    """xquant_hopper's weighing (4-bit per-token groups of 64, 128, 192 or 256 channels, at most 32 heads): against
    bmm over the gathered rows, and against the Triton fold path (the same operands, summed in another order), with
    window rows at both ends and between, zero rows, whole and partial steps, masked heads (20 of 32, 9 of 16), an
    odd row count (p's rows unaligned) and one split or several."""
    from kvzoo.kernels import xquant_hopper
    from kvzoo.kernels.xquant_remat import dequant_gather, weigh_gather

    monkeypatch.setattr(xquant_hopper, "MIN_ROWS", 0)                  # every size takes it
    launches, launch = [], xquant_hopper.weigh_splits
    monkeypatch.setattr(xquant_hopper, "weigh_splits", lambda *args: launches.append(1) or launch(*args))
    g = torch.Generator(device="cuda").manual_seed(N + Hq)
    q = quantize(torch.randn(B, N, r, generator=g, device="cuda") * 3, 4, group, axis=-1, symmetric=symmetric)
    src = torch.randint(0, N + W + 1, (S,), generator=g, device="cuda")
    src[:N + W] = torch.randperm(N + W, generator=g, device="cuda")[:S]
    if W:
        src[[0, S // 2, S - 1]] = torch.tensor([N, N + W - 1, N + W // 2], device="cuda")     # window rows
    p = torch.randn(B, Hq, S, generator=g, device="cuda").softmax(-1)
    for dtype in (torch.float16, torch.bfloat16):
        window = torch.randn(B, W, r, generator=g, device="cuda").to(dtype)
        want = torch.bmm(p.to(dtype).float(), dequant_gather(q, window, src, dtype).float())
        got = weigh_gather(q, window, src, p, programs=programs)
        assert len(launches) == 1                                        # the Gluon kernel, not the fold path
        monkeypatch.setattr(xquant_hopper, "ENABLED", False)
        fold = weigh_gather(q, window, src, p, programs=programs)
        monkeypatch.setattr(xquant_hopper, "ENABLED", True)
        launches.clear()
        assert got.dtype == dtype and got.shape == (B, Hq, r)
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * scale)
        torch.testing.assert_close(got.float(), fold.float(), rtol=1e-2, atol=2e-3 * scale)


@pytest.mark.parametrize("group", [64, 128, 192, 256, 320, 384, 512])
def test_gluon_weighing_copies_the_scale_pairs_its_warps_read(group):
    """xquant_hopper copies PAIRS int32 pairs of a row's scales a program: every pair its four warps' groups lie
    in, for every program of every eligible row width."""
    from kvzoo.kernels import xquant_hopper as xh

    for r in range(xh.CHANNELS, 8 * 1024 + 1, xh.CHANNELS):
        if r % group or (r // group) % 2:
            continue
        for k0 in range(0, r, xh.CHANNELS):
            first = (k0 // group) // 2
            reached = {(k0 + w * xh.WARP_CHANNELS) // group // 2 - first for w in range(xh.N_WARPS)}
            assert reached <= set(range(xh.pairs(group))), (r, k0, reached)


@pytest.mark.parametrize("axis,group", [(-1, 32), (-2, 16)])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_dequant_gather_puts_rows_in_a_new_order(axis, group, bits):
    """Rows of [dequant(codes) ; window] gathered by index in one pass, an index past both a zero row; a window
    that is a strided view (the store's buffer) and an empty window."""
    from kvzoo.cache.kvquant import dequantize
    from kvzoo.kernels.xquant_remat import dequant_gather

    g = torch.Generator().manual_seed(bits * 3 + group)
    B, N, W, r = 2, 48, 5, 72
    q = quantize(torch.randn(B, N, r, generator=g).to(DEVICE), bits, group if axis == -2 else 24, axis=axis)
    buf = torch.randn(B, W + 2, r + 8, generator=g).to(DEVICE)
    window = buf[:, 1:W + 1, :r]                                                  # strided rows
    src = torch.randint(0, N + W + 1, (70,), generator=g).to(DEVICE)
    src[:3] = torch.tensor([N + W, N, N - 1])                                     # zero row, first window row, last code
    rows = torch.cat([dequantize(q, torch.float32), window, torch.zeros(B, 1, r, device=DEVICE)], dim=1)
    want = rows[:, src]
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
        got = dequant_gather(q, window, src, dtype)
        assert got.shape == (B, 70, r) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    only_codes = src.clamp_max(N - 1)
    torch.testing.assert_close(dequant_gather(q, window[:, :0], only_codes, torch.float32), rows[:, only_codes])
    with pytest.raises(ValueError, match="window must be"):
        dequant_gather(q, window[0], src, torch.float32)
    with pytest.raises(ValueError, match="src must be"):
        dequant_gather(q, window, src.float(), torch.float32)
    if axis == -2:             # per-channel groups run along the tokens: a partial group is refused
        partial = dataclasses.replace(q, shape=(B, N - group // 2, r))
        with pytest.raises(ValueError, match="per-channel codes need whole groups"):
            dequant_gather(partial, window, src, torch.float32)


@pytest.mark.parametrize("axis,group", [(-1, 32), (-1, 24), (-2, 16)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("programs", [1, 5])
def test_weigh_gather_equals_the_product_of_the_gathered_rows(axis, group, bits, symmetric, programs):
    """Σ_i p_i · row src[i] read from the codes in one pass equals bmm(p, dequant_gather(...)) up to rounding:
    zero rows, window rows and coded rows in any order, query rows that fill the product's 16 rows or not, one split
    or several; per-token groups of 32 channels (their scales folded into the weights), of 24, per-channel groups and
    3-bit codes, which spill across words (dequantized first)."""
    from kvzoo.kernels.xquant_remat import dequant_gather, weigh_gather

    g = torch.Generator().manual_seed(bits * 7 + group + programs)
    B, N, W, r = 2, 48, 5, 96
    Hq = 16 if programs == 1 else 6                     # every head row live (no head masked), or padded to 16
    q = quantize(torch.randn(B, N, r, generator=g).to(DEVICE), bits, group, axis=axis, symmetric=symmetric)
    buf = torch.randn(B, W + 2, r + 8, generator=g).to(DEVICE)
    src = torch.randint(0, N + W + 1, (70,), generator=g).to(DEVICE)
    src[:3] = torch.tensor([N + W, N, N - 1])
    p = torch.rand(B, Hq, 70, generator=g).softmax(-1).to(DEVICE)
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        window = buf[:, 1:W + 1, :r].to(dtype)                                    # strided rows
        want = torch.bmm(p.to(dtype).float(), dequant_gather(q, window, src, dtype).float())
        got = weigh_gather(q, window, src, p, block_t=16, block_k=32, programs=programs)
        assert got.shape == (B, Hq, r) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="p must be"):
        weigh_gather(q, window, src, p[..., :-1])
    with pytest.raises(ValueError, match="window must be"):
        weigh_gather(q, window.float(), src, p)


def test_xquant_weighs_16_bit_value_latents_from_their_codes(monkeypatch):
    """xquant.weigh_latent: 16-bit rows of packed codes go through weigh_gather, never written as rows, and give
    what gathering them (latent_rows) and multiplying gives; fp32 rows take that path (weigh_gather refuses them)."""
    import kvzoo.cache.xquant as xq

    g = torch.Generator().manual_seed(3)
    B, N, W, r, Hq = 1, 32, 3, 40, 4
    q = quantize(torch.randn(B, N, r, generator=g).to(DEVICE), 4, 20, axis=-1)
    window = torch.randn(B, W, r, generator=g).to(DEVICE, torch.bfloat16)
    src = torch.cat([torch.arange(N + W).flip(0), torch.tensor([N + W] * 5)]).to(DEVICE)
    p = torch.rand(B, Hq, src.numel(), generator=g).softmax(-1).to(DEVICE)
    want = xq.weigh_rows(xq.latent_rows(q, None, window, src, torch.bfloat16, fused=True))(p)
    latent_rows = xq.latent_rows

    def no_rows(*args, **kwargs):
        raise AssertionError("the rows were gathered")

    monkeypatch.setattr(xq, "latent_rows", no_rows)
    got = xq.weigh_latent(q, None, window, src, torch.bfloat16, fused=True)(p)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    monkeypatch.setattr(xq, "latent_rows", latent_rows)
    assert xq.weigh_latent(q, None, window.float(), src, torch.float32, fused=True)(p).dtype == torch.float32
