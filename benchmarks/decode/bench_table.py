"""A markdown table of `kvtier bench --json` results: one row per (context, batch, dtype) file, per-step medians.

    python benchmarks/decode/bench_table.py benchmarks/results/cpu_epyc_fused_2026-12-02 > .../summary.md

Columns: kvtier ``full``'s median step and its ratio to the faster stock path (StaticCache or DynamicCache + SDPA;
"–" in a run without them),
then every other kvtier configuration as its speed vs ``full`` (median step of full / median step of it), all
from one interleaved run, so each ratio is side by side on one machine state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def label(r: dict) -> str:
    p = r.get("params") or {}
    if r["policy"] == "tiered":
        mode = p.get("t1_attention") if p.get("attention", "split") == "split" else "ordered"
        kernel = p.get("kernel")
        return f"tiered {mode}" + (f" ({kernel})" if kernel and kernel != "auto" else "")
    if r["policy"] == "full":
        return "full ordered" if p.get("attention") == "ordered" else "full"
    return r["policy"]


def rows(run_dir: Path) -> tuple[list[str], list[list[str]]]:
    out, cols = [], []
    runs = [json.loads(f.read_text()) for f in run_dir.glob("*.json")]
    for d in sorted(runs, key=lambda d: (d["config"]["batches"], d["config"]["context"], d["config"]["dtype"] != "fp32")):
        cfg = d["config"]
        res = {label(r): r for r in d["results"]}
        full = res["full"]
        # the ratios `kvtier bench` recorded (per-step medians, against the faster stock path)
        cells = {k: f"{r['median_ratio_to_full']:.2f}×" for k, r in res.items()
                 if not k.startswith("stock") and k != "full"}
        for k in cells:
            if k not in cols:
                cols.append(k)
        stock = full.get("median_ratio_to_stock")  # None: a run without the stock caches (--no-stock)
        out.append((f"{cfg['context']}", f"{cfg['batches'][0]} ({cfg['dtype']})",
                    f"{full['ms_per_step_median']:.0f} ms, " + ("–" if stock is None else f"{stock:.2f}×"), cells))
    table = []
    for ctx, batch, full, cells in out:
        table.append([ctx, batch, full] + [cells.get(c, "–") for c in cols])
    return cols, table


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        sys.exit("usage: bench_table.py RUN_DIR (a folder of kvtier bench --json files)")
    cols, table = rows(Path(argv[0]))
    head = ["context", "batch (dtype)", "kvtier `full`: median step, vs faster stock"] + [f"{c} vs full" for c in cols]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for t in table:
        print("| " + " | ".join(t) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
