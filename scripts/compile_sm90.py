"""Compile the H100's decode kernels for sm_90 without a GPU and report, per kernel: the shared memory a program takes,
its registers, its register spills (the SASS's local stores and loads, and the stack frame ptxas gives them) and the
instructions of its main loop (the longest backward branch of its SASS). Triton compiles and assembles for a target
it is given on any machine, with its own ptxas and cuobjdump; the interpreter (TRITON_INTERPRET=1) must be off.

    python scripts/compile_sm90.py                          # every kernel, a table
    python scripts/compile_sm90.py --cases innerq-gluon --mix   # and each loop's most frequent instructions
    python scripts/compile_sm90.py --json                   # JSON (tests/kernels/test_sm90_compile.py)

A kernel's loop instructions, registers and shared memory are read before device time is spent: the loop's length
tracks an issue-bound kernel's speed (the InnerQ hybrid loop from 1,586 to 1,363 instructions, 831 to 747 us at 32K,
batch 32), while registers and shared memory decide how many programs an SM holds (docs/decode.md). Cases: the Gluon
split kernels at the head shapes the benchmarks run (Llama-3.1-8B's head_dim 128 and rep 4, SmolLM2's 64 and rep 3),
and at the 8B shape the Triton InnerQ split kernel's fp16 fast path, the outer-layout split kernel as KIVI-2,
KIVI*-2 (keys rotated in the kernel), int8 and KV Pareto's k8v8 take it (the token given apart, as the graph step
gives it), int8's Gluon kernel, XQuant's scores over its rotated keys and its weighing of 4-bit value latents (1,024
wide, groups of 128), and the 4-bit weight kernels (groups of 128, bf16 activations) for one row, the group kernel's
16 rows and the Gluon kernel's 1, 2, 4, 8 and 16 rows, split over K or not; the InnerQ Gluon kernel at 8B also
under the register cap of three programs an SM (innerq_hopper.register_cap, "-busy"); InnerQ's window kernel, the
combine kernel its split kernels and the outer ones share, the outer ones' combine with the sink and the tail in it
(capped as the tail's program), InnerQ's two key kernels of the graph step at the paper's windows, and AlignedKV's
static step (its two products over 64-token blocks, its first top-k pass, and its estimate over the candidates of
128 chunks, 128K tokens). Each with its launcher's settings."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from kvzoo.kernels import (alignedkv_attention, innerq_attention, innerq_hopper, outer_attention, outer_hopper,
                           quantize_pack, scores, token_hopper, w4a16, w4a16_hopper, xquant_hopper,
                           xquant_remat)
from kvzoo.kernels.quant_matvec import unpack_asm

H100 = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*fp16", "qs_ptr": "*fp16", "kc_ptr": "*i32", "ks_ptr": "*fp16", "kz_ptr": "*i32",
            "km_ptr": "*i32", "vc_ptr": "*i32", "vs_ptr": "*fp16", "vz_ptr": "*i32", "vm_ptr": "*i32",
            "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "len_ptr": "*i32"}
# the caches' head strides of their codes, scales and zeros or slots: multiples of 16 (capacities in whole groups of
# 32), which the launcher specializes and the Gluon kernels' loads are vectorized on
STRIDES = ("s_kc", "s_ks", "s_kz", "s_vc", "s_vs", "s_vz")
HEADS = ((128, 4), (64, 3))   # (head_dim, query rows a KV head)
# the outer kernel's layouts: (key bits, value bits, keys grouped per token (KT), group size, keys rotated (RoPE))
OUTER = {"kivi": (2, 2, False, 32, False), "kivi-pre": (2, 2, False, 32, True), "int8": (8, 8, True, 128, False),
         "kvpareto": (8, 8, True, 32, False)}
OUTER_POINTERS = dict(POINTERS, kz_ptr="*fp16", vz_ptr="*fp16", kr_ptr="*fp16", vr_ptr="*fp16", kw_ptr="*fp16",
                      vw_ptr="*fp16", cos_ptr="*fp16", sin_ptr="*fp16")


def compile_for_h100(fn, constexprs: dict, source=ASTSource, pointers: dict = POINTERS, divisible=(), **options):
    """fn compiled for sm_90 with these constexprs; every other argument a pointer of `pointers`, 16-byte aligned as
    the launch's torch tensors are (Triton's launcher specializes on it, and it decides which loads are vectors),
    the softmax scale fp32, the rest int32 (lengths, counts and strides, as the launchers pass them), those named in
    `divisible` multiples of 16 (the launcher specializes an integer that is)."""
    names = fn.arg_names
    scalar = {"qk_scale": "fp32", "scale": "fp32"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, scalar.get(name, "i32"))
                 for name in names}
    values = {(names.index(name),): value for name, value in constexprs.items()}
    aligned = {(names.index(name),): [["tt.divisibility", 16]] for name, kind in signature.items()
               if kind.startswith("*") or name in divisible}
    return triton.compile(source(fn, signature, values, aligned), target=H100, options=options)


def cases() -> dict:
    """{name: (kernel, constexprs, source, pointers, compile options)}."""
    gluon = dict(num_warps=outer_hopper.N_WARPS)
    out = {}
    for d, rep in HEADS:
        rows = outer_hopper.rows_for(rep)
        for mode, has_sym in (("hybrid", True), ("asym", False)):
            out[f"innerq-gluon-d{d}-{mode}"] = (innerq_hopper._split_kernel, dict(
                D=d, REP=rep, ROWS=rows, HAS_SYM=has_sym, DYN=True, HAS_QS=True,
                **dict(zip(("LK", "LV", "LKG", "LVG"), innerq_hopper._operand_layouts(d)))),
                GluonASTSource, POINTERS, dict(gluon, divisible=STRIDES))
            if d == 128:    # large batches: BUSY_PROGRAMS_PER_SM programs an SM, under register_cap
                busy = dict(gluon, divisible=STRIDES,
                            maxnreg=innerq_hopper.register_cap(innerq_hopper.BUSY_PROGRAMS_PER_SM))
                out[f"innerq-gluon-d{d}-{mode}-busy"] = (*out[f"innerq-gluon-d{d}-{mode}"][:4], busy)
        for name, rope in (("kivi", False), ("kivi-pre", True)):
            if d == outer_hopper.WARP_HEAD_DIM:      # the warp kernel serves it
                out[f"{name}-gluon-d{d}"] = (outer_hopper._warp_kernel, dict(
                    D=d, REP=rep, ROWS=rows, CG=32, ROPE=rope, QROWS=outer_hopper.query_rows(rep),
                    **dict(zip(("LKW", "KSL", "LVW", "XL", "VL"), outer_hopper._warp_layouts(d, rope))),
                    **dict(zip(("LT", "LQC"), outer_hopper._warp_rope_layouts(outer_hopper.query_rows(rep))))),
                    GluonASTSource,
                    dict(POINTERS, kz_ptr="*fp16", vz_ptr="*fp16", cos_ptr="*bf16", sin_ptr="*bf16", off_ptr="*fp16"),
                    dict(gluon, divisible=STRIDES))
                continue
            lp, ksl, lpk, lh = outer_hopper._layouts(d, rope)
            out[f"{name}-gluon-d{d}"] = (outer_hopper._quantized_kernel, dict(
                D=d, REP=rep, ROWS=rows, CG=32, LP=lp, KSL=ksl, LPK=lpk, LH=lh, ROPE=rope,
                QROWS=outer_hopper.query_rows(rep)), GluonASTSource,
                dict(POINTERS, kz_ptr="*fp16", vz_ptr="*fp16", cos_ptr="*bf16", sin_ptr="*bf16", off_ptr="*fp16"),
                dict(gluon, divisible=STRIDES))
    for name, group in (("int8", 128), ("kvpareto", 32)):
        out[f"{name}-gluon-d128"] = (token_hopper._token_kernel, dict(
            D=128, REP=4, ROWS=token_hopper.ROWS_MAX, CG=group,
            **dict(zip(("LK", "LK5", "LV", "LV5"), token_hopper._layouts(128)))),
            GluonASTSource, dict(POINTERS, ks_ptr="*fp16", kz_ptr="*fp16", vs_ptr="*fp16", vz_ptr="*fp16"),
            dict(gluon, divisible=STRIDES))
    for bits in (2, 4):
        asm, con = unpack_asm(bits)
        for mode, has_sym in (("hybrid", True), ("asym", False)):
            gs, _, stages, warps = innerq_attention._split_config(4, True, has_sym)
            out[f"innerq-triton-{bits}bit-{mode}"] = (innerq_attention._split_kernel, dict(
                D=128, BITS=bits, REP=4, REP_P=16, HAS_SYM=has_sym, DYN=True, HAS_QS=True, GS=gs, FAST=True, ASM=asm,
                CON=con), ASTSource, POINTERS, dict(num_warps=warps, num_stages=stages, enable_fp_fusion=True))
    for name, (kb, vb, kt, group, rope) in OUTER.items():
        gs, stages = (outer_attention.ROPE_GROUPS_PER_STEP, outer_attention.ROPE_STAGES) if rope else \
            (outer_attention.GROUPS_PER_STEP, outer_attention.SPLIT_STAGES)
        out[f"outer-triton-{name}"] = (outer_attention._split_kernel, dict(
            D=128, KB=kb, VB=vb, REP=4, REP_P=16, GS=gs, BLOCK=outer_attention.BLOCK_W, FAST=True,
            AK=unpack_asm(kb)[0], CK=unpack_asm(kb)[1], AV=unpack_asm(vb)[0], CV=unpack_asm(vb)[1], ROPE=rope, KT=kt,
            CG=group, TAIL=True, TAIL_ONLY=False, EARLY=True), ASTSource, OUTER_POINTERS, dict(
                num_warps=outer_attention.split_kernel_warps("token" if kt else "channel", group, 128, 4),
                num_stages=stages, enable_fp_fusion=True))
        # the combine with the sink and the tail attended in it, launched while a Gluon kernel runs
        out[f"outer-tail-combine-{name}"] = (outer_attention._tail_combine_kernel, dict(
            D=128, KB=kb, VB=vb, REP=4, REP_P=16, ROWS=4, BLOCK=outer_attention.BLOCK_W, ROPE=rope, KT=kt, CG=group,
            DC=32, CHUNK=64, TOKEN=True, WAIT=True), ASTSource, dict(OUTER_POINTERS, out_ptr="*fp16", kt_ptr="*fp16",
                                                                    vt_ptr="*fp16"),
            dict(num_warps=outer_attention.TAIL_WARPS, num_stages=1, maxnreg=outer_attention.TAIL_REGISTERS,
                 enable_fp_fusion=True))
        if not kt:
            continue
        # beside the per-token Gluon kernel: the last program alone, slim enough to share an SM with its programs
        tail = dict(num_warps=outer_attention.TAIL_WARPS, num_stages=1, maxnreg=outer_attention.TAIL_REGISTERS,
                    enable_fp_fusion=True)
        constexprs = dict(out[f"outer-triton-{name}"][1], TAIL_ONLY=True)
        out[f"outer-tail-{name}"] = (outer_attention._split_kernel, constexprs, ASTSource, OUTER_POINTERS, tail)
    win = dict(POINTERS, q_ptr="*bf16", qs_ptr="*bf16", kw_ptr="*bf16", vw_ptr="*bf16", kw2_ptr="*bf16",
               vw2_ptr="*bf16", kr_ptr="*bf16", win_ptr="*bf16", out_ptr="*bf16", nk_ptr="*i64", nq_ptr="*i64",
               ks_ptr="*fp16")
    # the paper's windows: the value window's keys from the key ring (k_ring2); the windows' head strides,
    # multiples of 16, specialized as the launcher does
    out["innerq-window"] = (innerq_attention._window_kernel, dict(
        D=128, REP=4, REP_P=16, BLOCK=innerq_attention.BLOCK_W, DYN=True, HAS_QS=True, RING=True), ASTSource, win,
        dict(num_warps=4, enable_fp_fusion=True, divisible=("s_kw", "s_vw", "s_kw2", "s_vw2", "s_kr")))
    out["combine"] = (innerq_attention.combine_kernel, dict(D=128, DC=32, REP=4, REP_P=4, CHUNK=64, TOKEN=True),
                      ASTSource,
                      dict(win, kt_ptr="*bf16", vt_ptr="*bf16"), dict(num_warps=4))
    # InnerQ's key work at the paper's windows: a key window of R + 1 = 97 rows, the 32 lagging keys
    out["innerq-aligned-keys"] = (quantize_pack._aligned_keys_kernel, dict(
        D=128, BITS=2, KW=97, VW=32, READ=quantize_pack.READS.index("mask"), CODES=True), ASTSource, win,
        dict(num_warps=4, enable_fp_fusion=False))
    out["innerq-key-flush"] = (quantize_pack._key_flush_kernel, dict(
        D=128, BITS=2, MODE=quantize_pack.MODES.index("hybrid"), TOP=3.0, KW=97, MASK=True), ASTSource, win,
        dict(num_warps=4, enable_fp_fusion=False))
    xq = dict(POINTERS, codes_ptr="*i32", scale_ptr="*fp16", zero_ptr="*fp16", win_ptr="*bf16", src_ptr="*i64",
              p_ptr="*fp32", out_ptr="*fp32", k_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_ptr="*bf16")
    asm, con = unpack_asm(4, centered=True)
    out["xquant-weigh"] = (xquant_remat._weigh_fold_kernel, dict(
        GROUP=128, BITS=4, HAS_ZERO=True, FAST=True, ASM=asm, CON=con, EXACT_DOT=False, ALL_H=True,
        BLOCK_H=32, BLOCK_T=64, BLOCK_K=128), ASTSource, xq, dict(num_warps=4, num_stages=2))
    out["xquant-weigh-gluon"] = (xquant_hopper._weigh_kernel, dict(
        GROUP=128, PAIRS=xquant_hopper.pairs(128), HAS_ZERO=True, ALL_H=True, BLOCK_H=32, STAGES=xquant_hopper.STAGES,
        **dict(zip(("LW", "LP", "LPT", "LPC", "LSRC"), xquant_hopper._layouts(32)))), GluonASTSource, xq,
        dict(num_warps=xquant_hopper.N_WARPS, maxnreg=xquant_hopper.REGISTERS,
             divisible=("WORDS", "PER_SPLIT", "s_ph", "s_pb")))
    out["xquant-scores"] = (scores._scores_kernel, dict(
        H=8, REP=4, REP_P=16, D=128, BLOCK=scores.BLOCK, PRECISION="tf32", UPCAST=False, ROPE=True, Q_ROPE=True),
        ASTSource, dict(xq, qcos_ptr="*bf16", qsin_ptr="*bf16"), dict(num_warps=4, num_stages=3))
    w4 = dict(x_ptr="*bf16", codes_ptr="*i32", scale_ptr="*fp16", zero_ptr="*fp16", out_ptr="*bf16", part_ptr="*fp32",
              count_ptr="*i32")
    asm, con = unpack_asm(4, bf16=True)
    one, grouped = w4a16.ONE_ROW, w4a16.GROUPED
    out["w4a16-one-row"] = (w4a16._w4a16_gemv_kernel, dict(
        GROUP=128, GPS=one.block_k // 128, SPLIT=4, PANELS=True, WHOLE=True, FAST=True, ASM=asm, CON=con,
        BLOCK_N=one.block_n), ASTSource, w4,
        dict(num_warps=one.num_warps, num_stages=one.num_stages, maxnreg=w4a16.ONE_ROW_REGISTERS))
    out["w4a16-group-16-rows"] = (w4a16._w4a16_group_kernel, dict(
        GROUP=128, SPLIT=4, PANELS=True, WHOLE=True, IEEE=False, FAST=True, ASM=asm, CON=con, BLOCK_M=16,
        BLOCK_N=grouped.block_n), ASTSource, w4, dict(num_warps=grouped.num_warps, num_stages=grouped.num_stages))
    hop = w4a16_hopper
    for rows, split in ((1, 1), (1, 4), (2, 4), (4, 4), (8, 4), (16, 1), (16, 4)):     # XS as at the 8B gate/up
        out[f"w4a16-gluon-{rows}-rows-split-{split}"] = (hop._w4_kernel, dict(
            GROUP=128, SPLIT=split, XS=hop.x_steps(rows, 32), R=rows, LP=hop._words_layout(),
            LF=hop._x_frag_layout(rows), L3=hop._x_column_layout(min(rows, 4)),
            **({"M": 1} if rows == 1 else {})), GluonASTSource, w4,          # the launch makes an int 1 a constant
            dict(num_warps=hop.N_WARPS, divisible=("K", "N"), maxnreg=hop.REGISTERS))
    aligned = dict(q_ptr="*bf16", hi_ptr="*u16", mid_ptr="*u8", lo_ptr="*u8", exp_ptr="*i8", out_ptr="*fp32",
                   len_ptr="*i64", tk_ptr="*bf16", mask_ptr="*i1", p_ptr="*fp32", o_ptr="*fp32", part_ptr="*fp32",
                   tv_ptr="*bf16", cand_ptr="*i64", vhi_ptr="*u8", vmid_ptr="*u8", vlo_ptr="*u8", tail_ptr="*bf16",
                   na_ptr="*i64")
    al = alignedkv_attention
    out["alignedkv-qk"] = (al._qk_kernel, dict(G=4, G_E=4, G_P=16, D=128, DP=128, BT=64, MIN_BITS=8, EXACT_Q=False,
                                               DYN=True, STATIC=True), ASTSource, aligned,
                           dict(num_warps=4, num_stages=al.QK_STAGES))
    out["alignedkv-pv"] = (al._pv_kernel, dict(G=4, G_P=16, D=128, BLOCK_N=al.PV_BLOCK_N, MIN_BITS=8, ROW_MASK=True,
                                               DYN=True, LIVE_ROWS=64, TAIL=64, TAIL_P=64), ASTSource, aligned,
                           dict(num_warps=4, num_stages=al.PV_STAGES))
    out["alignedkv-topk"] = (al._chunk_topk_kernel, dict(C=al.TOPK_CHUNK, K_P=32), ASTSource, aligned,
                             dict(num_warps=4))
    out["alignedkv-estimate"] = (al._estimate_kernel, dict(G=4, K=32, K_P=32, NC_P=4096, D=128, NA_ROWS=64,
                                                           SELECT=True), ASTSource, aligned, dict(num_warps=4))
    return out


def resources(cubin: bytes) -> dict:
    """read_resources of a compiled kernel, from cuobjdump's resource usage and SASS."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        tool = triton.knobs.nvidia.cuobjdump.path
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    return read_resources(usage, sass)


def read_resources(usage: str, sass: str) -> dict:
    """Registers and spills of a kernel (cuobjdump -res-usage, -sass), and its main loop: the longest backward
    branch's instructions, with their opcodes counted; `loops` lists, in program order, the lengths of every loop at
    least half as long (a kernel that runs its whole steps in one loop and the rest of a split in another has two).
    Spills are the SASS's local stores and loads (STL, LDL), in the whole kernel and in its loop, and the stack frame
    (bytes a thread) ptxas gives them: cuobjdump's LOCAL counts only local arrays, and reads 0 for a kernel that
    spills."""
    ins = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = [(int(m.group(1), 16), addr) for addr, text in ins
             if (m := re.search(r"BRA\s+`?\(?(?:\.L_x_\d+\)?\s*)?0x([0-9a-f]+)", text)) and int(m.group(1), 16) < addr]
    first, last = max(loops, key=lambda span: span[1] - span[0], default=(0, -1))
    ops = [(addr, (text.split()[1] if text.startswith("@") else text.split()[0]).split(".")[0]) for addr, text in ins]
    body = [op for addr, op in ops if first <= addr <= last]
    sizes = [sum(start <= addr <= end for addr, _ in ins) for start, end in sorted(loops)]
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "spills": sum(op in ("STL", "LDL") for _, op in ops),
            "loop_spills": sum(op in ("STL", "LDL") for op in body),
            "loop": len(body), "loops": [n for n in sizes if 2 * n >= len(body)],
            "mix": collections.Counter(body).most_common(12)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", metavar="TEXT", help="only the kernels whose names hold one of these")
    parser.add_argument("--mix", action="store_true", help="also each main loop's most frequent instructions")
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):     # its kernels were made interpreted at import
        sys.exit("compile_sm90.py compiles for the GPU: run it with TRITON_INTERPRET unset or 0")
    todo = {name: case for name, case in cases().items() if not args.cases or any(c in name for c in args.cases)}
    if not todo:
        parser.error(f"--cases {args.cases} names no kernel; the kernels: {', '.join(cases())}")
    results = {}
    for name, (fn, constexprs, source, pointers, options) in todo.items():
        try:
            kernel = compile_for_h100(fn, constexprs, source, pointers, **options)
            results[name] = {"shared": kernel.metadata.shared, **resources(kernel.asm["cubin"])}
        except Exception as e:     # reported per kernel: the test names the kernel that failed and why
            results[name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    if args.json:
        print(json.dumps(results))
        return
    print("| kernel (sm_90) | shared memory (bytes) | registers | spill stores + loads (in the loop) | stack bytes | "
          "loop instructions |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | {r['error'].splitlines()[-1]} | | | | |")
            continue
        print(f"| {name} | {r['shared']:,} | {r['registers']} | {r['spills']} ({r['loop_spills']}) | {r['stack']} | "
              f"{', '.join(f'{n:,}' for n in r['loops'])} |")
        if args.mix:
            print(f"|  | {' '.join(f'{op} {n}' for op, n in r['mix'])} | | | | |")


if __name__ == "__main__":
    main()
