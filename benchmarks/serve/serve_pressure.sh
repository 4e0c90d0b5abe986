#!/usr/bin/env bash
# Serving under memory pressure (#28, benchmark 2): one device-KV budget that holds about ROWS `full` rows of the
# trace at their peak, CLIENTS closed-loop clients, every request decoding MAX_TOKENS tokens (ignore_eos, which
# both servers honour, so every system does the same work); one server at a time, resumable (rows.jsonl).
#
#   benchmarks/serve/serve_pressure.sh benchmarks/results/serve_pressure_<date>_<cpu> [/path/to/vllm-venv/bin/python]
#
# Systems at the same budget: vLLM-CPU (--num-gpu-blocks-override: the budget in its 128-token blocks; the field's
# policy, preempt and recompute), kvtier static (admits by count: --max-batch = ROWS), continuous queue (admit at
# peak only), recompute (preempt the newest), demote (the default; `full` requests, then tiered ones without
# eviction, evict_ratio 0: both exact).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: benchmarks/serve/serve_pressure.sh OUT_DIR [VLLM_PYTHON]}
VLLM_PY=${2:-/work/vllm-venv/bin/python}
ROWS=${ROWS:-8}
CLIENTS=${CLIENTS:-32}
MAX_TOKENS=${MAX_TOKENS:-1024}
PROMPT=${PROMPT:-200}                # tokens budgeted for a prompt (the chat-templated GSM8K questions: ~90-200)
MODEL=qwen2.5-coder-0.5b-instruct
CONVERTED=${KVTIER_CACHE:-$HOME/.cache/kvtier}/converted/$MODEL-bfloat16
mkdir -p "$OUT"
lscpu > "$OUT/lscpu.txt"
.venv/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" > "$OUT/versions.txt"
"$VLLM_PY" -c "import vllm; print('vllm', vllm.__version__)" >> "$OUT/versions.txt" 2>/dev/null || echo "vllm: not found" >> "$OUT/versions.txt"

# The budget, from kvtier's own arithmetic (a full row's device columns at its peak, the embedded model's bytes a
# token: 24 layers x 2 kv-heads x 64 x K,V x bf16 = 12288), and the same bytes in vLLM's blocks
read -r BUDGET BLOCKS < <(.venv/bin/python - "$ROWS" "$PROMPT" "$MAX_TOKENS" <<'EOF'
import sys
from kvtier.cache.state import full_columns
rows, prompt, new = (int(x) for x in sys.argv[1:])
col = 24 * 2 * 64 * 2 * 2
budget = rows * full_columns(prompt + new) * col
print(budget, budget // (128 * col))
EOF
)
echo "budget $BUDGET bytes ($ROWS full rows of $PROMPT + $MAX_TOKENS tokens); vLLM: $BLOCKS blocks of 128 tokens" \
    | tee "$OUT/budget.txt"

PEER=(.venv/bin/python benchmarks/serve/serve_peer.py --out "$OUT" --vllm-python "$VLLM_PY" --clients "$CLIENTS"
      --per-client 1 --max-tokens "$MAX_TOKENS" --ignore-eos --dtype bfloat16 --kvtier-dtype bf16
      --model-dir "$CONVERTED" --max-batch "$CLIENTS" --static-max-batch "$ROWS" --device-kv-budget "$BUDGET"
      --vllm-blocks "$BLOCKS" --hbm-ratio 0.3 --evict-ratio 0)
"${PEER[@]}" --systems vllm,kvtier-full:continuous:demote,kvtier-tiered:continuous:demote,kvtier-full:continuous:recompute,kvtier-full:continuous:queue,kvtier-full:static
cat "$OUT/table.md"
