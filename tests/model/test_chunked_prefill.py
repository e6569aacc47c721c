"""Chunked prefill (KV Pareto §4.1): the prompt fills the cache a chunk at a time. For the fp16 cache the
logits equal one unchunked prefill; every strategy accepts it; the options are checked."""

import pytest
import torch

from kvzoo.cache.base import list_caches
from kvzoo.eval.perplexity import perplexity
from kvzoo.generate import prefill
from tests.cache.test_cache_contract import LOSSY, model, tokens  # noqa: F401  (the tiny model fixture)


@pytest.mark.parametrize("chunk", [1, 7, 16, 48])
@torch.no_grad()
def test_fp16_chunked_prefill_equals_one_prefill(model, chunk):  # noqa: F811
    x = tokens(length=48, seed=11)
    pad = torch.tensor([5, 0])
    whole = model(x, model.new_cache("fp16", 2, 48), pad=pad)
    cache = model.new_cache("fp16", 2, 48)
    parts = torch.cat([model(x[:, a:a + chunk], cache, pad=pad) for a in range(0, 48, chunk)], dim=1)
    assert (parts - whole)[:, 5:].abs().max() < 1e-5 and (parts - whole)[1].abs().max() < 1e-5
    last = prefill(model, x, model.new_cache("fp16", 2, 48), pad, chunk)
    assert (last - whole[:, -1]).abs().max() < 1e-5


@pytest.mark.parametrize("name", sorted(list_caches()))
@torch.no_grad()
def test_every_strategy_prefills_in_chunks(model, name):  # noqa: F811
    spec = next(s for s in LOSSY.values() if s.split(":")[0] == name)
    x = tokens(length=40, seed=12)
    cache = model.new_cache(spec, 2, 48)
    logits = prefill(model, x, cache, None, chunk=16)
    assert cache.length == 40 and torch.isfinite(logits).all()
    assert torch.isfinite(model(x[:, :1], cache)).all()                     # decode continues


@torch.no_grad()
def test_perplexity_streaming_with_chunks(model):  # noqa: F811
    ids = torch.randint(0, 97, (96,), generator=torch.Generator().manual_seed(13))
    one = perplexity(model, ids, seq_len=48, mode="streaming", prompt=32, progress=False)
    chunked = perplexity(model, ids, seq_len=48, mode="streaming", prompt=32, prefill_chunk=10, progress=False)
    assert chunked.perplexity == pytest.approx(one.perplexity, rel=1e-5)
    with pytest.raises(ValueError, match="prefill_chunk applies to streaming and graph modes"):
        perplexity(model, ids, seq_len=48, prefill_chunk=8, progress=False)
    with pytest.raises(ValueError, match="unknown mode 'eager'; accepted: simulated, streaming, graph"):
        perplexity(model, ids, seq_len=48, mode="eager", progress=False)


@pytest.mark.parametrize("name", ["fp16", "kivi", "squat-pre-g8", "xquant", "alignedkv", "innerq"])
@torch.no_grad()
def test_perplexity_graph_mode_equals_streaming(model, name):  # noqa: F811
    """Graph mode decodes through kvzoo.graphs.decoder (on a CPU the same static steps, run eagerly): the same
    perplexity and bytes as streaming, the whole-step graph (fp16, kivi) and the piecewise one alike."""
    ids = torch.randint(0, 97, (96,), generator=torch.Generator().manual_seed(14))
    kw = dict(seq_len=48, prompt=16, batch_size=2, prefill_chunk=8, progress=False)
    streaming = perplexity(model, ids, cache=LOSSY[name], mode="streaming", **kw)
    graph = perplexity(model, ids, cache=LOSSY[name], mode="graph", **kw)
    assert graph.perplexity == pytest.approx(streaming.perplexity, rel=1e-6)
    assert graph.kv_nbytes == streaming.kv_nbytes


def test_generate_refuses_a_bad_chunk():
    from kvzoo.generate import generate

    with pytest.raises(ValueError, match="prefill_chunk must be >= 1, got 0"):
        generate(None, None, "hi", prefill_chunk=0)
