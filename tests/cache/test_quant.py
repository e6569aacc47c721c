"""Property tests for the shared quantizers and bit-packing (kvzoo/cache/kvquant.py)."""

import pytest
import torch

pytest.importorskip("hypothesis")   # the `test` extra

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvzoo.cache.kvquant import (SUPPORTED_BITS, block_codes, check_bits, pack, pack_tokens, packed_words,  # noqa: E402
                                 quantize, unpack, unpack_tokens)

bits_st = st.sampled_from(SUPPORTED_BITS)
mask_bits_st = st.sampled_from((1, *SUPPORTED_BITS))   # 1 bit: InnerQ's sign and mask words


@given(bits=mask_bits_st, n=st.integers(1, 130), rows=st.integers(1, 3), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_pack_then_unpack_is_identity(bits, n, rows, seed):
    codes = torch.randint(0, 2**bits, (rows, n), generator=torch.Generator().manual_seed(seed)).to(torch.uint8)
    words = pack(codes, bits)
    assert words.dtype == torch.int32 and words.shape == (rows, packed_words(n, bits))
    assert torch.equal(unpack(words, bits, n), codes)


@pytest.mark.parametrize("bits", (1, *SUPPORTED_BITS))
def test_unpack_reads_slices_of_the_stored_words(bits):
    """A store unpacks slots [a, b) of its buffers and, at times, words whose last dim is not contiguous."""
    codes = torch.randint(0, 2**bits, (2, 9, 64), generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    words = pack(codes, bits)
    assert torch.equal(unpack(words[:, 2:7], bits, 64), codes[:, 2:7])
    strided = words.transpose(-1, -2).contiguous().transpose(-1, -2)         # same values, last-dim stride 9
    assert strided.stride(-1) == 9 and torch.equal(unpack(strided, bits, 64), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_packing_along_tokens(bits):
    """pack_tokens (InnerQ's values): a word holds one channel's codes of consecutive tokens, a chunk's words lie in
    its own rows, so chunks are written and sliced by token; unpack_tokens inverts it."""
    codes = torch.randint(0, 2**bits, (2, 64, 96), generator=torch.Generator().manual_seed(bits))
    words = pack_tokens(codes, bits)
    assert words.shape == (2, 64, packed_words(96, bits))
    assert torch.equal(unpack_tokens(words, bits), codes)
    block = block_codes(bits)
    assert torch.equal(pack_tokens(codes[:, block:3 * block], bits), words[:, block:3 * block])
    chunk = words[:, :block].flatten(-2).unflatten(-1, (96, -1))               # (2, d, words): channel by channel
    assert torch.equal(chunk[:, 5], pack(codes[:, :block, 5], bits))


def test_packing_is_exactly_b_bits_per_code():
    for bits in SUPPORTED_BITS:
        assert packed_words(64, bits) * 32 == 64 * bits
    # 3-bit codes straddle int32 words: 32 codes in exactly 3 words
    codes = torch.full((1, 32), 7, dtype=torch.uint8)
    assert pack(codes, 3).shape == (1, 3) and torch.equal(unpack(pack(codes, 3), 3, 32), codes)


@given(bits=bits_st, symmetric=st.booleans(), per_channel=st.booleans(), seed=st.integers(0, 2**16),
       scale=st.floats(1e-3, 1e3))
@settings(max_examples=60, deadline=None)
def test_round_trip_error_at_most_half_a_step(bits, symmetric, per_channel, seed, scale):
    x = torch.randn(2, 3, 32, 16, generator=torch.Generator().manual_seed(seed)) * scale
    axis = -2 if per_channel else -1
    q = quantize(x, bits, 8, axis=axis, symmetric=symmetric, scale_dtype=torch.float32)
    step = q.scale.float().repeat_interleave(8, dim=axis)
    err = (q.dequantize() - x).abs()
    assert (err <= 0.5 * step * (1 + 1e-5) + 1e-6 * scale).all()


def test_fp16_scales_stay_within_half_a_step_plus_zero_rounding():
    x = torch.randn(4, 64, 32) * 5
    q = quantize(x, 4, 32, axis=-1, scale_dtype=torch.float16)
    assert q.scale.dtype == torch.float16 and q.zero.dtype == torch.float16
    step = q.scale.float().repeat_interleave(32, dim=-1)
    assert ((q.dequantize() - x).abs() <= 0.5 * step + 1e-2).all()


@pytest.mark.parametrize("symmetric", [False, True])
def test_constant_groups_and_one_token_per_channel_groups(symmetric):
    """min == max: no division by zero, the value comes back (the classic silent NaN)."""
    x = torch.randn(2, 3, 1, 16)                        # one token: per-channel groups of size 1
    q = quantize(x, 2, 1, axis=-2, symmetric=symmetric, scale_dtype=torch.float32)
    assert torch.isfinite(q.dequantize()).all()
    assert torch.allclose(q.dequantize(), x, atol=1e-6)
    const = torch.full((1, 4, 32), 3.25)
    assert torch.equal(quantize(const, 2, 32, scale_dtype=torch.float32).dequantize(), const)
    zeros = torch.zeros(1, 4, 32)
    assert torch.equal(quantize(zeros, 3, 32, symmetric=symmetric).dequantize(), zeros)


def test_bad_bits_and_groups_are_refused():
    with pytest.raises(ValueError, match="unsupported bit width 5; accepted: 2, 3, 4, 8"):
        check_bits(5)
    with pytest.raises(ValueError, match="group size 24 does not divide the quantized dimension 64"):
        quantize(torch.randn(2, 64), 2, 24)


@pytest.mark.parametrize("axis", [-1, -2, -3])
@pytest.mark.parametrize("symmetric", [False, True])
def test_dequantize_in_place_equals_the_grouped_formula(axis, symmetric):
    """dequantize scales the unpacked codes in place (scale_codes_, the group axis split where it lies) and
    gives bit for bit code * scale + zero (or (code - 2^(b-1)) * scale) computed group by group."""
    from kvzoo.cache.kvquant import _grouped, _ungrouped, dequantize

    x = torch.randn(2, 64, 32, 64, generator=torch.Generator().manual_seed(5))
    q = quantize(x, 4, 16, axis=axis, symmetric=symmetric)
    g = _grouped(unpack(q.codes, 4, 64).float(), axis, 16)                       # (..., 16)
    s = q.scale.float().unsqueeze(-1)
    want = (g - 8) * s if symmetric else g * s + q.zero.float().unsqueeze(-1)
    assert torch.equal(dequantize(q), _ungrouped(want, axis))


@pytest.mark.parametrize("axis,group", [(-1, 32), (-2, 8), (-1, 24), (-3, 16)])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16])
def test_fake_quantize_is_the_round_trip_bit_for_bit(axis, group, symmetric, scale_dtype):
    """fake_quantize (no packing) gives exactly dequantize(quantize(...)): every bit width, constant groups, given
    limits (values clamped into them), the result's dtype."""
    from kvzoo.cache.kvquant import _grouped, dequantize, fake_quantize

    g = torch.Generator().manual_seed(group)
    x = torch.randn(2, 48, 16, 96, generator=g) * 3
    x[0, :16, :8, :32] = 1.5                                                      # constant groups
    for bits in SUPPORTED_BITS:
        want = dequantize(quantize(x, bits, group, axis, symmetric, scale_dtype))
        assert torch.equal(fake_quantize(x, bits, group, axis, symmetric, scale_dtype), want)
    grouped = _grouped(x, axis, group)                                          # (..., group)
    limits = (grouped.amin(-1, keepdim=True) / 2, grouped.amax(-1, keepdim=True) / 2)   # half the range: clamped
    want = dequantize(quantize(x, 4, group, axis, scale_dtype=scale_dtype, limits=limits), torch.bfloat16)
    assert torch.equal(fake_quantize(x, 4, group, axis, scale_dtype=scale_dtype, limits=limits, dtype=torch.bfloat16),
                       want)
