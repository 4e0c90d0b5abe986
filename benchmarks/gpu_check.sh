#!/usr/bin/env bash
# The GPU check: one short run (<= 6 minutes on an H200, nothing downloaded, the device's own torch and
# transformers), results under $OUT in the order of importance -- the CUDA tests, one decode bench point per T1 mode
# at 4K and 16K, one memory-pressure serving point -- each step under its own time limit, so a run cut short still
# returns the first results. benchmarks/gpu_check.py does the work (its docstring lists the steps).
#
#   benchmarks/gpu_check.sh --dry-run     # any machine: what it would run, and each step's time budget
#   benchmarks/gpu_check.sh --smoke       # any CPU: the same steps on tiny models (a test of the script)
#   device run: command "bash benchmarks/gpu_check.sh", timeout_s 420 (one rerun fits in 15 device minutes only
#   if the first run is cut short early; give the machine back after it)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
