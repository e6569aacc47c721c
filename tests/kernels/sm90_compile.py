"""Compile the H100's decode split kernels for sm_90 without a GPU and print each case's shared memory (or its
error) as JSON: `TRITON_INTERPRET=0 python -m tests.kernels.sm90_compile`. Triton compiles and assembles kernels for
a target it is given, but not under the interpreter, so test_sm90_compile.py runs this in a process of its own.

Cases: the Gluon split kernels at the head shapes the benchmarks run (Llama-3.1-8B's head_dim 128 and rep 4,
SmolLM2's 64 and rep 3), and at the 8B shape the Triton InnerQ split kernel's fp16 fast path and the outer-layout
split kernel as KIVI-2, KIVI*-2 (keys rotated in the kernel), int8 and KV Pareto's k8v8 take it, with the token given
apart as the graph step gives it; XQuant's scores over its rotated keys and its weighing of 4-bit value latents (1,024
wide, groups of 128); the 4-bit weight kernels (groups of 128, bf16 activations) for one row, the group kernel's
16 rows, and the Gluon kernel's 8 and 16 rows, split over K or not. Each with its launcher's settings."""

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from kvzoo.kernels import (innerq_attention, innerq_hopper, outer_attention, outer_hopper, scores, w4a16, w4a16_hopper,
                           xquant_remat)
from kvzoo.kernels.quant_matvec import unpack_asm

H100 = GPUTarget("cuda", 90, 32)
POINTERS = {"q_ptr": "*fp16", "qs_ptr": "*fp16", "kc_ptr": "*i32", "ks_ptr": "*fp16", "kz_ptr": "*i32",
            "km_ptr": "*i32", "vc_ptr": "*i32", "vs_ptr": "*fp16", "vz_ptr": "*i32", "vm_ptr": "*i32",
            "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "len_ptr": "*i32"}
HEADS = ((128, 4), (64, 3))   # (head_dim, query rows a KV head)
# the outer kernel's layouts: (key bits, value bits, keys grouped per token (KT), group size, keys rotated (RoPE))
OUTER = {"kivi": (2, 2, False, 32, False), "kivi-pre": (2, 2, False, 32, True), "int8": (8, 8, True, 128, False),
         "kvpareto": (8, 8, True, 32, False)}
OUTER_POINTERS = dict(POINTERS, kz_ptr="*fp16", vz_ptr="*fp16", kr_ptr="*fp16", vr_ptr="*fp16", kw_ptr="*fp16",
                      vw_ptr="*fp16", kt_ptr="*fp16", vt_ptr="*fp16", cos_ptr="*fp16", sin_ptr="*fp16")


def compile_for_h100(fn, constexprs: dict, source=ASTSource, pointers: dict = POINTERS, **options):
    """fn compiled for sm_90 with these constexprs; every other argument a pointer of `pointers`, the softmax scale
    fp32, the rest int32 (lengths, counts and strides, as the launchers pass them)."""
    names = fn.arg_names
    scalar = {"qk_scale": "fp32", "scale": "fp32"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, scalar.get(name, "i32"))
                 for name in names}
    values = {(names.index(name),): value for name, value in constexprs.items()}
    return triton.compile(source(fn, signature, values), target=H100, options=options)


def cases() -> dict:
    """{name: (kernel, constexprs, source, pointers, compile options)}."""
    gluon = dict(num_warps=outer_hopper.N_WARPS)
    out = {}
    for d, rep in HEADS:
        lp, ksl = outer_hopper._layouts(d)
        rows = outer_hopper.rows_for(rep)
        for mode, has_sym in (("hybrid", True), ("asym", False)):
            out[f"innerq-gluon-d{d}-{mode}"] = (innerq_hopper._split_kernel, dict(
                D=d, REP=rep, ROWS=rows, HAS_SYM=has_sym, DYN=True, HAS_QS=True, LP=lp,
                LV=innerq_hopper._value_layout(d)), GluonASTSource, POINTERS, gluon)
        out[f"kivi-gluon-d{d}"] = (outer_hopper._quantized_kernel, dict(D=d, REP=rep, ROWS=rows, CG=32, LP=lp, KSL=ksl),
                                   GluonASTSource, dict(POINTERS, kz_ptr="*fp16", vz_ptr="*fp16"), gluon)
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
            CG=group, TOKEN=True), ASTSource, OUTER_POINTERS, dict(num_warps=4, num_stages=stages,
                                                                   enable_fp_fusion=True))
    xq = dict(POINTERS, codes_ptr="*i32", scale_ptr="*fp16", zero_ptr="*fp16", win_ptr="*bf16", src_ptr="*i64",
              p_ptr="*fp32", out_ptr="*fp32", k_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", q_ptr="*bf16")
    asm, con = unpack_asm(4, centered=True)
    out["xquant-weigh"] = (xquant_remat._weigh_kernel, dict(
        GROUP=128, BITS=4, PER_TOKEN=True, HAS_ZERO=True, FOLD=True, FAST=True, ASM=asm, CON=con, EXACT_DOT=False,
        BLOCK_H=32, BLOCK_T=128, BLOCK_K=128), ASTSource, xq, dict(num_warps=4, num_stages=2))
    out["xquant-scores"] = (scores._scores_kernel, dict(
        H=8, REP=4, REP_P=16, D=128, BLOCK=scores.BLOCK, PRECISION="tf32", UPCAST=False, ROPE=True), ASTSource, xq,
        dict(num_warps=4, num_stages=3))
    w4 = dict(x_ptr="*bf16", codes_ptr="*i32", scale_ptr="*fp16", zero_ptr="*fp16", out_ptr="*bf16", part_ptr="*fp32",
              count_ptr="*i32")
    asm, con = unpack_asm(4, bf16=True)
    one, grouped = w4a16.ONE_ROW, w4a16.GROUPED
    out["w4a16-one-row"] = (w4a16._w4a16_gemv_kernel, dict(
        GROUP=128, GPS=one.block_k // 128, SPLIT=4, FAST=True, ASM=asm, CON=con, BLOCK_N=one.block_n), ASTSource, w4,
        dict(num_warps=one.num_warps, num_stages=one.num_stages))
    out["w4a16-group-16-rows"] = (w4a16._w4a16_group_kernel, dict(
        GROUP=128, SPLIT=4, IEEE=False, FAST=True, ASM=asm, CON=con, BLOCK_M=16, BLOCK_N=grouped.block_n), ASTSource,
        w4, dict(num_warps=grouped.num_warps, num_stages=grouped.num_stages))
    for rows in (8, 16):
        for split in (1, 4):
            out[f"w4a16-gluon-{rows}-rows-split-{split}"] = (w4a16_hopper._w4_kernel, dict(
                GROUP=128, NP=rows, SPLIT=split, LP=w4a16_hopper._words_layout()), GluonASTSource, w4,
                dict(num_warps=w4a16_hopper.N_WARPS))
    return out


def main() -> None:
    results = {}
    for name, (fn, constexprs, source, pointers, options) in cases().items():
        try:
            results[name] = {"shared": compile_for_h100(fn, constexprs, source, pointers, **options).metadata.shared}
        except Exception as e:     # reported per case: the test names the kernel that failed and why
            results[name] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
