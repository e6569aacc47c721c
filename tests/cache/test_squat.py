"""SQuat and SQuat-pre: the linear algebra (Lemmas 2 and 3, Woodbury), λ = 0 is KIVI, the subspace
(GQA stacking, padding, batch sharing), the perplexity protocol, bytes, options, real keys."""


import pytest
import torch

from kvzoo.cache.store import SCALE_DTYPE
from kvzoo.cache.kvquant import dequantize, quantize
from kvzoo.cache.squat import grouped_queries, query_subspace, squat_adjust, squat_quantize_keys, update_matrices
from kvzoo.eval.perplexity import perplexity
from kvzoo.models.loader import load_weights
from tests.cache.test_cache_contract import stream, tokens
from tests.tiny import tiny_llama

T = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """2 layers, 4 query heads of 32 sharing 2 KV heads: head_dim 32, so block 8 gives 4 iterations."""
    return load_weights(tiny_llama(tmp_path_factory.mktemp("tiny"), head_dim=32, hidden_size=64))


def random_subspace(r=5, d=32, seed=0, batch=()):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*batch, r, d, generator=g) * 3


# ---- the linear algebra -------------------------------------------------------------------------------
@pytest.mark.parametrize("r,d,block", [(5, 32, 8), (5, 32, 16), (40, 32, 8), (3, 64, 1), (2, 16, 4)])
def test_update_matrices_are_lemma_2_from_direct_inverses(r, d, block):
    """U_t = B_t H_t with A_t the top-left tg x tg block of P_inv inverted directly (no Lemma 3, no
    Woodbury): the recursion and the r < d shortcut change nothing."""
    lam = 0.05
    s = random_subspace(r, d).double()
    p_inv = torch.linalg.inv(torch.eye(d, dtype=s.dtype) + lam * s.T @ s)
    mats = update_matrices(s.float(), lam, block)
    assert len(mats) == d // block - 1
    for t, u in enumerate(mats, start=1):
        n = t * block
        h = torch.linalg.inv(p_inv[:n, :n])[:, n - block:]
        assert u.shape == (d - n, block)
        torch.testing.assert_close(u.double(), p_inv[n:, :n] @ h, rtol=1e-5, atol=1e-6)


def test_eq6_is_the_optimum_of_lemma_2():
    """δ on the free channels from eq. (6) minimizes δᵀ(I + λQ̂ᵀQ̂)δ with the first tg channels fixed to
    (0, d): the same as solving the quadratic directly, and no perturbation does better."""
    d, block, lam, t = 32, 8, 0.1, 2
    s = random_subspace(6, d).double()
    P = torch.eye(d, dtype=s.dtype) + lam * s.T @ s
    n = t * block
    fixed = torch.zeros(n, dtype=s.dtype)
    fixed[n - block:] = torch.randn(block, generator=torch.Generator().manual_seed(1), dtype=s.dtype)
    free = -torch.linalg.solve(P[n:, n:], P[n:, :n] @ fixed)                   # ∂/∂δ_free = 0
    u = update_matrices(s.float(), lam, block)[t - 1].double()
    torch.testing.assert_close(u @ fixed[n - block:], free, rtol=1e-5, atol=1e-6)

    def cost(f):
        delta = torch.cat([fixed, f])
        return delta @ P @ delta
    for seed in range(5):
        nudge = torch.randn(d - n, generator=torch.Generator().manual_seed(seed), dtype=s.dtype) * 1e-3
        assert cost(free) <= cost(free + nudge)


def test_query_subspace_is_the_svd():
    """Q̂ᵀQ̂ = V_r Σ_r² V_rᵀ of the SVD of the queries (signs aside), and ranks past N give zero rows."""
    q = torch.randn(2, 3, 50, 16, generator=torch.Generator().manual_seed(2))
    sub = query_subspace(q, 4)
    _, sigma, vh = torch.linalg.svd(q.double(), full_matrices=False)
    expected = vh[..., :4, :].transpose(-1, -2) @ (sigma[..., :4, None] ** 2 * vh[..., :4, :])
    torch.testing.assert_close((sub.transpose(-1, -2) @ sub).double(), expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(sub.norm(dim=-1).double(), sigma[..., :4], rtol=1e-5, atol=1e-4)
    few = query_subspace(q[..., :2, :], 5)
    assert few.shape == (2, 3, 5, 16) and few[..., 2:, :].abs().max() < 1e-3


def test_grouped_queries_follow_gqa_heads():
    q = torch.arange(2 * 6 * 3 * 1, dtype=torch.float32).view(2, 6, 3, 1)     # (B, Hq, T, d)
    g = grouped_queries(q, 2)                                                  # heads 0-2 -> KV 0, 3-5 -> KV 1
    assert g.shape == (2, 2, 9, 1)
    assert torch.equal(g[1, 1, :, 0], q[1, 3:, :, 0].flatten())


def test_lambda_zero_or_one_block_is_kivis_quantizer():
    keys = torch.randn(1, 2, 64, 32, generator=torch.Generator().manual_seed(3))
    kivi = dequantize(quantize(keys, 2, 32, axis=-2, scale_dtype=SCALE_DTYPE))
    sub = random_subspace(5, 32, batch=(1, 2))
    assert torch.equal(squat_quantize_keys(keys, sub, 2, 32, lam=0.0, block=16), kivi)
    assert torch.equal(squat_quantize_keys(keys, sub, 2, 32, lam=0.5, block=32), kivi)


def test_squat_shrinks_the_error_inside_the_subspace():
    """On random keys with a subspace that has directions to exploit, ||Q̂(k - k̂)|| drops well below
    KIVI's and ||k - k̂|| grows only a little: the trade-off λ sets."""
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(1, 1, 256, 64, generator=g)
    sub = torch.randn(1, 1, 5, 64, generator=g) * 10
    kivi = dequantize(quantize(keys, 2, 32, axis=-2, scale_dtype=SCALE_DTYPE))
    squat = squat_quantize_keys(keys, sub, 2, 32, lam=0.01, block=8)
    inside = [((keys - k) @ sub.transpose(-1, -2)).norm() for k in (kivi, squat)]
    total = [(keys - k).norm() for k in (kivi, squat)]
    assert inside[1] < 0.6 * inside[0]
    assert total[1] < 1.5 * total[0]


def test_adjusted_keys_are_what_each_block_was_rounded_from():
    """squat_adjust's output, quantized by KIVI's quantizer, gives the codes of the block loop: block t's
    rounding is computed from the values it held when the loop reached it, and later blocks move."""
    keys = torch.randn(2, 2, 32, 32, generator=torch.Generator().manual_seed(5))
    mats = update_matrices(random_subspace(4, 32, batch=(1, 2)), 0.05, 8)
    adjusted = squat_adjust(keys, mats, 2, 16)
    assert torch.equal(adjusted[..., :8], keys[..., :8])                       # the first block never moves
    assert (adjusted[..., 8:] - keys[..., 8:]).abs().max() > 1e-3
    k = keys.clone()
    for t in range(4):                                                          # the loop, written out
        cols = k[..., 8 * t:8 * t + 8].clone()
        err = dequantize(quantize(cols, 2, 16, axis=-2, scale_dtype=SCALE_DTYPE)) - cols
        if t < 3:
            k[..., 8 * t + 8:] += err @ mats[t].transpose(-1, -2)
        assert torch.allclose(adjusted[..., 8 * t:8 * t + 8], cols, atol=1e-5)


# ---- the cache ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["squat", "squat-pre"])
@torch.no_grad()
def test_lambda_zero_reproduces_kivi_exactly(model, name):
    kivi = {"squat": "kivi", "squat-pre": "kivi-pre"}[name]
    x = tokens(seed=8)
    for mode_kwargs in ({"prefill": 20}, {"prefill": 1}):
        ours, c1 = stream(model, f"{name}:lam=0,group_size=8,residual=8", x, **mode_kwargs)
        ref, c2 = stream(model, f"{kivi}:bits=2,group_size=8,residual=8", x, **mode_kwargs)
        assert torch.equal(ours, ref)
        for a, b in zip(c1.layers, c2.layers):
            ka, kb = a.store.codecs["k"], b.store.codecs["k"]
            assert torch.equal(ka.codes, kb.codes) and torch.equal(ka.scale, kb.scale)
    # simulated mode with a prompt of half the window: its queries read every key exact in both
    sim = model(x, model.new_cache(f"{name}:lam=0,group_size=8,residual=8", 2, T, mode="simulated", prompt=T // 2))
    ref = model(x, model.new_cache(f"{kivi}:bits=2,group_size=8,residual=8", 2, T, mode="simulated", prompt=T // 2))
    assert torch.equal(sim, ref)


@torch.no_grad()
def test_lambda_changes_the_keys_but_not_the_values(model):
    x = tokens(seed=9)
    _, ours = stream(model, "squat:lam=0.05,group_size=8,residual=8,block=8", x, prefill=20)
    _, ref = stream(model, "kivi:bits=2,group_size=8,residual=8", x, prefill=20)
    for a, b in zip(ours.layers, ref.layers):
        assert not torch.equal(a.store.codecs["k"].codes, b.store.codecs["k"].codes)
    # layer 0's values are the same tensors in both (later layers' values follow the changed attention)
    assert torch.equal(ours.layers[0].store.codecs["v"].codes, ref.layers[0].store.codecs["v"].codes)


@torch.no_grad()
def test_batch_shares_the_first_rows_matrices_unless_per_sample(model):
    x = tokens(batch=3, seed=10)
    _, shared = stream(model, "squat:group_size=8,residual=8,block=8", x, prefill=20)
    _, first = stream(model, "squat:group_size=8,residual=8,block=8", x[:1], prefill=20)
    _, per = stream(model, "squat:group_size=8,residual=8,block=8,per_sample=true", x, prefill=20)
    for s, f, p in zip(shared.layers, first.layers, per.layers):
        for t in (1, 2, 3):
            a, b, c = getattr(s, f"upd{t}"), getattr(f, f"upd{t}"), getattr(p, f"upd{t}")
            assert a.shape[0] == 1 and c.shape[0] == 3
            torch.testing.assert_close(a, b)
            torch.testing.assert_close(c[:1], b)
            assert not torch.allclose(c[1], b[0])


@torch.no_grad()
def test_padding_is_left_out_of_the_subspace(model):
    """A left-padded row builds the same matrices as the row alone (a padding query would add a
    direction to the subspace)."""
    x = tokens(batch=1, length=20, seed=11)
    padded = torch.cat([torch.zeros(1, 6, dtype=x.dtype), x], dim=1)
    alone = model.new_cache("squat:block=8,group_size=8", 1, 26)
    model(x, alone)
    cache = model.new_cache("squat:block=8,group_size=8", 1, 26)
    model(padded, cache, pad=torch.tensor([6]))
    for a, b in zip(alone.layers, cache.layers):
        torch.testing.assert_close(a.upd1, b.upd1, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["squat", "squat-pre"])
@torch.no_grad()
def test_perplexity_protocol_simulated_equals_streaming(model, name):
    """The prompt (the subspace, unscored): simulated mode and a real prefill of it followed by token-by-token
    decoding score the same predictions identically. per_sample: the two windows streamed side by side must not
    share the first one's subspace."""
    ids = torch.randint(0, 97, (2 * T,), generator=torch.Generator().manual_seed(12))
    spec = f"{name}:group_size=8,residual=8,block=8,lam=0.05,per_sample=true"
    sim = perplexity(model, ids, seq_len=T, cache=spec, mode="simulated", prompt=T // 2, progress=False)
    streamed = perplexity(model, ids, seq_len=T, cache=spec, mode="streaming", prompt=T // 2, batch_size=2,
                          progress=False)
    assert sim.prompt == streamed.prompt == T // 2
    assert sim.scored_tokens == 2 * (T - T // 2)
    assert streamed.perplexity == pytest.approx(sim.perplexity, rel=1e-5)


@torch.no_grad()
def test_nbytes_counts_the_update_matrices(model):
    x = tokens(seed=13)
    _, squat = stream(model, "squat:group_size=8,residual=8,block=8", x, prefill=20)
    _, kivi = stream(model, "kivi:bits=2,group_size=8,residual=8", x, prefill=20)
    d, g = 32, 8
    mats = 4 * 2 * sum((d - t * g) * g for t in (1, 2, 3))        # fp32, 2 KV heads, one shared set
    for a, b in zip(squat.layers, kivi.layers):
        assert a.nbytes() == b.nbytes() + mats == a.formula_nbytes(T)


@pytest.mark.parametrize("spec,message", [
    ("squat:block=12", "squat block 12 must divide the head dimension 32"),
    ("squat:rank=33", "squat rank 33 exceeds the head dimension 32"),
    ("squat:lam=-1", "lam must be >= 0, got -1.0"),
    ("squat:rank=0", "rank must be >= 1, got 0"),
    ("squat-pre:bits=5", "unsupported bit width 5; accepted: 2, 3, 4, 8"),
])
def test_bad_options_are_refused(model, spec, message):
    with pytest.raises(ValueError, match=message):
        model.new_cache(spec, 1, 16)


# ---- the embedded model --------------------------------------------------------------------------------
@torch.no_grad()
def test_real_keys_squat_beats_kivi_inside_the_subspace_and_on_scores(default_model_dir, wikitext_text):
    """SmolLM2's post-RoPE keys of one 512-token window, the first half the prompt: with the paper's
    r = 5, λ = 0.001 (g = 32, two iterations at head_dim 64), SQuat's ||Q̂(k - k̂)|| and its attention-score
    error against the response's queries are both below KIVI's, in most layers and on average."""
    from kvzoo.tokenizer import Tokenizer
    from repro.squat.analysis import capture_qk, score_errors

    model = load_weights(default_model_dir)
    ids = torch.tensor(Tokenizer.from_pretrained(default_model_dir).encode(wikitext_text)[:512])
    qs, ks = capture_qk(model, ids)
    wins_sub = wins_score = 0
    means = {"kivi_score": 0.0, "squat_score": 0.0, "kivi_subspace": 0.0, "squat_subspace": 0.0}
    for q, k in zip(qs, ks):
        err = score_errors(q, k, 256, bits=2, group_size=32, rank=5, lam=0.001, block=32)
        wins_sub += err["squat_subspace"].mean() < err["kivi_subspace"].mean()
        wins_score += err["squat_score"].mean() < err["kivi_score"].mean()
        for key in means:
            means[key] += err[key].mean().item() / len(qs)
    assert wins_sub >= 25 and wins_score >= 25
    assert means["squat_subspace"] < 0.9 * means["kivi_subspace"]
    assert means["squat_score"] < 0.95 * means["kivi_score"]
