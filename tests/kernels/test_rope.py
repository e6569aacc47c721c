"""The in-place RoPE kernel (kvzoo/kernels/rope.py) against its torch reference and the model's own rotation,
under the Triton interpreter on CPU (compiled on CUDA with TRITON_INTERPRET=0)."""

import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.kernels.rope import rope_, rope_ref  # noqa: E402
from kvzoo.models.llama import RotaryEmbedding  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"


def rope_module():
    """The model's RotaryEmbedding for a head dim of 64 (it reads only these config fields)."""
    return RotaryEmbedding(SimpleNamespace(head_dim=64, rope_theta=10000.0, rope_scaling=None)).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotates_a_strided_view_in_place(dtype):
    """Keys as XQuant's static step holds them: heads of a flat (B, T + 3, H*d) buffer, a transposed view; 70 rows
    (not a multiple of the 64-row block); the buffer's other rows untouched."""
    g = torch.Generator().manual_seed(0)
    B, H, T, d = 2, 3, 70, 64
    flat = torch.randn(B, T + 3, H * d, generator=g).to(DEVICE, dtype)
    before = flat.clone()
    x = flat[:, :T].view(B, T, H, d).transpose(1, 2)                         # (B, H, T, d), strided
    ids = torch.randint(0, 4000, (B, T), generator=g)
    rope = rope_module()
    cos, sin = rope.cos_sin(ids.to(DEVICE), dtype)
    want = rope_ref(x.clone(), cos, sin)
    assert rope_(x, cos, sin) is x
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(x, want, rtol=tol, atol=tol)
    torch.testing.assert_close(x.float(), rope.apply_tables(before[:, :T].view(B, T, H, d).transpose(1, 2), cos,
                                                            sin).float(), rtol=2 * tol, atol=2 * tol)
    assert torch.equal(flat[:, T:], before[:, T:])


def test_bad_input_is_named():
    rope = rope_module()
    x = torch.randn(1, 2, 5, 64).to(DEVICE)
    cos, sin = rope.cos_sin(torch.arange(5)[None].to(DEVICE), torch.float32)
    with pytest.raises(ValueError, match="cos has shape"):
        rope_(x, cos[:, :, :4], sin)
    with pytest.raises(ValueError, match="dtype"):
        rope_(x, cos.half(), sin)
    with pytest.raises(ValueError, match="unit stride"):
        rope_(torch.randn(1, 2, 64, 5).to(DEVICE)[..., :4].transpose(-1, -2)[..., :2, :], cos[:, :, :2], sin[:, :, :2])
    with pytest.raises(ValueError, match="B, H, T, d"):
        rope_(x[0], cos, sin)
