"""repro/kvpareto/bench.py's read-floor kernel against a torch XOR of the same code words, under the Triton
interpreter on CPU (the benchmark itself needs a GPU)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.kernels.w4a16 import quantize_weight  # noqa: E402
from repro.kvpareto.bench import _read_kernel  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"


@pytest.mark.parametrize("split,per", [(1, 4), (2, 2), (3, 2)])
def test_read_kernel_reads_every_code_word_of_its_split_once(split, per):
    """N = 100 (a partial tile of 64), K = 1024 in 4 steps of 256 channels (32 words); splits of 4, 2 + 2 and
    2 + 2 + none: each split's row is the XOR of its steps' words of that feature."""
    w4 = quantize_weight(torch.randn(100, 1024, generator=torch.Generator().manual_seed(split)).to(DEVICE), 128)
    out = torch.zeros(16, 100, dtype=torch.int32, device=DEVICE)
    _read_kernel[(2, split)](w4.codes, out, 100, 4, per, KW=32)
    steps = w4.codes.view(100, 4, 32)
    for s in range(split):
        want = torch.zeros(100, dtype=torch.int32, device=DEVICE)
        for word in steps[:, s * per:(s + 1) * per].reshape(100, -1).unbind(1):
            want ^= word
        assert torch.equal(out[s], want)
