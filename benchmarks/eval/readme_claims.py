"""Writes (or checks) the README's claim-by-claim table from the committed campaigns' records.

    python benchmarks/eval/readme_claims.py            # print the table
    python benchmarks/eval/readme_claims.py --write    # replace it in README.md
    python benchmarks/eval/readme_claims.py --check    # exit 1 if README.md differs from what the records give

Which campaign and which claims row each README line comes from is the list below; the rows themselves, verdicts
included, are :func:`kvtier.eval.claims.evaluate`'s (the same as ``kvtier report DIR --claims``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier.eval.claims.table import Pick, Source, render, replace_block, table_rows

ROOT = Path(__file__).resolve().parents[2]
V1 = "benchmarks/results/paper_cpu_2026-12-01"
V2 = "benchmarks/results/paper_cpu_v2_2026-12-04"
V2_1P5B = "benchmarks/results/paper_cpu_v2_1p5b"

SOURCES = [
    Source(V2, "0.5B", "v2", (
        Pick("C1 eviction bites on gsm8k (window 32", "C1 evicting 50% takes accuracy to ~0 (GSM8K, window 32)"),
        Pick("C1 at length", "C1 the cliff, by chain length (GSM8K strata by reference steps)"),
        Pick("C1 eviction bites on math500 (window 32", "C1 evicting 50% takes accuracy to ~0 (MATH-500, window 32)"),
        Pick("C2 at the device share evict keeps, gsm8k (window 32)",
             "C2 the hierarchy at evict's device share keeps ~91% of full (GSM8K)"),
        Pick("C2 at the device share evict keeps, gsm8k?steps=3-4",
             "C2 the same where eviction bites (GSM8K, 3–4 reference steps)"),
        Pick("C2 at the device share evict keeps, math500", "C2 the same on MATH-500 (window 32)"),
        Pick("C3 HBM independence on the default (split) path, gsm8k",
             "C3 the HBM ratio changes nothing at fixed eviction (default split path)"),
    )),
    Source(V1, "0.5B", "v1", (
        Pick("C3 HBM independence", "C3 the same on the ordered path"),
        Pick("C4 precision sensitivity", "C4 int8 in the low tier costs accuracy (evict 0.05)"),
    )),
    Source(V2, "0.5B", "v2", (
        Pick("Baselines at equal device memory and equal protection, gsm8k",
             "Baselines at equal device memory, prompt protected like tiered (GSM8K)"),
    )),
    Source(V1, "0.5B", "v1", (
        Pick("Baselines at equal device memory (hbm 0.3, prompt unprotected)",
             "Baselines at equal device memory, the authors' setting (prompt unprotected)"),
    )),
    Source(V2_1P5B, "1.5B Q4_K_M", "v2 1.5B", (
        Pick("C1 eviction bites on gsm8k (window 32", "C1 evicting 50% takes accuracy to ~0 (GSM8K, window 32)"),
        Pick("C2 at the device share evict keeps, gsm8k (window 32)",
             "C2 the hierarchy at evict's device share (GSM8K)"),
        Pick("Baselines at equal device memory and equal protection, gsm8k",
             "Baselines at equal device memory, prompt protected (GSM8K)"),
    )),
]


def build() -> str:
    return render(table_rows(SOURCES, ROOT), SOURCES)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="replace the table in README.md")
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's table differs from the records'")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    a = ap.parse_args(argv)
    block = build()
    if not (a.write or a.check):
        print(block)
        return 0
    text = a.readme.read_text()
    new = replace_block(text, block)
    if a.check:
        if new != text:
            print(f"{a.readme}: the claims table differs from what the records give; run {Path(__file__).name} --write",
                  file=sys.stderr)
            return 1
        return 0
    a.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
