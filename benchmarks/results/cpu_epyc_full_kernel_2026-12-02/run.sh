#!/usr/bin/env bash
# kvtier `full` on the fused CPU kernel (one region, no score update; it beats this CPU's SDPA, see
# benchmarks/kernel_micro.py) and the kernel taking bf16 queries as they are: full, tiered split (T1 host / stream)
# and tiered ordered beside stock SDPA + DynamicCache / StaticCache, interleaved, one run per (context, batch), on an
# AMD EPYC with AVX512-BF16 and no AMX, 2 cores, in bf16 (the faster dtype here at both batch sizes, measured in
# ../cpu_epyc_fused_2026-12-02/run.sh). The same settings as that run, so the two tables compare.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/cpu_epyc_full_kernel_2026-12-02
for spec in "512 1 bf16" "2048 1 bf16" "4096 1 bf16" "8192 1 bf16" "512 4 bf16" "2048 4 bf16" "4096 4 bf16" "8192 4 bf16"; do
  set -- $spec
  [ -s "$OUT/ctx$1_b$2_$3.json" ] && continue  # resumable: a finished point is kept
  ${KVTIER:-.venv/bin/kvtier} bench --model random:qwen2.5-0.5b --context "$1" --batch "$2" --dtype "$3" --device cpu \
    --policy full,tiered --hbm-ratio 0.3 --evict-ratio 0.03 --attention split,ordered --t1-attention host,stream \
    --interleave --no-warm-repeat --new-tokens 32 --warmup-steps 8 --repeats 1 \
    --json "$OUT/ctx$1_b$2_$3.json" > "$OUT/ctx$1_b$2_$3.txt" 2>&1
  echo "done $spec $(date -u +%FT%TZ)" >> "$OUT/progress.log"
done
