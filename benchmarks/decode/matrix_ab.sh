#!/usr/bin/env bash
# A/B of a change through the CPU decode matrix: the same points measured at a base revision and at the working
# tree, alternating (base, new, new, base, ...) so that a drift of the machine's pace falls on both sides alike.
# usage: benchmarks/decode/matrix_ab.sh BASE OUT [rounds]   (POINTS, as in cpu_decode_matrix.sh; default "4096x1")
# Each run is `cpu_decode_matrix.sh DIR bf16 tiered` (full and tiered split, T1 host and stream, 3 repeats) into
# OUT/<round>_<base|new>/; the base runs from a clone of BASE (its own kernel build: the build name hashes the source).
set -euo pipefail
BASE="$1"
OUT="$(realpath -m "$2")"
ROUNDS="${3:-2}"
cd "$(dirname "$0")/../.."
ROOT="$PWD"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT  # the base's clone goes whether the runs finish or fail
SRC="$TMP/base"
git clone -q "$ROOT" "$SRC"
git -C "$SRC" checkout -q "$BASE"
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
{ echo "base $(git -C "$SRC" rev-parse --short HEAD), new $(git rev-parse --short HEAD)$(git diff --quiet || echo ' + working tree')"
  PYTHONPATH="$ROOT" "$PY" -c "from kvtier.kernels.cpu import machine; print(machine())"; } > "$OUT/conditions.txt"
run() {  # run TAG TREE
  mkdir -p "$OUT/$1"
  KVTIER="env PYTHONPATH=$2 $PY -m kvtier" bash "$ROOT/benchmarks/cpu_decode_matrix.sh" "$OUT/$1" bf16 tiered
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="base new"; else order="new base"; fi
  for side in $order; do
    if [ "$side" = base ]; then run "${r}_base" "$SRC"; else run "${r}_new" "$ROOT"; fi
  done
done
