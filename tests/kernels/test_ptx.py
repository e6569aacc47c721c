"""The kernels' inline PTX (kvzoo/kernels/quant_matvec.py) run by a small emulator of the instructions it uses, on
the CPU: the GPU runs this PTX only compiled, so these tests check on every machine what each string computes.

Emulated (32-bit registers as numpy uint32 arrays, one lane per element): mov, shr, shl, lop3 (its truth table),
prmt (default mode, with the sign-replicating selector bit), sub.f16x2 and fma.rn.f16x2 (each half rounded once
to fp16, as the hardware does: fp16 inputs are exact in float64, so a product plus an addend is too), and
fma.rn.bf16x2 the same way in bf16."""

import re

import numpy as np
import pytest
import torch

from kvzoo.kernels.quant_matvec import MAGICS, pair_asm, two_magic_pair_asm, unpack_asm

RNG = np.random.default_rng(0)
LANES = 4096


def run_ptx(asm: str, n_out: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The asm's n_out output registers ($0 ..) for input registers $n_out .. (uint32 arrays)."""
    regs = {f"${i + n_out}": x.astype(np.uint32) for i, x in enumerate(inputs)}

    def value(token: str) -> np.ndarray:
        token = token.strip()
        if token in regs:
            return regs[token]
        return np.full(inputs[0].shape, int(token, 0) & 0xFFFFFFFF, dtype=np.uint32)

    def halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ((x & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64),
                (x >> 16).astype(np.uint16).view(np.float16).astype(np.float64))

    def pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return (lo.astype(np.float16).view(np.uint16).astype(np.uint32)
                | (hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16))

    for line in re.findall(r"[^;{}]+;", asm):
        op, _, args = line.strip().rstrip(";").partition(" ")
        if op == ".reg":
            continue
        dst, *src = [a.strip() for a in args.split(",")]
        v = [value(s) for s in src]
        if op == "mov.b32":
            out = v[0]
        elif op == "shr.b32":
            out = v[0] >> v[1]
        elif op == "shl.b32":
            out = (v[0].astype(np.uint64) << v[1]).astype(np.uint32)
        elif op == "lop3.b32":
            a, b, c, lut = v[0], v[1], v[2], int(src[3], 0)
            out = np.zeros_like(a)
            for bit in range(32):
                index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
                out |= ((lut >> index.astype(np.int64)) & 1).astype(np.uint32) << bit
        elif op == "prmt.b32":
            source = v[0].astype(np.uint64) | (v[1].astype(np.uint64) << 32)
            out = np.zeros_like(v[0])
            for byte in range(4):
                select = (v[2] >> (4 * byte)) & 0xF
                picked = ((source >> (8 * (select & 7)).astype(np.uint64)) & 0xFF).astype(np.uint32)
                picked = np.where(select & 8, np.where(picked & 0x80, 0xFF, 0), picked).astype(np.uint32)
                out |= picked << (8 * byte)
        elif op == "sub.f16x2":
            (a0, a1), (b0, b1) = halves(v[0]), halves(v[1])
            out = pack(a0 - b0, a1 - b1)
        elif op == "fma.rn.f16x2":
            (a0, a1), (b0, b1), (c0, c1) = halves(v[0]), halves(v[1]), halves(v[2])
            out = pack(a0 * b0 + c0, a1 * b1 + c1)
        elif op == "fma.rn.bf16x2":
            (a0, a1), (b0, b1), (c0, c1) = bf16_halves(v[0]), bf16_halves(v[1]), bf16_halves(v[2])
            out = bf16_pack(a0 * b0 + c0, a1 * b1 + c1)
        else:
            raise NotImplementedError(op)
        regs[dst] = out.astype(np.uint32)
    return [regs[f"${i}"] for i in range(n_out)]


def bf16_halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A register's two bf16 halves as float64 (a bf16 is the top 16 bits of an fp32)."""
    return (((x & 0xFFFF) << 16).view(np.float32).astype(np.float64),
            (x & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64))


def bf16_pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two float64 arrays rounded once to bf16 (to nearest, ties to even) and packed, lo in the low half."""
    def bits(x):
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    return bits(lo) | (bits(hi) << 16)


def half_pair(x: np.ndarray) -> np.ndarray:
    """(..., 2) fp16 values -> uint32 registers, element 0 in the low half."""
    bits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    return bits[..., 0] | (bits[..., 1] << 16)


def unpair(r: np.ndarray) -> np.ndarray:
    """uint32 registers -> (..., 2) fp16 values as float64."""
    return np.stack([(r & 0xFFFF).astype(np.uint16), (r >> 16).astype(np.uint16)], -1).view(np.float16).astype(float)


def codes_of(words: np.ndarray, bits: int) -> np.ndarray:
    """(n,) words -> (n, 32/bits) codes, code k at bits k*bits."""
    return (words[:, None] >> (np.arange(32 // bits, dtype=np.uint32) * bits)) & ((1 << bits) - 1)


WORDS = RNG.integers(0, 2**32, LANES, dtype=np.uint64).astype(np.uint32)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("centered", [False, True])
def test_pair_asm_gives_codes_a_and_a_plus_half(bits, centered):
    """Output a: codes a and a + 16/bits of a word; centered (XQuant's Gluon weighing), less 2^(bits-1)."""
    half = 16 // bits
    out = run_ptx(pair_asm(bits, centered)[0], half, [WORDS, WORDS])
    codes = codes_of(WORDS, bits).astype(np.int64) - ((1 << (bits - 1)) if centered else 0)
    for a in range(half):
        assert np.array_equal(unpair(out[a]), codes[:, [a, a + half]])


@pytest.mark.parametrize("bits,bf16", [(2, False), (4, False), (8, False), (2, True), (4, True)])
def test_unpack_asm_gives_code_k_of_both_words(bits, bf16):
    other = WORDS[::-1].copy()
    out = run_ptx(unpack_asm(bits, bf16)[0], 32 // bits, [WORDS, other])
    for k in range(32 // bits):
        got = np.stack(bf16_halves(out[k]), -1) if bf16 else unpair(out[k])
        assert np.array_equal(got, np.stack([codes_of(WORDS, bits)[:, k], codes_of(other, bits)[:, k]], -1))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_centered_unpack_asm_gives_the_codes_less_half_their_range(bits):
    """The FOLD path of xquant_remat's weigh kernel: code - 2^(bits-1), exact in fp16."""
    other = WORDS[::-1].copy()
    out = run_ptx(unpack_asm(bits, centered=True)[0], 32 // bits, [WORDS, other])
    for k in range(32 // bits):
        want = np.stack([codes_of(WORDS, bits)[:, k], codes_of(other, bits)[:, k]], -1).astype(np.int64)
        assert np.array_equal(unpair(out[k]), want - (1 << (bits - 1)))
    with pytest.raises(ValueError, match="fp16's"):
        unpack_asm(2, bf16=True, centered=True)


def signs_register(signs: np.ndarray) -> np.ndarray:
    """(n, 16) sign bits of a word's codes -> the signs register two_magic_pair_asm(signed=True) takes: code a's at
    bit a, a + 8's at bit 16 + a (a < 8); the other bits random, which the PTX must ignore."""
    bits = signs.astype(np.uint32)
    register = sum(bits[:, a] << a | bits[:, a + 8] << (16 + a) for a in range(8))
    return register | (RNG.integers(0, 2**32, len(signs), dtype=np.uint64).astype(np.uint32) & 0xFF00FF00)


SIGNS = RNG.integers(0, 2, (LANES, 16))


def test_two_magic_pair_asm_reads_output_a_as_its_magic_plus_the_code():
    """Three shifts a word: output a holds codes a and a + 8 read as 4 + c (a even) or 16 + c (a odd), exact."""
    out = run_ptx(two_magic_pair_asm(scaled=False)[0], 8, [WORDS, WORDS])
    codes = codes_of(WORDS, 2)
    for a in range(8):
        assert np.array_equal(unpair(out[a]), codes[:, [a, a + 8]] + MAGICS[a % 2])


@pytest.mark.parametrize("signed", [False, True])
def test_two_magic_pair_asm_is_one_rounding_of_magic_code_times_scale_plus_its_offset(signed):
    """Each output (M + code) * scale + round(zero - M * scale), rounded once, then its sign flipped where the code's
    is set: within an fp16 ulp of code * scale + zero."""
    scale = RNG.uniform(0.01, 3.0, (LANES, 2)).astype(np.float16)
    zero = RNG.uniform(-20.0, 20.0, (LANES, 2)).astype(np.float16)
    register = signs_register(SIGNS)
    inputs = [WORDS, WORDS] + ([register, register] if signed else []) + [half_pair(scale), half_pair(zero)]
    out = run_ptx(two_magic_pair_asm(signed=signed)[0], 8, inputs)
    sign = np.where(SIGNS == 1, -1.0, 1.0) if signed else np.ones(SIGNS.shape)
    codes = codes_of(WORDS, 2)
    for a in range(8):
        pair, magic = [a, a + 8], MAGICS[a % 2]
        offset = (zero.astype(float) - magic * scale.astype(float)).astype(np.float16).astype(float)
        want = (codes[:, pair] + magic) * scale.astype(float) + offset
        assert np.array_equal(unpair(out[a]), want.astype(np.float16).astype(float) * sign[:, pair])
        exact = codes[:, pair] * scale.astype(float) + zero.astype(float)
        ulp = np.spacing(np.maximum(np.abs(exact), np.abs(offset)).astype(np.float16)).astype(float)
        assert np.all(np.abs(unpair(out[a]) * sign[:, pair] - exact) <= ulp)


def test_signed_two_magic_pair_asm_with_zero_0_is_sign_times_code_times_scale():
    """A symmetric group (zero 0): both offsets exact, each output sign * round(code * scale)."""
    scale = RNG.uniform(0.01, 3.0, (LANES, 2)).astype(np.float16)
    register = signs_register(SIGNS)
    out = run_ptx(two_magic_pair_asm(signed=True)[0], 8,
                  [WORDS, WORDS, register, register, half_pair(scale), half_pair(np.zeros((LANES, 2)))])
    values = codes_of(WORDS, 2) * np.where(SIGNS == 1, -1.0, 1.0)
    for a in range(8):
        pair = [a, a + 8]
        want = (np.abs(values[:, pair]) * scale.astype(float)).astype(np.float16).astype(float)
        assert np.array_equal(unpair(out[a]), want * np.sign(values[:, pair] + 0.5))


def test_prmt_selectors_of_a_words_signs():
    """innerq_hopper's byte permute (_signs): a word's 16 signs from its group's slot, 0x0100 for the group's first 16
    elements and 0x0302 for the other 16, at bits 0-7 and 16-23 as two_magic_pair_asm takes them."""
    slot = WORDS
    for select, shift in ((0x0100, 0), (0x0302, 16)):
        out = run_ptx(f"prmt.b32 $0, $1, $2, {select};", 1, [slot, slot, slot])[0]
        want = (slot >> shift) & 0xFF | ((slot >> (shift + 8)) & 0xFF) << 16
        assert np.array_equal(out & 0x00FF00FF, want)


def test_unpack_asm_refuses_8_bit_codes_in_bf16():
    """Codes of 128 and more would be OR-ed into a bf16's exponent (found by the emulator: code 168 came out as 208)."""
    with pytest.raises(ValueError, match="at most 4 bits"):
        unpack_asm(8, bf16=True)
