"""Where the cliff appears (kvtier/eval/claims/cliff.py): strata found by their steps, each verdict rule both ways."""

from __future__ import annotations

from test_claims import _cfg

from kvtier.eval.claims import by_config
from kvtier.eval.claims import VERDICTS, evaluate, write_claims
from kvtier.eval.claims.cliff import cells, cliff_lines

RIGHT = set(range(20))  # full: 20/40 in every stratum
W = {"recent_window": 32}
TIERED = {"attention": "split", "protect_prompt": True, "quant_ratio": 0.0, **W}


def _stratum(steps, evict_right, tiered_right=RIGHT, gen=100, full_right=RIGHT, same_t3_text=None):
    b = f"gsm8k?steps={steps}"
    recs = _cfg("full", bench=b, correct=full_right, gen=gen)
    recs += _cfg("evict", bench=b, correct=evict_right, gen=gen, evict_ratio=0.5, **W)
    recs += _cfg("tiered", bench=b, correct=tiered_right, gen=gen, hbm_ratio=0.5, evict_ratio=0.03, **TIERED)
    # tiered with evict's T3: evict's answers; its texts are evict's unless told otherwise (rounding)
    ev_text = {i: f"text {i} {i in evict_right}" for i in range(40)}
    recs += _cfg("tiered", bench=b, correct=evict_right, gen=gen, completions={**ev_text, **(same_t3_text or {})},
                 hbm_ratio=0.25, evict_ratio=0.5, **TIERED)
    return recs


def _claim(recs):
    rows = [r for r in evaluate(recs) if r.claim.startswith("C1 at length")]
    assert len(rows) <= 1 and all(r.verdict in VERDICTS for r in rows)
    return rows[0] if rows else None


def test_strata_ordered_by_steps_with_their_cells():
    recs = _stratum("5-11", set(range(2)), gen=400) + _stratum("2", set(range(18)), gen=80, same_t3_text={0: "x"})
    recs += _stratum("3-4", set(range(10)), gen=200)
    rows = cells(by_config(recs))
    assert [r["steps"] for r in rows] == [[2, 2], [3, 4], [5, 11]]  # by steps, not by name
    short = rows[0]["cells"]
    assert short["evict 0.5"]["retention"] == 18 / 20 and short["full"]["generated"]["median"] == 80 + 19.5
    assert short["tiered hbm 0.25, evict 0.5"]["identical_to_evict"] == 39 / 40
    assert rows[2]["chain_over_window"] == (400 + 19.5) / 32
    table = cliff_lines(rows)
    assert sum(line.startswith("| ") for line in table) == 4 and "97.5% identical to evict" in "\n".join(table)


def test_cliff_rule_one_way():
    recs = _stratum("2", set(range(19)), gen=80) + _stratum("5-11", {0, 1}, gen=400)  # 95% -> 10% retention
    c = _claim(recs)
    assert c.verdict == "reproduced" and "retention 10.0%" in c.kvtier


def test_cliff_rule_the_other_way():
    flat = _stratum("2", set(range(10)), gen=80) + _stratum("5-11", set(range(12)), gen=400)  # 50% -> 60%
    assert _claim(flat).verdict == "not reproduced" and "as much" in _claim(flat).rule
    slope = _stratum("2", set(range(19)), gen=80) + _stratum("5-11", set(range(10)), gen=400)  # 95% -> 50%, p 0.002
    assert _claim(slope).verdict == "not reproduced" and "a slope, not the cliff" in _claim(slope).rule
    unsure = _stratum("2", set(range(19)), gen=80) + _stratum("5-11", set(range(16)), gen=400)  # 80%: p 0.125
    assert _claim(unsure).verdict == "not testable here" and "cannot tell" in _claim(unsure).rule
    weak = _stratum("2", set(range(19)), gen=80) + _stratum("5-11", set(), gen=400, full_right={0, 1})
    assert _claim(weak).verdict == "not testable here" and "below 10%" in _claim(weak).rule
    assert _claim(_stratum("2", {0}, gen=80)) is None  # one stratum: no claim


def test_cliff_table_in_claims_md(tmp_path):
    recs = _stratum("2", set(range(19)), gen=80) + _stratum("5-11", {0, 1}, gen=400)
    recs += _cfg("full", correct=RIGHT)
    paths = write_claims(recs, tmp_path)
    md = paths["claims_md"].read_text()
    assert "## Where the cliff appears" in md and "| 5-11 | 13.1 |" in md
    assert "(v2 grid, gsm8k?steps" not in md  # the strata have their own table, not a grid each


def test_a_stratum_too_weak_for_full_is_left_out_of_the_judgement():
    """The longest stratum where full is below 10% cannot carry a retention: the cliff is judged on the longest
    stratum where full is strong enough, and the row says which one was left out."""
    recs = _stratum("2", set(range(19)), gen=80) + _stratum("3-4", {0, 1}, gen=200)  # 95% -> 10%
    recs += _stratum("5-11", set(), gen=400, full_right={0, 1})  # full 5%
    c = _claim(recs)
    assert c.verdict == "reproduced" and "judged without steps=5-11" in c.kvtier


def test_c2_on_each_stratum():
    """Beside the cliff, the hierarchy at evict's device share is judged on every stratum (kvtier.eval.claims.eviction's C2 rule)."""
    recs = _stratum("2", set(range(19)), gen=80) + _stratum("3-4", set(range(5)), gen=200)  # tiered keeps all
    rows = {r.claim.split(":")[0]: r for r in evaluate(recs)}
    c2 = rows["C2 at the device share evict keeps, gsm8k?steps=3-4 (window 32)"]
    assert c2.verdict == "reproduced"
    assert rows["C2 at the device share evict keeps, gsm8k?steps=2 (window 32)"].verdict == "not testable here"


def test_report_draws_one_cliff_figure_instead_of_plots_per_stratum(tmp_path):
    import json

    from kvtier.eval.report import write_report

    recs = _stratum("2", set(range(19)), gen=80) + _stratum("5-11", {0, 1}, gen=400) + _cfg("full", correct=RIGHT)
    run = tmp_path / "run"
    run.mkdir()
    filled = [{"tier_tokens": {"T0": 100, "T1": 0, "T2": 0, "T3": 0}, "tier_bytes": {"T0": 1000, "T1": 0, "T2": 0}, "seconds": 1.0, **r} for r in recs]
    (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in filled))
    paths = write_report(run)
    pngs = sorted(p.name for p in run.glob("*.png"))
    assert "cliff_accuracy_vs_chain_length.png" in pngs and paths["cliff"].stat().st_size > 10_000
    assert not [p for p in pngs if "steps" in p]  # the strata: in the one figure
    assert "gsm8k_memory_vs_accuracy.png" in pngs  # a benchmark outside the strata keeps its plots
