"""Triton is optional: with it unimportable, kvzoo imports, registers every strategy and generates through each
one's pure-torch path (CPU tensors never need a kernel; kernels are imported only where a CUDA path is taken).

One subprocess runs every strategy (sys.modules["triton"] = None there, so any `import triton` fails); each
strategy then passes or fails on its own below."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvzoo

REPO = Path(__file__).resolve().parents[2]
STRATEGIES = kvzoo.list_caches()     # at collection time, with whatever this interpreter has installed

CHILD = """
import json, sys, traceback
sys.modules["triton"] = None          # `import triton` (or triton.language ...) now raises ImportError
report = {"import": None, "caches": None, "results": {}}
try:
    import kvzoo
    model, tok = kvzoo.load_model()
    report["caches"] = kvzoo.list_caches()
except Exception:
    report["import"] = traceback.format_exc()
else:
    for name in sys.argv[1:]:
        try:
            out = kvzoo.generate(model, tok, ["Hello"], max_new_tokens=4, cache=name)
            report["results"][name] = None if out.new_tokens > 0 else "no token generated"
        except Exception:
            report["results"][name] = traceback.format_exc()
print("REPORT " + json.dumps(report))
"""


def child_report() -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *STRATEGIES], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    lines = [line for line in out.stdout.splitlines() if line.startswith("REPORT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.fixture(scope="module")
def without_triton(default_model_dir, run_once):
    """The child's report: import and load errors, the strategies it registered, each strategy's error (or None)."""
    return run_once("without-triton", child_report)


def test_kvzoo_imports_and_lists_every_strategy_without_triton(without_triton):
    assert without_triton["import"] is None, without_triton["import"]
    assert without_triton["caches"] == STRATEGIES


@pytest.mark.parametrize("name", STRATEGIES)
def test_strategy_generates_without_triton(without_triton, name):
    assert without_triton["import"] is None, without_triton["import"]
    assert without_triton["results"][name] is None, without_triton["results"][name]
