"""One-off: the committed one-wave plans (innerq_hopper.WAVE, outer_hopper.ROPE_WAVE) against whole waves (the
least splits set out of reach), alternating, three runs each, L2 flushed (bench_kernels' Timer)."""
import json, os, sys
sys.path.insert(0, "scripts")
import torch
import bench_kernels as bk
from timing import Timer
from kvzoo.kernels import innerq_hopper, outer_hopper

timer = Timer(100, 10)
gen = torch.Generator(device="cuda").manual_seed(0)
waves = {"one-wave": (innerq_hopper.WAVE, outer_hopper.ROPE_WAVE), "whole-waves": ((2, 10 ** 9), (2, 10 ** 9))}
shapes = [(2, 32768), (4, 32768), (2, 131072), (4, 131072), (8, 32768), (16, 32768)]
out = open(os.path.join(os.environ.get("OUT", "."), "wave_ab.jsonl"), "w")
for B, N, name, launch, read in bk.selected_cases(gen, ["InnerQ-2 asymmetric", "InnerQ-2 hybrid", "KIVI*-2"], shapes):
    if "Triton" in name:
        continue
    for rep in range(3):
        for label, (iq, rope) in waves.items():
            innerq_hopper.WAVE, outer_hopper.ROPE_WAVE = iq, rope
            us = timer(launch) * 1e3
            row = dict(B=B, N=N, case=name, setting=label, rep=rep, us=round(us, 2))
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n"); out.flush()
    del launch
