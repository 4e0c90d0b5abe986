"""Packed prefill GEMMs whole against in pieces (kvtier.step.linear.CHUNK_ROWS): the per-row cost by row count, and a
packed prefill of several prompts both ways, alternating, with its logits compared.

    python benchmarks/probes/prefill_chunks.py --out benchmarks/results/prefill_chunks_<date>/

Part 1: for the 0.5B model's four projection shapes (packed bf16 weights, random values), microseconds per row of
one oneDNN call at row counts from 256 to 1500 (warm: the same input repeated). Part 2: a packed prefill of seven
prompts (738 tokens, `random:qwen2.5-0.5b`, bf16, the direct step) with the pieces switched off (``whole``, every
product one call) and on (the library's default), alternating for ``--reps`` rounds; the logits of both are
compared bit for bit. Writes ``prefill_chunks.json`` and ``prefill_chunks.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvtier
from kvtier.step import linear as lin_mod
from kvtier.step.direct import direct_step, rows_logits

SHAPES = {"down (896 x 4864)": (896, 4864), "gate/up (9728 x 896)": (9728, 896), "q/k/v (1152 x 896)": (1152, 896),
          "o (896 x 896)": (896, 896)}
ROWS = (256, 384, 512, 640, 736, 738, 768, 1024, 1280, 1500, 2048)
PROMPTS = (105, 98, 112, 101, 95, 120, 107)


def _ms(f, n: int) -> float:
    for _ in range(2):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def per_row() -> dict:
    out = {}
    for name, (o, i) in SHAPES.items():
        p = torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i).bfloat16(), lin_mod.PACK_ROWS_HINT)
        out[name] = {}
        for m in ROWS:
            x = torch.randn(1, m, i).bfloat16()
            out[name][m] = 1e3 * _ms(lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), 5) / m
    return out


def timed_prefill(model, step, seqs: list[list[int]]) -> tuple[float, torch.Tensor]:
    """A packed prefill of ``seqs`` into fresh one-row ``full`` caches through ``step``, once to warm and once timed:
    (ms of the timed one, its logits). The A/B scripts alternate their variants over this."""
    for warm in (True, False):
        caches = [kvtier.make_cache("full", model) for _ in seqs]
        t = time.perf_counter()
        lg = rows_logits(model, step, caches, seqs)
    return 1e3 * (time.perf_counter() - t), lg


def prefill(reps: int) -> dict:
    model, _ = kvtier.load_model("random:qwen2.5-0.5b", device="cpu", dtype="bfloat16")
    step = direct_step(model)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in PROMPTS]
    default = lin_mod.CHUNK_MIN_ROWS
    times, logits = {"whole": [], "pieces": []}, {}
    for _ in range(reps):
        for how in ("whole", "pieces"):
            lin_mod.CHUNK_MIN_ROWS = 1 << 60 if how == "whole" else default
            ms, logits[how] = timed_prefill(model, step, seqs)
            times[how].append(ms)
    lin_mod.CHUNK_MIN_ROWS = default
    return {"tokens": sum(PROMPTS), "ms": times, "median_ms": {k: statistics.median(v) for k, v in times.items()},
            "logits_equal": bool(torch.equal(logits["whole"], logits["pieces"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    (args.out / "lscpu.txt").write_text(cpu)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "chunk_rows": lin_mod.CHUNK_ROWS,
           "chunk_min_rows": lin_mod.CHUNK_MIN_ROWS, "chunk_max_rows": lin_mod.CHUNK_MAX_ROWS,
           "chunk_max_out": lin_mod.CHUNK_MAX_OUT,
           "us_per_row": per_row(), "prefill": prefill(args.reps)}
    (args.out / "prefill_chunks.json").write_text(json.dumps(res, indent=1))
    lines = ["| weight | " + " | ".join(str(m) for m in ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for name, row in res["us_per_row"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[m]:.1f}" for m in ROWS) + " |")
    pf = res["prefill"]
    lines += ["", f"us per row of one packed bf16 call, by row count. Packed prefill of {pf['tokens']} tokens "
              f"(7 prompts), ms, alternating: whole {[round(x) for x in pf['ms']['whole']]} (median "
              f"{pf['median_ms']['whole']:.0f}); in pieces {[round(x) for x in pf['ms']['pieces']]} (median "
              f"{pf['median_ms']['pieces']:.0f}); logits bit for bit equal: {pf['logits_equal']}"]
    (args.out / "prefill_chunks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
