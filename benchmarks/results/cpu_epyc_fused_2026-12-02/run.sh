#!/usr/bin/env bash
# The fused CPU kernel (with VDPBF16PS dots for bf16) on an AMD EPYC with AVX512-BF16 and no AMX, 2 cores:
# full, tiered split (T1 host / stream) and tiered ordered beside stock SDPA + DynamicCache / StaticCache,
# interleaved, one run per (context, batch), in bf16: the faster dtype here at both batch sizes (one 896 x 4864
# linear with its weights streaming from DRAM, as in a model: 1 row fp32 1.45 ms vs bf16 1.12 ms; 4 rows fp32
# 3.37 ms vs bf16 0.75 ms). ctx512_b1_fp32.* is one earlier fp32 point (the kernel's float32 path), kept.
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec benchmarks/cpu_decode_matrix.sh benchmarks/results/cpu_epyc_fused_2026-12-02 bf16
