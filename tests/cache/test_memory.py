"""Total-memory model (KV Pareto Appendix I): estimates agree with what is held; chunking bounds the
attention activation."""

import pytest

from repro.kvpareto.memory_model import activation_estimate, estimate, measure
from tests.cache.test_cache_contract import model  # noqa: F401  (the tiny model fixture)


@pytest.mark.parametrize("spec", ["fp16", "kvpareto:k_bits=4,v_bits=2", "kivi:bits=2,group_size=8,residual=16"])
def test_estimate_matches_the_tensors_held(model, spec):  # noqa: F811
    est, got = estimate(model, spec, 40, chunk=16), measure(model, spec, 40, chunk=16)
    assert est.model == got.model == sum(p.nbytes for p in model.parameters())
    assert est.kv == got.kv > 0
    assert got.activation is None and got.total is None and est.total == est.model + est.kv + est.activation


def test_activation_follows_eq_6_to_8(model):  # noqa: F811
    cfg = model.cfg
    assert activation_estimate(model, 40, None) == max(cfg.n_heads * 40 * 40 * 4, cfg.vocab_size * 4)
    assert activation_estimate(model, 40, 8) == max(cfg.n_heads * 8 * 40 * 4, cfg.vocab_size * 4)
    assert activation_estimate(model, 40, 8, logits_rows=40) == max(cfg.n_heads * 8 * 40 * 4, 40 * cfg.vocab_size * 4)
