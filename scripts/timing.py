"""What the GPU benchmarks share: a CUDA-graph timer that finds the cache cold, the device's copy bandwidth, the
checks that refuse to time on the wrong machine, and output paths that are never overwritten silently.

Not an entry point, and not part of the kvzoo package. Imported, with no edit of the module search path, as
    `from timing import ...`          by scripts/bench_kernels.py and scripts/bench_decode.py: running
                                      `python scripts/x.py` puts scripts/ first on the search path
    `from scripts.timing import ...`  by repro/<paper>/bench.py: `python -m repro.<paper>.bench`, run from the
                                      repository root, puts the root there
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

FLUSH_BYTES = 256 * 2 ** 20                        # > the 50-60 MB L2 of an H100 / H200


class Timer:
    """Median latency (ms) of a callable captured in a CUDA graph: warm-up replays, then `runs` timed
    replays (CUDA events), L2 flushed before each one (a decode step finds a layer's cache cold)."""

    def __init__(self, runs: int, warmup: int, device: str = "cuda"):
        self.runs, self.warmup = runs, warmup
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)

    def graph(self, fn) -> torch.cuda.CUDAGraph:
        """fn run once outside the graph (compile / autotune), captured, and replayed `warmup` times."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(self.warmup):
            graph.replay()
        return graph

    def __call__(self, fn) -> float:
        graph = self.graph(fn)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.runs)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)


def copy_bandwidth(device: str = "cuda", runs: int = 20, warmup: int = 5) -> float:
    """GB/s of a device-to-device copy, bytes read plus written: what a memory-bound kernel can reach. On a GPU
    the median of `runs` graph replays of a 1 GiB copy (Timer); on a CPU the fastest of `runs` 128 MiB copies."""
    n = (1 << 30) if device == "cuda" else (1 << 27)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    if device == "cuda":
        return 2 * n / Timer(runs, warmup)(lambda: dst.copy_(src)) / 1e6
    times = []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 2 * n / min(times) / 1e9


def require_compiled_gpu(script: str, tests: str) -> None:
    """Exit with a clear message unless a CUDA GPU is there and the Triton interpreter is off."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} times Triton kernels on a CUDA GPU and found none; on CPU the kernels run only "
                         f"under the Triton interpreter ({tests})")
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        raise SystemExit("unset TRITON_INTERPRET: the benchmark times compiled kernels")


def output_paths(out: str, overwrite: bool) -> list[Path]:
    """OUT.json and OUT.md; exits before any work if either exists and overwrite is off."""
    paths = [Path(out + ".json"), Path(out + ".md")]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise SystemExit(f"{', '.join(existing)} already exist; pass --overwrite to replace them")
    return paths
