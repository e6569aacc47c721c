"""One-off, for the build in ../innerq.md: InnerQ's Gluon split kernel under one_wave caps (innerq_hopper.WAVE). "off"
was meant as the committed plan; it timed the Triton split kernel (../innerq.md)."""
import json, os, sys
sys.path.insert(0, "scripts")
import torch
import bench_kernels as bk
from timing import Timer
from kvzoo.kernels import innerq_hopper

timer = Timer(100, 10)
gen = torch.Generator(device="cuda").manual_seed(0)
settings = {"off": (1e9, 10 ** 9), "2.5": (2.5, 8), "2.75": (2.75, 8)}
out = open(os.path.join(os.environ.get("OUT", "."), "iq_sweep.jsonl"), "w")
for B, N in [(1, 32768), (1, 131072), (4, 32768)]:
    for B_, N_, name, launch, read in bk.selected_cases(gen, ["InnerQ-2 asymmetric", "InnerQ-2 hybrid"], [(B, N)]):
        if "Triton" in name:
            continue
        floor = timer(bk.read_floor(read))
        for rep in range(2):
            for label, wave in settings.items():
                innerq_hopper.WAVE = wave
                us = timer(launch) * 1e3
                row = dict(B=B, N=N, case=name, wave=label, rep=rep, us=round(us, 2), share=round(floor * 1e3 / us, 4))
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n"); out.flush()
        del launch
