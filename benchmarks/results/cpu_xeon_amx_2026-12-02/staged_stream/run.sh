#!/usr/bin/env bash
# The same matrix as ../run.sh after the fused kernel began staging a streamed T1 block by block (bd67cae): each
# (row, kv-head) block of K, then of V, copied into a per-thread buffer just before it is read, instead of the
# layer's whole T1 copied into a staging slot first. Same machine kind (lscpu model 167), a later session.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
exec benchmarks/cpu_decode_matrix.sh benchmarks/results/cpu_xeon_amx_2026-12-02/staged_stream bf16
