"""Which campaign gives which claim row, and which supersedes which: :func:`evaluate`, the one entry point.

Three campaigns write the records the claims are read from (each a sweep file under ``benchmarks/sweeps/``):

============  ======================  =========================================================================
campaign      module                  rows
============  ======================  =========================================================================
first         :mod:`.paper`           C1 (window 128) per benchmark, C2 at 3% eviction per benchmark, C3 on the
                                      ordered path, C4 (int8), the baselines without prompt protection
second        :mod:`.eviction`        C1 at windows 32 and 128, C2 at evict's device share, C3 on the split
                                      path, the baselines with the prompt protected; per benchmark
cliff         :mod:`.cliff`           C1 by chain length over GSM8K strata, and C2 on each stratum
============  ======================  =========================================================================

Where the second campaign ran on a benchmark (:func:`.eviction.in_run`) its rows supersede the first's C1 there;
where it ran on GSM8K it also supersedes the first's C2 (both benchmarks), C3 and baselines — its settings are the
ones where eviction bites. C4 only the first campaign measures, so it is never superseded.
"""

from __future__ import annotations

from .cliff import evaluate as cliff_rows
from .eviction import evaluate as second_rows
from .eviction import in_run
from .paper import baselines_unprotected, c1, c2, c3_ordered, c4
from .rules import ClaimRow, by_config

C2_PAPER_RETENTION = {"gsm8k": 0.91, "math500": 0.71}  # the paper's retention at 3% eviction


def evaluate(records: list[dict], gsm: str = "gsm8k", math: str = "math500?shuffle=0") -> list[ClaimRow]:
    """One :class:`~kvtier.eval.claims.rules.ClaimRow` per claim the records can speak to (a missing configuration
    gives a "not testable here" row naming what it needs), in a fixed order: the first campaign's rows that stand,
    then the second campaign's on ``gsm`` and on ``math``, then the cliff's."""
    by = by_config(records)
    second = {b: in_run(by, b) for b in (gsm, math)}
    rows = [c1(by, b) for b in (gsm, math) if not second[b]]
    if not second[gsm]:
        rows += [c2(by, gsm, C2_PAPER_RETENTION["gsm8k"]), c2(by, math, C2_PAPER_RETENTION["math500"]),
                 c3_ordered(by, gsm)]
    rows.append(c4(by, gsm))
    if not second[gsm]:
        rows.append(baselines_unprotected(by, gsm))
    return rows + second_rows(by, gsm) + second_rows(by, math) + cliff_rows(by)
