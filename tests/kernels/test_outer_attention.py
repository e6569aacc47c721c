"""The fused outer-layout decode attention (kvzoo/kernels/outer_attention.py) against its pure-torch reference,
under the Triton interpreter (`TRITON_INTERPRET=0` on a GPU machine runs the compiled kernels instead)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvzoo.cache.kvquant import quantize  # noqa: E402
from kvzoo.kernels.outer_attention import (  # noqa: E402
    WHOLE_TOKEN_WARPS, outer_decode_attention, outer_decode_attention_ref, split_kernel_warps)
from kvzoo.kernels.quant_matvec import dequant_outer  # noqa: E402

DEVICE = "cpu" if os.environ["TRITON_INTERPRET"].lower() in ("1", "true", "on", "yes") else "cuda"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}   # relative to the largest reference magnitude


def name(value) -> str:
    return str(value).replace("torch.", "").replace(" ", "")


def cache(B, H, N_k, N_v, d, bits, dtype, rows=40, sink=4, seed=0, group=32):
    """Codes of random keys (per-channel groups) and values (per-token groups of `group` channels), window and sink
    rows."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, N_k, d, generator=g), torch.randn(B, H, N_v, d, generator=g)
    kq = quantize(k.to(DEVICE), bits, 32, axis=-2, scale_dtype=torch.float16)
    vq = quantize(v.to(DEVICE), bits, group, axis=-1, scale_dtype=torch.float16)
    k_rec, v_rec, k_sink, v_sink = (torch.randn(B, H, n, d, generator=g).to(DEVICE, dtype)
                                    for n in (rows, rows, sink, sink))
    return (kq.codes, kq.scale, kq.zero, vq.codes, vq.scale, vq.zero), (k_rec, v_rec), (k_sink, v_sink)


def assert_close(got, want, dtype):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.float().abs().max().item()), err


# lengths [n_k, n_v, n_tail, n_sink]: KIVI's authors' windows (keys quantized past values), one window for both,
# values quantized past keys (policy none), nothing quantized, only the sink, no sink
LENGTHS = [(128, 90, 130, 4), (96, 96, 120, 2), (64, 95, 96, 0), (0, 0, 30, 4), (0, 0, 0, 3), (32, 5, 40, 0)]
CASES = [(bits, d, dtype, rep, lengths) for (bits, d, dtype), (rep, lengths) in zip(
    itertools.product((2, 4), (64, 128), (torch.float32, torch.float16, torch.bfloat16)),
    itertools.cycle(itertools.product((1, 3, 4), LENGTHS)))]


@pytest.mark.parametrize("bits,d,dtype,rep,lengths", CASES, ids=name)
def test_fused_outer_attention_matches_reference(bits, d, dtype, rep, lengths):
    B, H = 2, 2
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(B, H, 128, 96, d, bits, dtype, seed=bits + d + rep)
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(rep)).to(DEVICE, dtype)
    for lens in (lengths, torch.tensor(lengths, dtype=torch.int32, device=DEVICE)):
        args = (q, *codes, bits, k_rec, v_rec, lens)
        got = outer_decode_attention(*args, k_sink=k_sink, v_sink=v_sink, num_splits=2)
        assert got.dtype == dtype and got.shape == (B, H * rep, d)
        assert_close(got, outer_decode_attention_ref(*args, k_sink=k_sink, v_sink=v_sink), dtype)


@pytest.mark.parametrize("dtype,rows", [(torch.float32, (0, 7)), (torch.float16, (39, 1)), (torch.bfloat16, (13, 26))],
                         ids=name)
def test_windows_as_rings_equal_them_in_slot_order(dtype, rows):
    """lengths [.., k_row, v_row]: windows held as rings (their oldest slots in rows k_row and v_row, wrapping past
    the last row, kvzoo.cache.store.Window.first_row) attend as the same windows in slot order, kernel and
    reference."""
    B, H, rep, d = 2, 2, 4, 64
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(B, H, 128, 96, d, 2, dtype, seed=sum(rows))
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    lengths, kw = (96, 64, 100, 4), dict(k_sink=k_sink, v_sink=v_sink)
    want = outer_decode_attention(q, *codes, 2, k_rec, v_rec, lengths, num_splits=2, **kw)
    k_ring, v_ring = k_rec.roll(rows[0], dims=2), v_rec.roll(rows[1], dims=2)    # row 0 moved to row k_row, v_row
    for lens in ((*lengths, *rows), torch.tensor((*lengths, *rows), dtype=torch.int32, device=DEVICE)):
        assert_close(outer_decode_attention(q, *codes, 2, k_ring, v_ring, lens, num_splits=2, **kw), want, dtype)
        assert_close(outer_decode_attention_ref(q, *codes, 2, k_ring, v_ring, lens, **kw), want, dtype)


# (bits, d, dtype, lengths): the token in the tail's last slot (keys past values, one window, nothing quantized)
# or, with no tail yet, in the sink's last row
@pytest.mark.parametrize("bits,d,dtype,lengths", [(2, 128, torch.float16, (128, 90, 130, 4)),
                                                  (4, 64, torch.float32, (96, 96, 120, 2)),
                                                  (2, 64, torch.bfloat16, (0, 0, 30, 0)),
                                                  (2, 128, torch.float32, (0, 0, 0, 3))], ids=name)
def test_token_given_apart_equals_the_token_in_its_window(bits, d, dtype, lengths):
    """k_token, v_token: the step's token attended after the stored slots equals the same token stored where the
    step stores it (the windows' row of the tail's last slot, or the sink's last row), kernel and reference."""
    B, H, rep = 2, 2, 4
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(B, H, 128, 96, d, bits, dtype, seed=bits + d)
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(d)).to(DEVICE, dtype)
    n_k, n_v, n_tail, n_sink = lengths
    if n_tail:
        apart = (n_k, n_v, n_tail - 1, n_sink)
        k_tok, v_tok = k_rec[:, :, n_tail - 1 - n_k][:, :, None], v_rec[:, :, n_tail - 1 - n_v][:, :, None]
    else:
        apart = (n_k, n_v, 0, n_sink - 1)
        k_tok, v_tok = k_sink[:, :, n_sink - 1][:, :, None], v_sink[:, :, n_sink - 1][:, :, None]
    kw = dict(k_sink=k_sink, v_sink=v_sink)
    stored = outer_decode_attention(q, *codes, bits, k_rec, v_rec, lengths, num_splits=2, **kw)
    for lens in (apart, torch.tensor(apart, dtype=torch.int32, device=DEVICE)):
        got = outer_decode_attention(q, *codes, bits, k_rec, v_rec, lens, num_splits=2, k_token=k_tok.contiguous(),
                                     v_token=v_tok.contiguous(), **kw)
        assert_close(got, stored, dtype)
        assert_close(got, outer_decode_attention_ref(q, *codes, bits, k_rec, v_rec, apart, k_token=k_tok,
                                                     v_token=v_tok, **kw), dtype)
    with pytest.raises(ValueError, match="k_token must hold one token"):
        outer_decode_attention(q, *codes, bits, k_rec, v_rec, apart, k_token=k_rec, v_token=v_rec)
    with pytest.raises(ValueError, match="give both k_token and v_token"):
        outer_decode_attention(q, *codes, bits, k_rec, v_rec, apart, k_token=k_tok)


def token_cache(B, H, N, d, k_bits, v_bits, group, dtype, rows=3, seed=0):
    """Codes of random keys and values, both in per-token groups of `group` channels (KV Pareto, int8)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, N, d, generator=g), torch.randn(B, H, N, d, generator=g)
    kq = quantize(k.to(DEVICE), k_bits, group, axis=-1, scale_dtype=torch.float16)
    vq = quantize(v.to(DEVICE), v_bits, group, axis=-1, scale_dtype=torch.float16)
    k_rec, v_rec = (torch.randn(B, H, rows, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    return (kq.codes, kq.scale, kq.zero, vq.codes, vq.scale, vq.zero), (k_rec, v_rec)


# (k_bits, v_bits, group, d, dtype, N, lengths): int8's one group per token, KV Pareto's k8v8 / k8v4 / k4v2 in
# groups of 32; buffers of 100 slots (not whole runs of 32) with every slot quantized, and the token in the window
@pytest.mark.parametrize("k_bits,v_bits,group,d,dtype,N,lengths", [
    (8, 8, 64, 64, torch.float32, 100, (100, 100, 101, 0)), (8, 8, 128, 128, torch.float16, 96, (70, 70, 71, 0)),
    (8, 4, 32, 64, torch.bfloat16, 100, (33, 33, 34, 0)), (4, 2, 32, 128, torch.float32, 64, (64, 64, 65, 0)),
    (2, 8, 64, 64, torch.float16, 100, (0, 0, 1, 0))], ids=name)
def test_token_grouped_keys_match_reference(k_bits, v_bits, group, d, dtype, N, lengths):
    """The kernel against the reference, the token in its window and given apart (k_token, v_token: the window's
    row of the tail's last slot, as the graph step gives it; int8 at d = 128 takes WHOLE_TOKEN_WARPS on a GPU)."""
    B, H, rep = 2, 2, 3
    codes, (k_rec, v_rec) = token_cache(B, H, N, d, k_bits, v_bits, group, dtype, seed=k_bits + v_bits + group)
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(group)).to(DEVICE, dtype)
    layout = dict(v_bits=v_bits, key_groups="token", group=group)
    args = (q, *codes, k_bits, k_rec, v_rec, torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    got = outer_decode_attention(*args, num_splits=2, **layout)
    assert got.dtype == dtype and got.shape == (B, H * rep, d)
    want = outer_decode_attention_ref(*args, **layout)
    assert_close(got, want, dtype)
    n_k, n_v, n_tail, n_sink = lengths
    row = n_tail - 1 - n_k                                           # the token's window row (keys and values alike)
    apart = torch.tensor((n_k, n_v, n_tail - 1, n_sink), dtype=torch.int32, device=DEVICE)
    got = outer_decode_attention(q, *codes, k_bits, k_rec, v_rec, apart, num_splits=2,
                                 k_token=k_rec[:, :, row:row + 1], v_token=v_rec[:, :, row:row + 1], **layout)
    assert_close(got, want, dtype)


def test_whole_token_groups_of_128_channels_take_more_warps():
    """int8 on Llama's heads (groups of a token's d = 128 channels) runs the split kernel at WHOLE_TOKEN_WARPS;
    per-channel keys, KV Pareto's groups of 32 and head_dim 64 keep the caller's warps."""
    assert WHOLE_TOKEN_WARPS == 8
    assert split_kernel_warps("token", 128, 128, 4) == WHOLE_TOKEN_WARPS
    assert split_kernel_warps("token", 32, 128, 4) == 4
    assert split_kernel_warps("token", 64, 64, 4) == 4
    assert split_kernel_warps("channel", 32, 128, 4) == 4


def test_reference_is_attention_over_the_slots_in_order():
    """Slot u of the tail reads its key from the codes while u < n_k, else key-window row u - n_k (values the same
    with n_v): the reference equals softmax attention over those rows, built one slot at a time."""
    bits, d, (n_k, n_v, n_tail, n_sink) = 2, 64, (64, 40, 70, 3)
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(1, 1, 64, 64, d, bits, torch.float32)
    k_all = dequant_outer(codes[0], codes[1], codes[2], bits, -2)[0, 0]
    v_all = dequant_outer(codes[3], codes[4], codes[5], bits, -1)[0, 0]
    keys = [k_sink[0, 0, i] for i in range(n_sink)] + \
        [k_all[u] if u < n_k else k_rec[0, 0, u - n_k] for u in range(n_tail)]
    values = [v_sink[0, 0, i] for i in range(n_sink)] + \
        [v_all[u] if u < n_v else v_rec[0, 0, u - n_v] for u in range(n_tail)]
    q = torch.randn(1, 2, d, device=DEVICE)
    p = torch.softmax(q[0] @ torch.stack(keys).T / math.sqrt(d), -1)
    want = (p @ torch.stack(values))[None]
    got = outer_decode_attention_ref(q, *codes, bits, k_rec, v_rec, (n_k, n_v, n_tail, n_sink), k_sink=k_sink,
                                     v_sink=v_sink)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_close(outer_decode_attention(q, *codes, bits, k_rec, v_rec, (n_k, n_v, n_tail, n_sink), k_sink=k_sink,
                                        v_sink=v_sink), want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=name)
def test_nothing_quantized_yet_and_no_sink(dtype):
    """Code buffers of no slots (a cache too short to quantize anything) and no sink: only the windows."""
    codes, (k_rec, v_rec), _ = cache(1, 2, 0, 0, 64, 2, dtype)
    q = torch.randn(1, 6, 64, device=DEVICE).to(dtype)
    args = (q, *codes, 2, k_rec, v_rec, (0, 0, 33, 0))
    assert_close(outer_decode_attention(*args), outer_decode_attention_ref(*args), dtype)


def test_peaked_softmax_and_many_splits():
    """A large softmax scale: one key dominates, so the online max and the merge of splits (some past the live
    slots) must be right."""
    codes, (k_rec, v_rec), _ = cache(1, 2, 256, 256, 64, 2, torch.float32, seed=3)
    q = torch.randn(1, 8, 64, device=DEVICE)
    args = (q, *codes, 2, k_rec, v_rec, (224, 192, 230, 0))
    for splits in (1, 3, 8):
        assert_close(outer_decode_attention(*args, sm_scale=4.0, num_splits=splits),
                     outer_decode_attention_ref(*args, sm_scale=4.0), torch.float32)


@pytest.mark.parametrize("k_bits,v_bits,group", [(8, 8, 128), (8, 4, 32)], ids=name)
def test_no_window_and_every_slot_quantized(k_bits, v_bits, group):
    """No window and no sink (KV Pareto's and int8's graph step): the quantized slots, then the token given apart."""
    B, H, N, d, rep = 1, 2, 100, 64 if group == 32 else 128, 2
    codes, _ = token_cache(B, H, N, d, k_bits, v_bits, group, torch.float32, seed=k_bits + v_bits)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE)
    k_tok, v_tok = (torch.randn(B, H, 1, d, generator=g).to(DEVICE) for _ in range(2))
    args = (q, *codes, k_bits, None, None, (90, 90, 90, 0))
    kw = dict(v_bits=v_bits, key_groups="token", group=group, k_token=k_tok, v_token=v_tok)
    assert_close(outer_decode_attention(*args, num_splits=2, **kw), outer_decode_attention_ref(*args, **kw),
                 torch.float32)


def test_bad_inputs_name_the_problem():
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(1, 2, 64, 64, 64, 2, torch.float32)
    q = torch.randn(1, 4, 64, device=DEVICE)
    lens = (32, 32, 40, 0)
    with pytest.raises(ValueError, match="bits"):
        outer_decode_attention(q, *codes, 3, k_rec, v_rec, lens)
    with pytest.raises(ValueError, match="query heads"):
        outer_decode_attention(q[:, :3], *codes, 2, k_rec, v_rec, lens)
    with pytest.raises(ValueError, match="k_scale has shape"):
        outer_decode_attention(q, codes[0], codes[1][:, :, :1], *codes[2:], 2, k_rec, v_rec, lens)
    with pytest.raises(ValueError, match="v_recent has dtype"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec.half(), lens)
    with pytest.raises(ValueError, match="both k_sink and v_sink"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, lens, k_sink=k_sink)
    with pytest.raises(ValueError, match="lengths must be"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, (96, 32, 100, 0))
    with pytest.raises(ValueError, match="the sink holds 4 rows"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, (32, 32, 40, 5), k_sink=k_sink, v_sink=v_sink)
    with pytest.raises(ValueError, match="48 tail slots .* the larger window 40"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, (32, 32, 80, 0))
    with pytest.raises(ValueError, match="optionally \\[k_row, v_row\\]"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, (32, 32, 40, 0, 1))
    with pytest.raises(ValueError, match=r"lengths has shape \(5,\), expected \(6,\)"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, torch.zeros(5, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="v_bits must be one of"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, lens, v_bits=3)
    with pytest.raises(ValueError, match="key_groups must be"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, lens, key_groups="block")
    with pytest.raises(ValueError, match="group must be a power of two"):
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, lens, group=48)
    with pytest.raises(ValueError, match="k_scale has shape"):                 # per-channel scales, token layout
        outer_decode_attention(q, *codes, 2, k_rec, v_rec, lens, key_groups="token")


@pytest.mark.parametrize("dtype,rope", [(torch.float32, False), (torch.float16, False), (torch.float32, True),
                                        (torch.bfloat16, True)], ids=name)
def test_sink_and_tail_of_several_blocks(dtype, rope):
    """A sink of 45 rows and a tail of 60 slots past the quantized ones, each more than one block of 32 (the last
    program walks them block by block, the last block of each partial)."""
    d, lengths = 64, (64, 40, 100, 45)                      # keys quantized past values: 60 tail slots, 36 keys'
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(1, 2, 96, 64, d, 2, dtype, rows=70, sink=48, seed=3)
    q = torch.randn(1, 6, d, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    kw = dict(k_sink=k_sink, v_sink=v_sink, rope=rope_tables(160, d, dtype) if rope else None)
    args = (q, *codes, 2, k_rec, v_rec, lengths)
    assert_close(outer_decode_attention(*args, **kw, num_splits=2), outer_decode_attention_ref(*args, **kw), dtype)


def rope_tables(positions: int, d: int, dtype):
    """cos, sin (positions, d) as kvzoo.models.llama.RotaryEmbedding makes them (rotate-half layout)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(positions).float()[:, None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)


@pytest.mark.parametrize("bits,d,dtype,lengths", [
    (2, 64, torch.float32, (128, 90, 130, 4)), (4, 128, torch.float16, (96, 96, 120, 2)),
    (2, 128, torch.bfloat16, (64, 95, 96, 0)), (2, 64, torch.float16, (32, 5, 40, 3))], ids=name)
def test_keys_stored_before_rope_are_rotated_in_the_kernel(bits, d, dtype, lengths):
    """KIVI*: every key is stored before RoPE and rotated inside the kernel (RotaryEmbedding's rotate-half): sink
    row i to position i, tail slot u (quantized or in the key window) to n_sink + u."""
    from kvzoo.models.llama import RotaryEmbedding

    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(1, 2, 128, 96, d, bits, dtype, seed=bits)
    cos, sin = rope_tables(256, d, dtype)
    q = torch.randn(1, 8, d, generator=torch.Generator().manual_seed(d)).to(DEVICE, dtype)
    args = (q, *codes, bits, k_rec, v_rec, lengths)
    want = outer_decode_attention_ref(*args, k_sink=k_sink, v_sink=v_sink, rope=(cos, sin))
    assert_close(outer_decode_attention(*args, k_sink=k_sink, v_sink=v_sink, rope=(cos, sin), num_splits=2), want,
                 dtype)
    n_k, n_sink = lengths[0], lengths[3]
    k_all = dequant_outer(codes[0], codes[1], codes[2], bits, -2)[:, :, :n_k]
    n_v, n_tail = lengths[1], lengths[2]
    v_all = dequant_outer(codes[3], codes[4], codes[5], bits, -1)
    keys = torch.cat([k_sink[:, :, :n_sink].float(), k_all, k_rec[:, :, :n_tail - n_k].float()], dim=2)
    keys = RotaryEmbedding.rotate(keys, cos[:n_sink + n_tail].float(), sin[:n_sink + n_tail].float())
    values = torch.cat([v_sink[:, :, :n_sink].float(), v_all[:, :, :n_v], v_rec[:, :, :n_tail - n_v].float()], dim=2)
    qh = q.float().view(1, 2, 4, d)
    p = torch.softmax(qh @ keys.transpose(-1, -2) / math.sqrt(d), dim=-1)
    assert_close((p @ values).view(1, 8, d), want.float(), dtype)


@pytest.mark.skipif(DEVICE == "cpu", reason="compiles the kernels at a Llama-3.1-8B layer's shape (a GPU)")
@pytest.mark.parametrize("rope", [False, True], ids=["post-rope", "pre-rope"])
def test_compiles_and_matches_at_the_8b_shape(rope):
    """8 KV heads of 128, 32 query heads, 4,096 tokens: the largest tiles (4 groups per step) a 32K-128K cache
    gets, which small shapes never compile."""
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(1, 8, 4096, 4096, 128, 2, torch.bfloat16, rows=160)
    q = torch.randn(1, 32, 128, device=DEVICE).bfloat16()
    tables = rope_tables(4096 + 8, 128, torch.bfloat16) if rope else None
    args = (q, *codes, 2, k_rec, v_rec, (4064, 3990, 4100, 4))
    assert_close(outer_decode_attention(*args, k_sink=k_sink, v_sink=v_sink, rope=tables),
                 outer_decode_attention_ref(*args, k_sink=k_sink, v_sink=v_sink, rope=tables), torch.bfloat16)


def test_bad_rope_tables_name_the_problem():
    codes, (k_rec, v_rec), _ = cache(1, 2, 64, 64, 64, 2, torch.float32)
    q = torch.randn(1, 4, 64, device=DEVICE)
    cos, sin = rope_tables(100, 64, torch.float32)
    args = (q, *codes, 2, k_rec, v_rec, (64, 32, 70, 0))
    with pytest.raises(ValueError, match="pair of tables"):
        outer_decode_attention(*args, rope=cos)
    with pytest.raises(ValueError, match="rope sin has shape"):
        outer_decode_attention(*args, rope=(cos, sin[:, :32]))
    with pytest.raises(ValueError, match="rope sin has dtype"):
        outer_decode_attention(*args, rope=(cos, sin.half()))
    with pytest.raises(ValueError, match="rope tables hold 50 positions"):
        outer_decode_attention(*args, rope=(cos[:50], sin[:50]))


HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)


# (d, dtype, rep, B, N, lengths, group, rope, splits): KIVI's windows (keys quantized past values), partial steps and
# groups, whole steps only (the warp kernel's first loop, no clamped rest), a short run (5 groups), 16 query rows,
# with and without a sink, splits of two groups (fewer than a step of the warp kernel's four warps); value groups of
# one word, two and a whole token;
# keys stored before RoPE (KIVI*), rotated in the kernel: with and without a sink, bf16 tables and fp16, query rows
# in half the padded rows (4 of 8), fewer (3) and all of them (8, 16); at head_dim 128 (the warp kernel) also value
# groups of one word and splits of two groups
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("d,dtype,rep,B,N,lengths,group,rope,splits", [
    (128, torch.float16, 4, 2, 1024, (1024, 1000, 1030, 4), 32, False, 2),
    (128, torch.float16, 4, 2, 1024, (1024, 1024, 1030, 4), 32, False, 2),
    (64, torch.bfloat16, 3, 3, 800, (800, 777, 810, 0), 32, False, 2),
    (128, torch.bfloat16, 1, 1, 160, (160, 129, 160, 2), 32, False, 2),
    (64, torch.float16, 16, 1, 4096, (4096, 4095, 4100, 4), 32, False, 2),
    (128, torch.float16, 16, 1, 4096, (4096, 4095, 4100, 4), 32, False, 2),
    (128, torch.float16, 4, 2, 1024, (1024, 1000, 1030, 4), 32, False, 16),
    (128, torch.float16, 4, 1, 640, (640, 616, 650, 4), 16, False, 2),
    (128, torch.bfloat16, 2, 1, 640, (608, 630, 640, 0), 128, False, 2),
    (64, torch.float16, 4, 1, 640, (640, 616, 650, 4), 16, False, 2),
    (128, torch.bfloat16, 4, 2, 1024, (1024, 1000, 1030, 4), 32, True, 2),
    (64, torch.float16, 3, 3, 800, (800, 777, 810, 0), 32, True, 2),
    (128, torch.float16, 16, 1, 4096, (4096, 4095, 4100, 4), 32, True, 2),
    (128, torch.bfloat16, 8, 1, 640, (608, 630, 640, 0), 32, True, 2),
    (128, torch.float16, 3, 3, 800, (800, 777, 810, 0), 32, True, 2),
    (128, torch.float16, 4, 1, 640, (640, 616, 650, 4), 16, True, 2),
    (128, torch.float16, 4, 2, 1024, (1024, 1000, 1030, 4), 32, True, 16)], ids=name)
def test_hopper_kernel_matches_reference_and_triton_kernel(d, dtype, rep, B, N, lengths, group, rope, splits,
                                                          monkeypatch):
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    H = 2
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(B, H, N, N, d, 2, dtype, seed=d + rep, group=group)
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(rep)).to(DEVICE, dtype)
    args = (q, *codes, 2, k_rec, v_rec, torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    kw = dict(k_sink=k_sink, v_sink=v_sink, group=group, rope=rope_tables(N + 16, d, dtype) if rope else None)
    check_gluon_kernel(outer_hopper, args, kw, splits, dtype, monkeypatch)


def check_gluon_kernel(module, args, kw, splits, dtype, monkeypatch):
    """outer_decode_attention(*args, **kw) takes `module`'s Gluon kernel (any amount of work), matches the reference,
    replays the same in a CUDA graph, and matches the Triton kernel (the Gluon kernel disabled)."""
    calls = []
    monkeypatch.setattr(module, "MIN_GROUP_ROWS", 0)
    run = module.quantized_splits
    monkeypatch.setattr(module, "quantized_splits", lambda *a: calls.append(1) or run(*a))
    got = outer_decode_attention(*args, num_splits=splits, **kw)
    assert calls, "the Gluon kernel was not taken"
    assert_close(got, outer_decode_attention_ref(*args, **kw), dtype)
    graph = torch.cuda.CUDAGraph()             # the tail's program and the Gluon kernel captured as they launch
    with torch.cuda.graph(graph):
        replayed = outer_decode_attention(*args, num_splits=splits, **kw)
    graph.replay()
    assert torch.equal(replayed, got)
    monkeypatch.setattr(module, "ENABLED", False)
    assert_close(got, outer_decode_attention(*args, num_splits=splits, **kw), dtype)
    assert len(calls) == 2                     # eager and captured; none with the kernel disabled


def warp_launches(outer_hopper, monkeypatch) -> list:
    """The grids the warp kernel is launched with from here on, listed as they launch."""
    launches, warp = [], outer_hopper._warp_kernel
    monkeypatch.setattr(outer_hopper, "_warp_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launches.append(grid) or warp[grid]})())
    return launches


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
def test_hopper_kernel_with_a_negative_softmax_scale(monkeypatch):
    """The warp kernel takes its whole steps' max before the softmax scale; a scale <= 0 takes the other kernel
    (its launches counted), split in its whole steps also where no split count is given (the split-K plan is the
    warpgroup kernel's, not the warp kernel's), and matches the reference. The Gluon kernels' offsets zero - M * scale
    are rounded to fp16 (M = 16: half an ulp of |zero - 16 scale| a key), 0.3% of this output's largest magnitude at
    the positive scale, so the tolerance is 4e-3 of it, not TOL's 2e-3."""
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    monkeypatch.setattr(outer_hopper, "MIN_GROUP_ROWS", 0)
    launches = warp_launches(outer_hopper, monkeypatch)
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(1, 2, 512, 512, 128, 2, torch.float16, seed=3, group=32)
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    args = (q, *codes, 2, k_rec, v_rec, torch.tensor((512, 500, 520, 4), dtype=torch.int32, device=DEVICE))
    for scale, taken in ((0.05, True), (-0.05, False)):
        kw = dict(k_sink=k_sink, v_sink=v_sink, group=32, sm_scale=scale)
        want = outer_decode_attention_ref(*args, **kw).float()
        for splits in (2, None):
            launches.clear()
            err = (outer_decode_attention(*args, num_splits=splits, **kw).float() - want).abs().max().item()
            assert err <= 4e-3 * max(1.0, want.abs().max().item()), (scale, splits, err)
            assert bool(launches) == taken, (scale, splits, launches)


# (dtype, rep, B, N, lengths, splits, group): 8-bit codes in per-token groups in their Gluon kernel, int8's (the
# whole head) and KV Pareto's (32 and 64 channels): a sink and a tail, a partial last group (a warp's slots past the
# last live one), short splits (groups fewer than the four warps), splits of whole steps only, the default split
# plan, eight query rows
@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("dtype,rep,B,N,lengths,splits,group", [
    (torch.float16, 4, 2, 1024, (1024, 1024, 1030, 4), 2, 128), (torch.bfloat16, 8, 1, 640, (608, 608, 620, 0), 2, 128),
    (torch.float16, 1, 1, 160, (160, 129, 160, 2), 2, 128), (torch.float16, 4, 2, 1024, (1000, 1024, 1030, 4), 16, 128),
    (torch.bfloat16, 3, 3, 800, (800, 777, 810, 0), None, 128),
    (torch.float16, 4, 2, 1024, (1024, 1024, 1030, 4), 2, 32), (torch.bfloat16, 8, 1, 640, (608, 608, 620, 0), 2, 64),
    (torch.float16, 1, 1, 160, (160, 129, 160, 2), 2, 32), (torch.float16, 4, 2, 1024, (1000, 1024, 1030, 4), 16, 32),
    (torch.bfloat16, 3, 3, 800, (800, 777, 810, 0), None, 32)], ids=name)
def test_token_kernel_matches_reference_and_triton_kernel(dtype, rep, B, N, lengths, splits, group, monkeypatch):
    token_hopper = pytest.importorskip("kvzoo.kernels.token_hopper")
    H, d = 2, 128
    codes, (k_rec, v_rec) = token_cache(B, H, N, d, 8, 8, group, dtype, rows=40, seed=rep + N)
    g = torch.Generator().manual_seed(rep)
    k_sink, v_sink = (torch.randn(B, H, 4, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE, dtype)
    args = (q, *codes, 8, k_rec, v_rec, torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    kw = dict(k_sink=k_sink, v_sink=v_sink, key_groups="token", group=group)
    check_gluon_kernel(token_hopper, args, kw, splits, dtype, monkeypatch)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("early,sms,one_stream", [(True, None, True), (False, None, False), (True, 1, False)])
def test_tail_program_then_the_gluon_kernel_on_one_stream(early, sms, one_stream, monkeypatch):
    """On an H100 the tail's program launches first and the Gluon kernel programmatically while it runs, on the
    current stream (no second stream); with launches_early off, or more KV rows than TAIL_PROGRAMS_PER_SM an SM
    (here: one SM), the tail's program runs on a second stream. Each matches the reference, replayed too."""
    from kvzoo.kernels import outer_attention
    token_hopper = pytest.importorskip("kvzoo.kernels.token_hopper")
    monkeypatch.setattr(outer_attention, "TAIL_IN_COMBINE", "never")
    monkeypatch.setattr(outer_attention, "launches_early", lambda device: early)
    if sms is not None:
        monkeypatch.setattr(outer_attention, "sm_count", lambda device: sms)
    sides, launches = [], []
    side_stream = outer_attention.side_stream
    monkeypatch.setattr(outer_attention, "side_stream", lambda *a: sides.append(1) or side_stream(*a))
    run = token_hopper.quantized_splits
    monkeypatch.setattr(token_hopper, "quantized_splits", lambda *a: launches.append(a[-1]) or run(*a))
    B, H, N, d, rep, dtype = 2, 2, 1024, 128, 4, torch.float16
    codes, (k_rec, v_rec) = token_cache(B, H, N, d, 8, 8, 32, dtype, rows=40, seed=int(early))
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(int(early))).to(DEVICE, dtype)
    args = (q, *codes, 8, k_rec, v_rec, torch.tensor((1000, 1000, 1030, 0), dtype=torch.int32, device=DEVICE))
    kw = dict(key_groups="token", group=32)
    monkeypatch.setattr(token_hopper, "MIN_GROUP_ROWS", 0)
    got = outer_decode_attention(*args, num_splits=4, **kw)
    assert_close(got, outer_decode_attention_ref(*args, **kw), dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = outer_decode_attention(*args, num_splits=4, **kw)
    graph.replay()
    assert torch.equal(replayed, got)
    assert launches == [one_stream, one_stream] and (not sides) == one_stream


def tail_combines(outer_attention, monkeypatch) -> list:
    """The grids of the combine with the tail in it (_tail_combine_kernel) from here on, listed as they launch."""
    launches, kernel = [], outer_attention._tail_combine_kernel
    monkeypatch.setattr(outer_attention, "_tail_combine_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: launches.append(grid) or kernel[grid]})())
    return launches


@pytest.mark.parametrize("value,held", [("never", "never"), ("always", "always"), ("sometimes", None)])
def test_tail_in_combine_setting_refuses_other_values(value, held):
    """KVZOO_TAIL_IN_COMBINE, read when outer_attention is imported: auto (the default), never or always; anything
    else is refused by name, with the values accepted."""
    code = "from kvzoo.kernels import outer_attention as o; print(o.TAIL_IN_COMBINE)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "KVZOO_TAIL_IN_COMBINE": value})
    if held is None:
        assert run.returncode != 0
        assert "KVZOO_TAIL_IN_COMBINE must be one of ('auto', 'never', 'always'), got 'sometimes'" in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [held]


# KIVI's windows with a sink, KIVI* (keys rotated in the kernel), values quantized past keys, nothing quantized but
# the sink, the token given apart, keys grouped per token (KV Pareto's k8v4, k4v2), 16 query rows, a tail of several
# blocks
@pytest.mark.parametrize("bits,d,dtype,rep,lengths,rope,apart,token_keys", [
    (2, 64, torch.float16, 4, (128, 90, 130, 4), False, False, False),
    (2, 128, torch.float32, 3, (96, 90, 120, 2), True, False, False),
    (4, 64, torch.bfloat16, 1, (64, 95, 96, 0), False, True, False),
    (2, 64, torch.float32, 16, (0, 0, 30, 4), False, True, False),
    (8, 64, torch.float16, 4, (96, 96, 120, 0), False, False, True),
    (4, 128, torch.float32, 2, (32, 32, 100, 0), False, True, True)], ids=name)
def test_tail_attended_in_the_combine(bits, d, dtype, rep, lengths, rope, apart, token_keys, monkeypatch):
    """The sink and the tail attended in the combine (its program's first part, before it merges the quantized
    columns), here after the Triton kernel's quantized columns (KVZOO_TAIL_IN_COMBINE=always), equal the reference
    and the tail in the split kernel's last program."""
    from kvzoo.kernels import outer_attention
    B, H = 2, 2
    if token_keys:
        codes, (k_rec, v_rec) = token_cache(B, H, 128, d, bits, bits // 2, 32, dtype, rows=90, seed=bits)
        k_sink = v_sink = None
        kw = dict(key_groups="token", group=32, v_bits=bits // 2)
    else:
        codes, (k_rec, v_rec), (k_sink, v_sink) = cache(B, H, 128, 96, d, bits, dtype, seed=bits + d)
        kw = dict(k_sink=k_sink, v_sink=v_sink, rope=rope_tables(256, d, dtype) if rope else None)
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(rep)).to(DEVICE, dtype)
    if apart:
        kw.update(k_token=torch.randn(B, H, 1, d).to(DEVICE, dtype), v_token=torch.randn(B, H, 1, d).to(DEVICE, dtype))
    args = (q, *codes, bits, k_rec, v_rec, torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    monkeypatch.setattr(outer_attention, "TAIL_IN_COMBINE", "never")
    in_program = outer_decode_attention(*args, num_splits=2, **kw)
    launches = tail_combines(outer_attention, monkeypatch)
    monkeypatch.setattr(outer_attention, "TAIL_IN_COMBINE", "always")
    got = outer_decode_attention(*args, num_splits=2, **kw)
    assert launches == [(B * H, d // 32)]
    assert_close(got, outer_decode_attention_ref(*args, **kw), dtype)
    assert_close(got, in_program, dtype)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("group,sms", [(32, None), (None, None), (32, 3), (None, 3), (128, None)])
def test_gluon_kernel_then_the_tail_in_the_combine(group, sms, monkeypatch):
    """On an H100 the Gluon kernel goes first and the combine launches programmatically while it runs, attends the
    sink and the tail, then waits for it and merges (no Triton split kernel), where the combine's programs find room
    beside the Gluon kernel's (KV Pareto's groups of 32, KIVI's layout: group None); with too few SMs for them (sms),
    or int8's whole-head groups (their last program at 8 warps), the tail's program goes first as before. Each matches
    the tail's program first (the reference within 1e-2 of its largest magnitude: the warp kernels' fp16 rounding
    reaches 3-4e-3 on some of these random caches, test_keys_before_rope_take_the_warp_kernel_at_head_dim_128),
    and replays the same in a CUDA graph."""
    from kvzoo.kernels import outer_attention
    token_keys = group is not None
    module = pytest.importorskip("kvzoo.kernels.token_hopper" if token_keys else "kvzoo.kernels.outer_hopper")
    monkeypatch.setattr(module, "MIN_GROUP_ROWS", 0)
    if sms is not None:
        monkeypatch.setattr(outer_attention, "sm_count", lambda device: sms)
    B, H, N, d, rep, dtype = 2, 2, 1024, 128, 4, torch.float16
    if token_keys:
        codes, (k_rec, v_rec) = token_cache(B, H, N, d, 8, 8, group, dtype, rows=40, seed=5)
        k_sink = v_sink = None
        kw, bits, lengths = dict(key_groups="token", group=group), 8, (1000, 1000, 1030, 0)
    else:
        codes, (k_rec, v_rec), (k_sink, v_sink) = cache(B, H, N, N, d, 2, dtype, seed=5)
        kw, bits, lengths = dict(k_sink=k_sink, v_sink=v_sink), 2, (1024, 1000, 1030, 4)
    q = torch.randn(B, H * rep, d, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    args = (q, *codes, bits, k_rec, v_rec, torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    combines = tail_combines(outer_attention, monkeypatch)
    splits = []
    run = outer_attention._split_kernel
    monkeypatch.setattr(outer_attention, "_split_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: splits.append(grid) or run[grid]})())
    got = outer_decode_attention(*args, num_splits=4, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = outer_decode_attention(*args, num_splits=4, **kw)
    graph.replay()
    assert torch.equal(replayed, got)
    in_combine = sms is None and group != d
    assert (combines, splits) == (([(B * H, d // 32)] * 2, []) if in_combine else ([], [(B * H, 1)] * 2))
    want = outer_decode_attention_ref(*args, **kw).float()
    assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()
    monkeypatch.setattr(outer_attention, "TAIL_IN_COMBINE", "never")
    assert_close(got, outer_decode_attention(*args, num_splits=4, **kw), dtype)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("dtype,rep,lengths,group", [(torch.float16, 4, (1000, 1024, 1030, 4), 32),
                                                     (torch.bfloat16, 8, (608, 608, 620, 0), 128)], ids=name)
def test_token_kernel_beside_the_slim_tail(dtype, rep, lengths, group, monkeypatch):
    """A KV row an SM or more (here: one SM): the tail's program compiled alone under its register cap (TAIL_ONLY),
    beside the per-token kernel, matches the reference, replayed too."""
    from kvzoo.kernels import outer_attention
    token_hopper = pytest.importorskip("kvzoo.kernels.token_hopper")
    monkeypatch.setattr(outer_attention, "sm_count", lambda device: 1)
    B, H, N, d = 2, 2, 1024, 128
    codes, (k_rec, v_rec) = token_cache(B, H, N, d, 8, 8, group, dtype, rows=40, seed=rep)
    g = torch.Generator().manual_seed(rep)
    k_sink, v_sink = (torch.randn(B, H, 4, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE, dtype)
    args = (q, *codes, 8, k_rec, v_rec, torch.tensor(lengths, dtype=torch.int32, device=DEVICE))
    check_gluon_kernel(token_hopper, args, dict(k_sink=k_sink, v_sink=v_sink, key_groups="token", group=group), 2,
                       dtype, monkeypatch)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("group,dtype", [(32, torch.float16), (128, torch.bfloat16)], ids=name)
def test_token_kernel_alone_where_every_slot_is_quantized(group, dtype, monkeypatch):
    """KV Pareto's and int8's graph step: every stored slot quantized, no window and no sink, the token given apart.
    The Gluon kernel's columns and the combine only (no Triton launch), equal to the reference, also replayed."""
    from kvzoo.kernels import outer_attention
    token_hopper = pytest.importorskip("kvzoo.kernels.token_hopper")
    B, H, N, d, rep = 2, 2, 1024, 128, 4
    codes, _ = token_cache(B, H, N, d, 8, 8, group, dtype, seed=group)
    g = torch.Generator().manual_seed(group)
    q = torch.randn(B, H * rep, d, generator=g).to(DEVICE, dtype)
    k_tok, v_tok = (torch.randn(B, H, 1, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    args = (q, *codes, 8, None, None, torch.tensor((1000, 1000, 1000, 0, 0, 0), dtype=torch.int32, device=DEVICE))
    kw = dict(key_groups="token", group=group, k_token=k_tok, v_token=v_tok)
    launches = []

    class Counted:                             # the Triton split kernel, its launches counted
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    kernel = outer_attention._split_kernel
    monkeypatch.setattr(outer_attention, "_split_kernel", Counted())
    check_gluon_kernel(token_hopper, args, kw, 4, dtype, monkeypatch)
    assert len(launches) == 1                  # the Triton kernel only with the Gluon kernel disabled


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("group", [32, 128], ids=["kvpareto", "int8"])
@pytest.mark.parametrize("B,N", [(1, 32768), (1, 131072), (4, 32768), (16, 32768)], ids=name)
def test_token_kernel_plans_one_wave_at_small_batches(B, N, group, monkeypatch):
    """The per-token kernel's split-K plan: one wave (innerq_attention.one_wave at token_hopper.wave) where it holds
    enough splits a KV row; at larger batches PROGRAMS_PER_SM programs an SM, or SHORT_PROGRAMS_PER_SM where those
    splits would keep fewer than MIN_GROUPS groups."""
    from kvzoo.kernels import outer_attention
    from kvzoo.kernels.innerq_attention import one_wave
    from kvzoo.kernels.quant_matvec import sm_count
    token_hopper = pytest.importorskip("kvzoo.kernels.token_hopper")
    H, d, rep = 8, 128, 4
    plans = []
    monkeypatch.setattr(token_hopper, "quantized_splits", lambda *a: plans.append(a[6:8]))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    words = [torch.randint(-2 ** 31, 2 ** 31, (B, H, N, d // 4), dtype=torch.int32, device=DEVICE, generator=g)
             for _ in range(2)]
    scales = [torch.rand(B, H, N, d // group, device=DEVICE, generator=g).half() for _ in range(4)]
    q = torch.randn(B, H * rep, d, device=DEVICE, generator=g).half()
    rows = torch.randn(B, H, 8, d, device=DEVICE, generator=g).half()
    outer_decode_attention(q, words[0], *scales[:2], words[1], *scales[2:], 8, rows, rows, (N, N, N, 0),
                           key_groups="token", group=group)
    n_groups, step = N // 32, outer_attention.GROUPS_PER_STEP
    per_sm, least = token_hopper.wave(group, d)
    wave = one_wave(n_groups, B * H, sm_count(q.device), per_sm, step, least)
    plan = [outer_attention._plan_splits(n_groups, B * H, q.device, None, step, programs)
            for programs in (token_hopper.PROGRAMS_PER_SM, token_hopper.SHORT_PROGRAMS_PER_SM)]
    splits, per_split, _ = wave or (plan[0] if plan[0][1] >= token_hopper.MIN_GROUPS else plan[1])
    assert plans == [(per_split, splits)]
    assert (wave is None) == (B == 16)
    assert B * H * splits <= sm_count(q.device) * per_sm or wave is None


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("B,N", [(1, 32768), (1, 131072), (8, 32768)], ids=name)
def test_warp_kernel_plans_one_wave_at_small_batches(B, N, monkeypatch):
    """The warp kernel's split-K plan (KIVI-2 on Llama-3.1-8B's heads): one wave (innerq_attention.one_wave at
    outer_hopper.WAVE) where it holds enough splits a KV row, else the plan for WARP_PROGRAMS_PER_SM where its
    splits keep WARP_MIN_GROUPS groups, else PROGRAMS_PER_SM's."""
    from kvzoo.kernels import outer_attention
    from kvzoo.kernels.innerq_attention import one_wave
    from kvzoo.kernels.quant_matvec import sm_count
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    n_groups, step, sms = N // 32, outer_attention.GROUPS_PER_STEP, sm_count(torch.device(DEVICE))
    wave = one_wave(n_groups, B * 8, sms, outer_hopper.WAVE[0], step, outer_hopper.WAVE[1])
    warp = outer_attention._plan_splits(n_groups, B * 8, torch.device(DEVICE), None, step,
                                        outer_hopper.WARP_PROGRAMS_PER_SM)
    other = outer_attention._plan_splits(n_groups, B * 8, torch.device(DEVICE), None, step,
                                         outer_attention.PROGRAMS_PER_SM)
    splits, per_split, _ = wave or (warp if warp[1] >= outer_hopper.WARP_MIN_GROUPS else other)
    assert warp_plans(outer_hopper, B, N, None, monkeypatch) == [(per_split, splits)]
    assert (wave is None) == (B == 8)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("B,N", [(1, 32768), (2, 32768), (16, 16384), (32, 8192)], ids=name)
def test_warp_kernel_plans_one_wave_for_keys_before_rope(B, N, monkeypatch):
    """KIVI*'s split-K plan (keys stored before RoPE, two programs an SM): one wave (innerq_attention.one_wave at
    outer_hopper.ROPE_WAVE) where it holds enough splits a KV row, else PROGRAMS_PER_SM's whole waves."""
    from kvzoo.kernels import outer_attention
    from kvzoo.kernels.innerq_attention import one_wave
    from kvzoo.kernels.quant_matvec import sm_count
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    n_groups, step = N // 32, outer_attention.ROPE_GROUPS_PER_STEP
    wave = one_wave(n_groups, B * 8, sm_count(torch.device(DEVICE)), outer_hopper.ROPE_WAVE[0], step,
                    outer_hopper.ROPE_WAVE[1])
    splits, per_split, _ = wave or outer_attention._plan_splits(n_groups, B * 8, torch.device(DEVICE), None, step,
                                                                outer_attention.PROGRAMS_PER_SM)
    assert warp_plans(outer_hopper, B, N, rope_tables(N + 200, 128, torch.float16), monkeypatch) == \
        [(per_split, splits)]
    assert (wave is None) == (B == 32)


def warp_plans(outer_hopper, B, N, rope, monkeypatch) -> list:
    """The (groups a split, splits) of the Gluon kernel's launches for one call on Llama-3.1-8B's heads (KV rows
    of B x 8, 4 query rows each; not run)."""
    plans = []
    monkeypatch.setattr(outer_hopper, "quantized_splits", lambda *a: plans.append(a[6:8]))
    codes, (k_rec, v_rec), _ = cache(B, 8, N, N, 128, 2, torch.float16, rows=160)
    q = torch.randn(B, 32, 128, device=DEVICE).half()
    outer_decode_attention(q, *codes, 2, k_rec, v_rec, (N - 32, N - 96, N + 4, 0), rope=rope)
    return plans


def test_token_kernel_is_not_taken_off_its_layout():
    """The per-token kernel: 8-bit keys and values in per-token groups of 32, 64 or 128 channels (KV Pareto, int8),
    keys after RoPE, head_dim 128, at most 8 query rows, enough work; groups of 16, 4-bit codes, per-channel keys,
    keys before RoPE, head_dim 64, 16 query rows, small work and anything off an H100 take the Triton kernel."""
    token_hopper = pytest.importorskip("kvzoo.kernels.token_hopper")
    q = torch.zeros(1, 4, 128, dtype=torch.float16, device=DEVICE)
    big = 1 << 20
    for group in (32, 64, 128):
        assert token_hopper.eligible(q, 8, 8, False, None, group, 4, big) == HOPPER
    assert token_hopper.eligible(q, 8, 8, False, None, 128, 8, big) == HOPPER
    assert not token_hopper.eligible(q, 8, 8, False, None, 16, 4, big)
    assert not token_hopper.eligible(q, 8, 4, False, None, 128, 4, big)
    assert not token_hopper.eligible(q, 8, 8, True, None, 128, 4, big)
    assert not token_hopper.eligible(q, 8, 8, False, rope_tables(128, 128, torch.float16), 128, 4, big)
    assert not token_hopper.eligible(q[..., :64], 8, 8, False, None, 64, 4, big)
    assert not token_hopper.eligible(q, 8, 8, False, None, 128, 9, big)
    assert not token_hopper.eligible(q, 8, 8, False, None, 128, 4, token_hopper.MIN_GROUP_ROWS - 1)
    assert not token_hopper.eligible(q.float(), 8, 8, False, None, 128, 4, big)


def test_hopper_kernel_is_not_taken_off_its_layout():
    """4-bit codes, per-token keys, short runs (but for the warp kernel's layout, keys after RoPE at head_dim 128),
    small work, RoPE's tables shorter than a step, and anything off an H100: the Triton kernel serves them."""
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    q = torch.zeros(1, 4, 128, dtype=torch.float16, device=DEVICE)
    big = 1 << 20
    assert not outer_hopper.eligible(q, 4, 4, True, None, 32, 4, 4, big, 0.1)
    assert not outer_hopper.eligible(q, 2, 2, False, None, 32, 4, 4, big, 0.1)
    assert outer_hopper.eligible(q, 2, 2, True, None, 32, 4, 2, big, 0.1) == HOPPER        # the warp kernel: any run
    assert not outer_hopper.eligible(q, 2, 2, True, None, 32, 4, 2, big, -0.1)     # ... but the warpgroup kernel's
    assert outer_hopper.takes_warp_kernel(q, 2, 2, True, None, 32, 4, big, 0.1) == HOPPER
    assert not outer_hopper.takes_warp_kernel(q, 2, 2, True, None, 32, 4, big, -0.1)     # max before the scale
    assert not outer_hopper.eligible(q[..., :64], 2, 2, True, None, 32, 4, 2, big, 0.1)
    assert not outer_hopper.takes_warp_kernel(q[..., :64], 2, 2, True, None, 32, 4, big, 0.1)
    assert not outer_hopper.eligible(q, 2, 2, True, None, 32, 4, 4, outer_hopper.MIN_GROUP_ROWS - 1, 0.1)
    assert outer_hopper.eligible(q, 2, 2, True, None, 32, 4, 4, big, 0.1) == HOPPER
    tables = rope_tables(outer_hopper.TOKENS, 128, torch.float16)
    assert outer_hopper.eligible(q, 2, 2, True, tables, 32, 4, 4, big, 0.1) == HOPPER      # keys rotated in the kernel
    assert not outer_hopper.eligible(q, 2, 2, True, (tables[0][:-1], tables[1][:-1]), 32, 4, 4, big, 0.1)
    assert outer_hopper.eligible(q, 2, 2, True, tables, 32, 4, 2, big, 0.1) == HOPPER      # the warp kernel: any run
    half = rope_tables(outer_hopper.TOKENS, 64, torch.float16)
    assert not outer_hopper.eligible(q[..., :64], 2, 2, True, half, 32, 4, 2, big, 0.1)    # the warpgroup kernel's
    assert not outer_hopper.takes_warp_kernel(q, 2, 2, True, tables, 32, 4, big, 0.1)      # two programs an SM


def test_hopper_kernel_reads_rope_tables_in_its_channel_order():
    """KIVI*'s rotations by the offsets within a step, as the Gluon kernel reads them: the first halves of the
    first TOKENS rows of the model's cos and sin, fp16 as the Triton kernel converts them, logical channel
    16 w + 2 a + b holding real channel 16 w + a + 8 b; made once for the same tables."""
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    n = outer_hopper.TOKENS
    cos, sin = rope_tables(n + 40, 64, torch.bfloat16)
    got = outer_hopper.rope_tables(cos, sin)
    assert outer_hopper.rope_tables(cos, sin) is got
    assert got.dtype == torch.float16 and got.shape == (2, n, 32)
    for made, table in zip(got, (cos, sin)):
        assert torch.equal(made[:, 16 + 2 * 3 + 1], table[:n, 16 + 3 + 8].half())
        assert torch.equal(made.view(n, 2, 8, 2).transpose(2, 3).reshape(n, 32), table[:n, :32].half())
    assert outer_hopper.rope_tables(cos.clone(), sin) is not got


def test_warp_kernel_reads_rope_tables_in_its_registers_order():
    """KIVI*'s rotations by the offsets within a key group, as the warp kernel reads them: the first 32 rows of the
    model's cos and sin, fp16, row j's frequencies in the order a thread holds its key columns (16 t + 8 b + a at
    [t, b + 2 a]); made once for the same tables."""
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    cos, sin = rope_tables(200, 128, torch.bfloat16)
    got = outer_hopper.warp_rope_tables(cos, sin)
    assert outer_hopper.warp_rope_tables(cos, sin) is got
    assert got.dtype == torch.float16 and got.shape == (2, 32, 4, 16)
    for made, table in zip(got, (cos, sin)):
        assert torch.equal(made[:, 2, 2 * 5 + 1], table[:32, 16 * 2 + 8 + 5].half())
        assert torch.equal(made.view(32, 4, 8, 2).transpose(2, 3).reshape(32, 64), table[:32, :64].half())
    assert outer_hopper.warp_rope_tables(cos.clone(), sin) is not got


@pytest.mark.parametrize("which,d", [("rope_tables", 64), ("warp_rope_tables", 128)])
def test_kept_rope_tables_cost_no_device_work(which, d):
    """A table kept for the same cos and sin is returned without a single torch operation: a graph step captured
    with it launches nothing for it (each operation there would be a kernel in every layer's replay)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    make = getattr(outer_hopper, which)
    cos, sin = rope_tables(200, d, torch.float16)
    made = make(cos, sin)

    class Count(TorchDispatchMode):
        ops: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Count() as count:
        assert make(cos, sin) is made
    assert count.ops == []


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel compiles for sm_90 only (TRITON_INTERPRET=0 on an H100)")
@pytest.mark.parametrize("d", [128, 64])
def test_keys_before_rope_take_the_warp_kernel_at_head_dim_128(d, monkeypatch):
    """Keys stored before RoPE are rotated in the warp kernel at head_dim 128 (its launches counted) and in the
    warpgroup kernel at 64, each matching the reference. Both round each rotated key to fp16 and take the query's
    angle apart from the key's (the module docstring), 3-4e-3 of this output's largest magnitude in fp16 for both,
    so the tolerance is 1e-2 of it, not TOL's 2e-3."""
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    monkeypatch.setattr(outer_hopper, "MIN_GROUP_ROWS", 0)
    launches = warp_launches(outer_hopper, monkeypatch)
    codes, (k_rec, v_rec), (k_sink, v_sink) = cache(1, 2, 512, 512, d, 2, torch.float16, seed=5, group=32)
    q = torch.randn(1, 8, d, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    args = (q, *codes, 2, k_rec, v_rec, torch.tensor((512, 500, 520, 4), dtype=torch.int32, device=DEVICE))
    kw = dict(k_sink=k_sink, v_sink=v_sink, group=32, rope=rope_tables(540, d, torch.float16))
    want = outer_decode_attention_ref(*args, **kw).float()
    err = (outer_decode_attention(*args, num_splits=3, **kw).float() - want).abs().max().item()
    assert err <= 1e-2 * max(1.0, want.abs().max().item()), err
    assert bool(launches) == (d == 128)


def test_hopper_kernels_pad_their_query_rows_to_8_or_16():
    """The Gluon kernels' wgmma N: 8 rows up to rep 8 (Llama-3.1-8B's 4, SmolLM2's 3), 16 above; the compiled tests
    run both (1 to 16 query rows). Keys rotated in the kernel rotate back only rep rows padded to a power of two
    of at least 4."""
    outer_hopper = pytest.importorskip("kvzoo.kernels.outer_hopper")
    assert [outer_hopper.rows_for(rep) for rep in (1, 3, 4, 8, 9, 16)] == [8, 8, 8, 8, 16, 16]
    # keys rotated in the kernel: the query rows rotated back each step, a power of two from 4 to rows_for(rep)
    assert [outer_hopper.query_rows(rep) for rep in (1, 3, 4, 5, 8, 9, 16)] == [4, 4, 4, 8, 8, 16, 16]


@pytest.mark.parametrize("choice,enabled,floor", [("triton", False, 2016), ("gluon", True, 0), ("auto", True, 2016)])
def test_kvzoo_outer_kernel_picks_the_kernel(choice, enabled, floor):
    """KVZOO_OUTER_KERNEL, read when outer_hopper is imported: triton never takes the Gluon kernel, gluon drops the
    MIN_GROUP_ROWS floor, auto keeps it."""
    pytest.importorskip("kvzoo.kernels.outer_hopper")
    code = "from kvzoo.kernels import outer_hopper as h; print(h.ENABLED, h.MIN_GROUP_ROWS)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVZOO_OUTER_KERNEL": choice},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(enabled), str(floor)]
