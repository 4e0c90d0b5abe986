"""kvtier's AMX projections (kvtier.step.linear.AmxWeight) against oneDNN's packed ones, in the continuous engine's
step: decode steps at 1, 8 and 32 rows and a packed prefill, alternating in one process.

    python benchmarks/probes/amx_linear_ab.py --out benchmarks/results/amx_linear_<date>/

Two copies of `random:qwen2.5-0.5b` in bf16, one packed with ``KVTIER_LINEAR_KERNEL=onednn`` (oneDNN's layout, the
previous default) and one with the default (AMX tiles where the CPU has AMX), each stepped by its own direct step
(kvtier.step.direct) over its own one-row ``full`` caches fed the same tokens. Part 1: per call, each projection
shape of the model (microseconds, 24 distinct weights in turn, so each call reads its weight from memory as in a
step). Part 2: decode steps at ``--rows`` of ~100 tokens each and a packed prefill of seven prompts (738 tokens),
the two models alternating for ``--reps`` rounds; the logits of each step are compared (bit for bit at decode row
counts, where the two kernels sum in one order; the max difference elsewhere). Writes ``amx_linear.json`` and
``amx_linear.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvtier
from kvtier.step import linear as lin_mod
from kvtier.step.direct import direct_step, rows_logits

sys.path.insert(0, str(Path(__file__).parent))
from prefill_chunks import PROMPTS, timed_prefill  # noqa: E402

SHAPES = {"q/k/v (1152 x 896, bias)": (1152, 896, True), "o (896 x 896)": (896, 896, False),
          "gate/up (9728 x 896)": (9728, 896, False), "down (896 x 4864)": (896, 4864, False)}


def _load(kernel: str):
    os.environ["KVTIER_LINEAR_KERNEL"] = kernel
    try:
        model, _ = kvtier.load_model("random:qwen2.5-0.5b", device="cpu", dtype="bfloat16")
    finally:
        os.environ.pop("KVTIER_LINEAR_KERNEL", None)
    return model, direct_step(model)


def per_call(reps: int, rows_list: list[int]) -> dict:
    out = {}
    for name, (n, k, has_bias) in SHAPES.items():
        ws = [torch.randn(n, k).bfloat16() * k**-0.5 for _ in range(24)]
        b = torch.randn(n).bfloat16() if has_bias else None
        packs = {}
        for kernel in ("onednn", "auto"):
            os.environ["KVTIER_LINEAR_KERNEL"] = kernel
            packs[kernel] = [lin_mod._pack(w, b) for w in ws]
        os.environ.pop("KVTIER_LINEAR_KERNEL", None)
        out[name] = {}
        for rows in rows_list:
            x = torch.randn(1, rows, k).bfloat16()
            times = {kn: [] for kn in packs}
            for _ in range(reps):
                for kn, ps in packs.items():
                    t = time.perf_counter()
                    for p in ps:
                        lin_mod._run_packed(x, p, b)
                    times[kn].append((time.perf_counter() - t) / len(ps) * 1e6)
            same = torch.equal(lin_mod._run_packed(x, packs["onednn"][0], b), lin_mod._run_packed(x, packs["auto"][0], b))
            out[name][rows] = {"onednn": statistics.median(times["onednn"]), "amx": statistics.median(times["auto"]),
                               "equal": same}
    return out


def in_step(reps: int, rows_list: list[int], decode_steps: int) -> dict:
    models = {"onednn": _load("onednn"), "amx": _load("auto")}
    amx_model = models["amx"][0]
    assert type(amx_model.model.layers[0].mlp.down_proj.packed) is lin_mod.AmxWeight, "no AMX tiles on this CPU"
    g = torch.Generator().manual_seed(0)
    res = {}
    for rows in rows_list:
        ctx = [torch.randint(10, 1000, (96 + i % 8,), generator=g).tolist() for i in range(rows)]
        caches = {kn: [kvtier.make_cache("full", m) for _ in ctx] for kn, (m, _) in models.items()}
        nxt = {}
        for kn, (m, step) in models.items():
            lg = rows_logits(m, step, caches[kn], ctx)
            nxt[kn] = [[int(t)] for t in lg[0].float().argmax(dim=-1)]
        times, diffs = {kn: [] for kn in models}, []
        feed = nxt["onednn"]  # both fed the same tokens, so their logits compare step by step
        for _ in range(reps):
            out = {}
            for kn, (m, step) in models.items():
                t = time.perf_counter()
                for _ in range(decode_steps):
                    out[kn] = rows_logits(m, step, caches[kn], feed)
                times[kn].append(1e3 * (time.perf_counter() - t) / decode_steps)
            diffs.append((out["onednn"].float() - out["amx"].float()).abs().max().item())
            feed = [[int(t)] for t in out["onednn"][0].float().argmax(dim=-1)]
        res[f"decode_{rows}"] = {"ms": times, "median_ms": {k: statistics.median(v) for k, v in times.items()},
                                 "max_logit_diff": max(diffs)}
    seqs = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in PROMPTS]
    times, lgs = {kn: [] for kn in models}, {}
    for _ in range(reps):
        for kn, (m, step) in models.items():
            ms, lgs[kn] = timed_prefill(m, step, seqs)
            times[kn].append(ms)
    res["prefill"] = {"tokens": sum(PROMPTS), "ms": times, "median_ms": {k: statistics.median(v) for k, v in times.items()},
                      "max_logit_diff": (lgs["onednn"].float() - lgs["amx"].float()).abs().max().item()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--decode-steps", type=int, default=6)
    args = ap.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lscpu.txt").write_text(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "per_call_us": per_call(args.reps, rows_list + [128, 738]),
           "step": in_step(args.reps, rows_list, args.decode_steps)}
    (args.out / "amx_linear.json").write_text(json.dumps(res, indent=1))
    cols = rows_list + [128, 738]
    lines = ["| weight | " + " | ".join(f"{r} rows: oneDNN / AMX us" for r in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, by in res["per_call_us"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{by[r]['onednn']:.0f} / {by[r]['amx']:.0f}{' (=)' if by[r]['equal'] else ''}" for r in cols) + " |")
    lines += ["", "(=): the two products bit for bit equal.", "",
              "| step | oneDNN ms | AMX ms | ratio | max logit diff |", "|---|---|---|---|---|"]
    for key, r in res["step"].items():
        a, b = r["median_ms"]["onednn"], r["median_ms"]["amx"]
        lines.append(f"| {key} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {r['max_logit_diff']:.3g} |")
    (args.out / "amx_linear.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
