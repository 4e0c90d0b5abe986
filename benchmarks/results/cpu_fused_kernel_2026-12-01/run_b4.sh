#!/usr/bin/env bash
# Batch 4 (bf16) after the batch-1 runs, without the untimed warm repeat (one prefill per configuration: the
# 8 untimed decode steps warm the kernels; the b1 runs' warm repeat doubled their prefill time).
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/cpu_fused_kernel_2026-12-01
for spec in "2048 4 bf16" "4096 4 bf16"; do
  set -- $spec
  ${KVTIER:-.venv/bin/kvtier} bench --model random:qwen2.5-0.5b --context "$1" --batch "$2" --dtype "$3" --device cpu \
    --policy full,tiered --hbm-ratio 0.3 --evict-ratio 0.03 --t1-attention host,stream --kernel auto,eager \
    --interleave --no-warm-repeat --new-tokens 32 --warmup-steps 8 --repeats 1 --json "$OUT/ctx$1_b$2_$3.json" > "$OUT/ctx$1_b$2_$3.txt" 2>&1
  echo "done $spec $(date)" >> "$OUT/progress.log"
done
