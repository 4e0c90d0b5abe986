"""Per-layer decode attention: the fused CPU kernel vs SDPA over one contiguous cache (what ``full`` runs).

    python benchmarks/kernels/kernel_micro.py --batch 4 --context 4096 --dtype bf16 [--threads 2] [--reps 200]

Shapes are one layer of Qwen2.5-0.5B (2 kv-heads x 7 query heads, head dim 64). The kernel attends two regions
(T0: 30% of the context, T1: the rest, as ``tiered`` hbm 0.3 lays them out), timed both with the score update
(the merged weights added to a float64 accumulator, as every decode step does) and without it. Times are medians of interleaved repetitions
(each repetition runs every variant once, in rotated order), so the ratios are side by side on one machine state.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvtier.attention import fused_cpu


def layer_inputs(B: int, H: int, g: int, D: int, T: int, dt: torch.dtype):
    """One layer's decode inputs: q (B, H, g, D), the whole K/V (B, H, T, D) for SDPA, the kernel's two regions
    (T0: the first 30% of the context, T1: the rest; K, V, biases (B, 1, 1, C), positions (B, C)) and a float64
    score accumulator (B, T + 1). Seeded, so every script times the same numbers."""
    torch.manual_seed(0)
    k = torch.randn(B, H, T, D, dtype=dt)
    v = torch.randn(B, H, T, D, dtype=dt)
    q = torch.randn(B, H, g, D, dtype=dt)
    c0 = int(0.3 * T)
    regions_k = [k[:, :, :c0].contiguous(), k[:, :, c0:].contiguous()]
    regions_v = [v[:, :, :c0].contiguous(), v[:, :, c0:].contiguous()]
    biases = [torch.zeros(B, 1, 1, r.shape[2]) for r in regions_k]
    poss = [torch.arange(c0).expand(B, -1).contiguous(), torch.arange(c0, T).expand(B, -1).contiguous()]
    acc = torch.zeros(B, T + 1, dtype=torch.float64)
    return q, k, v, (regions_k, regions_v, biases, poss), acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--group", type=int, default=7)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    B, H, g, D, T = args.batch, args.kv_heads, args.group, args.head_dim, args.context
    q, k, v, (regions_k, regions_v, biases, poss), acc = layer_inputs(B, H, g, D, T, dt)
    scale = D ** -0.5

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, scale=scale)

    def fused_scores():
        fused_cpu.attend(q, regions_k, regions_v, biases, poss, [acc, acc], 1e-3, scale)

    def fused_plain():
        fused_cpu.attend(q, regions_k, regions_v, biases, poss, None, 1e-3, scale)

    variants = {"sdpa (full)": sdpa, "fused + scores": fused_scores, "fused, no scores": fused_plain}
    for f in variants.values():
        for _ in range(10):
            f()
    times = {name: [] for name in variants}
    order = list(variants.items())
    for rep in range(args.reps):
        # rotated each repetition: a variant run right after another over the same data finds it in cache
        for name, f in order[rep % len(order):] + order[: rep % len(order)]:
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["sdpa (full)"])
    print(f"B={B} T={T} H_kv={H} g={g} D={D} {args.dtype} threads={torch.get_num_threads()} reps={args.reps}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:18s} {med * 1e3:7.3f} ms   {med / base:5.2f}x sdpa")


if __name__ == "__main__":
    main()
