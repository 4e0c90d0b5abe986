#!/usr/bin/env bash
# The same matrix as ../run.sh, rerun with the final kernel of this date (the 16-key logits added, 95b081c), on
# the same machine in the same session: a second sample of every ratio.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
exec benchmarks/cpu_decode_matrix.sh benchmarks/results/cpu_xeon_amx_2026-12-02/final_kernel bf16
