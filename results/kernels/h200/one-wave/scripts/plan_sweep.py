"""One-off: the outer/per-token Gluon kernels at batch 1 under split counts the plan does not choose
(one wave at three programs an SM), alternating with the committed plan, L2 flushed (bench_kernels' Timer)."""
import json, os, sys
sys.path.insert(0, "scripts")
import torch
import bench_kernels as bk
from timing import Timer
from kvzoo.kernels import outer_attention as oa

orig = oa._plan_splits
OVERRIDE = [None]

def plan(n_groups, rows, device, num_splits, max_gs, pps):
    return orig(n_groups, rows, device, OVERRIDE[0] if OVERRIDE[0] else num_splits, max_gs, pps)

oa._plan_splits = plan
timer = Timer(200, 20)
gen = torch.Generator(device="cuda").manual_seed(0)
settings = {32768: [None, 43, 40, 48], 131072: [None, 49, 47, 66]}
cases = sys.argv[1:] or ["SQuat (outer)", "KV Pareto", "int8"]
out = open(os.path.join(os.environ.get("OUT", "."), "plan_sweep.jsonl"), "w")
for N, splits_list in settings.items():
    for B, N2, name, launch, read in bk.selected_cases(gen, cases, [(1, N)]):
        floor = timer(bk.read_floor(read))
        for rep in range(2):
            for s in splits_list:
                OVERRIDE[0] = s
                us = timer(launch) * 1e3
                row = dict(N=N, case=name, splits=s, rep=rep, us=round(us, 2), floor_us=round(floor * 1e3, 2),
                           share=round(floor * 1e3 / us, 4))
                print(row, flush=True)
                out.write(json.dumps(row) + "\n"); out.flush()
        OVERRIDE[0] = None
        del launch
