#!/usr/bin/env bash
# The GPU check. One script, about 8 minutes on one H200, nothing downloaded:
#   - the CUDA tests (pinned T1, side-stream staging, bit-exact tiered == full on the GPU; split attention with T1
#     streamed and attended on the host vs the ordered path);
#   - `kvtier bench` on random-weight Qwen2-7B shapes in bf16, contexts 4096 and 16384, batch 1 and 8: stock
#     DynamicCache / StaticCache, kvtier full, tiered at hbm 0.5 (evict 0.03) in every T1 mode (split: stream,
#     host, auto) and ordered; JSON and text written to $OUT (or benchmarks/results).
#   - `kvtier plan` for the same points (the floors the bench is compared with);
#   - `kvtier bench-serve` on random Qwen2.5-0.5B shapes, 1 and 8 clients, full vs tiered (about a minute), if the
#     device has the serve extra's packages (fastapi, uvicorn, prometheus-client, httpx); skipped otherwise.
#
# The device has torch 2.11 and transformers 5.17, inside kvtier's supported range (5.4 - 5.24, kvtier/compat.py):
# it runs with the device's own packages, carrying nothing. Device run: command "bash benchmarks/gpu_check.sh",
# timeout 540.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD"
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_transfer.py tests/attention/test_split_attention.py -k cuda
stamp="$(date -u +%Y-%m-%d)"
for ctx in 4096 16384; do
  python3 -m kvtier plan --model random:qwen2-7b --batch 8 --seq-len "$ctx" --hbm-ratio 0.5 --evict-ratio 0.03 \
    --hardware h200 | tee "$OUT/gpu_h200_plan_ctx${ctx}_${stamp}.txt"
  python3 -m kvtier bench --model random:qwen2-7b --context "$ctx" --new-tokens 128 --warmup-steps 8 --batch 1,8 \
    --policy full,tiered --hbm-ratio 0.5 --evict-ratio 0.03 --repeats 1 --no-warm-repeat --device cuda --dtype bf16 \
    --attention split,ordered --t1-attention stream,host,auto \
    --json "$OUT/gpu_h200_qwen2-7b_ctx${ctx}_${stamp}.json" | tee "$OUT/gpu_h200_qwen2-7b_ctx${ctx}_${stamp}.txt"
done
if python3 -c "import fastapi, uvicorn, prometheus_client, httpx" 2>/dev/null; then
  python3 -m kvtier bench-serve --model random:qwen2.5-0.5b --device cuda --dtype bf16 --concurrency 1,8 \
    --max-tokens 64 --requests-per-client 2 --max-batch 8 --json "$OUT/gpu_h200_serve_${stamp}.json"
else
  echo "bench-serve skipped: the serve extra (fastapi, uvicorn, prometheus-client, httpx) is not installed here"
fi
