"""The block's one-kernel operations (kvzoo/kernels/layer_ops.py) against the torch code of the model's modules,
under the Triton interpreter on CPU; compiled on CUDA (TRITON_INTERPRET=0) the same tests ask for the torch code's
results to the bit (the norms: to the last bit of a few elements, their sums run in another order).

The interpreter rounds to bfloat16 by truncation and has no libdevice, so on CPU the results are held within a
unit in the last place instead."""

import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.kernels.layer_ops import add_rms_norm, rms_norm, rope_qk, silu_mul  # noqa: E402
from kvzoo.models.llama import MLP, RMSNorm, RotaryEmbedding, join_weights, joined_weight  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"
COMPILED = DEVICE == "cuda"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
ULP = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7, torch.float32: 2 ** -22}


def assert_same(got, want, exact: bool = COMPILED, few: float = 0.0):
    """Equal to the bit (compiled), or within a unit in the last place (interpreter); `few`: the share of
    elements allowed one unit off even when compiled (fp32 norms: any)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    off = got != want
    if exact and few and (want.dtype == torch.float32 or off.float().mean().item() <= few):
        exact = False
    if exact:
        assert not off.any(), f"{off.sum().item()} of {off.numel()} elements differ"
    ulp = ULP[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp * want.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [576, 1000])
def test_norms_compute_the_modules_torch_code(dtype, n):
    """RMSNorm of rows of SmolLM2's width and of a width that is not a power of two; the residual add before it."""
    g = torch.Generator().manual_seed(n)
    norm = RMSNorm(n, 1e-5).to(DEVICE, dtype)
    norm.weight.data = torch.randn(n, generator=g).to(DEVICE, dtype)
    x = (3 * torch.randn(2, 5, n, generator=g)).to(DEVICE, dtype)
    delta = torch.randn(2, 5, n, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        assert_same(rms_norm(x, norm.weight, norm.eps), norm.reference(x), few=0.01)
        total, normed = add_rms_norm(x, delta, norm.weight, norm.eps)
        assert_same(total, x + delta)
        assert_same(normed, norm.reference(x + delta), few=0.01)
        got = norm.add(x, delta)                                   # the module: kernel on CUDA, torch on CPU
    assert_same(got[0], x + delta)
    assert_same(got[1], norm.reference(x + delta), few=0.01)


@pytest.mark.parametrize("dtype,d", [(torch.float16, 64), (torch.bfloat16, 64), (torch.float32, 64),
                                     (torch.float16, 80)], ids=str)
def test_rope_rotates_strided_q_and_k_as_the_torch_code(dtype, d):
    """q and k as the attention module makes them (heads of the projections' (B, T, H*d) rows, transposed
    views), SmolLM2's 9 and 3 heads (not powers of two), positions up to 128K, Llama 3.1's scaled frequencies;
    a head dim of 80 (halves of 40, not a power of two)."""
    g = torch.Generator().manual_seed(1)
    B, T, Hq, Hk = 2, 6, 9, 3
    cfg = SimpleNamespace(head_dim=d, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    rope = RotaryEmbedding(cfg).to(DEVICE)
    q = torch.randn(B, T, Hq * d, generator=g).to(DEVICE, dtype).view(B, T, Hq, d).transpose(1, 2)
    k = torch.randn(B, T, Hk * d, generator=g).to(DEVICE, dtype).view(B, T, Hk, d).transpose(1, 2)
    ids = torch.randint(0, 131072, (B, T), generator=g).to(DEVICE)
    with torch.no_grad():
        q_want, k_want = rope.reference(q, k, ids)
        for heads in (8, 2):                                # q and k in one block each, in 5 and 2 blocks
            q_got, k_got = rope_qk(q, k, ids, rope.inv_freq, heads=heads)
            assert_same(q_got, q_want)
            assert_same(k_got, k_want)
            assert q_got.is_contiguous() and k_got.is_contiguous()
        q_mod, k_mod = rope(q, k, ids)
    assert_same(q_mod, q_want)
    assert_same(k_mod, k_want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_is_the_mlps_product(dtype):
    g = torch.Generator().manual_seed(2)
    gate = (4 * torch.randn(3, 2500, generator=g)).to(DEVICE, dtype)     # not a multiple of the 1,024 block
    up = torch.randn(3, 2500, generator=g).to(DEVICE, dtype)
    assert_same(silu_mul(gate, up), MLP.reference(gate, up))
    both = torch.randn(2, 3, 2 * 2500, generator=g).to(DEVICE, dtype)      # the halves of one projection's rows
    gate, up = both.chunk(2, dim=-1)
    assert_same(silu_mul(gate, up), MLP.reference(gate, up))


def test_joined_weights_are_one_tensor_until_something_replaces_them():
    """join_weights makes gate and up one tensor's rows; a weight assigned anew, a module replaced, a hook on a
    module (AWQ's calibration reads gate's inputs) or a bias each turn the one product off."""
    mlp = MLP(SimpleNamespace(hidden_size=8, intermediate_size=12))
    assert joined_weight(mlp.gate_proj, mlp.up_proj) is None                  # two allocations
    gate, up = mlp.gate_proj.weight.clone(), mlp.up_proj.weight.clone()
    join_weights(mlp.gate_proj, mlp.up_proj)
    both = joined_weight(mlp.gate_proj, mlp.up_proj)
    assert both.shape == (24, 8) and torch.equal(both, torch.cat([gate, up]))
    assert torch.equal(mlp.gate_proj.weight, gate) and torch.equal(mlp.up_proj.weight, up)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)                                          # in place: still one tensor
    assert torch.equal(joined_weight(mlp.gate_proj, mlp.up_proj)[12:], 2 * up)
    handle = mlp.gate_proj.register_forward_pre_hook(lambda *args: None)
    assert joined_weight(mlp.gate_proj, mlp.up_proj) is None
    handle.remove()
    assert joined_weight(mlp.up_proj, mlp.gate_proj) is None                 # not in the joined order
    mlp.up_proj.weight = torch.nn.Parameter(up.clone())
    assert joined_weight(mlp.gate_proj, mlp.up_proj) is None


def test_layer_ops_variable_refuses_other_values():
    """KVZOO_LAYER_OPS, read when the model module is imported: fused (the default) or torch, nothing else."""
    import subprocess
    import sys

    code = "import kvzoo.models.llama as m; print(m.FUSED_OPS)"
    for value, fused in (("fused", "True"), ("torch", "False")):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "KVZOO_LAYER_OPS": value})
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [fused]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "KVZOO_LAYER_OPS": "Torch"})
    assert run.returncode != 0
    assert "KVZOO_LAYER_OPS must be one of ('fused', 'torch'), got 'Torch'" in run.stderr


def test_bad_input_is_named():
    x = torch.randn(2, 8).to(DEVICE)
    w = torch.ones(8).to(DEVICE)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(x, w[:4], 1e-5)
    with pytest.raises(ValueError, match="weight has dtype"):
        rms_norm(x, w.half(), 1e-5)
    with pytest.raises(ValueError, match="at most 16384"):
        rms_norm(torch.randn(1, 20000).to(DEVICE), torch.ones(20000).to(DEVICE), 1e-5)
    with pytest.raises(ValueError, match="delta has shape"):
        add_rms_norm(x, x[:1], w, 1e-5)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm(x.long(), w, 1e-5)
    q = torch.randn(1, 4, 3, 16).to(DEVICE)
    freq = torch.ones(8).to(DEVICE)
    ids = torch.zeros(1, 3, dtype=torch.long).to(DEVICE)
    with pytest.raises(ValueError, match="k has shape"):
        rope_qk(q, q[:, :, :2], ids, freq)
    with pytest.raises(ValueError, match="inv_freq has dtype"):
        rope_qk(q, q, ids, freq.long())
    with pytest.raises(ValueError, match="ids has dtype"):
        rope_qk(q, q, ids.float(), freq)
    with pytest.raises(ValueError, match="inv_freq has shape"):
        rope_qk(q, q, ids, freq[:4])
    with pytest.raises(ValueError, match="must be even"):
        rope_qk(q[..., :15], q[..., :15], ids, freq[:7])
    with pytest.raises(ValueError, match="unit stride"):
        rope_qk(q.transpose(-1, -2).contiguous().transpose(-1, -2), q, ids, freq)
    with pytest.raises(ValueError, match="up has shape"):
        silu_mul(x, x[:1])
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        silu_mul(x.long(), x.long())


@pytest.mark.skipif(not COMPILED, reason="the model takes these kernels on CUDA tensors only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_on_a_gpu_equals_its_torch_code(dtype, tmp_path):
    """A random-weight model's logits with the kernels (no autograd) and with the torch code (autograd on, where
    the model takes the torch code), prefill and one decode step through an fp16 cache."""
    from kvzoo.models.loader import load_weights
    from tests.tiny import tiny_llama

    model = load_weights(tiny_llama(tmp_path)).to("cuda", dtype).join_projections()
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    assert joined_weight(mlp.gate_proj, mlp.up_proj) is not None
    assert joined_weight(attn.q_proj, attn.k_proj, attn.v_proj) is not None
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3)).cuda()
    logits = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            cache = model.new_cache("fp16", 2, 41)
            first = model(tokens, cache)
            logits.append(torch.cat([first, model(tokens[:, :1], cache)], dim=1).detach())
    torch.testing.assert_close(logits[0].float(), logits[1].float(), rtol=0.02, atol=0.02)
