"""The wall time of `kvtier eval` runs of one configuration made different ways (eval_switch_walltime.sh): per run
its seconds from start to end, problems, accuracy and generated tokens per second, and how many completions equal
the first run's.

    python benchmarks/eval/eval_walltime.py OUT_DIR RUN [RUN ...]    # each RUN: OUT_DIR/RUN/{records.jsonl,seconds.txt}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier.eval.records import dedupe, read_records


def summarize(out: Path, runs: list[str]) -> str:
    """A markdown table, one line per run, the first run being the one compared against."""
    rows, first = [], None
    for name in runs:
        start, end = (float(x) for x in (out / name / "seconds.txt").read_text().split())
        recs = {r["id"]: r for r in dedupe(read_records(out / name))}
        if first is None:
            first = recs
        same = sum(1 for k, r in recs.items() if k in first and first[k]["completion"] == r["completion"])
        tokens = sum(r["generated_tokens"] for r in recs.values())
        correct = sum(bool(r["correct"]) for r in recs.values())
        machine = next(iter(recs.values()))["machine"] if recs else "-"
        rows.append((name, end - start, len(recs), correct, tokens, same, machine))
    base = rows[0][1]
    lines = ["| run | wall s | vs first | problems | correct | generated tokens | tok/s | completions equal to the first |",
             "|---|---|---|---|---|---|---|---|"]
    for name, secs, n, correct, tokens, same, _ in rows:
        lines.append(f"| {name} | {secs:.0f} | {secs / base:.2f}x | {n} | {correct} ({100 * correct / max(n, 1):.1f}%) "
                     f"| {tokens} | {tokens / secs:.1f} | {same}/{n} |")
    lines.append("")
    lines.append(f"machine: {rows[0][6]}; wall s: the whole `kvtier eval` process (model load and warm-up included)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("runs", nargs="+")
    a = ap.parse_args(argv)
    print(summarize(a.out, a.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
