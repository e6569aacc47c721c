"""repro/kvpareto/bench.py's read-floor kernels against a torch XOR of the same words, under the Triton interpreter
on CPU (the benchmark itself needs a GPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.kernels.w4a16 import quantize_weight  # noqa: E402
from repro.kvpareto.bench import _read_kernel, block_products, flat_words, layer_shapes, stream  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"


@pytest.mark.parametrize("split,per", [(1, 4), (2, 2), (3, 2)])
def test_read_kernel_reads_every_code_word_of_its_split_once(split, per):
    """N = 100 (a partial tile of 64), K = 1024 in 4 steps of 256 channels (32 words); splits of 4, 2 + 2 and
    2 + 2 + none: each split's row is the XOR of its steps' words of that feature, read where the panel order keeps
    them."""
    w4 = quantize_weight(torch.randn(100, 1024, generator=torch.Generator().manual_seed(split)).to(DEVICE), 128)
    out = torch.zeros(16, 100, dtype=torch.int32, device=DEVICE)
    _read_kernel[(2, split)](w4.codes, out, 100, 4, per, KW=32, PANELS=True)
    steps = w4.rows()[0].view(100, 4, 32)
    for s in range(split):
        want = torch.zeros(100, dtype=torch.int32, device=DEVICE)
        for word in steps[:, s * per:(s + 1) * per].reshape(100, -1).unbind(1):
            want ^= word
        assert torch.equal(out[s], want)


def test_layer_shapes_name_the_products_that_share_one():
    """The per-layer table's shapes are a block's seven products, each shape once, named by the products that share
    it (--step runs the seven, the module docstring lists these)."""
    assert layer_shapes("Llama-3.1-8B") == [("q/o", 4096, 4096), ("k/v", 1024, 4096), ("gate/up", 14336, 4096),
                                            ("down", 4096, 14336)]
    assert layer_shapes("Llama-2-7B") == [("q/k/v/o", 4096, 4096), ("gate/up", 11008, 4096), ("down", 4096, 11008)]
    assert [name for name, _, _ in block_products("SmolLM2-135M")] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert layer_shapes("SmolLM2-135M") == [("q/o", 576, 576), ("k/v", 192, 576), ("gate/up", 1536, 576),
                                            ("down", 576, 1536)]


def test_stream_reads_every_word_of_the_weight_once():
    """--step's floor: a weight's codes, scales and zeros in one flat buffer (its nbytes, byte for byte), streamed a
    block of words a program, the last block partial."""
    w4 = quantize_weight(torch.randn(96, 384, generator=torch.Generator().manual_seed(3)).to(DEVICE), 128)
    words = flat_words(w4)
    assert words.numel() * 4 == w4.nbytes() and words.numel() % 1024
    assert torch.equal(words[-(w4.zero.numel() // 2):].view(torch.float16).view_as(w4.zero), w4.zero)
    out = torch.zeros(words.numel() // 1024 + 1, dtype=torch.int32, device=DEVICE)
    stream(words, out, 1024, 4)
    for program, block in enumerate(words.split(1024)):
        want = torch.zeros((), dtype=torch.int32, device=DEVICE)
        for word in block:
            want ^= word
        assert out[program] == want
