"""tests/interpreted.py leaves what the interpreter computes unchanged: a fused kernel full of nested @triton.jit
helpers gives the same bits with it as with Triton's own patching."""

import pytest
import torch

from tests.interpreted import interpreting
from tests.kernels.test_outer_attention import cache


def test_skipping_repeated_patching_changes_no_bit(monkeypatch):
    if not interpreting():
        pytest.skip("the kernels are compiled, not interpreted")
    from triton.runtime import interpreter

    from kvzoo.kernels.outer_attention import outer_decode_attention

    assert getattr(interpreter._patch_lang, "skips_repeats", False), "tests/conftest.py installs it"
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(2, 2, 64, 64, 64, 2, torch.float32)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(0))

    def run():
        return outer_decode_attention(q, *codes, 2, k_rec, v_rec, (64, 64, 90, 4), k_sink=k_sink, v_sink=v_sink,
                                      num_splits=2)

    skipped = run()
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.plain)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", interpreter.GridExecutor.__call__.plain)
    assert torch.equal(run(), skipped)
