"""Load an entry point of scripts/ as a module, the way `python scripts/<name>.py` runs it: scripts/ first on the
module search path while it imports, so that its sibling helper scripts/timing.py imports as `timing`."""

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parents[2] / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module
