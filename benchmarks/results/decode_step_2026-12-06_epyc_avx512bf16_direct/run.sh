set -x
cd /tmp/peer
lscpu > /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/lscpu.txt
.venv/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" > /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/versions.txt
/work/vllm-venv/bin/python -c "import vllm; print('vllm', vllm.__version__)" >> /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/versions.txt 2>/dev/null
git rev-parse HEAD >> /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/versions.txt
KVTIER_LOG=debug PYTHONPATH=. .venv/bin/python benchmarks/serve_peer.py --out /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/serve --label run1 --clients 1,8,32 --per-client 2 --max-tokens 256 --dtype bfloat16 --kvtier-dtype bf16 --model-dir $HOME/.cache/kvtier/converted/qwen2.5-coder-0.5b-instruct-bfloat16 --vllm-python /work/vllm-venv/bin/python --data /work/shared/data --systems vllm,kvtier-full > /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/serve.log 2>&1
PYTHONPATH=. .venv/bin/python benchmarks/serve_peer_ratios.py /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/serve > /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/serve/ratios.md 2>&1
PYTHONPATH=. .venv/bin/python -m kvtier bench --dtype bf16 --policy full --batch 1,8,32 --context 512 --new-tokens 32 --warmup-steps 8 --repeats 2 --linear eager,auto --json /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/bench_ctx512.json.part > /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/bench_ctx512.txt 2>&1 && mv /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/bench_ctx512.json.part /tmp/peer/benchmarks/results/decode_step_2026-12-06_epyc_avx512bf16_direct/bench_ctx512.json
echo finished
