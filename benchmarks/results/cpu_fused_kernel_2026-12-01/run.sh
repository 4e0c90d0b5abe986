#!/usr/bin/env bash
# The fused CPU kernel vs the eager split step vs full and stock, interleaved, one run per (context, batch, dtype).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/cpu_fused_kernel_2026-12-01
for spec in "512 1 fp32" "2048 1 fp32" "4096 1 fp32" "8192 1 fp32"; do  # batch 4: run_b4.sh
  set -- $spec
  ${KVTIER:-.venv/bin/kvtier} bench --model random:qwen2.5-0.5b --context "$1" --batch "$2" --dtype "$3" --device cpu \
    --policy full,tiered --hbm-ratio 0.3 --evict-ratio 0.03 --t1-attention host,stream --kernel auto,eager \
    --interleave --new-tokens 32 --warmup-steps 8 --repeats 1 --json "$OUT/ctx$1_b$2_$3.json" > "$OUT/ctx$1_b$2_$3.txt" 2>&1
  echo "done $spec $(date)" >> "$OUT/progress.log"
done
