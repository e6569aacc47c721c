"""One-off: InnerQ's Gluon split kernel and KIVI*'s kernel under one wave of splits at 2.0 / 1.94 / 1.5 programs
an SM against the committed plan (whole_waves), alternating, L2 flushed (bench_kernels' Timer)."""
import json, os, sys
sys.path.insert(0, "scripts")
import torch
import bench_kernels as bk
from timing import Timer
from kvzoo.kernels import innerq_attention as ia, outer_attention as oa
from kvzoo.kernels.quant_matvec import sm_count

orig = ia._plan_splits
WAVE = [None]
LAST = [None]

def plan(n_groups, rows, device, num_splits, max_gs, pps):
    p = None
    if WAVE[0] is not None and num_splits is None:
        p = ia.one_wave(n_groups, rows, sm_count(device), WAVE[0], max_gs, 1)
    if p is None:
        p = orig(n_groups, rows, device, num_splits, max_gs, pps)
    LAST[0] = p
    return p

ia._plan_splits = plan
oa._plan_splits = plan
timer = Timer(100, 10)
gen = torch.Generator(device="cuda").manual_seed(0)
settings = {"committed": None, "w2.0": 2.0, "w1.94": 1.94, "w1.5": 1.5}
shapes = [(1, 32768), (2, 32768), (4, 32768), (8, 32768), (16, 32768), (2, 131072)]
cases = sys.argv[1:] or ["InnerQ-2 asymmetric", "InnerQ-2 hybrid", "KIVI*-2"]
out = open(os.path.join(os.environ.get("OUT", "."), "wave_sweep.jsonl"), "w")
for B, N in shapes:
    for B_, N_, name, launch, read in bk.selected_cases(gen, cases, [(B, N)]):
        if "Triton" in name:
            continue
        floor = timer(bk.read_floor(read))
        for rep in range(2):
            for label, w in settings.items():
                WAVE[0] = w
                us = timer(launch) * 1e3
                row = dict(B=B, N=N, case=name, setting=label, plan=[int(getattr(x, "value", x)) for x in LAST[0]], rep=rep, us=round(us, 2),
                           floor_us=round(floor * 1e3, 2), share=round(floor * 1e3 / us, 4))
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n"); out.flush()
        WAVE[0] = None
        del launch
