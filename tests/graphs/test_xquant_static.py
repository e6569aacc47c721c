"""XQuant's and XQuant-CL's static decode step (kvzoo/graphs.py's whole-step graph): on CPU GraphDecoder runs it
eagerly and must equal the eager decode token for token, across window flushes (a group quantized inside the
step), with padding and a sliding window, through the torch path and through the rematerialization kernel
(the Triton interpreter); on CUDA the captured graphs must equal it too."""

import os

import pytest
import torch

import kvzoo.cache.xquant as xq
import kvzoo.cache.xquant_cl as xcl
from kvzoo.cache.store import GroupCodec
from kvzoo.generate import prefill
from kvzoo.graphs import GraphDecoder, decoder
from kvzoo.models.loader import load_weights
from tests.cache.test_xquant import gqa, mha  # noqa: F401  (fixtures: 4-layer MHA and GQA Llamas)
from tests.tiny import tiny_mistral

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
STEPS = 40


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny 4-layer GQA Mistral with a sliding window of 6 tokens."""
    return load_weights(tiny_mistral(tmp_path_factory.mktemp("tinyw"), num_hidden_layers=4))


def decode_both(model, spec: str, pad: torch.Tensor | None, device="cpu"):
    """Logits (B, STEPS, vocab) of greedy decode steps after a 3-token prompt, eager and through GraphDecoder,
    and the phases GraphDecoder recorded."""
    prompts = torch.randint(3, 97, (2, 3), generator=torch.Generator().manual_seed(4))
    if pad is not None:
        prompts[1, :int(pad[1])] = 0
        pad = pad.to(device)
    out = []
    for static in (False, True):
        kv = model.new_cache(spec, 2, 3 + STEPS)
        token = prefill(model, prompts.to(device), kv, pad).argmax(-1)
        if static:
            step = decoder(model, kv, pad)
            assert isinstance(step, GraphDecoder)
        else:
            step = lambda t: model(t[:, None], kv, pad=pad)[:, -1]          # noqa: E731
        logits = []
        for _ in range(STEPS):
            logits.append(step(token).clone())
            token = logits[-1].argmax(-1)
        out.append(torch.stack(logits, 1))
        assert kv.length == 3 + STEPS
    return out[0], out[1], set(step.steps)


# (spec, architectures): every setting flushes its window several times in 40 steps (G = 8 or 16); the paper's
# windows (the default: GQA's X U_k in whole groups, X U_v a token at a time) and one window for every stream
STATIC = [("xquant:bits=4,group_size=8,residual=8", ("mha", "gqa")),
          ("xquant:bits=2,group_size=16,policy=grouped", ("mha", "gqa")),              # R = 0: a flush every G tokens
          ("xquant:bits=3,group_size=8,residual=16,policy=grouped", ("gqa",)),         # 3 bits: codes spill across words
          ("xquant:bits=2,group_size=16,outlier_channel=true,high_layers=1,policy=grouped", ("gqa",)),
          ("xquant:bits=16,group_size=8,residual=8,policy=grouped", ("mha", "gqa")),   # rows kept exact
          ("xquant-cl:bits=2,high_layers=2,base_layer=1,group_size=8,residual=8", ("mha", "gqa")),
          ("xquant-cl:bits=3,high_bits=8,high_layers=1,base_layer=0,group_size=16,policy=grouped", ("mha", "gqa"))]
CASES = [(spec, arch) for spec, archs in STATIC for arch in archs]


@pytest.mark.parametrize("spec, arch", CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_whole_step_equals_eager(request, spec, arch, padded):
    """Through every phase: tokens joining the window ("recent") and filling it, so that its oldest group is
    quantized into the codes at a device-held slot inside the step ("flush")."""
    model = request.getfixturevalue(arch)
    eager, static, phases = decode_both(model, spec, torch.tensor([0, 2]) if padded else None)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
    windows = not spec.startswith("xquant-cl") or "base_layer=0" not in spec    # CL: plain layers before the base
    assert any("flush" in stream for phase in phases for stream in phase) == windows


def test_paper_defaults_before_any_group_is_quantized(gqa):
    """G = 128 > max_len: no quantized slot is allocated (capacity 0), every token stays in the window."""
    eager, static, phases = decode_both(gqa, "xquant:policy=grouped", None)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)
    assert phases == {("recent",) * 4}


@pytest.mark.parametrize("spec", ["xquant:bits=4,group_size=8,residual=8,policy=grouped", STATIC[5][0]])
def test_whole_step_with_a_sliding_window(windowed, spec):
    eager, static, _ = decode_both(windowed, spec, torch.tensor([0, 2]))      # the window binds after 6 tokens
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="forces the kernel on CPU tensors, which needs the Triton interpreter")
@pytest.mark.parametrize("spec", ["xquant:bits=4,group_size=16,outlier_channel=true,policy=grouped",
                                  "xquant-cl:bits=2,high_layers=1,base_layer=1,group_size=16,policy=grouped"])
def test_whole_step_through_the_kernel(gqa, monkeypatch, spec):
    """What a GPU runs: every packed latent rematerialized by the kernels (dequant_matmul, and dequant_gather and
    weigh_gather in XQuant's static step; here under the interpreter), the static step over every allocated slot,
    the eager one over the live ones."""
    pytest.importorskip("triton")
    calls = []

    def fused(latent, first, up, fused=None):
        calls.append(latent)
        return rematerialize(latent, first, up, fused=True)

    def fused_rows(latent, first, window, src, dtype, fused=None):
        calls.append(latent)
        return latent_rows(latent, first, window, src, dtype, fused=True)

    def fused_weigh(latent, first, window, src, dtype, fused=None):
        calls.append(latent)
        return weigh_latent(latent, first, window, src, dtype, fused=True)

    rematerialize, latent_rows, weigh_latent = xq.rematerialize, xq.latent_rows, xq.weigh_latent
    monkeypatch.setattr(xq, "rematerialize", fused)
    monkeypatch.setattr(xq, "latent_rows", fused_rows)
    monkeypatch.setattr(xq, "weigh_latent", fused_weigh)
    monkeypatch.setattr(xcl, "rematerialize", fused)
    eager, static, _ = decode_both(gqa, spec, None)
    assert any(isinstance(latent, xq.QTensor) for latent in calls)
    torch.testing.assert_close(static, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not INTERPRETED, reason="forces the kernel on CPU tensors, which needs the Triton interpreter")
def test_bf16_step_weighs_the_value_latents_from_their_codes(gqa, monkeypatch):
    """A bf16 model's static step, whose value latents a GPU weighs from their codes (weigh_gather), against the
    same step gathering the rows and multiplying them, over the same teacher-forced tokens (16-channel groups:
    their scales folded into the weights; a flush every 8 tokens)."""
    import copy

    import kvzoo.kernels.xquant_remat as remat

    model = copy.deepcopy(gqa).to(torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    prompts, tokens = torch.randint(3, 97, (2, 3), generator=g), torch.randint(3, 97, (2, 16), generator=g)
    weigh_latent, weigh_gather, calls = xq.weigh_latent, remat.weigh_gather, []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return weigh_gather(*args, **kwargs)

    monkeypatch.setattr(remat, "weigh_gather", counted)

    def logits(fused: bool) -> torch.Tensor:
        monkeypatch.setattr(xq, "weigh_latent", lambda *args: weigh_latent(*args, fused=fused))
        kv = model.new_cache("xquant:bits=4,group_size=8,policy=grouped", 2, 3 + tokens.shape[1])
        prefill(model, prompts, kv, None)
        step = decoder(model, kv)
        assert isinstance(step, GraphDecoder)
        return torch.stack([step(tokens[:, i]).float() for i in range(tokens.shape[1])], 1)

    want, got = logits(False), logits(True)
    assert calls and not any(latent.axis != -1 for latent in calls)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())   # bf16 logits: 1.2% here


def test_decoder_picks_the_whole_step(gqa):
    for spec in ("xquant", "xquant:policy=grouped", "xquant:bits=2,residual=128,policy=grouped", "xquant-cl",
                 "xquant-cl:policy=grouped", "xquant-cl:bits=16,high_bits=16,policy=grouped"):
        kv = gqa.new_cache(spec, 2, 8)
        prefill(gqa, torch.tensor([[0, 5, 6], [4, 5, 6]]), kv, torch.tensor([1, 0]))
        assert isinstance(decoder(gqa, kv), GraphDecoder)
        assert isinstance(decoder(gqa, kv, torch.tensor([1, 0])), GraphDecoder)     # padding: the step's mask
    for spec in ("xquant", "xquant-cl"):
        with pytest.raises(ValueError, match="needs a streaming cache"):
            decoder(gqa, gqa.new_cache(spec, 1, 8, mode="simulated"))


def test_write_at_takes_whole_per_channel_groups():
    codec = GroupCodec((1,), 32, 16, 4, 8, True, torch.float32, "cpu")
    codec.write_at(torch.tensor([8]), torch.randn(1, 8, 16))
    with pytest.raises(ValueError, match="whole groups of 8 rows, got 3"):
        codec.write_at(torch.tensor([8]), torch.randn(1, 3, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("spec, arch", [CASES[0], CASES[1], (STATIC[3][0], "gqa"), (STATIC[5][0], "gqa"),
                                        (STATIC[5][0], "mha")])
def test_cuda_graph_equals_its_step(request, monkeypatch, spec, arch):
    """One graph per phase, captured and replayed, against the same static step run uncaptured on the GPU: the
    same kernels, so the same logits. (Against the eager decode the static step agrees to rounding, and at 2
    bits a rounding difference can flip a code, a step of one quantization level in the later logits, as it
    does on the H100 for the XQuant-CL MHA case: the CPU tests above hold that comparison.)"""
    import kvzoo.graphs as graphs

    model = request.getfixturevalue(arch).to("cuda")
    try:
        _, graphed, phases = decode_both(model, spec, torch.tensor([0, 2]), device="cuda")
        monkeypatch.setattr(graphs._Captured, "__call__", lambda self, cuda: self.fn())     # uncaptured
        _, stepped, _ = decode_both(model, spec, torch.tensor([0, 2]), device="cuda")
        torch.testing.assert_close(graphed, stepped, rtol=1e-6, atol=1e-6)
        assert any("flush" in stream for phase in phases for stream in phase)
    finally:
        model.to("cpu")
