"""The GQA scores kernel (kvzoo/kernels/scores.py) against its torch reference, under the Triton interpreter on CPU
(compiled on CUDA with TRITON_INTERPRET=0)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.kernels.scores import gqa_scores, gqa_scores_ref  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("H,rep", [(1, 1), (2, 3), (3, 4)])
def test_matches_reference_on_a_strided_view(dtype, tol, H, rep):
    """Keys as XQuant's static step holds them: rows [0, K) of a longer (B, K + 5, H*d) buffer; K = 200, not a multiple
    of the block; 1, 3 and 4 query heads per KV head."""
    g = torch.Generator().manual_seed(H * 10 + rep)
    B, K, d = 2, 200, 32
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE, dtype)
    buf = torch.randn(B, K + 5, H * d, generator=g).to(DEVICE, dtype)
    keys = buf[:, :K]
    got = gqa_scores(q, keys, 0.25)
    assert got.shape == (B, H * rep, K) and got.dtype == torch.float32
    want = gqa_scores_ref(q, keys, 0.25)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("programs,block", [(1, 16), (7, 16), (64, 32)])
@pytest.mark.parametrize("rope", [False, True])
def test_any_split_of_the_keys_over_programs(programs, block, rope):
    """One program per KV head looping over all 200 keys, runs of keys per program that end inside a block, and more
    programs than blocks: the same scores, with and without the keys rotated in the kernel."""
    g = torch.Generator().manual_seed(programs + block)
    B, K, H, rep, d = 2, 200, 2, 3, 32
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE, torch.float16)
    keys = torch.randn(B, K, H * d, generator=g).to(DEVICE, torch.float16)
    tables = tuple(torch.rand(B, 1, K, d, generator=g).to(DEVICE, torch.float16) for _ in range(2)) if rope else None
    want = gqa_scores_ref(q, keys, 0.25, tables)
    got = gqa_scores(q, keys, 0.25, tables, block=block, programs=programs)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_keys_rotated_as_they_are_loaded(dtype, tol):
    """Keys stored before RoPE and the model's tables for their positions (up to 128K): the scores of the rotated
    keys, against the reference and against the kernel given keys the model rotated first."""
    from types import SimpleNamespace

    from kvzoo.models.llama import RotaryEmbedding

    g = torch.Generator().manual_seed(7)
    B, K, H, rep, d = 2, 200, 2, 4, 64
    rope = RotaryEmbedding(SimpleNamespace(head_dim=d, rope_theta=500000.0, rope_scaling=None)).to(DEVICE)
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE, dtype)
    keys = torch.randn(B, K + 3, H * d, generator=g).to(DEVICE, dtype)[:, :K]
    tables = rope.cos_sin(torch.randint(0, 131072, (B, K), generator=g).to(DEVICE), dtype)    # (B, 1, K, d) each
    got = gqa_scores(q, keys, 0.125, tables)
    want = gqa_scores_ref(q, keys, 0.125, tables)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    rotated = rope.apply_tables(keys.view(B, K, H, d).transpose(1, 2), *tables).transpose(1, 2).reshape(B, K, H * d)
    first = gqa_scores(q, rotated, 0.125)
    torch.testing.assert_close(got, first, rtol=2 * tol, atol=2 * tol * want.abs().max().item())
    with pytest.raises(ValueError, match="cos has shape"):
        gqa_scores(q, keys, 1.0, (tables[0][:, :, :5], tables[1]))
    with pytest.raises(ValueError, match="sin has dtype"):
        gqa_scores(q, keys, 1.0, (tables[0], tables[1].double()))
    narrow = (tables[0][..., :16], tables[1][..., :16])                  # d = 16: rotated before the kernel
    torch.testing.assert_close(gqa_scores(q[..., :16], keys[..., :H * 16], 1.0, narrow),
                               gqa_scores_ref(q[..., :16], keys[..., :H * 16], 1.0, narrow), rtol=tol, atol=tol * 16)


def test_bad_input_is_named():
    q = torch.randn(1, 4, 32).to(DEVICE)
    with pytest.raises(ValueError, match="keys must be"):
        gqa_scores(q, torch.randn(1, 10, 48).to(DEVICE), 1.0)               # 48 is not a multiple of d
    with pytest.raises(ValueError, match="keys must be"):
        gqa_scores(q, torch.randn(1, 10, 96).to(DEVICE), 1.0)               # 3 KV heads for 4 query heads
    with pytest.raises(ValueError, match="keys must be"):
        gqa_scores(q, torch.randn(1, 10, 64).to(DEVICE).half(), 1.0)        # dtype differs
    with pytest.raises(ValueError, match="q must be"):
        gqa_scores(q[0], torch.randn(1, 10, 64).to(DEVICE), 1.0)
