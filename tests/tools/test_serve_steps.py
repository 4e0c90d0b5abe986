"""benchmarks/serve/serve_steps.py: the served run's time split into steps and the gaps between them, decode steps'
median by row count, and what a joining prefill cost beyond a decode step of the rows already running."""

from __future__ import annotations

import pytest
from scripts import benchmark_script

LOG = """\
2026-12-05 17:00:00,100 DEBUG kvtier.serve.continuous: step 1: 1 rows, 1 joining with 90 prompt tokens, 100.0 ms
2026-12-05 17:00:00,130 DEBUG kvtier.serve.continuous: step 2: 1 rows, 0 joining with 0 prompt tokens, 20.0 ms
2026-12-05 17:00:00,160 DEBUG kvtier.serve.continuous: step 3: 1 rows, 0 joining with 0 prompt tokens, 24.0 ms
2026-12-05 17:00:00,300 DEBUG kvtier.serve.continuous: step 4: 2 rows, 1 joining with 80 prompt tokens, 121.0 ms
2026-12-05 17:00:00,330 INFO uvicorn.access: 127.0.0.1 - "POST /v1/chat/completions HTTP/1.1" 200
2026-12-05 17:00:00,340 DEBUG kvtier.serve.continuous: step 5: 2 rows, 0 joining with 0 prompt tokens, 30.0 ms
2026-12-05 17:00:03,440 DEBUG kvtier.serve.continuous: step 6: 1 rows, 1 joining with 70 prompt tokens, 100.0 ms
"""


def test_steps_gaps_and_join_costs():
    mod = benchmark_script("serve_steps")
    steps = mod.parse(LOG)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    s = mod.summary(steps)
    assert s["span_s"] == pytest.approx(3.44, abs=1e-6)  # from step 1's start (0.100 - 0.100) to step 6's end
    assert s["inside_s"] == pytest.approx(0.395)
    # step 6 starts at 3.340 with every row joining: the 3.0 s before it the engine was empty (idle), not overhead
    assert s["idle_s"] == pytest.approx(3.0, abs=1e-6)
    assert s["between_s"] == pytest.approx(0.045, abs=1e-6)
    assert s["decode_ms_median_by_rows"] == {1: 22.0, 2: 30.0}
    # steps 1 and 6 join with no row running (no decode step of 0 rows to compare); step 4: 121 - 22
    assert s["join_steps"] == 3 and s["join_prompt_tokens"] == 240
    assert s["join_extra_ms_total"] == pytest.approx(99.0)


def test_a_log_without_step_lines_says_how_to_get_them():
    mod = benchmark_script("serve_steps")
    with pytest.raises(ValueError, match="KVTIER_LOG=debug"):
        mod.summary(mod.parse("INFO kvtier: serving\n"))


def test_a_log_of_two_server_runs_is_read_run_by_run():
    mod = benchmark_script("serve_steps")
    second = LOG.replace("17:00:0", "17:05:0")
    found = mod.runs(mod.parse(LOG + second))
    assert [len(r) for r in found] == [6, 6]
    assert mod.summary(found[1])["span_s"] == pytest.approx(3.44, abs=1e-6)
