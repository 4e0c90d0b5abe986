#!/usr/bin/env bash
# One 200-problem GSM8K configuration of the claims campaign, run once per value of one environment switch (#29
# benchmark 3: before/after a change to the decode step), e.g. KVTIER_LINEAR=eager then auto, or KVTIER_DIRECT=0
# then 1: `kvtier eval` one process at a time, each into its own run folder OUT/<value>; then
# benchmarks/eval/eval_walltime.py writes the wall times, accuracy and how many completions equal the first run's.
# Resumable: a finished run is kept (kvtier eval resumes its records.jsonl). DATA: the benchmark data folder.
#
#   benchmarks/eval/eval_switch_walltime.sh OUT_DIR VARIABLE VALUE [VALUE ...]
#   benchmarks/eval/eval_switch_walltime.sh benchmarks/results/eval_linear_<date>_<cpu> KVTIER_LINEAR eager auto
#   benchmarks/eval/eval_switch_walltime.sh benchmarks/results/eval_direct_<date>_<cpu> KVTIER_DIRECT 0 1
set -euo pipefail
cd "$(dirname "$0")/../.."
USAGE="usage: benchmarks/eval/eval_switch_walltime.sh OUT_DIR VARIABLE VALUE [VALUE ...]"
OUT=${1:?$USAGE}
VAR=${2:?$USAGE}
shift 2
[ $# -ge 1 ] || { echo "$USAGE" >&2; exit 2; }
case "$VAR" in KVTIER_*) ;; *) echo "VARIABLE must be a KVTIER_ switch, got $VAR" >&2; exit 2 ;; esac
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
{ $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "kvtier $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (+ uncommitted changes)')"; } > "$OUT/versions.txt"
# the campaign's pair for evict 0.5 at window 32 (benchmarks/sweeps/paper_cpu_v2.json): tiered holding half on the device
ARGS=(--model qwen2.5-coder-0.5b-instruct --benchmark gsm8k --limit 200 --data-dir "${DATA:-../shared/data}" --device cpu
      --dtype bf16 --batch-size 40 --max-new-tokens 512 --policy tiered --hbm-ratio 0.5 --evict-ratio 0.03
      --param recent_window=32)
for value in "$@"; do
  if [ ! -s "$OUT/$value/seconds.txt" ]; then
    start=$(date +%s.%N)
    env "$VAR=$value" $PY -m kvtier eval "${ARGS[@]}" --out "$OUT/$value" > "$OUT/$value.log" 2>&1
    end=$(date +%s.%N)
    echo "$start $end" > "$OUT/$value/seconds.txt"
  fi
done
$PY benchmarks/eval/eval_walltime.py "$OUT" "$@" | tee "$OUT/summary.md"
