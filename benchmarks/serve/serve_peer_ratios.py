"""kvtier against vLLM-CPU over repeated ``serve_peer.py`` runs: each run's ratios, and their median and range.

One run of a 2-core guest moves by about the gap being judged (vLLM-CPU served 274 and 330 tok/s at 32 clients in
two runs of one session), so a goal such as "tokens/s >= 0.9x the peer's" is read from the ratios of several runs,
each taken side by side (the systems in turn within a run, labelled ``--label runN``):

    python benchmarks/serve/serve_peer_ratios.py benchmarks/results/serve_peer_repeat_<date>_<cpu> [--peer vllm]

Reads ``rows.jsonl`` and writes ``ratios.md``: per system and number of clients, tokens/s, TTFT p99 and ITL p50 of
kvtier over the peer's in the same run, every run's ratio, their median, min and max. Rows of runs the peer did not
finish are left out, and said so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METRICS = (("tok/s", "tok_s"), ("TTFT p99", "ttft_p99_s"), ("ITL p50", "itl_p50_ms"))


def ratios(rows: list[dict], peer: str) -> dict[tuple[str, int], dict[str, list[tuple[str, float]]]]:
    """{(system, clients): {metric: [(label, kvtier / peer), ...]}} over the runs where both have the row."""
    by = {(r["system"], r["clients"], r.get("label", "")): r for r in rows}
    out: dict = {}
    for (system, clients, label), r in sorted(by.items()):
        p = by.get((peer, clients, label))
        if system == peer or p is None:
            continue
        cell = out.setdefault((system, clients), {m: [] for _, m in METRICS})
        for _, m in METRICS:
            if p[m]:
                cell[m].append((label, r[m] / p[m]))
    return out


def table(rows: list[dict], peer: str) -> str:
    res = ratios(rows, peer)
    labels = sorted({r.get("label", "") for r in rows})
    missing = [lb for lb in labels if not any(r["system"] == peer and r.get("label", "") == lb for r in rows)]
    lines = [f"kvtier over {peer}, each run side by side (one server at a time); runs: {', '.join(labels) or '(one)'}"]
    if missing:
        lines += ["", f"Left out (no {peer} row): {', '.join(missing)}"]
    lines += ["", "| system | clients | " + " | ".join(f"{name}: runs → median (min–max)" for name, _ in METRICS) + " |",
              "|---|---|" + "---|" * len(METRICS)]
    for (system, clients), cell in res.items():
        parts = []
        for _, m in METRICS:
            vals = [v for _, v in cell[m]]
            if not vals:
                parts.append("–")
                continue
            runs = " / ".join(f"{v:.2f}" for v in vals)
            parts.append(f"{runs} → **{statistics.median(vals):.2f}×** ({min(vals):.2f}–{max(vals):.2f})")
        lines.append(f"| {system} | {clients} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--peer", default="vllm")
    args = ap.parse_args()
    rows = [json.loads(x) for x in (args.folder / "rows.jsonl").read_text().splitlines() if x.strip()]
    text = table(rows, args.peer)
    (args.folder / "ratios.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
