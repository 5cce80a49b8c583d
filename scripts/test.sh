#!/usr/bin/env bash
# Sets everything up, lints, and runs the whole test suite (on the CPU; Triton kernels run under
# TRITON_INTERPRET=1). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check tinyvllm tests benchmarks
.venv/bin/python -m pytest "$@"
