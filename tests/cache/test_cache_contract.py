"""One contract, run over every registered cache strategy (in the manner of kvpress's default presses).

Each strategy names a lossless setting (which must reproduce the fp16 cache) and a lossy one (for which
simulated mode must equal token-by-token streaming decode, and nbytes must match the documented formula).
A strategy registered without entries here fails test_every_strategy_is_covered.
"""

import copy

import pytest
import torch

from kvzoo.cache.base import list_caches
from kvzoo.models.loader import load_weights
from tests.tiny import tiny_llama

LOSSLESS = {
    "fp16": "fp16",
    "kivi": "kivi:bits=2,group_size=8,residual=64",      # the window covers every token of the tests
    "kivi-pre": "kivi-pre:bits=2,group_size=8,residual=64",
    "innerq": "innerq:sink=16,recent=64",                 # key normalization on: must stay exact
    "xquant": "xquant:bits=16",                           # no quantization: K, V rematerialized from X U_k, X U_v
    "xquant-cl": "xquant-cl:bits=16,high_bits=16,base_layer=0",   # layer 1 caches its latent delta
    "squat": "squat:bits=2,group_size=8,residual=64",     # the window covers every token of the tests
    "squat-pre": "squat-pre:bits=2,group_size=8,residual=64",
    "alignedkv": "alignedkv:min_bits=16",                 # every bit read
    "kvpareto": "kvpareto:k_bits=16,v_bits=16,k_smooth=false",
    "int8": "int8:bits=16",
}
LOSSY = {
    "fp16": "fp16",
    "kivi": "kivi:bits=2,group_size=8,residual=16",
    "kivi-pre": "kivi-pre:bits=3,group_size=8,residual=8",
    "kivi+sink": "kivi:bits=2,group_size=8,residual=8,sink=5",
    "innerq": "innerq:sink=4,recent=0",
    "innerq-sym-outer": "innerq:bits=3,sink=0,recent=32,quant_mode=sym,outer=true,key_norm=false",
    "innerq-asym": "innerq:bits=4,sink=7,recent=0,quant_mode=asym,key_norm=false",
    "xquant": "xquant:bits=2,group_size=8,residual=8",
    "xquant-outlier": "xquant:bits=3,group_size=16,residual=0,outlier_channel=true",
    "xquant-cl": "xquant-cl:bits=2,high_layers=1,base_layer=0,group_size=16",        # base 4-bit, a 2-bit delta
    # per_sample: rows alone must equal the batch
    "squat": "squat:group_size=8,residual=8,rank=4,lam=0.05,per_sample=true",
    "squat-pre-g8": "squat-pre:bits=3,group_size=16,residual=0,rank=2,lam=0.5,block=8,per_sample=true",
    "squat-grouped": "squat:group_size=8,residual=8,rank=4,lam=0.05,per_sample=true,policy=grouped",
    "kivi-none": "kivi:bits=2,group_size=8,residual=16,policy=none",
    "innerq-grouped": "innerq:bits=2,sink=3,recent=0,policy=grouped,key_norm=false",
    "innerq-none-hybrid-prefill": "innerq:bits=3,recent=32,quant_mode=hybrid_prefill,policy=none,key_norm=false",
    "xquant-cl-plain-first": "xquant-cl:bits=3,high_layers=0,base_layer=1,group_size=8,residual=8",
    "alignedkv": "alignedkv:block=8,topk=4",
    "alignedkv-12": "alignedkv:block=16,topk=2,min_bits=12",
    "kvpareto": "kvpareto:k_bits=4,v_bits=2,group_size=16",
    "kvpareto-block": "kvpareto:k_bits=2,v_bits=4,granularity=block,group_size=8",
    "kvpareto-tensor": "kvpareto:k_bits=8,v_bits=4,granularity=tensor,k_smooth=false",
    "kvpareto-k16": "kvpareto:k_bits=16,v_bits=2,granularity=tensor",
    "int8": "int8",
}
# Settings whose statistics come from the prompt (InnerQ's key norm, KV Pareto's K-smoothing mean, SQuat's
# subspace) at their defaults, so that the causality test covers them
CAUSAL = LOSSY | {
    "innerq-tied": "innerq:sink=4,recent=0,tie_norm=true",
    "innerq-default": "innerq:sink=8,recent=32",
    "squat-default": "squat:group_size=8,residual=8",
    "squat-pre-default": "squat-pre:group_size=8,residual=8",
    "kvpareto-smooth-block": "kvpareto:k_bits=2,v_bits=2,granularity=block,group_size=8",
}
T = 48
# Strategies whose storage format is fp16 itself (AlignedKV reads fp16 bit planes): an fp32 model rounds
# their K/V to fp16, so their lossless setting is checked in a half-precision copy of the model.
FP16_FORMAT = {"alignedkv"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_weights(tiny_llama(tmp_path_factory.mktemp("tiny"), head_dim=32, hidden_size=64))


def tokens(batch=2, length=T, seed=0):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def stream(model, spec, x, prefill=1):
    """Prefill `prefill` tokens, then decode the rest one at a time: logits (B, T, V)."""
    cache = model.new_cache(spec, x.shape[0], x.shape[1])
    out = [model(x[:, :prefill], cache)] + [model(x[:, t:t + 1], cache) for t in range(prefill, x.shape[1])]
    return torch.cat(out, dim=1), cache


def test_every_strategy_is_covered():
    assert set(list_caches()) == set(LOSSLESS) == {spec.split(":")[0] for spec in LOSSY.values()}


@pytest.mark.parametrize("name", sorted(LOSSLESS))
@torch.no_grad()
def test_lossless_setting_reproduces_fp16(model, name):
    if name in FP16_FORMAT:
        model = copy.deepcopy(model).half()
    x = tokens()
    reference, _ = stream(model, "fp16", x, prefill=20)
    ours, _ = stream(model, LOSSLESS[name], x, prefill=20)
    simulated = model(x, model.new_cache(LOSSLESS[name], 2, T, mode="simulated"))
    if name in FP16_FORMAT:   # in half precision one forward and token-by-token decode differ by rounding
        reference_sim = model(x, model.new_cache("fp16", 2, T, mode="simulated"))
    else:
        reference_sim = reference
    assert (ours - reference).abs().max() < 1e-5
    assert (simulated - reference_sim).abs().max() < 1e-5


@pytest.mark.parametrize("name", sorted(LOSSY))
@torch.no_grad()
def test_simulated_mode_equals_token_by_token_decode(model, name):
    x = tokens(seed=1)
    streamed, _ = stream(model, LOSSY[name], x)
    simulated = model(x, model.new_cache(LOSSY[name], 2, T, mode="simulated"))
    assert (simulated - streamed).abs().max() < 1e-4


@pytest.mark.parametrize("name", sorted(LOSSY))
@torch.no_grad()
def test_simulated_mode_with_a_prompt_equals_prefill_then_decode(model, name):
    """prompt=P: the first P queries see every key exact, as one streaming prefill of P tokens does.
    InnerQ: the last-bit differences between a 20-token prefill and one forward flip one 2-bit code of
    a 32-token value group (row 0, slots 36 on, 1.5e-3 in the logits); a code flip, not a protocol gap."""
    x = tokens(seed=1)
    streamed, _ = stream(model, LOSSY[name], x, prefill=20)
    simulated = model(x, model.new_cache(LOSSY[name], 2, T, mode="simulated", prompt=20))
    assert (simulated - streamed).abs().max() < (3e-3 if name.startswith("innerq") else 1e-4)


@pytest.mark.parametrize("name", sorted(LOSSY))
@torch.no_grad()
def test_streaming_prefill_is_exact_then_decode_uses_storage(model, name):
    """A prompt prefill attends at full precision (the fp16 logits); decode continues from storage."""
    x = tokens(seed=2)
    reference, _ = stream(model, "fp16", x, prefill=30)
    ours, cache = stream(model, LOSSY[name], x, prefill=30)
    assert (ours[:, :30] - reference[:, :30]).abs().max() < 1e-5
    assert cache.length == T


@pytest.mark.parametrize("prompt", [0, 20])
@pytest.mark.parametrize("name", sorted(CAUSAL))
@torch.no_grad()
def test_simulated_mode_is_causal(model, name, prompt):
    """No prediction depends on a later token: changing the tokens after slot t leaves the logits of slots
    <= t unchanged (statistics taken from the prompt only, as a streaming run has them)."""
    x = tokens(seed=8)
    base = model(x, model.new_cache(CAUSAL[name], 2, T, mode="simulated", prompt=prompt))
    for t in (5, 40):
        changed = x.clone()
        changed[:, t + 1:] = tokens(seed=9)[:, t + 1:]
        other = model(changed, model.new_cache(CAUSAL[name], 2, T, mode="simulated", prompt=prompt))
        assert (other[:, :t + 1] - base[:, :t + 1]).abs().max() < 1e-5, f"slot <= {t} saw a later token"


@pytest.mark.parametrize("name", sorted(LOSSY))
@torch.no_grad()
def test_nbytes_is_held_tensors_and_formula(model, name):
    x = tokens(seed=3)
    for prefill in (1, 17, T):
        _, cache = stream(model, LOSSY[name], x, prefill=prefill)
        for layer in cache.layers:
            assert layer.nbytes() == layer.formula_nbytes(T)
        held = sum(b.nbytes for b in cache.buffers())
        assert 0 < cache.nbytes() <= held


@pytest.mark.parametrize("name", sorted(LOSSY))
@torch.no_grad()
def test_batch_equals_rows_alone(model, name):
    x = tokens(batch=3, seed=4)
    batched, _ = stream(model, LOSSY[name], x, prefill=10)
    for row in range(3):
        alone, _ = stream(model, LOSSY[name], x[row:row + 1], prefill=10)
        assert (batched[row] - alone[0]).abs().max() < 1e-4


@pytest.mark.parametrize("name", sorted(LOSSY))
@torch.no_grad()
def test_reset_forgets_everything(model, name):
    x = tokens(seed=5)
    first, cache = stream(model, LOSSY[name], x)
    cache.reset()
    assert cache.nbytes() == 0 and cache.length == 0
    again = torch.cat([model(x[:, :1], cache)] + [model(x[:, t:t + 1], cache) for t in range(1, T)], dim=1)
    assert torch.equal(first, again)


@torch.no_grad()
def test_streaming_perplexity_equals_simulated_when_decoding_from_one_token(model):
    """kvzoo.eval.perplexity: both modes score the same predictions when streaming prefills one token."""
    from kvzoo.eval.perplexity import perplexity

    ids = torch.randint(0, 97, (3 * T,), generator=torch.Generator().manual_seed(6))
    spec = LOSSY["kivi"]
    sim = perplexity(model, ids, seq_len=T, cache=spec, mode="simulated", prompt=0, progress=False)
    stream_ = perplexity(model, ids, seq_len=T, cache=spec, mode="streaming", prompt=0, batch_size=2,
                         progress=False)
    assert sim.windows == stream_.windows == 3
    assert stream_.perplexity == pytest.approx(sim.perplexity, rel=1e-5)
    assert stream_.kv_nbytes == sim.kv_nbytes


@torch.no_grad()
def test_perplexity_scores_after_the_prompt(model):
    """prompt = P scores the predictions of tokens P..L-1 only: the mean of exactly those losses; the default
    prompt is min(256, L // 8), the same for every strategy."""
    import torch.nn.functional as F

    from kvzoo.eval.perplexity import default_prompt, perplexity

    ids = torch.randint(0, 97, (T,), generator=torch.Generator().manual_seed(7))
    result = perplexity(model, ids, seq_len=T, prompt=20, progress=False)
    logits = model(ids[None], model.new_cache("fp16", 1, T))[0]
    expected = F.cross_entropy(logits[19:-1].float(), ids[20:]).exp().item()
    assert result.scored_tokens == T - 20 and result.perplexity == pytest.approx(expected, rel=1e-5)
    assert perplexity(model, ids, seq_len=T, prompt=1, progress=False).perplexity == \
        pytest.approx(perplexity(model, ids, seq_len=T, prompt=0, progress=False).perplexity, rel=1e-6)
    assert perplexity(model, ids, seq_len=T, progress=False).prompt == default_prompt(T) == T // 8
    assert default_prompt(2048) == default_prompt(4096) == 256
    with pytest.raises(ValueError, match=r"prompt must be in \[0, seq_len=48\), got 48"):
        perplexity(model, ids, seq_len=T, prompt=T, progress=False)


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_repeat_row_copies_a_prefilled_row(model, name):
    """repeat_row (parallel sampling from one prefill; bench_decode's large batches): every row of the copy
    decodes as the one-row cache does."""
    x = tokens(batch=1, length=40, seed=5)
    one = model.new_cache(LOSSY[name], 1, 44)
    token = model(x, one)[:, -1].argmax(-1)                                    # (1,)
    many = model.new_cache(LOSSY[name], 3, 44)
    many.repeat_row(one)
    assert many.length == one.length == 40
    got = model(token.expand(3)[:, None], many)[:, -1]
    want = model(token[:, None], one)[:, -1]
    torch.testing.assert_close(got, want.expand(3, -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one-row cache of the same strategy"):
        many.repeat_row(many)
