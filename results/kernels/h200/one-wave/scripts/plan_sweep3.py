"""One-off: outer warp kernel, KV Pareto and int8 under split plans capped at a number of programs (whole steps of
4 groups a split), alternating with the committed plan, L2 flushed."""
import json, os, sys
sys.path.insert(0, "scripts")
import torch
import bench_kernels as bk
from timing import Timer
from kvzoo.kernels import outer_attention as oa

orig = oa._plan_splits
PER = [None]
LAST = [None]

def plan(n_groups, rows, device, num_splits, max_gs, pps):
    if PER[0]:
        p = (-(-n_groups // PER[0]), PER[0], 4)
    else:
        p = orig(n_groups, rows, device, num_splits, max_gs, pps)
    LAST[0] = p
    return p

oa._plan_splits = plan
timer = Timer(100, 10)
gen = torch.Generator(device="cuda").manual_seed(0)
shapes = [(1, 16384), (1, 24576), (1, 49152), (1, 98304), (1, 131072), (2, 32768), (4, 32768)]
caps = [256, 344, 368, 376, 384, 392]
cases = sys.argv[1:] or ["SQuat (outer)", "KV Pareto", "int8"]
out = open(os.path.join(os.environ.get("OUT", "."), "plan_sweep3.jsonl"), "w")
for B, N in shapes:
    ng = -(-(N - bk.WINDOW) // 32)
    pers = []
    for cap in caps:
        per = 4
        while B * 8 * -(-ng // per) > cap:
            per += 4
        if per not in pers:
            pers.append(per)
    for B_, N_, name, launch, read in bk.selected_cases(gen, cases, [(B, N)]):
        floor = timer(bk.read_floor(read))
        for rep in range(2):
            for per in [None, *pers]:
                PER[0] = per
                us = timer(launch) * 1e3
                row = dict(B=B, N=N, case=name[:10], plan=LAST[0], programs=B * 8 * LAST[0][0], rep=rep,
                           us=round(us, 2), share=round(floor * 1e3 / us, 4))
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n"); out.flush()
        PER[0] = None
        del launch
