"""The H100's decode kernels (InnerQ's and KIVI's split kernels in Gluon, InnerQ's and the outer layout's in Triton,
InnerQ's window and key kernels and the shared combine, XQuant's scores and weighing, the 4-bit weight kernels,
AlignedKV's static step) compiled for sm_90 on any machine (scripts/compile_sm90.py), at the shapes the benchmarks
run and with the launchers' settings: a kernel that does not fit an H100 (its shared memory, registers ptxas cannot
assign, or spills in its main loop) fails here, not first on the device. The interpreter tests check what the
kernels compute; they run none of the compiled code."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

ROOT = Path(__file__).resolve().parents[2]
SHARED_MEMORY = 232_448          # bytes a program may take on an H100 (227 KB)
SM_SHARED_MEMORY = 233_472       # bytes of an SM's shared memory, of which the driver takes 1 KB a program
MODES = ("hybrid", "asym")
NAMES = [f"innerq-gluon-d{d}-{g}" for d in (128, 64) for g in MODES] + \
    [f"innerq-gluon-d128-{g}-busy" for g in MODES] + \
    [f"{name}-gluon-d{d}" for name in ("kivi", "kivi-pre") for d in (128, 64)] + \
    ["int8-gluon-d128", "kvpareto-gluon-d128"] + \
    [f"innerq-triton-{b}bit-{g}" for b in (2, 4) for g in MODES] + \
    [f"outer-triton-{name}" for name in ("kivi", "kivi-pre", "int8", "kvpareto")] + \
    [f"outer-tail-{name}" for name in ("int8", "kvpareto")] + \
    [f"outer-tail-combine-{name}" for name in ("kivi", "kivi-pre", "int8", "kvpareto")] + \
    ["xquant-weigh", "xquant-weigh-gluon", "xquant-scores", "w4a16-one-row", "w4a16-group-16-rows"] + \
    [f"w4a16-gluon-{rows}-rows-split-{split}" for rows, split in ((1, 1), (1, 4), (2, 4), (4, 4), (8, 4), (16, 1),
                                                                   (16, 4))]
NAMES += ["innerq-window", "combine", "innerq-aligned-keys", "innerq-key-flush"]
NAMES += ["alignedkv-qk", "alignedkv-pv", "alignedkv-topk", "alignedkv-estimate"]
# no loop: a block of 32 rows a program (the window's 32 tokens, the 32 lagging keys), the flush's one row, or
# AlignedKV's top-k passes (one sorting network a program)
LOOPLESS = {"innerq-window", "innerq-aligned-keys", "innerq-key-flush", "alignedkv-topk", "alignedkv-estimate"}


def _compile_all() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "scripts/compile_sm90.py", "--json"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compiled(run_once):
    return run_once("sm90-compile", _compile_all)


# kernels that spill in their main loop at their launchers' settings (Triton 3.6 or 3.9): every spill-free setting
# tried ran slower on an H200 (docs/decode.md, "Register spills"). Spills outside the loop cost a few instructions
# a program and are allowed.
SPILLING = {"innerq-triton-2bit-asym": "256 tokens a step, 2 stages (128 tokens, or one stage: 1.0-1.2x slower)",
            "kivi-pre-gluon-d128": "Triton 3.9: 14 reloads a step of values set before the loop, no stores in it; "
                                   "none on Triton 3.6",
            **{f"outer-tail-{name}": "capped at TAIL_REGISTERS to share an SM with the per-token kernel's programs; "
               "uncapped (the whole kernel: up to 255 registers, 104 KB of shared memory), KV Pareto and int8 ran "
               "10% slower at batch 32 (docs/decode.md)"
               for name in ("int8", "kvpareto")},
            **{f"w4a16-gluon-{rows}-rows-split-4": "codes in panels: 2 of 4 spill instructions in the loop on "
               "Triton 3.6, 4 of 11 on 3.9; at 2 and 4 rows the 8B block's products still take 48.0 and 50.2 µs "
               "against 50.2 and 53.0 with rows in order (docs/decode.md)" for rows in (2, 4)},
            "outer-triton-kivi": "Triton 3.6: 3 reloads in its loop at 255 registers; none on Triton 3.9. On sm_90 "
                                 "KIVI's quantized columns run in the Gluon warp kernel (kivi-gluon-d128), this one off "
                                 "Hopper",
            "w4a16-one-row": "Triton 3.6: 1 spill instruction in the loop at ONE_ROW_REGISTERS (sixteen one-warp "
                             "programs an SM); none on Triton 3.9",
            "w4a16-gluon-1-rows-split-1": "M = 1 a constant, as the launch makes it: 2 spill instructions in the loop "
                                          "on Triton 3.9, 3 on 3.6; the 8B block's products at one row take 45.3 "
                                          "µs against 46.3 with M left unspecialized and no spills (docs/decode.md)",
            "w4a16-gluon-8-rows-split-4": "Triton 3.9: 3 reloads an iteration (4 steps) of two addresses set before "
                                          "the loop, no stores in it",
            "xquant-weigh-gluon": "Triton 3.9: 3 reloads a step, in its copies, of values set before the loop; none on "
                                  "Triton 3.6, where it runs and was measured (docs/decode.md)",
            **{f"outer-tail-combine-{name}": "capped at TAIL_REGISTERS to share an SM with a Gluon kernel's programs "
               "while it attends the sink and the tail (test_tail_combine_fits_beside_the_gluon_kernels)"
               for name in ("kivi", "kivi-pre", "int8", "kvpareto")}}


def test_every_case_is_checked(compiled):
    assert sorted(compiled) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_kernel_compiles_for_an_h100_and_fits_it(compiled, name):
    result = compiled[name]
    assert "error" not in result, result.get("error")
    assert result["shared"] <= SHARED_MEMORY
    assert result["registers"] <= 255
    if name not in SPILLING:
        assert result["loop_spills"] == 0, f"{name} spills in its loop: {result}"
    if name not in LOOPLESS:
        assert result["loop"] > 0                                  # its main loop was found in the SASS


def test_spills_are_read_from_the_sass():
    """A loop's local stores and loads count as spills, with the stack frame; cuobjdump's LOCAL (0 here) does not
    say whether a kernel spills."""
    from tests.scripts.scripts_module import load

    usage = "Function k:\n REG:255 STACK:400 SHARED:1024 LOCAL:0 CONSTANT[0]:736"
    sass = """
        /*0010*/                   STL [R1+0x8], R17 ;
        /*0020*/                   IMAD R2, R3, R4, R5 ;
        /*0030*/                   LDL R6, [R1+0x8] ;
        /*0040*/               @P0 STL.64 [R1], R16 ;
        /*0050*/                   HFMA2 R7, R8, R9, R10 ;
        /*0060*/               @P1 BRA 0x20 ;
        /*0070*/                   EXIT ;"""
    result = load("compile_sm90").read_resources(usage, sass)
    assert (result["registers"], result["stack"], result["spills"], result["loop_spills"], result["loop"]) == \
        (255, 400, 3, 2, 5)
    assert result["loops"] == [5]


@pytest.mark.parametrize("name", ["kivi", "kivi-pre"])
def test_kivi_warp_kernel_fits_its_programs_an_sm(compiled, name):
    """The warp kernel's split-K plan sizes for WARP_PROGRAMS_PER_SM programs an SM (keys stored before RoPE, rotated
    in it: the Triton kernel's PROGRAMS_PER_SM): its registers must fit them, with no spills (a register more, and
    an SM holds one program fewer)."""
    from kvzoo.kernels.outer_attention import PROGRAMS_PER_SM
    from kvzoo.kernels.outer_hopper import N_WARPS, WARP_PROGRAMS_PER_SM

    result = compiled[f"{name}-gluon-d128"]
    programs = PROGRAMS_PER_SM if name == "kivi-pre" else WARP_PROGRAMS_PER_SM
    assert result["registers"] * 32 * N_WARPS * programs <= 65536 and result["spills"] == 0, result
    assert len(result["loops"]) == 2, result            # the whole steps, then the rest of a split


@pytest.mark.parametrize("rows,split", [(1, 1), (1, 4), (2, 4), (4, 4), (8, 4), (16, 1), (16, 4)])
def test_w4a16_gluon_kernel_fits_its_programs_an_sm(compiled, rows, split):
    """The Gluon W4A16 kernel's split-K plan sizes for PROGRAMS_PER_SM programs an SM: its registers (under its cap)
    and its x in shared memory (the steps x_steps gives at the 8B gate/up's 32 a split) must fit them, with no
    spills (but SPILLING's)."""
    from kvzoo.kernels.w4a16_hopper import N_WARPS, PROGRAMS_PER_SM, REGISTERS, x_steps

    name = f"w4a16-gluon-{rows}-rows-split-{split}"
    result = compiled[name]
    assert result["registers"] <= REGISTERS and (result["spills"] == 0 or name in SPILLING), result
    assert REGISTERS * 32 * N_WARPS * PROGRAMS_PER_SM <= 65536
    assert result["shared"] == x_steps(rows, 32) * rows * 128 * 2
    assert result["shared"] * PROGRAMS_PER_SM <= 227 * 1024


@pytest.mark.parametrize("name", ["int8", "kvpareto"])
def test_tail_program_fits_beside_two_gluon_programs(compiled, name):
    """The Triton kernel's last program, launched alone beside the per-token Gluon kernel (TAIL_ONLY, a KV row an SM
    or more), fits an SM's registers and shared memory with two of that kernel's programs, so that it starts beside
    them rather than after them."""
    from kvzoo.kernels.outer_attention import TAIL_REGISTERS, TAIL_WARPS
    from kvzoo.kernels.token_hopper import N_WARPS

    tail, gluon = compiled[f"outer-tail-{name}"], compiled[f"{name}-gluon-d128"]
    assert tail["registers"] <= TAIL_REGISTERS and gluon["registers"] <= 168
    assert TAIL_REGISTERS * 32 * TAIL_WARPS + 2 * gluon["registers"] * 32 * N_WARPS <= 65536
    assert tail["shared"] + 2 * gluon["shared"] + 3 * 1024 <= SM_SHARED_MEMORY


@pytest.mark.parametrize("name", ["int8", "kvpareto"])
def test_token_gluon_kernel_fits_its_programs_an_sm(compiled, name):
    """The per-token kernel, int8's groups and KV Pareto's: the split-K plan sizes for token_hopper.PROGRAMS_PER_SM
    programs an SM; its registers (the next step's operands held through a step's work) and its shared memory (the
    warps' merge after the loop) must fit them, with no spills."""
    from kvzoo.kernels.token_hopper import N_WARPS, PROGRAMS_PER_SM

    result = compiled[f"{name}-gluon-d128"]
    assert result["registers"] * 32 * N_WARPS * PROGRAMS_PER_SM <= 65536 and result["spills"] == 0, result
    assert (result["shared"] + 1024) * PROGRAMS_PER_SM <= SM_SHARED_MEMORY, result
    assert len(result["loops"]) == 2, result            # the whole steps, then the rest of a split


@pytest.mark.parametrize("mode", MODES)
def test_innerq_gluon_kernel_fits_three_programs_an_sm_under_its_register_cap(compiled, mode):
    """innerq_hopper.programs_per_sm's three programs: their registers and shared memory fit one SM, without
    spills."""
    from kvzoo.kernels.innerq_hopper import BUSY_PROGRAMS_PER_SM, N_WARPS, REGISTERS_PER_SM

    result = compiled[f"innerq-gluon-d128-{mode}-busy"]
    assert result["registers"] * 32 * N_WARPS * BUSY_PROGRAMS_PER_SM <= REGISTERS_PER_SM and result["loop_spills"] == 0
    assert (result["shared"] + 1024) * BUSY_PROGRAMS_PER_SM <= SM_SHARED_MEMORY


def test_compile_sm90_refuses_the_interpreter_and_unknown_cases():
    for env, argv, message in ((dict(TRITON_INTERPRET="1"), [], "TRITON_INTERPRET unset or 0"),
                               (dict(TRITON_INTERPRET="0"), ["--cases", "nope"], "names no kernel")):
        run = subprocess.run([sys.executable, "scripts/compile_sm90.py", *argv], cwd=ROOT, env=dict(os.environ, **env),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode != 0 and message in run.stderr


@pytest.mark.parametrize("name,gluon", [("kivi", "kivi-gluon-d128"), ("int8", "int8-gluon-d128"),
                                        ("kvpareto", "kvpareto-gluon-d128")])
def test_tail_combine_fits_beside_the_gluon_kernels(compiled, name, gluon):
    """The combine with the sink and the tail in it launches while a Gluon kernel runs, where it finds room: one
    program of it and one fewer of that kernel's than an SM holds (outer_hopper.programs_an_sm) must fit an SM's
    registers and shared memory together."""
    from kvzoo.kernels.outer_attention import TAIL_WARPS
    from kvzoo.kernels.outer_hopper import N_WARPS, WARP_PROGRAMS_PER_SM
    from kvzoo.kernels.token_hopper import PROGRAMS_PER_SM

    tail, main = compiled[f"outer-tail-combine-{name}"], compiled[gluon]
    others = (WARP_PROGRAMS_PER_SM if name == "kivi" else PROGRAMS_PER_SM) - 1
    assert tail["registers"] * 32 * TAIL_WARPS + others * main["registers"] * 32 * N_WARPS <= 65536, (tail, main)
    assert tail["shared"] + 1024 + others * (main["shared"] + 1024) <= SM_SHARED_MEMORY


def test_xquant_gluon_weighing_fits_its_programs_an_sm(compiled):
    """XQuant's Gluon weighing sizes its split for PROGRAMS_PER_SM programs an SM: its registers (the cap) and its
    shared memory (STAGES steps of operands) must fit them."""
    from kvzoo.kernels.xquant_hopper import N_WARPS, PROGRAMS_PER_SM

    result = compiled["xquant-weigh-gluon"]
    assert result["registers"] * 32 * N_WARPS * PROGRAMS_PER_SM <= 65536, result
    assert (result["shared"] + 1024) * PROGRAMS_PER_SM <= SM_SHARED_MEMORY, result


PDL_ORDER = r"""
import json, sys
sys.path.insert(0, "scripts")
import compile_sm90 as c
from kvzoo.kernels import layer_ops
def ptx(fn, constexprs, source, pointers, options):
    return c.compile_for_h100(fn, constexprs, source, pointers, **options).asm["ptx"]
def at(text, s):
    return text.find(s)
w4 = ptx(*c.cases()["w4a16-gluon-1-rows-split-4"])
norm = {early: ptx(layer_ops._rms_norm_kernel, dict(HAS_DELTA=True, BLOCK=4096, PRECISE=True, EARLY=early),
                   c.ASTSource, dict(x_ptr="*bf16", delta_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                                     sum_ptr="*bf16", eps="fp32"), {}) for early in (True, False)}
print(json.dumps(dict(launch=at(w4, "griddepcontrol.launch_dependents"), wait=at(w4, "griddepcontrol.wait"),
                      first_store=min(at(w4, s) for s in ("st.global", "atom.global", "red.global") if s in w4),
                      norm_early=at(norm[True], "griddepcontrol.launch_dependents"),
                      norm_plain=at(norm[False], "griddepcontrol.launch_dependents"))))
"""


def test_w4a16_gluon_kernel_waits_for_the_kernel_before_it():
    """Launched programmatically, the 4-bit kernel lets the next launch first and waits for the kernel before it
    before it stores or counts anything; the RMSNorm kernel lets it launch only where asked (EARLY)."""
    run = subprocess.run([sys.executable, "-c", PDL_ORDER], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TRITON_INTERPRET="0"))
    assert run.returncode == 0, run.stderr[-2000:]
    pos = json.loads(run.stdout.strip().splitlines()[-1])
    assert 0 <= pos["launch"] < pos["wait"] < pos["first_store"]
    assert pos["norm_early"] >= 0 and pos["norm_plain"] == -1
