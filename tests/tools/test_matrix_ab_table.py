"""benchmarks/decode/matrix_ab_table.py: rows found per run folder (<round>_<base|new>), each tiered mode's ratio to full
within its run, and the median over runs per side."""

from __future__ import annotations

import json

from scripts import benchmark_script


def _run(folder, full_ms, host, stream):
    folder.mkdir(parents=True)
    res = [{"policy": "full", "t1_mode": None, "ms_per_step_median": full_ms, "median_ratio_to_full": 1.0},
           {"policy": "tiered", "t1_mode": "host", "ms_per_step_median": full_ms / host, "median_ratio_to_full": host},
           {"policy": "tiered", "t1_mode": "stream", "ms_per_step_median": full_ms / stream,
            "median_ratio_to_full": stream}]
    (folder / "ctx4096_b1_bf16.json").write_text(json.dumps({"results": res}))


def test_runs_pair_by_side_and_median_over_runs(tmp_path):
    mod = benchmark_script("matrix_ab_table")
    _run(tmp_path / "1_base", 60.0, 0.97, 0.90)
    _run(tmp_path / "1_new", 62.0, 0.98, 0.95)
    _run(tmp_path / "2_new", 61.0, 0.96, 0.93)
    (tmp_path / "notes").mkdir()  # not a run folder: ignored
    found = mod.rows(tmp_path)
    assert len(found) == 9 and {r["side"] for r in found} == {"base", "new"}
    text = mod.table(found)
    assert "| 4096x1 | 1 | base | 60.0 | 0.970 | 0.900 |" in text
    assert "| 4096x1 | 2 | new | 61.0 | 0.960 | 0.930 |" in text
    assert "| 4096x1 | stream | 0.900 (1 runs) | 0.940 (2 runs) |" in text
    assert "| 4096x1 | host | 0.970 (1 runs) | 0.970 (2 runs) |" in text
