"""serve's rows step attention (``fused_decode_rows``) at a git revision vs the working tree, cold, side by side.

    python benchmarks/kernels/kernel_rows_ab.py --base HEAD~1 [--rows 32] [--context 512] [--capacity 768] [--layers 24] [--amx-off]

Every layer of Qwen2.5-0.5B's shapes (2 kv-heads x 7 query heads, head dim 64) gets its own ``--rows`` one-row
``full`` caches of ``--context`` bf16 tokens (24 layers x 32 rows x 512 tokens: 201 MB, more than the caches hold,
as in a real step; ``--capacity``: each buffer's columns, the ones past the context closed (-inf), as a cache's
buffer grows by 256-column granules), and one repetition calls the kernel once per layer, alternating base and working tree. Prints
medians, the KV read rate and the largest output difference; ``--amx-off`` adds the working tree with its AMX
logits switched off (the prefetch alone). Built as kvtier builds its kernel (``kernel_ab.build``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from kernel_ab import base_source, build  # this folder is on sys.path when run as a script

from kvtier.kernels.build import DECODE_SRC


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--capacity", type=int, default=0, help="buffer columns (>= context; 0: the context)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--amx-off", action="store_true")
    a = ap.parse_args()
    R, T, L, H, g, D = a.rows, a.context, a.layers, 2, 7, 64
    C = max(a.capacity, T)
    if a.capacity and a.capacity < T:
        raise SystemExit(f"--capacity must be >= --context ({T}), got {a.capacity}")
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(L):
        rows = []
        for _ in range(R):
            k = torch.randn(1, H, C, D, generator=gen).to(torch.bfloat16)
            v = torch.randn(1, H, C, D, generator=gen).to(torch.bfloat16)
            bias = torch.zeros(1, 1, 1, C)
            bias[..., T:] = float("-inf")  # closed columns: the buffer's room to grow
            rows.append(([k], [v], [bias], [torch.arange(C).clamp(max=T).view(1, C)], [], 1.0))
        layers.append([list(x) for x in zip(*rows)])
    q = torch.randn(R, H, g, D, generator=gen).to(torch.bfloat16)
    kv_bytes = L * R * 2 * H * T * D * 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base_src = base_source(a.base, root)
        mods = {"base": build("rows_base", base_src, root), "new": build("rows_new", DECODE_SRC, root)}
        variants = [("base", mods["base"], True), ("new", mods["new"], True)]
        if a.amx_off:
            variants.append(("new, AMX off", mods["new"], False))
        times: dict[str, list[float]] = {n: [] for n, _, _ in variants}
        outs = {}
        for rep in range(a.reps + 2):
            for name, mod, amx in variants:
                if hasattr(mod, "set_amx"):
                    mod.set_amx(amx)
                t = time.perf_counter()
                for ks, vs, bs, ps, sc, ss in layers:
                    o = mod.fused_decode_rows(q, ks, vs, bs, ps, sc, ss, 0.125)
                if rep >= 2:
                    times[name].append(time.perf_counter() - t)
                outs[name] = o
            if hasattr(mods["new"], "set_amx"):
                mods["new"].set_amx(True)
    print(f"base {a.base} vs working tree: {R} rows x {T} tokens (buffers of {C} columns) x {L} layers, bf16, "
          f"{kv_bytes / 1e6:.0f} MB of K/V, threads {torch.get_num_threads()}")
    base = statistics.median(times["base"])
    for name, ts in times.items():
        m = statistics.median(ts)
        diff = (outs[name].float() - outs["base"].float()).abs().max().item()
        print(f"  {name:14s} {m * 1e3:6.1f} ms  {kv_bytes / m / 1e9:5.1f} GB/s  vs base {m / base:.2f}  "
              f"max|diff| {diff:.1e}")


if __name__ == "__main__":
    main()
