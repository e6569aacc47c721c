"""KV Pareto's frontier: non-dominated points, the chosen point, the configuration grid, the script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from repro.kvpareto import frontier as frontier_script
from repro.kvpareto.analysis import Point, choose, frontier

REPO = Path(__file__).resolve().parents[2]


def point(memory, accuracy, name="x"):
    return Point(name, 0, memory, "estimate", accuracy)


def test_frontier_keeps_the_non_dominated_points():
    pts = [point(10, 0.9, "base"), point(5, 0.88, "a"), point(6, 0.80, "dominated"), point(3, 0.5, "b"),
           point(5, 0.88, "tie"), point(12, 0.95, "best")]
    front = frontier(pts)
    assert [p.cache for p in front] == ["b", "a", "tie", "base", "best"]
    assert not pts[2].frontier
    assert choose(front, pts[0], tolerance=0.03).cache == "a"          # 0.88 >= 0.9 - 0.027
    assert choose(front, pts[0], tolerance=0.0).cache == "base"
    neg = [point(10, -20.0), point(4, -20.5), point(2, -30.0)]         # -perplexity: higher is better
    assert choose(frontier(neg), neg[0], tolerance=0.03).memory == 4


def test_configuration_grid():
    specs = frontier_script.configurations(["k8v4", "k2v2"], ["token", "tensor"], [32, 64])
    assert specs[0] == "fp16" and len(specs) == 1 + 2 * (2 + 1)
    assert "kvpareto:k_bits=8,v_bits=4,granularity=token,group_size=64" in specs
    assert "kvpareto:k_bits=2,v_bits=2,granularity=tensor" in specs
    with pytest.raises(ValueError, match="--kv takes pairs like k8v4"):
        frontier_script.configurations(["8/4"], ["token"], [32])


def test_script_end_to_end(tmp_path):
    """Both weight formats: w4-awq's model memory is its 4-bit codes, the w16 model's its fp weights."""
    pytest.importorskip("matplotlib")   # --plot (the `eval` extra)
    pytest.importorskip("triton")       # --weights w4-awq: kvzoo.weightquant.awq imports kvzoo.kernels.w4a16
    target, figure = tmp_path / "p.json", tmp_path / "p.png"
    cmd = [sys.executable, "-m", "repro.kvpareto.frontier", "--device", "cpu", "--context", "256",
           "--windows", "1", "--kv", "k8v8,k2v2", "--chunks", "0,64", "--weights", "w16,w4-awq", "--calib-windows",
           "1", "--json", str(target), "--plot", str(figure)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr
    result = json.loads(target.read_text())
    points = result["points"]
    assert len(points) == 2 * 3 * 2 and result["baseline"]["label"] == "w16 / fp16 / chunk none"
    assert any(p["frontier"] for p in points) and 0 < result["memory_reduction"] < 1
    w16, w4 = (next(p for p in points if p["weights"] == w and p["cache"] == "fp16" and p["chunk"] == 0)
               for w in ("w16", "w4-awq"))
    assert w4["memory"] < w16["memory"] and w4["accuracy"] < 0 and w16["accuracy"] < 0
    assert figure.stat().st_size > 0 and "chosen (frontier" in out.stdout
