#!/usr/bin/env bash
# The CUDA path, checked where a GPU is available (CI has none):
#   1. the tests marked `cuda` (kernels, random masks and trim thresholds on the
#      GPU against the CPU, and engine merges with --device cuda);
#   2. every operator merged on the CPU and on the GPU from the same plan:
#      output files must be bit-identical for the streaming operators and
#      close for slerp/model_stock (their float64 reductions may round differently).
# Usage: bash scripts/gpu-check.sh [WORKDIR]   (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-.venv/bin/python}"
"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu-check: no CUDA device (torch.cuda.is_available() is False)")'
"$py" -m pytest -q -p no:cacheprovider -m cuda tests
"$py" -m scripts.gpu_check "${1:-gpu-check-out}"
