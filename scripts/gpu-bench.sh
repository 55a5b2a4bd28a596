#!/usr/bin/env bash
# Issue 14's GPU row: the standard suite's TIES K = 4 merge (Qwen3-0.6B layout,
# 100% and 10% budgets) with `--device cpu` and `--device cuda` side by side in
# one run, each with a cold page cache, beside the naive full-read merge.
# Generates the workload first when it is not there.
# Usage: bash scripts/gpu-bench.sh [RESULTS_DIR [SUITE OPTIONS...]]   (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py="${PYTHON:-.venv/bin/python}"
"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu-bench: no CUDA device (torch.cuda.is_available() is False)")'
"$py" -m benchmarks.suite --only ties:4 --systems naive,mergepipe --budgets 100%,10% --devices cpu,cuda \
    --results "${1:-benchmarks/results}" "${@:2}"
