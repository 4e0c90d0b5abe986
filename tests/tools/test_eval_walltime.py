"""benchmarks/eval/eval_walltime.py: wall seconds from each run's start/end, accuracy over its deduplicated records, and
completions compared with the first run's by problem id."""

from __future__ import annotations

import json

from scripts import benchmark_script


def _run(root, name, start, end, completions, correct):
    d = root / name
    d.mkdir()
    (d / "seconds.txt").write_text(f"{start} {end}\n")
    recs = [{"config_key": "k", "id": f"p{i}", "sample": 0, "problem_hash": f"h{i}", "completion": c,
             "correct": ok, "generated_tokens": 10, "machine": "test cpu", "benchmark": "gsm8k", "policy": "tiered",
             "params": {}, "tier_tokens": {}, "tier_bytes": {}, "seconds": 1.0}
            for i, (c, ok) in enumerate(zip(completions, correct))]
    recs.append(dict(recs[0], completion="a duplicate: the first written wins"))
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_wall_time_accuracy_and_equal_completions(tmp_path):
    mod = benchmark_script("eval_walltime")
    _run(tmp_path, "eager", 100.0, 300.0, ["a", "b", "c", "d"], [True, False, True, False])
    _run(tmp_path, "auto", 500.0, 600.0, ["a", "b", "x", "d"], [True, True, True, False])
    text = mod.summarize(tmp_path, ["eager", "auto"])
    assert "| eager | 200 | 1.00x | 4 | 2 (50.0%) | 40 | 0.2 | 4/4 |" in text
    assert "| auto | 100 | 0.50x | 4 | 3 (75.0%) | 40 | 0.4 | 3/4 |" in text
    assert "machine: test cpu" in text
