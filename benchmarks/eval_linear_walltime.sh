#!/usr/bin/env bash
# One 200-problem GSM8K configuration of the claims campaign, before/after the prepacked linears (#29 benchmark 3):
# `kvtier eval` with KVTIER_LINEAR=eager (stock F.linear) and =auto (the default), one process at a time, each into
# its own run folder; then benchmarks/eval_walltime.py writes the wall times, accuracy and identical completions.
# Resumable: a finished run is kept (kvtier eval resumes its records.jsonl).
#
#   benchmarks/eval_linear_walltime.sh benchmarks/results/eval_linear_<date>_<cpu>
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: benchmarks/eval_linear_walltime.sh OUT_DIR}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    > "$OUT/versions.txt"
# the campaign's pair for evict 0.5 at window 32 (benchmarks/sweeps/paper_cpu_v2.json): tiered holding half on the device
ARGS=(--model qwen2.5-coder-0.5b-instruct --benchmark gsm8k --limit 200 --data-dir ../shared/data --device cpu
      --dtype bf16 --batch-size 40 --max-new-tokens 512 --policy tiered --hbm-ratio 0.5 --evict-ratio 0.03
      --param recent_window=32)
for mode in eager auto; do
  if [ ! -s "$OUT/$mode/seconds.txt" ]; then
    start=$(date +%s.%N)
    KVTIER_LINEAR=$mode $PY -m kvtier eval "${ARGS[@]}" --out "$OUT/$mode" > "$OUT/$mode.log" 2>&1
    end=$(date +%s.%N)
    echo "$start $end" > "$OUT/$mode/seconds.txt"
  fi
done
$PY benchmarks/eval_walltime.py "$OUT" eager auto | tee "$OUT/summary.md"
