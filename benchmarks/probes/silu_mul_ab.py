"""A fused op of the direct step against the ops it replaces: per call, in the 32-row step and in a prefill.

    python benchmarks/probes/silu_mul_ab.py --out benchmarks/results/silu_mul_<date>/
    python benchmarks/probes/silu_mul_ab.py --fusion add_norm --out benchmarks/results/add_norm_<date>/

``--fusion mlp`` (default): the SiLU x product (kvtier.step.mlp) against torch's two ops; ``add_norm``: a residual
add and the RMSNorm after it in one pass (kvtier.step.norm.add_rms_norm) against the add and the fused norm apart.
Part 1: microseconds of one call at 1, 8, 32 and 738 rows (mlp: the gate and up halves of one (rows, 2 x 4864) bf16
product, the 0.5B model's MLP width; add_norm: (rows, 896) bf16), the two alternating, warm. Part 2: the continuous
engine's step (kvtier.step.direct) on `random:qwen2.5-0.5b` bf16, packed: a packed prefill of seven prompts (738
tokens) and decode steps of 32 one-row ``full`` caches (~100 tokens each), through a step built with the fused op and
one built without it, alternating for ``--reps`` rounds; their logits are compared bit for bit. Writes
``<fusion>.json`` and ``<fusion>.md`` (mlp: ``silu_mul.*``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import kvtier
from kvtier.step import direct as direct_mod
from kvtier.step import mlp as mlp_mod
from kvtier.step import norm as norm_mod
from kvtier.step.direct import DirectStep, rows_logits

sys.path.insert(0, str(Path(__file__).parent))
from prefill_chunks import PROMPTS, timed_prefill  # noqa: E402

WIDTH = 4864
ROWS = (1, 8, 32, 738)


def _us(f, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def _calls(fusion: str, rows: int) -> dict:
    """{"torch": the ops apart, "fused": the fused call} on inputs of ``rows`` rows."""
    if fusion == "mlp":
        g, u = torch.randn(1, rows, 2 * WIDTH).bfloat16().split([WIDTH, WIDTH], dim=-1)
        return {"torch": lambda: F.silu(g) * u, "fused": lambda: mlp_mod.silu_mul(g, u)}
    x, y, w = torch.randn(1, rows, 896).bfloat16(), torch.randn(1, rows, 896).bfloat16(), torch.randn(896).bfloat16()

    def apart():
        s = x + y
        return torch.cat([s, norm_mod.rms_norm(s, w, 1e-6)])

    return {"torch": apart, "fused": lambda: torch.cat(norm_mod.add_rms_norm(x, y, w, 1e-6))}


def per_call(fusion: str, reps: int) -> dict:
    out = {}
    for rows in ROWS:
        fs = _calls(fusion, rows)
        n = max(5, 20000 // rows)
        for f in fs.values():
            f()
        times = {k: [] for k in fs}
        for _ in range(reps):
            for k, f in fs.items():
                times[k].append(_us(f, n))
        out[rows] = {k: statistics.median(v) for k, v in times.items()}
        out[rows]["equal"] = bool(torch.equal(fs["torch"](), fs["fused"]()))
    return out


class _StockMLP(nn.Module):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _steps(model, fusion: str) -> dict:
    """A DirectStep with the fused op and one without: mlp, over the same projections with torch's SiLU and
    product; add_norm, with each residual add and the norm after it apart."""
    steps = {"fused": DirectStep(model)}
    if fusion == "add_norm":
        real = direct_mod._add_norm

        def apart(m):
            def f(x, y):
                s = x + y
                return s, direct_mod._norm(m)(s)
            return f

        direct_mod._add_norm = apart
        try:
            steps["torch"] = DirectStep(model)
        finally:
            direct_mod._add_norm = real
        return steps
    fused = [layer.mlp for layer in model.model.layers]
    for layer, m in zip(model.model.layers, fused):
        layer.mlp = _StockMLP()
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            setattr(layer.mlp, name, getattr(m, name))
    steps["torch"] = DirectStep(model)
    for layer, m in zip(model.model.layers, fused):
        layer.mlp = m
    return steps


def in_step(fusion: str, reps: int, decode_steps: int) -> dict:
    model, _ = kvtier.load_model("random:qwen2.5-0.5b", device="cpu", dtype="bfloat16")
    assert mlp_mod.fused_mlp_count(model) == model.config.num_hidden_layers, "the MLPs were not fused here"
    steps = _steps(model, fusion)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in PROMPTS]
    prefill, logits = {k: [] for k in steps}, {}
    for _ in range(reps):
        for how, step in steps.items():
            ms, logits[how] = timed_prefill(model, step, seqs)
            prefill[how].append(ms)
    prefill_equal = bool(torch.equal(logits["fused"], logits["torch"]))
    # 32 rows of ~100 tokens, prefilled once; then decode steps alternating between the two steps (each appends
    # its token to every row: the rows grow by one a step either way)
    rows = [torch.randint(10, 1000, (96 + i % 8,), generator=g).tolist() for i in range(32)]
    caches = [kvtier.make_cache("full", model) for _ in rows]
    twins = [kvtier.make_cache("full", model) for _ in rows]
    lg = rows_logits(model, steps["fused"], caches, rows)
    rows_logits(model, steps["fused"], twins, rows)
    nxt = [[int(t)] for t in lg[0].float().argmax(dim=-1)]
    decode_equal = bool(torch.equal(rows_logits(model, steps["fused"], caches, nxt),
                                    rows_logits(model, steps["torch"], twins, nxt)))
    decode = {k: [] for k in steps}
    for _ in range(reps):
        for how, step in steps.items():
            t = time.perf_counter()
            for _ in range(decode_steps):
                lg = rows_logits(model, step, caches, nxt)
                nxt = [[int(t)] for t in lg[0].float().argmax(dim=-1)]
            decode[how].append(1e3 * (time.perf_counter() - t) / decode_steps)
    return {"prefill_tokens": sum(PROMPTS), "prefill_ms": prefill,
            "prefill_median_ms": {k: statistics.median(v) for k, v in prefill.items()},
            "prefill_logits_equal": prefill_equal, "decode_rows": len(rows), "decode_steps_per_round": decode_steps,
            "decode_ms": decode, "decode_median_ms": {k: statistics.median(v) for k, v in decode.items()},
            "decode_logits_equal": decode_equal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--fusion", choices=("mlp", "add_norm"), default="mlp")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--decode-steps", type=int, default=8)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    (args.out / "lscpu.txt").write_text(cpu)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
           "torch": torch.__version__, "threads": torch.get_num_threads(), "fusion": args.fusion,
           "width": WIDTH if args.fusion == "mlp" else 896,
           "per_call_us": per_call(args.fusion, args.reps), "step": in_step(args.fusion, args.reps, args.decode_steps)}
    name = "silu_mul" if args.fusion == "mlp" else args.fusion
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))
    apart = "torch F.silu(g) * u" if args.fusion == "mlp" else "x + y, then rms_norm"
    lines = [f"| rows | {apart}, us | fused, us | ratio | bit for bit |", "|---|---|---|---|---|"]
    for rows, r in res["per_call_us"].items():
        lines.append(f"| {rows} | {r['torch']:.1f} | {r['fused']:.1f} | {r['torch'] / r['fused']:.2f}x | {r['equal']} |")
    s = res["step"]
    lines += ["", f"Packed prefill of {s['prefill_tokens']} tokens (7 prompts), ms, alternating: apart "
              f"{[round(x) for x in s['prefill_ms']['torch']]} (median {s['prefill_median_ms']['torch']:.0f}); fused "
              f"{[round(x) for x in s['prefill_ms']['fused']]} (median {s['prefill_median_ms']['fused']:.0f}); "
              f"logits bit for bit equal: {s['prefill_logits_equal']}.",
              "", f"Decode step of {s['decode_rows']} rows (~100 tokens each), ms a step (each value the mean of "
              f"{s['decode_steps_per_round']} steps), alternating: apart {[round(x, 1) for x in s['decode_ms']['torch']]} "
              f"(median {s['decode_median_ms']['torch']:.1f}); fused {[round(x, 1) for x in s['decode_ms']['fused']]} "
              f"(median {s['decode_median_ms']['fused']:.1f}); logits bit for bit equal: {s['decode_logits_equal']}."]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
