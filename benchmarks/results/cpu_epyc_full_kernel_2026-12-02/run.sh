#!/usr/bin/env bash
# kvtier `full` on the fused CPU kernel (one region, no score update; it beats this CPU's SDPA, see
# benchmarks/kernel_micro.py) and the kernel taking bf16 queries as they are: full, tiered split (T1 host / stream)
# and tiered ordered beside stock SDPA + DynamicCache / StaticCache, interleaved, one run per (context, batch), on an
# AMD EPYC with AVX512-BF16 and no AMX, 2 cores, in bf16 (the faster dtype here at both batch sizes, measured in
# ../cpu_epyc_fused_2026-12-02/run.sh). The same settings as that run, so the two tables compare.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec benchmarks/cpu_decode_matrix.sh benchmarks/results/cpu_epyc_full_kernel_2026-12-02 bf16
