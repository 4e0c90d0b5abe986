"""The table of a matrix_ab.sh run: per point and run, full's median ms/step and tiered's ratios to it, base vs new.

    python benchmarks/decode/matrix_ab_table.py OUT [--write]

Ratios are medians of per-step ratios within one run (``median_ratio_to_full``: the machine's pace cancels);
the last lines give, per point and tiered mode, the median over runs of new and of base. ``--write`` also writes
OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def rows(out: Path) -> list[dict]:
    """One row per (run, point, configuration) found under OUT/<round>_<side>/ctx<C>_b<B>_<dtype>.json."""
    found = []
    for run in sorted(p for p in out.iterdir() if p.is_dir() and re.fullmatch(r"\d+_(base|new)", p.name)):
        rnd, side = run.name.split("_")
        for f in sorted(run.glob("ctx*_b*_*.json")):
            point = re.fullmatch(r"ctx(\d+)_b(\d+)_\w+\.json", f.name)
            for r in json.loads(f.read_text())["results"]:
                found.append({"round": int(rnd), "side": side, "point": f"{point[1]}x{point[2]}",
                              "config": "full" if r["policy"] == "full" else f"tiered/{r['t1_mode']}",
                              "ms": r["ms_per_step_median"], "vs_full": r["median_ratio_to_full"]})
    return found


def table(found: list[dict]) -> str:
    lines = ["| point | round | side | full ms/step (median) | tiered host vs full | tiered stream vs full |",
             "|---|---|---|---|---|---|"]
    runs = sorted({(r["point"], r["round"], r["side"]) for r in found})
    pick = {(r["point"], r["round"], r["side"], r["config"]): r for r in found}
    for point, rnd, side in runs:
        full = pick.get((point, rnd, side, "full"))
        cells = [f"{full['ms']:.1f}" if full else "–"]
        cells += [f"{pick[(point, rnd, side, c)]['vs_full']:.3f}" if (point, rnd, side, c) in pick else "–"
                  for c in ("tiered/host", "tiered/stream")]
        lines.append(f"| {point} | {rnd} | {side} | {' | '.join(cells)} |")
    lines += ["", "| point | tiered mode | base (median over runs) | new (median over runs) |", "|---|---|---|---|"]
    for point in sorted({r["point"] for r in found}):
        for mode in ("tiered/host", "tiered/stream"):
            med = {side: [r["vs_full"] for r in found if (r["point"], r["config"], r["side"]) == (point, mode, side)]
                   for side in ("base", "new")}
            cells = [f"{statistics.median(v):.3f} ({len(v)} runs)" if v else "–" for v in med.values()]
            lines.append(f"| {point} | {mode.split('/')[1]} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--write", action="store_true", help="also write OUT/table.md")
    args = ap.parse_args()
    text = table(rows(args.out))
    print(text, end="")
    if args.write:
        (args.out / "table.md").write_text(text)


if __name__ == "__main__":
    main()
