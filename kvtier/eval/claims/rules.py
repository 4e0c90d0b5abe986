"""The pieces every claims module shares: the verdict vocabulary, one claim row, finding a configuration in a run,
pairing two on shared problems (accuracy, exact McNemar, identical completions), the cliff rule and the table's number
formats (quantiles of chain lengths included)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..configs import full_params
from ..records import dedupe
from ..stats import mcnemar_exact, wilson

VERDICTS = ("reproduced", "not reproduced", "not testable here", "holds by construction")
MIN_FULL_ACCURACY = 0.10  # below this, retention is a ratio of two small noisy numbers
TOO_WEAK = ("not testable here", f"full accuracy below {100 * MIN_FULL_ACCURACY:.0f}%")  # verdict, rule


@dataclass(frozen=True)
class ClaimRow:
    """One claim, measured: its name, what the paper says, what kvtier measured (``kvtier``: the full text;
    ``short``: the README's one line), the verdict from :data:`VERDICTS` with the rule that gave it, ``n`` (problems
    paired, or a text such as "200 per stratum"), and ``data``, the numbers behind it (as claims.json holds them)."""

    claim: str
    paper: str
    kvtier: str
    verdict: str
    rule: str
    data: dict = field(default_factory=dict)
    n: int | str | None = None
    short: str = "–"

    def __post_init__(self):
        if self.verdict not in VERDICTS:
            raise ValueError(f"ClaimRow {self.claim!r}: verdict {self.verdict!r} is not one of {VERDICTS}")

    @classmethod
    def missing(cls, claim: str, paper: str, what: str) -> "ClaimRow":
        """The row of a claim whose configurations the run does not hold."""
        return cls(claim, paper, "–", "not testable here", f"needs {what} in the run")

    def as_dict(self) -> dict:
        """The row as claims.json writes it (``data`` shared, not copied)."""
        return {"claim": self.claim, "paper": self.paper, "kvtier": self.kvtier, "verdict": self.verdict,
                "rule": self.rule, "data": self.data, "n": self.n, "short": self.short}


def by_config(records: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in dedupe(records):
        by[r["config_key"]].append(r)
    return by


def find(by: dict[str, list[dict]], bench: str, policy: str, **want) -> list[dict] | None:
    """The records of the one configuration of ``policy`` on ``bench`` whose parameters match ``want`` (defaults
    filled in); the largest if several match."""
    hits = []
    for recs in by.values():
        r0 = recs[0]
        if r0["benchmark"] != bench or r0["policy"] != policy:
            continue
        p = full_params(r0)
        if all(_same(p.get(k), v) for k, v in want.items()):
            hits.append(recs)
    return max(hits, key=len) if hits else None


def _same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) < 1e-9
    return a == b


def accuracy(recs: list[dict]) -> dict:
    k, n = sum(bool(r["correct"]) for r in recs), len(recs)
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "accuracy": k / n if n else 0.0, "ci": [lo, hi]}


def paired(a: list[dict], b: list[dict]) -> dict:
    """``a`` vs ``b`` on the (problem, sample) pairs both hold: accuracies, exact McNemar p, identical outputs."""
    ma = {(r["id"], r.get("sample", 0)): r for r in a}
    mb = {(r["id"], r.get("sample", 0)): r for r in b}
    keys = sorted(set(ma) & set(mb))
    pa, pb = [ma[k] for k in keys], [mb[k] for k in keys]
    only_a = sum(x["correct"] and not y["correct"] for x, y in zip(pa, pb))
    only_b = sum(y["correct"] and not x["correct"] for x, y in zip(pa, pb))
    out = {"n": len(keys), "a": accuracy(pa), "b": accuracy(pb), "mcnemar_p": mcnemar_exact(only_a, only_b),
           "identical": sum(x["completion"] == y["completion"] for x, y in zip(pa, pb)) / max(1, len(keys))}
    fa = out["a"]["accuracy"]
    out["retention"] = out["b"]["accuracy"] / fa if fa else None
    return out


def pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def acc_text(a: dict) -> str:
    return f"{pct(a['accuracy'])} ({bound(a['ci'][0])}–{bound(a['ci'][1])}, n={a['n']})"


def bound(x: float) -> str:
    """An interval bound in percent: whole points from 10% up, one decimal below (a 0.51% bound is not "0")."""
    return f"{100 * x:.0f}" if x >= 0.095 else f"{100 * x:.1f}"


def quantile(xs: list[int], f: float) -> float:
    """The ``f`` quantile of sorted ``xs``, linear between order statistics: the median of an even count is the
    mean of the two middle values (the first campaign's report took the upper one: 478 where 467 is right)."""
    k = (len(xs) - 1) * f
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    v = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return int(v) if v == int(v) else round(v, 1)


def cliff_verdict(p: dict) -> tuple[str, str]:
    """C1's verdict and rule from ``paired(full, evict)``: the cliff is retention <= 25% with McNemar p < 0.05."""
    if p["a"]["accuracy"] < MIN_FULL_ACCURACY:
        return TOO_WEAK
    if p["retention"] is not None and p["retention"] <= 0.25 and p["mcnemar_p"] < 0.05:
        return "reproduced", "reproduced if retention <= 25% and McNemar p < 0.05"
    if p["mcnemar_p"] < 0.05:
        return "not reproduced", "accuracy falls (McNemar p < 0.05) but keeps more than 25%: a drop, not the cliff"
    return "not reproduced", "retention > 25% or no significant drop (McNemar p >= 0.05)"
