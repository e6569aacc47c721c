"""AlignedKV past the one-token decode: chunked prefill through the torch reference in query blocks of bounded
memory, and the static decode step that kvzoo/graphs.py captures whole (eager on CPU: the torch reference, or
the kernels under the Triton interpreter; a CUDA graph on a GPU), which must equal the eager decode."""

import pytest
import torch

import kvzoo.cache.alignedkv as alignedkv
from kvzoo.cache.alignedkv import AlignedKVCache
from kvzoo.generate import prefill
from kvzoo.graphs import GraphDecoder, PiecewiseDecoder, decoder
from tests.graphs.test_graphs import decode_both, model, whole_step_equals_eager, windowed  # noqa: F401  (the tiny model fixtures)


def kernels_on_cpu(monkeypatch):
    """The static step through aligned_decode_static (the Triton interpreter runs it on CPU)."""
    pytest.importorskip("triton")
    from kvzoo.kernels.quant_matvec import kernels_run_on

    if not kernels_run_on(torch.device("cpu")):
        pytest.skip("the Triton interpreter is off (on a GPU machine test_cuda_graph_equals_eager runs the kernels)")
    monkeypatch.setattr(AlignedKVCache, "_static_fused", lambda self: self._kernels_fit())


# ---- chunked prefill -------------------------------------------------------------------------------------
@torch.no_grad()
def test_chunked_prefill_runs_the_reference_in_bounded_query_blocks(model, monkeypatch):  # noqa: F811
    """A prompt prefilled in chunks of 17 (each past the first attends over stored blocks through the torch
    reference): a budget of 3 queries' temporaries gives the same logits, bit for bit, as one block per chunk."""
    x = torch.randint(3, 97, (2, 80), generator=torch.Generator().manual_seed(5))

    def chunked():
        kv = model.new_cache("alignedkv:block=8,topk=4", 2, 80)
        return torch.cat([model(x[:, a:a + 17], kv) for a in range(0, 80, 17)], dim=1)

    calls, reference = [], alignedkv.aligned_attention

    def counted(q, k16, v16, k_exp, v_exp, exact_k, exact_v, n_aligned, mask, *rest):
        B, _, T, d = q.shape
        calls.append((T, 4 * B * k16.shape[1] * T * mask.shape[-1] * d))   # queries, bytes of one (B, H, T, S, d)
        return reference(q, k16, v16, k_exp, v_exp, exact_k, exact_v, n_aligned, mask, *rest)

    monkeypatch.setattr(alignedkv, "aligned_attention", counted)
    whole = chunked()
    assert [T for T, _ in calls] == [17] * 6 + [12] * 2      # the 4 chunks past the first, 2 layers, one block each
    calls.clear()
    budget = 3 * 4 * 2 * model.cfg.n_kv_heads * 80 * model.cfg.head_dim    # 3 queries of the last chunk
    monkeypatch.setattr(alignedkv, "QUERY_BLOCK_BYTES", budget)
    blocked = chunked()
    assert len(calls) > 20 and all(size <= budget for _, size in calls) and calls[-1][0] <= 3
    assert torch.equal(blocked, whole)


# ---- the static step --------------------------------------------------------------------------------------
@pytest.mark.parametrize("cache, kernels", [("alignedkv:block=16,topk=4", False),
                                            ("alignedkv:block=16,topk=64,min_bits=12", False),
                                            ("alignedkv:block=16,min_bits=16", False),
                                            ("alignedkv:block=8,topk=2", False),
                                            ("alignedkv:block=16,topk=4", True),
                                            ("alignedkv:block=16,topk=64,min_bits=12", True)])
def test_whole_step_equals_eager(model, cache, kernels, monkeypatch):  # noqa: F811
    """The static step against the eager decode (the torch path on CPU), from a 2-token prompt for 40 steps:
    tokens before the first complete block, blocks closing inside the step (one graph per phase), and aligned
    reads of two complete blocks, through the torch reference or the kernels reading live lengths."""
    if kernels:
        kernels_on_cpu(monkeypatch)
    whole_step_equals_eager(model, cache)


@pytest.mark.parametrize("kernels", [False, True])
def test_whole_step_with_padding_and_sliding_window(model, windowed, kernels, monkeypatch):  # noqa: F811
    """Padded rows and a sliding window of 6 tokens: the step masks its scores with StaticStep.mask."""
    if kernels:
        kernels_on_cpu(monkeypatch)
    prompts = torch.randint(3, 97, (3, 10), generator=torch.Generator().manual_seed(1))
    pad = torch.tensor([0, 4, 7])
    prompts[1, :4] = prompts[2, :7] = 0
    for m in (model, windowed):
        eager, static = decode_both(m, prompts, pad, steps=25, cache="alignedkv:block=16,topk=4")
        torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels", [False, True])
@torch.inference_mode()
def test_the_static_step_stores_what_decode_stores(model, kernels, monkeypatch):  # noqa: F811
    """The same 37 tokens decoded eagerly and through the static step: layer 0 (whose K and V depend on the
    tokens only) holds the same bit planes, nibbles merged into shared bytes included, and exponents."""
    if kernels:
        kernels_on_cpu(monkeypatch)
    x = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(6))
    caches = []
    for static in (False, True):
        kv = model.new_cache("alignedkv:block=8,topk=4", 2, 40)
        prefill(model, x[:, :3], kv, None)
        step = GraphDecoder(model, kv) if static else (lambda t: model(t[:, None], kv)[:, -1])
        for t in range(3, 40):
            step(x[:, t])
        caches.append(kv.layers[0])
    eager, static = caches
    assert eager.length == static.length == 40
    assert torch.equal(static._stored_keys(0, 40), eager._stored_keys(0, 40))
    assert torch.equal(static._stored_values(40), eager._stored_values(40))
    assert torch.equal(static.k_exp[:, :, :5], eager.k_exp[:, :, :5])
    assert torch.equal(static.v_exp[:, :, :40], eager.v_exp[:, :, :40])


def test_decoder_picks_the_whole_step_for_alignedkv(model):  # noqa: F811
    assert isinstance(decoder(model, model.new_cache("alignedkv", 1, 8)), GraphDecoder)
    kv = model.new_cache("alignedkv:block=8", 2, 8)
    prefill(model, torch.tensor([[0, 5, 6], [4, 5, 6]]), kv, torch.tensor([1, 0]))
    assert isinstance(decoder(model, kv, torch.tensor([1, 0])), GraphDecoder)
    assert [layer.static_phase() for layer in kv.layers] == ["fill", "fill"]
    with pytest.raises(ValueError, match="needs a streaming cache"):
        decoder(model, model.new_cache("alignedkv", 1, 8, mode="simulated"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_equals_eager(model):  # noqa: F811
    """On a GPU: the captured step (aligned_decode_static) against the eager decode (aligned_decode once a block
    is complete), unpadded and padded; settings the kernels do not take fall back to PiecewiseDecoder."""
    m = model.to("cuda")
    try:
        prompts = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2)).cuda()
        for pad in (None, torch.tensor([0, 3], device="cuda")):
            eager, graphed = decode_both(m, prompts, pad, steps=40, device="cuda", cache="alignedkv:block=16,topk=4")
            torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
        assert isinstance(decoder(m, m.new_cache("alignedkv:block=8", 1, 8)), PiecewiseDecoder)
        assert isinstance(decoder(m, m.new_cache("alignedkv:block=16", 1, 8)), GraphDecoder)
    finally:
        model.to("cpu")
