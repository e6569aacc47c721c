"""One-off: the committed split plan against a one-wave model, time = waves * (groups a split + C), programs
counting the tail's (one a KV row), slots = 3 programs an SM; outer warp kernel, KV Pareto and int8, L2 flushed."""
import json, os, sys
sys.path.insert(0, "scripts")
import torch
import bench_kernels as bk
from timing import Timer
from kvzoo.kernels import outer_attention as oa

orig = oa._plan_splits
OVERRIDE = [None]
LAST = [None]

def plan(n_groups, rows, device, num_splits, max_gs, pps):
    p = orig(n_groups, rows, device, OVERRIDE[0] if OVERRIDE[0] else num_splits, max_gs, pps)
    LAST[0] = p
    return p

oa._plan_splits = plan
SLOTS = 3 * torch.cuda.get_device_properties(0).multi_processor_count

def model(n_groups, rows, c, gs=4, slots=SLOTS):
    best = None
    for s in range(1, n_groups + 1):
        per = -(-n_groups // s)
        per = -(-per // gs) * gs
        s2 = -(-n_groups // per)
        waves = -(-(rows * s2 + rows) // slots)
        key = (waves * (per + c), rows * s2)
        if best is None or key < best[0]:
            best = (key, s2)
    return best[1]

timer = Timer(100, 10)
gen = torch.Generator(device="cuda").manual_seed(0)
shapes = [(1, 8192), (1, 16384), (1, 24576), (1, 49152), (1, 65536), (1, 98304), (2, 32768), (4, 32768)]
cases = ["SQuat (outer)", "KV Pareto", "int8"]
out = open(os.path.join(os.environ.get("OUT", "."), "plan_sweep2.jsonl"), "w")
for B, N in shapes:
    for B_, N_, name, launch, read in bk.selected_cases(gen, cases, [(B, N)]):
        floor = timer(bk.read_floor(read))
        n_groups = -(-(N - bk.WINDOW) // 32)
        settings = {"committed": None, "wave3": model(n_groups, B * 8, 8), "wave2": model(n_groups, B * 8, 8, slots=SLOTS * 2 // 3)}
        for rep in range(2):
            for label, s in settings.items():
                OVERRIDE[0] = s
                us = timer(launch) * 1e3
                row = dict(B=B, N=N, case=name, setting=label, plan=LAST[0], rep=rep, us=round(us, 2),
                           floor_us=round(floor * 1e3, 2), share=round(floor * 1e3 / us, 4))
                print(row, flush=True)
                out.write(json.dumps(row) + "\n"); out.flush()
        OVERRIDE[0] = None
        del launch
