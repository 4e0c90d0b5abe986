#!/usr/bin/env bash
# The CPU decode matrix on an Intel Xeon with AVX512-BF16 and AMX-BF16 (a KVM guest that gcc's -march=native
# takes for Rocket Lake), 2 cores, in bf16 (the faster dtype here: kvtier full 87.8 vs 87.8 ms a step at 2048 x 1,
# 92.8 vs 191.0 ms at 2048 x 4, fp32 vs bf16, measured before this run), with the fused kernel after its two fixes
# of this date (kernel_micro_*.txt beside this). `full` stays on SDPA here (bf16 on AMX, fused_cpu.sdpa_is_faster).
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec benchmarks/cpu_decode_matrix.sh benchmarks/results/cpu_xeon_amx_2026-12-02 bf16
