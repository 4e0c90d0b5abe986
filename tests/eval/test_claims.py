"""`kvtier report --claims`: each claim found by its configuration, tested on shared problems, judged by its rule."""

from __future__ import annotations

import pytest

from kvtier.eval.claims import chain_lengths, evaluate, paired
from kvtier.policies import get_policy


def _cfg(policy, bench="gsm8k", correct=(), completions=None, n=40, gen=100, **params):
    full = {**get_policy(policy).params(), **params}
    key = f"{bench}|{policy}|{sorted(full.items())}"
    return [{"config_key": key, "benchmark": bench, "policy": policy, "params": params,
             "key_inputs": {"params": full, "model": "m"}, "id": f"p{i}", "sample": 0, "correct": i in correct,
             "completion": (completions or {}).get(i, f"text {i} {i in correct}"), "generated_tokens": gen + i,
             "prompt_tokens": 50, "max_new_tokens": 512} for i in range(n)]


def test_verdicts_follow_their_rules():
    right = set(range(20))  # full: 20/40
    recs = _cfg("full", correct=right)
    recs += _cfg("evict", correct={0}, evict_ratio=0.5)  # 1/40: a cliff
    recs += _cfg("tiered", correct=right, hbm_ratio=0.3, evict_ratio=0.03)  # everything kept
    for h in (0.3, 0.5, 0.7):  # ordered grid: identical across hbm, eviction costs 5 problems
        recs += _cfg("tiered", correct=right, hbm_ratio=h, evict_ratio=0.1, attention="ordered")
        recs += _cfg("tiered", correct=set(range(15)), hbm_ratio=h, evict_ratio=0.25, attention="ordered")
    recs += _cfg("tiered", correct=right, hbm_ratio=0.3, evict_ratio=0.05)
    recs += _cfg("quant", correct=set(range(5)), hbm_ratio=0.3, evict_ratio=0.05)  # int8: -37.5 points
    recs += _cfg("tiered", correct=right, hbm_ratio=0.3, evict_ratio=0.03, protect_prompt=False)
    for b in ("h2o", "rkv"):
        recs += _cfg(b, correct={1}, budget_ratio=0.3, budget_floor=None)
    rows = {r.claim.split(":")[0]: r for r in evaluate(recs)}
    assert rows["C1 eviction cliff on gsm8k"].verdict == "reproduced"
    assert rows["C1 eviction cliff on math500"].verdict == "not testable here"
    assert rows["C2 tiering holds on gsm8k"].verdict == "reproduced"
    assert rows["C2 tiering holds on math500"].verdict == "not testable here"  # no MATH-500 records
    c3 = rows["C3 HBM independence"]
    assert c3.verdict == "holds by construction" and "40/40 completions identical" in c3.kvtier
    assert c3.data["evict_spread"] == pytest.approx(5 / 40)
    assert rows["C4 precision sensitivity"].verdict == "reproduced"
    assert rows["Baselines at equal device memory (hbm 0.3, prompt unprotected)"].verdict == "reproduced"


def test_verdicts_can_go_the_other_way():
    right = set(range(20))
    recs = _cfg("full", correct=right)
    recs += _cfg("evict", correct=set(range(19)), evict_ratio=0.5)  # no cliff
    recs += _cfg("tiered", correct=set(range(5)), hbm_ratio=0.3, evict_ratio=0.03)  # loses 15 of 20
    recs += _cfg("full", bench="math500?shuffle=0", correct={1})  # full at 2.5%: too weak to judge
    recs += _cfg("tiered", bench="math500?shuffle=0", correct={1}, hbm_ratio=0.3, evict_ratio=0.03)
    recs += _cfg("evict", bench="math500?shuffle=0", correct=set(), evict_ratio=0.5)
    for h in (0.3, 0.5, 0.7):  # one completion differs at hbm 0.7
        comp = {3: "other"} if h == 0.7 else None
        recs += _cfg("tiered", correct=right, completions=comp, hbm_ratio=h, evict_ratio=0.1, attention="ordered")
        recs += _cfg("tiered", correct=right, hbm_ratio=h, evict_ratio=0.25, attention="ordered")
    recs += _cfg("tiered", correct=right, hbm_ratio=0.3, evict_ratio=0.05)
    recs += _cfg("quant", correct=right, hbm_ratio=0.3, evict_ratio=0.05)
    recs += _cfg("tiered", correct={1}, hbm_ratio=0.3, evict_ratio=0.03, protect_prompt=False)
    recs += _cfg("h2o", correct=right, budget_ratio=0.3, budget_floor=None)
    rows = {r.claim.split(":")[0]: r for r in evaluate(recs)}
    assert rows["C1 eviction cliff on gsm8k"].verdict == "not reproduced"
    c1m = rows["C1 eviction cliff on math500"]  # 1/40 -> 0/40 looks like a cliff, but full is too weak to judge
    assert c1m.verdict == "not testable here" and "below 10%" in c1m.rule and "retention 0.0%" in c1m.kvtier
    assert rows["C2 tiering holds on gsm8k"].verdict == "not reproduced"
    assert rows["C2 tiering holds on math500"].verdict == "not testable here"
    assert "below 10%" in rows["C2 tiering holds on math500"].rule
    assert rows["C3 HBM independence"].verdict == "not reproduced"
    assert rows["C4 precision sensitivity"].verdict == "not reproduced"
    assert rows["Baselines at equal device memory (hbm 0.3, prompt unprotected)"].verdict == "not reproduced"


def test_middle_cases_use_the_fixed_vocabulary():
    """A drop that is significant but not a cliff is "not reproduced" (the rule says so); a retention below the
    paper's that this n cannot tell from full, and an int8 loss that is large but not significant, are "not
    testable here" with the reason; every verdict is one of VERDICTS."""
    from kvtier.eval.claims import VERDICTS

    right = set(range(20))
    recs = _cfg("full", correct=right)
    recs += _cfg("evict", correct=set(range(10)), evict_ratio=0.5)  # 20 -> 10: significant, retention 50%
    recs += _cfg("tiered", correct=set(range(17)), hbm_ratio=0.3, evict_ratio=0.03)  # 85% < 91%, p >= 0.05
    recs += _cfg("tiered", correct=right, hbm_ratio=0.3, evict_ratio=0.05)
    recs += _cfg("quant", correct=set(range(15)), hbm_ratio=0.3, evict_ratio=0.05)  # -12.5 points, p = 0.0625
    rows = {r.claim.split(":")[0]: r for r in evaluate(recs)}
    c1 = rows["C1 eviction cliff on gsm8k"]
    assert c1.verdict == "not reproduced" and "not the cliff" in c1.rule
    c2 = rows["C2 tiering holds on gsm8k"]
    assert c2.verdict == "not testable here" and "at this n" in c2.rule
    c4 = rows["C4 precision sensitivity"]
    assert c4.verdict == "not testable here" and "cannot tell" in c4.rule
    assert all(r.verdict in VERDICTS for r in rows.values())


def test_paired_uses_shared_problems_only_and_chain_lengths():
    a = _cfg("full", correct={0, 1, 2}, n=10)
    b = _cfg("evict", correct={0}, n=4, evict_ratio=0.5)
    p = paired(a, b)
    assert p["n"] == 4 and p["a"]["k"] == 3 and p["b"]["k"] == 1 and p["retention"] == pytest.approx(1 / 3)
    (c,) = chain_lengths(a + b)
    # 100..109: an even count, so the median is the mean of the middle two (104, 105); p10 and p90 interpolate
    assert (c["n"], c["median"], c["p10"], c["p90"], c["max"], c["at_cap"]) == (10, 104.5, 100.9, 108.1, 109, 0)


def test_interval_bounds_below_ten_percent_keep_a_decimal():
    """The first campaign printed decode-SnapKV's Wilson interval (0.51%, 4.3%) as "(0–4)"."""
    from kvtier.eval.claims.rules import acc_text

    assert acc_text({"accuracy": 0.015, "ci": (0.0051, 0.0431), "n": 200}) == "1.5% (0.5–4.3, n=200)"
    assert acc_text({"accuracy": 0.28, "ci": (0.222, 0.346), "n": 200}) == "28.0% (22–35, n=200)"


def test_claim_row_refuses_a_verdict_outside_the_vocabulary_and_writes_one_shape():
    from kvtier.eval.claims import ClaimRow

    with pytest.raises(ValueError, match="verdict 'probably'"):
        ClaimRow("C9", "paper", "kvtier", "probably", "rule")
    row = ClaimRow.missing("C9 something", "~0", "full on gsm8k")
    assert row.verdict == "not testable here" and row.rule == "needs full on gsm8k in the run"
    assert list(row.as_dict()) == ["claim", "paper", "kvtier", "verdict", "rule", "data", "n", "short"]


def test_the_second_campaign_supersedes_the_first_where_it_ran():
    """A run holding both campaigns on GSM8K: the second's C1 (each window), C2 and C3 rows take the first's places;
    C4, which only the first measures, stays; MATH-500 without the second campaign keeps the first's C1 row."""
    right = set(range(20))
    recs = _cfg("full", correct=right) + _cfg("evict", correct={0}, evict_ratio=0.5)  # first campaign's C1
    recs += _cfg("evict", correct={0}, evict_ratio=0.5, recent_window=32)  # second campaign's C1
    recs += _cfg("tiered", correct=right, hbm_ratio=0.3, evict_ratio=0.05)
    recs += _cfg("quant", correct=set(range(5)), hbm_ratio=0.3, evict_ratio=0.05)
    names = [r.claim.split(":")[0] for r in evaluate(recs)]
    assert names == ["C1 eviction cliff on math500", "C4 precision sensitivity",
                     "C1 eviction bites on gsm8k (window 32, prompt protected)",
                     "C1 eviction bites on gsm8k (window 128, prompt protected)"]
