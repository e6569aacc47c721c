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


@pytest.mark.parametrize("K,block", [(200, 64), (300, 512), (5, 16)])
def test_softmax_rows_in_blocks(K, block):
    """softmax_rows against torch's, a row's bias added to each of its rows: keys masked (-inf) inside and across
    blocks, a block wholly masked, one block or many."""
    from kvzoo.kernels.scores import softmax_rows

    g = torch.Generator().manual_seed(K)
    s = (torch.randn(3, 4, K, generator=g) * 8).masked_fill(torch.rand(3, 4, K, generator=g) < 0.2, float("-inf"))
    bias = torch.zeros(3, K).masked_fill(torch.rand(3, K, generator=g) < 0.2, float("-inf"))
    bias[:, : min(K - 1, block)] = float("-inf")
    bias[:, -1] = 0
    s[..., -1] = 1.0
    s, bias = s.to(DEVICE), bias.to(DEVICE, torch.bfloat16)
    want = (s + bias.float()[:, None]).softmax(-1)
    torch.testing.assert_close(softmax_rows(s, bias, block=block), want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(softmax_rows(s, block=block), s.softmax(-1), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="contiguous fp32"):
        softmax_rows(s.half())
    with pytest.raises(ValueError, match="bias must be"):
        softmax_rows(s, bias[:, :3])


def test_add_weighted_rounds_as_torch():
    """a + w · v over a strided a (the per-head product's transposed output), each query head its KV head's v:
    torch's fp32 product and sum, bit for bit (bf16 on a GPU: the interpreter truncates fp32 to bf16)."""
    from kvzoo.kernels.scores import add_weighted

    g = torch.Generator().manual_seed(3)
    B, H, rep, d = 3, 2, 4, 24
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    a = torch.randn(H, B, rep, d, generator=g).to(DEVICE, dtype).transpose(0, 1)              # (B, H, rep, d)
    w = torch.rand(B, H * rep, 5, generator=g).to(DEVICE)[..., -1]
    v = torch.randn(B, H, 1, d, generator=g).to(DEVICE, dtype)[:, :, 0]
    want = (a.float() + w.view(B, H, rep, 1) * v[:, :, None].float()).reshape(B, H * rep, d).to(v.dtype)
    assert torch.equal(add_weighted(a, w, v), want)
    with pytest.raises(ValueError, match="unit last strides"):
        add_weighted(a, w[:, :3], v)
    with pytest.raises(ValueError, match=r"a must be \(B, H, rep, d\), got \(3, 8, 24\)"):
        add_weighted(a.reshape(B, H * rep, d), w, v)


@pytest.mark.parametrize("n_kv,rep", [(1, 1), (2, 3)])
def test_weighed_attention_through_the_kernels(n_kv, rep):
    """XQuant's static-step attention with its scores, softmax and the token's value in the kernels (fused) equals
    the torch path."""
    from types import SimpleNamespace

    from kvzoo.cache.xquant import heads, weigh_rows, weighed_attention
    from kvzoo.models.llama import RotaryEmbedding

    g = torch.Generator().manual_seed(n_kv * 10 + rep)
    B, K, c, d = 2, 40, 24, 32
    q = torch.randn(B, n_kv * rep, 1, d, generator=g).to(DEVICE)
    keys = heads(torch.randn(B, K, n_kv * d, generator=g).to(DEVICE), n_kv, torch.float32)
    rope = RotaryEmbedding(SimpleNamespace(head_dim=d, rope_theta=10000.0, rope_scaling=None)).to(DEVICE)
    tables = rope.cos_sin(torch.randint(0, 5000, (B, K), generator=g).to(DEVICE), torch.float32)
    rows = torch.randn(B, K, c, generator=g).to(DEVICE)
    rows[:, -1] = 0
    up_v = torch.randn(c, n_kv * d, generator=g).to(DEVICE)
    v = torch.randn(B, n_kv, 1, d, generator=g).to(DEVICE)
    bias = torch.zeros(B, 1, 1, K).masked_fill(torch.rand(B, 1, 1, K, generator=g) < 0.3, float("-inf")).to(DEVICE)
    bias[..., -1] = 0
    q_tables = rope.cos_sin(torch.randint(0, 5000, (B, 1), generator=g).to(DEVICE), torch.float32)
    args = (q, q_tables, keys, tables, bias, weigh_rows(rows), up_v, v)
    torch.testing.assert_close(weighed_attention(*args, fused=True), weighed_attention(*args, fused=False),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [64, 16])
def test_query_rotated_in_the_kernel(dtype, tol, d):
    """q given before RoPE with its row's tables: the scores of the query RotaryEmbedding.apply_tables rotates (d = 16:
    both rotated before the kernel)."""
    from types import SimpleNamespace

    from kvzoo.models.llama import RotaryEmbedding

    g = torch.Generator().manual_seed(d)
    B, K, H, rep = 2, 100, 2, 4
    rope = RotaryEmbedding(SimpleNamespace(head_dim=d, rope_theta=500000.0, rope_scaling=None)).to(DEVICE)
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE, dtype)
    keys = torch.randn(B, K, H * d, generator=g).to(DEVICE, dtype)
    tables = rope.cos_sin(torch.randint(0, 131072, (B, K), generator=g).to(DEVICE), dtype)
    q_tables = rope.cos_sin(torch.randint(0, 131072, (B, 1), generator=g).to(DEVICE), dtype)   # (B, 1, 1, d) each
    want = gqa_scores(rope.apply_tables(q[:, :, None], *q_tables)[:, :, 0], keys, 0.125, tables)
    got = gqa_scores(q, keys, 0.125, tables, q_tables=q_tables)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    with pytest.raises(ValueError, match="give the keys' tables too"):
        gqa_scores(q, keys, 0.125, q_tables=q_tables)
    with pytest.raises(ValueError, match="q sin has shape"):
        gqa_scores(q, keys, 0.125, tables, q_tables=(q_tables[0], q_tables[1][:1]))
