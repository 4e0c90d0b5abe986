#!/usr/bin/env bash
# The GSM8K baseline comparison on the embedded model (CPU): the hierarchy at 10% eviction, then every baseline
# at equal eviction (50%) and at equal device memory with tiered hbm 0.3. Resumable: rerun to continue.
# Usage: benchmarks/sweeps/gsm8k_cpu_baselines.sh [OUT] [DATA_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/gsm8k_cpu_baselines_2026-12-01}
DATA=${2:-../shared/data}
KV=${KVTIER:-.venv/bin/kvtier}  # a command, split on spaces (e.g. "python -m kvtier")
mkdir -p "$OUT"
cp benchmarks/sweeps/gsm8k_cpu_baselines_tiered.json "$OUT/config_tiered.json"
cp benchmarks/sweeps/gsm8k_cpu_baselines.json "$OUT/config.json"
$KV sweep --config benchmarks/sweeps/gsm8k_cpu_baselines_tiered.json --data-dir "$DATA" --batch-size 8 --out "$OUT"
$KV sweep --config benchmarks/sweeps/gsm8k_cpu_baselines.json --data-dir "$DATA" --batch-size 8 --out "$OUT"
