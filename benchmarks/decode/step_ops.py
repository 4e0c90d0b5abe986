"""kvtier's served decode step (the direct step over a RowsCache of one-row ``full`` caches, greedy pick included),
op by op with input shapes: the table to set beside vLLM-CPU's (benchmarks/decode/vllm_step_profile.sh) at the same rows.

    python benchmarks/decode/step_ops.py --rows 32 --context 100 --steps 20 --out DIR

`random:qwen2.5-0.5b` in bf16 (the embedded model's shapes), ``--rows`` caches prefilled with ``--context`` random
tokens, 4 warm-up steps, ``--steps`` steps timed plainly and then under torch.profiler (the fused kernel's calls and
RowsCache's per-layer Python labelled, as benchmarks/decode/step_profile.py labels them). Writes ``kvtier_ops.txt``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

import kvtier
from kvtier.attention import fused_cpu
from kvtier.step.direct import direct_step, rows_logits

sys.path.insert(0, str(Path(__file__).parent))
from step_profile import label_kernel_calls  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, _ = kvtier.load_model("random:qwen2.5-0.5b", device="cpu", dtype="bfloat16")
    step = direct_step(model)
    caches = [kvtier.make_cache("full", model) for _ in range(args.rows)]
    ids = torch.randint(10, 1000, (args.rows, args.context), generator=torch.Generator().manual_seed(0))
    last = rows_logits(model, step, caches, [ids[i].tolist() for i in range(args.rows)])
    nxt = [[int(t)] for t in fused_cpu.argmax_rows(last[0]).tolist()]

    def one() -> None:
        nonlocal nxt
        lg = rows_logits(model, step, caches, nxt)
        nxt = [[int(t)] for t in fused_cpu.argmax_rows(lg[0]).tolist()]

    for _ in range(4):
        one()
    t = time.perf_counter()
    for _ in range(args.steps):
        one()
    plain = (time.perf_counter() - t) / args.steps
    label_kernel_calls()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        t = time.perf_counter()
        for _ in range(args.steps):
            one()
        profiled = (time.perf_counter() - t) / args.steps
    head = (f"kvtier direct step, {args.rows} rows x {args.context}+ tokens, random:qwen2.5-0.5b bf16, torch "
            f"{torch.__version__}: {1e3 * plain:.1f} ms a step plain, {1e3 * profiled:.1f} profiled; "
            f"{args.steps} profiled steps below\n")
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=45,
                                                                max_name_column_width=40, max_shapes_column_width=60)
    (args.out / "kvtier_ops.txt").write_text(head + table)
    (args.out / "lscpu_kvtier.txt").write_text(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    print(head + table)


if __name__ == "__main__":
    main()
