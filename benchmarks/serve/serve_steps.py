"""Where a served run's time went, from the continuous engine's step log (``KVTIER_LOG=debug kvtier serve``).

    python benchmarks/serve/serve_steps.py SERVER.log [--json OUT.json]

A log that several servers appended to (serve_peer.py's, over runs) is read run by run (the step count restarts).

Each debug line ``step N: R rows, J joining with P prompt tokens, X ms`` is one forward (timed from building the
step's cache view to the last row's token drawn). Prints: the span from the first step's start to the last step's
end, the time inside steps, between them while rows were running (the loop's own scheduling, and anything that kept
the engine thread from the next step) and idle (the gaps before a step whose rows all join: the engine had nothing to
run and waited for arrivals, e.g. between the load generator's phases), decode-only steps' median ms by row count,
and what the steps with a joining prefill cost beyond a decode step of as many rows.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) DEBUG kvtier\.serve\.continuous: step (\d+): (\d+) rows, "
                  r"(\d+) joining with (\d+) prompt tokens, ([0-9.]+) ms$")


def parse(text: str) -> list[dict]:
    """One dict per step line: end time (s, the log's clock, ms resolution), rows, joining, prompt tokens, ms."""
    steps = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            steps.append({"end": t, "step": int(m[2]), "rows": int(m[3]), "joining": int(m[4]),
                          "prompt_tokens": int(m[5]), "ms": float(m[6])})
    return steps


def runs(steps: list[dict]) -> list[list[dict]]:
    """The steps split by server run: a log appended to by several servers restarts its step count at each."""
    out: list[list[dict]] = []
    for s in steps:
        if not out or s["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(s)
    return out


def summary(steps: list[dict]) -> dict:
    if not steps:
        raise ValueError("no step lines: was the server run with KVTIER_LOG=debug and the continuous scheduler?")
    span = steps[-1]["end"] - (steps[0]["end"] - steps[0]["ms"] / 1e3)
    inside = sum(s["ms"] for s in steps) / 1e3
    # the gap before a step whose rows all join followed an empty engine: idle, not the loop's overhead
    idle = sum(max(0.0, (s["end"] - s["ms"] / 1e3) - prev["end"])
               for prev, s in zip(steps, steps[1:]) if s["rows"] == s["joining"])
    decode: dict[int, list[float]] = {}
    for s in steps:
        if not s["joining"]:
            decode.setdefault(s["rows"], []).append(s["ms"])
    med = {r: statistics.median(v) for r, v in sorted(decode.items())}
    joins = [s for s in steps if s["joining"]]
    # a joining step's extra: its ms beyond a decode step of the rows already running (rows - joining)
    extra = [s["ms"] - med[s["rows"] - s["joining"]] for s in joins if s["rows"] - s["joining"] in med]
    return {"steps": len(steps), "span_s": span, "inside_s": inside, "between_s": span - inside - idle, "idle_s": idle,
            "decode_ms_median_by_rows": med, "decode_steps_by_rows": {r: len(v) for r, v in sorted(decode.items())},
            "join_steps": len(joins), "join_prompt_tokens": sum(s["prompt_tokens"] for s in joins),
            "join_ms_total": sum(s["ms"] for s in joins), "join_extra_ms_total": sum(extra),
            "join_extra_ms_median": statistics.median(extra) if extra else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    found = runs(parse(args.log.read_text(errors="replace"))) or [[]]
    out = []
    for i, steps in enumerate(found, 1):
        if len(found) > 1:
            print(f"server run {i} of {len(found)}:")
        try:
            out.append(report(summary(steps)))
        except ValueError as e:  # a log without step lines: one line, not a traceback
            raise SystemExit(f"error: {args.log}: {e}") from None
    if args.json:
        args.json.write_text(json.dumps(out if len(out) > 1 else out[0], indent=1) + "\n")


def report(s: dict) -> dict:
    print(f"{s['steps']} steps over {s['span_s']:.2f} s: {s['inside_s']:.2f} s inside steps, "
          f"{s['between_s']:.2f} s between them while rows ran, {s['idle_s']:.2f} s idle")
    print("decode-only steps, median ms by rows: " + ", ".join(
        f"{r}: {m:.1f} ({s['decode_steps_by_rows'][r]})" for r, m in s["decode_ms_median_by_rows"].items()))
    if s["join_steps"]:
        print(f"{s['join_steps']} steps with a joining prefill ({s['join_prompt_tokens']} prompt tokens): "
              f"{s['join_ms_total'] / 1e3:.2f} s in all, {s['join_extra_ms_total'] / 1e3:.2f} s beyond decode steps "
              f"of their running rows (median {s['join_extra_ms_median'] or 0:.1f} ms each)")
    return s


if __name__ == "__main__":
    main()
