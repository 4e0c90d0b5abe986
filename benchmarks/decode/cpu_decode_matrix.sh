#!/usr/bin/env bash
# The CPU decode matrix: random:qwen2.5-0.5b, contexts 512-8192 x batch 1 and 4 in one dtype, full / tiered split
# (T1 host and stream) / tiered ordered beside stock SDPA + DynamicCache / StaticCache, interleaved, one
# `kvtier bench` per (context, batch), written to OUT as ctx<C>_b<B>_<dtype>.{json,txt} with a progress.log.
# Resumable: a point whose JSON exists is kept (a run that died leaves only its .part).
# usage: benchmarks/decode/cpu_decode_matrix.sh OUT [dtype] [caches]
# caches "tiered": only full and tiered split (T1 host and stream), no stock or ordered, 3 repeats (the #29 targets
# between the caches, re-measured; REPEATS sets another count). POINTS="4096x1 2048x4" picks (context x batch)
# points, in that order.
set -euo pipefail
OUT="$1"
DT="${2:-bf16}"
CACHES="${3:-all}"
case "$CACHES" in
  all) SYS=(--stock --attention split,ordered --repeats 1) ;;
  tiered) SYS=(--no-stock --attention split --repeats "${REPEATS:-3}") ;;
  *) echo "caches: all or tiered, got $CACHES" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
POINTS="${POINTS:-512x1 2048x1 4096x1 8192x1 512x4 2048x4 4096x4 8192x4}"
for point in $POINTS; do
  set -- ${point/x/ }
  [ -s "$OUT/ctx$1_b$2_$DT.json" ] && continue
  ${KVTIER:-.venv/bin/kvtier} bench --model random:qwen2.5-0.5b --context "$1" --batch "$2" --dtype "$DT" --device cpu \
    --policy full,tiered --hbm-ratio 0.3 --evict-ratio 0.03 "${SYS[@]}" --t1-attention host,stream \
    --interleave --no-warm-repeat --new-tokens 32 --warmup-steps 8 \
    --json "$OUT/ctx$1_b$2_$DT.json.part" > "$OUT/ctx$1_b$2_$DT.txt" 2>&1
  mv "$OUT/ctx$1_b$2_$DT.json.part" "$OUT/ctx$1_b$2_$DT.json"  # bench writes after every batch: only a whole run counts
  echo "done $1 $2 $DT $CACHES $(date -u +%FT%TZ)" >> "$OUT/progress.log"
done
