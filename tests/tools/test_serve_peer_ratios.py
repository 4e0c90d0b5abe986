"""benchmarks/serve/serve_peer_ratios.py: kvtier over the peer within each run (never across runs), median and range,
and a run the peer did not finish left out and named."""

from __future__ import annotations

from scripts import benchmark_script


def _script():
    return benchmark_script("serve_peer_ratios")


def _row(system, clients, label, tok_s, ttft=1.0, itl=50.0):
    return {"system": system, "clients": clients, "label": label, "tok_s": tok_s, "ttft_p99_s": ttft,
            "itl_p50_ms": itl}


def test_ratios_pair_rows_of_the_same_run_and_leave_out_runs_without_the_peer():
    mod = _script()
    rows = [_row("vllm", 8, "run1", 200.0, itl=40.0), _row("kvtier-full", 8, "run1", 180.0, itl=44.0),
            _row("vllm", 8, "run2", 100.0), _row("kvtier-full", 8, "run2", 95.0),
            _row("kvtier-full", 8, "run3", 500.0)]  # run3: no peer row -> left out, not divided by another run's
    got = mod.ratios(rows, "vllm")
    assert list(got) == [("kvtier-full", 8)]
    cell = got[("kvtier-full", 8)]
    assert cell["tok_s"] == [("run1", 0.9), ("run2", 0.95)]
    assert cell["itl_p50_ms"][0] == ("run1", 1.1)
    text = mod.table(rows, "vllm")
    assert "Left out (no vllm row): run3" in text
    assert "0.90 / 0.95 → **0.93×** (0.90–0.95)" in text
