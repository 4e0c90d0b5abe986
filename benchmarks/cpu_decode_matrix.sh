#!/usr/bin/env bash
# The CPU decode matrix: random:qwen2.5-0.5b, contexts 512-8192 x batch 1 and 4 in one dtype, full / tiered split
# (T1 host and stream) / tiered ordered beside stock SDPA + DynamicCache / StaticCache, interleaved, one
# `kvtier bench` per (context, batch), written to OUT as ctx<C>_b<B>_<dtype>.{json,txt} with a progress.log.
# Resumable: a point whose JSON exists is kept.   usage: benchmarks/cpu_decode_matrix.sh OUT [dtype]
set -euo pipefail
OUT="$1"
DT="${2:-bf16}"
cd "$(dirname "$0")/.."
for spec in "512 1" "2048 1" "4096 1" "8192 1" "512 4" "2048 4" "4096 4" "8192 4"; do
  set -- $spec
  [ -s "$OUT/ctx$1_b$2_$DT.json" ] && continue
  ${KVTIER:-.venv/bin/kvtier} bench --model random:qwen2.5-0.5b --context "$1" --batch "$2" --dtype "$DT" --device cpu \
    --policy full,tiered --hbm-ratio 0.3 --evict-ratio 0.03 --attention split,ordered --t1-attention host,stream \
    --interleave --no-warm-repeat --new-tokens 32 --warmup-steps 8 --repeats 1 \
    --json "$OUT/ctx$1_b$2_$DT.json" > "$OUT/ctx$1_b$2_$DT.txt" 2>&1
  echo "done $spec $DT $(date -u +%FT%TZ)" >> "$OUT/progress.log"
done
