#!/usr/bin/env bash
# Every paper table of docs/<paper>.md, re-run under the evaluation protocol of kvzoo/eval/perplexity.py: simulated
# mode, 16 windows of 2048 tokens of WikiText-2 and C4, a prompt of 256 tokens per window (prefilled exact,
# statistics from it, not scored), one window policy per table (--policy, kvzoo/cache/store.py).
#
#   bash repro/tables.sh [innerq|xquant|squat|kvpareto|all] [extra report.py arguments]
#
# Writes results/<paper>/<table>/report.{md,json,png}; rows are written as they finish.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-all}
shift || true
P=(--device cuda --dtype float16 --windows 16 --batch-size 8 --overwrite "$@")
report() { python scripts/report.py "${P[@]}" "$@"; }

innerq() {   # Table 1 (KIVI, KIVI+sink, InnerQ) and Table 2 (quantization modes), plus the key-norm ablation
  local KIVI="kivi:bits=2,group_size=32,residual=128" SINK="kivi:bits=2,group_size=32,residual=96,sink=32"
  for policy in reference grouped; do
    report --policy $policy --out results/innerq/table1-$policy --caches fp16 $KIVI $SINK innerq
  done
  report --out results/innerq/table2 --caches innerq:quant_mode=asym innerq:quant_mode=sym innerq:quant_mode=hybrid \
    innerq:quant_mode=hybrid_prefill innerq:tie_norm=true innerq:key_norm=false innerq:outer=true
}

xquant() {   # Table 1 (KIVI*, XQuant) and Table 4 (+ XQuant-CL, first 3 layers at 4 bits), GQA and MHA, two protocols
  local K=kivi-pre:group_size=128,residual=0 X=xquant:group_size=128 H=high_layers=3
  for arch in gqa mha; do
    local M=(); [ $arch = mha ] && M=(--mha)
    for policy in none grouped; do
      report "${M[@]}" --policy $policy --out results/xquant/table1-$arch-$policy --caches fp16 \
        $K,bits=4 $K,bits=3 $K,bits=2 $X,bits=4 $X,bits=3 $X,bits=2
      report "${M[@]}" --policy $policy --out results/xquant/table4-$arch-$policy --caches fp16 \
        $K,bits=4,$H $K,bits=3,$H $K,bits=2,$H $X,bits=4,$H $X,bits=3,$H $X,bits=2,$H \
        xquant-cl:bits=4 xquant-cl:bits=3 xquant-cl:bits=2
    done
  done
}

squat() {    # the main table (2-bit, G = R = 32) under both window policies, and the r x lambda ablation
  local K=bits=2,group_size=32,residual=32
  for policy in reference grouped; do
    report --policy $policy --out results/squat/main-$policy --caches fp16 kivi:$K kivi-pre:$K squat squat-pre \
      squat-pre:rope_queries=false
  done
  local cells=(squat:lam=0)
  for r in 5 10 20 40 60; do for lam in 0.0001 0.0005 0.001 0.01 0.1; do cells+=(squat:rank=$r,lam=$lam); done; done
  report --out results/squat/ablation --caches "${cells[@]}"
}

kvpareto() { # Table 3 (granularity x bits), Table 4 (K-smoothing), the frontier on both datasets
  local cells=(fp16 kvpareto:k_bits=8,v_bits=8,granularity=tensor kvpareto:k_bits=4,v_bits=4,granularity=tensor)
  for g in 32 64 128; do for b in 8 4; do cells+=(kvpareto:k_bits=$b,v_bits=$b,granularity=block,group_size=$g); done; done
  for g in 16 32 64; do for b in 8 4; do cells+=(kvpareto:k_bits=$b,v_bits=$b,granularity=token,group_size=$g); done; done
  report --out results/kvpareto/table3 --caches "${cells[@]}"
  cells=()
  for kv in "8 8" "8 4" "4 4" "4 2" "2 2"; do
    set -- $kv
    for smooth in false true; do cells+=(kvpareto:k_bits=$1,v_bits=$2,k_smooth=$smooth); done
  done
  report --out results/kvpareto/table4 --caches "${cells[@]}"
  for d in wikitext2 c4; do
    python -m repro.kvpareto.frontier --device cuda --dtype float16 --task wikitext --dataset $d --context 2048 \
      --windows 16 --weights w16,w4-awq --chunks 0,256 --overwrite \
      --json results/kvpareto/frontier-$d.json --plot results/kvpareto/frontier-$d.png
  done
}

case $which in
  innerq|xquant|squat|kvpareto) $which ;;
  all) innerq; xquant; squat; kvpareto ;;
  *) echo "usage: bash repro/tables.sh [innerq|xquant|squat|kvpareto|all] [report.py arguments]" >&2; exit 2 ;;
esac
