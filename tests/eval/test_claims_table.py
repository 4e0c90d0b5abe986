"""The README's claim-by-claim table (kvtier/eval/claims/table.py, benchmarks/eval/readme_claims.py): built from records,
one short line per picked claims row, and the README holds exactly what the committed records give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripts import benchmark_script
from test_claims import _cfg
from test_claims_v2 import RIGHT, _pair

from kvtier.eval.claims.table import BEGIN, END, NOT_RUN, Pick, Source, render, replace_block, table_rows


def _script():
    return benchmark_script("readme_claims")


def _run_dir(path: Path, recs: list[dict]) -> Path:
    path.mkdir(parents=True)
    filled = [{"tier_tokens": {}, "tier_bytes": {}, "seconds": 1.0, **r} for r in recs]  # what a record also holds
    (path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in filled))
    return path


C1 = Pick("C1 eviction bites on gsm8k (window 32", "C1 (window 32)")
C2 = Pick("C2 at the device share evict keeps, gsm8k (window 32)", "C2 (window 32)")


def test_rows_come_from_the_records_and_follow_their_verdicts(tmp_path):
    cliff = _run_dir(tmp_path / "cliff", _cfg("full", correct=RIGHT) + _pair(32, {0}, RIGHT))
    drop = _run_dir(tmp_path / "drop", _cfg("full", correct=RIGHT) + _pair(32, set(range(10)), set(range(5))))
    srcs = [Source("cliff", "tiny", "a", (C1, C2)), Source("drop", "tiny", "b", (C1,)),
            Source("absent", "big", "c", (C1,))]
    rows = table_rows(srcs, tmp_path)
    assert [(r["label"], r["tag"], r["verdict"]) for r in rows] == [
        ("C1 (window 32)", "a", "reproduced"), ("C2 (window 32)", "a", "reproduced"),
        ("C1 (window 32)", "b", "not reproduced"), ("C1 (window 32)", "c", "not testable here")]
    assert rows[0]["kvtier"].startswith("full 50.0% → evict 0.5 2.5% (p ") and rows[0]["n"] == 40
    assert "50.0% of a row destroyed at its answer" in rows[0]["kvtier"]
    assert rows[1]["kvtier"].startswith("tiered 50.0% (100.0% of full 50.0%) vs evict 0.5 2.5%")
    assert rows[3]["kvtier"] == NOT_RUN and rows[3]["n"] is None
    table = render(rows, srcs)
    assert table.startswith(BEGIN) and table.endswith(END)
    assert "| C1 (window 32) | ~0 whatever the score function | full 50.0% → evict 0.5 2.5%" in table
    assert "**not testable here** (not yet run) | c |" in table
    assert "a = `cliff/`; b = `drop/`; c = `absent/`" in table


def test_a_source_needs_picks_and_a_pick_needs_a_prefix():
    with pytest.raises(ValueError, match="picks"):
        Source("x", "m", "t", ())
    with pytest.raises(ValueError, match="prefix and label"):
        Pick("", "label")


def test_replace_block_needs_both_markers_in_order():
    text = f"intro\n{BEGIN}\nold\n{END}\noutro\n"
    assert replace_block(text, f"{BEGIN}\nnew\n{END}") == f"intro\n{BEGIN}\nnew\n{END}\noutro\n"
    with pytest.raises(ValueError, match="markers"):
        replace_block("no table here", "x")
    with pytest.raises(ValueError, match="markers"):
        replace_block(f"{END}\n{BEGIN}", "x")


def test_check_fails_on_a_stale_readme(tmp_path, capsys):
    mod = _script()
    mod.build = lambda: f"{BEGIN}\nfrom the records\n{END}"  # the records' table, without reading them
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{BEGIN}\nedited by hand\n{END}\n")
    assert mod.main(["--check", "--readme", str(readme)]) == 1
    assert "differs" in capsys.readouterr().err
    assert mod.main(["--write", "--readme", str(readme)]) == 0
    assert mod.main(["--check", "--readme", str(readme)]) == 0
    assert "from the records" in readme.read_text()


def test_the_readme_table_is_what_the_committed_records_give():
    assert _script().main(["--check"]) == 0, "run: python benchmarks/eval/readme_claims.py --write"
