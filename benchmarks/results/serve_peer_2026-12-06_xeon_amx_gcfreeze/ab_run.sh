set -x
for i in 1 2; do
for side in A B; do
  dir=/tmp/peerA; [ $side = B ] && dir=/tmp/peer
  (cd $dir && KVTIER_LOG=debug PYTHONPATH=. .venv/bin/python benchmarks/serve_peer.py --out /work/campaign/abfreeze/$side --label r$i --clients 1,8 --per-client 2 --max-tokens 256 --dtype bfloat16 --kvtier-dtype bf16 --model-dir /root/.cache/kvtier/converted/qwen2.5-coder-0.5b-instruct-bfloat16 --vllm-python /work/vllm-venv/bin/python --data /work/shared/data --systems kvtier-full > /work/campaign/abfreeze/$side-r$i.log 2>&1)
done; done
