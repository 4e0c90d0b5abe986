"""GFLOP/s of one bf16 linear at M rows, for the 0.5B model's projection shapes: stock F.linear vs oneDNN prepacked.

Why: a serving step's matmuls see M = the rows decoding plus the prompt tokens joining; how fast they run at each M
decides how many prompt tokens a step should take (``kvtier serve --prefill-tokens``) and at which row counts the
prepacked weights pay (:mod:`kvtier.step.linear`).

    python benchmarks/probes/gemm_rows.py --rows 1,8,32,256,512,1024,2048 > benchmarks/results/<folder>/gemm_rows.txt

Each cell: best of ``--repeat`` timed calls after one warm-up; ``packed`` is the weight reordered once with the row
hint kvtier uses (32), ``packed@M`` with the hint M. Run alone on the machine (two processes share 2 cores badly).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

SHAPES = ((896, 9728), (4864, 896), (896, 1152), (896, 896))  # (in, out): gate+up, down, q+k+v, o of Qwen2.5-0.5B


def best(f, repeat: int) -> float:
    f()
    t = float("inf")
    for _ in range(repeat):
        s = time.perf_counter()
        f()
        t = min(t, time.perf_counter() - s)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,256,512,1024,2048")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print("| rows | " + " | ".join(f"{k}x{n}: stock / packed / packed@M" for k, n in SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for m in [int(x) for x in args.rows.split(",")]:
        cells = []
        for k, n in SHAPES:
            w = torch.randn(n, k, dtype=torch.bfloat16)
            x = torch.randn(m, k, dtype=torch.bfloat16)
            p32 = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            pm = torch.ops.mkldnn._reorder_linear_weight(w, m)
            flops = 2 * m * k * n
            times = (best(lambda: F.linear(x, w), args.repeat),
                     best(lambda: torch.ops.mkldnn._linear_pointwise(x, p32, None, "none", [], ""), args.repeat),
                     best(lambda: torch.ops.mkldnn._linear_pointwise(x, pm, None, "none", [], ""), args.repeat))
            cells.append(" / ".join(f"{flops / t / 1e9:.0f}" for t in times))
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
