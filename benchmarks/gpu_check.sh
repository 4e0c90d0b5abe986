#!/usr/bin/env bash
# The GPU check (issue: systems). One script, under 8 minutes on one H200, nothing downloaded:
#   - the CUDA tests (pinned T1, side-stream staging, bit-exact tiered == full on the GPU);
#   - `kvtier bench` on random-weight Qwen2-7B shapes in bf16, 4K context, batch 1 and 8,
#     full vs tiered at hbm 0.3 / 0.5 / 0.7 (evict 0.03), JSON written to $OUT (or benchmarks/results).
#
# The device has torch 2.11 and transformers 5.17; kvtier pins transformers 5.24, whose needs the device already
# meets (huggingface-hub 1.33, tokenizers 0.23.2, safetensors 0.8, typer, rich, pytest are there). Carry one wheel:
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl transformers==5.24.0   (.whl/ is git-ignored)
# then: device run, carry [".whl"], command "bash benchmarks/gpu_check.sh", timeout 540.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
python3 -m pytest -q -p no:cacheprovider tests/test_systems.py -k cuda
stamp="$(date -u +%Y-%m-%d)"
python3 -m kvtier bench --model random:qwen2-7b --context 4096 --new-tokens 256 --batch 1,8 \
  --policy full,tiered --hbm-ratio 0.3,0.5,0.7 --evict-ratio 0.03 --repeats 2 --device cuda --dtype bf16 \
  --json "$OUT/gpu_h200_qwen2-7b_${stamp}.json" | tee "$OUT/gpu_h200_qwen2-7b_${stamp}.txt"
