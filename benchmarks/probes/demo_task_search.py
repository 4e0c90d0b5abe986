"""Which task should ``kvtier demo`` use? The embedded model, full cache vs the demo's heavy eviction, on a few
problems of each candidate; the demo needs one the model often solves, with chains long enough that eviction
bites, and short enough to finish in about 3 minutes on 2 cores.

    python benchmarks/probes/demo_task_search.py --out runs/demo_search [--problems 8] [--max-new-tokens 256]

Resumable: each task is its own run folder (``kvtier eval`` records), so a rerun skips what is recorded.
Writes ``search.md`` and ``search.json`` (one row per task) next to them; ``--with-tiered`` (the finalists, with
the demo's tiered row too) writes ``finalists.md/json``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import kvtier
from kvtier.eval.demo import DEMO_CONFIGS
from kvtier.eval.records import dedupe
from kvtier.eval.runner import EvalConfig, read_records, run_eval
from kvtier.models import EMBEDDED_NAME

CANDIDATES = ["rg:leg_counting", "rg:basic_arithmetic", "rg:chain_sum", "rg:letter_counting", "rg:spell_backward",
              "rg:word_sorting", "rg:number_sorting", "rg:gcd", "rg:count_bits", "rg:simple_equations",
              "rg:word_sequence_reversal", "rg:number_filtering", "rg:gsm_symbolic", "gsm8k"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("runs/demo_search"))
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tasks", default=",".join(CANDIDATES))
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--with-tiered", action="store_true", help="also run the demo's tiered configuration")
    a = ap.parse_args()
    loaded = kvtier.load_model(EMBEDDED_NAME, device="cpu", dtype=a.dtype)
    # full and the heavy eviction decide the choice; the tiered row confirms the finalists
    configs = [c for c in DEMO_CONFIGS if a.with_tiered or c[0] != "tiered"]
    rows = []
    for task in a.tasks.split(","):
        out = a.out / re.sub(r"[^A-Za-z0-9_.-]+", "_", task)
        cfgs = [EvalConfig(model=EMBEDDED_NAME, benchmark=task, policy=p, params=dict(q), limit=a.problems,
                           max_new_tokens=a.max_new_tokens) for p, q in configs]
        t = time.perf_counter()
        keys = run_eval(cfgs, out, data_dir=a.data_dir, batch_size=a.batch_size, dtype=a.dtype, loaded=loaded)
        wall = time.perf_counter() - t
        recs = dedupe(read_records(out))
        row = {"task": task, "problems": a.problems}
        for (pol, _), k in zip(configs, keys):
            rs = [r for r in recs if r["config_key"] == k]
            row[f"{pol}_accuracy"] = sum(r["correct"] for r in rs) / max(1, len(rs))
            row[f"{pol}_gen_tokens"] = sum(r["generated_tokens"] for r in rs) / max(1, len(rs))
            row[f"{pol}_seconds"] = sum(r["seconds"] for r in rs)
        row["wall_seconds_this_run"] = wall
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = "search" if not a.with_tiered else "finalists"
    (a.out / f"{name}.json").write_text(json.dumps(rows, indent=2))
    pols = [p for p, _ in configs]
    lines = [f"# Demo task search: {EMBEDDED_NAME}, {a.problems} problems, greedy, {a.max_new_tokens} new tokens max, "
             f"batch {a.batch_size}, dtype {a.dtype}", "",
             "| task | " + " | ".join(f"{p} accuracy" for p in pols) + " | " + " | ".join(f"{p} mean gen tokens" for p in pols)
             + " | " + " | ".join(f"{p} s" for p in pols) + " |",
             "|---" * (1 + 3 * len(pols)) + "|"]
    for r in rows:
        lines.append(f"| {r['task']} | " + " | ".join(f"{100 * r[p + '_accuracy']:.0f}%" for p in pols) + " | "
                     + " | ".join(f"{r[p + '_gen_tokens']:.0f}" for p in pols) + " | "
                     + " | ".join(f"{r[p + '_seconds']:.0f}" for p in pols) + " |")
    (a.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
