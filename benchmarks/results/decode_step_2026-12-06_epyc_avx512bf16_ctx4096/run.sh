# #29 benchmark 1 at 4096 tokens, one process at a time, from a clone of the commit in versions.txt (.venv linked)
set -x
OUT=${OUT:?}
CONVERTED=~/.cache/kvtier/converted/qwen2.5-coder-0.5b-instruct-bfloat16
lscpu > $OUT/lscpu.txt
{ .venv/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  /work/vllm-venv/bin/python -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null
  echo "kvtier $(git rev-parse --short HEAD)"; } > $OUT/versions.txt
# 1. served side by side: every prompt ~3.8K tokens (its own worked GSM8K examples, then the question), 256 new tokens
KVTIER_LOG=debug PYTHONPATH=. .venv/bin/python benchmarks/serve_peer.py --out $OUT/serve --label ctx4096 \
  --clients 1,8,32 --per-client 1 --max-tokens 256 --prompt-tokens 3800 --dtype bfloat16 --kvtier-dtype bf16 \
  --model-dir $CONVERTED --vllm-python /work/vllm-venv/bin/python --data /work/shared/data --systems vllm,kvtier-full
PYTHONPATH=. .venv/bin/python benchmarks/serve_peer_ratios.py $OUT/serve > $OUT/serve/ratios.md
# 2. kvtier bench, full, the default step (direct step, default linears) at 4096 tokens
[ -s $OUT/bench_ctx4096.json ] || { PYTHONPATH=. .venv/bin/python -m kvtier bench --dtype bf16 --policy full \
  --batch 1,8,32 --context 4096 --new-tokens 32 --warmup-steps 8 --repeats 1 --no-stock --linear auto \
  --json $OUT/bench_ctx4096.json.part > $OUT/bench_ctx4096.txt 2>&1 && mv $OUT/bench_ctx4096.json.part $OUT/bench_ctx4096.json; }
