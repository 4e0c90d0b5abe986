#!/usr/bin/env bash
# The GSM8K baseline comparison on the embedded model (CPU): the hierarchy at 10% eviction, every baseline at equal
# device memory with tiered hbm 0.3 (the paper's comparison, first), then everything at equal eviction (50%).
# Resumable: rerun to continue (a configuration already recorded is skipped, whichever file named it).
# Usage: benchmarks/sweeps/gsm8k_cpu_baselines.sh [OUT] [DATA_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/gsm8k_cpu_baselines_2026-12-01}
DATA=${2:-../shared/data}
KV=${KVTIER:-.venv/bin/kvtier}  # a command, split on spaces (e.g. "python -m kvtier")
mkdir -p "$OUT"
cp benchmarks/sweeps/gsm8k_cpu_baselines_tiered.json "$OUT/config_tiered.json"
cp benchmarks/sweeps/gsm8k_cpu_baselines_memory.json "$OUT/config_memory.json"
cp benchmarks/sweeps/gsm8k_cpu_baselines.json "$OUT/config.json"
$KV sweep --config benchmarks/sweeps/gsm8k_cpu_baselines_tiered.json --data-dir "$DATA" --batch-size 8 --out "$OUT"
$KV sweep --config benchmarks/sweeps/gsm8k_cpu_baselines_memory.json --data-dir "$DATA" --batch-size 8 --out "$OUT"
$KV sweep --config benchmarks/sweeps/gsm8k_cpu_baselines.json --data-dir "$DATA" --batch-size 8 --out "$OUT"
