"""benchmarks/gpu_check.sh: its dry run lists the steps in order of importance within the time budget, and the
whole driver runs end to end on a CPU with tiny models (``--smoke``), writing every step's files as it goes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["env", "cuda_tests", "decode_4k", "decode_16k", "serve_pressure"]


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_lists_the_steps_and_their_budgets(tmp_path):
    res = _run("--dry-run", "--out", str(tmp_path / "o"))
    assert res.returncode == 0, res.stderr
    steps = re.findall(r"^\d+\. (\S+)\s+(\d+) s", res.stdout, flags=re.M)
    assert [s for s, _ in steps] == ORDER
    total = sum(int(b) for _, b in steps)
    assert total <= 360 and f"{total} s budgeted of 360 s" in res.stdout
    assert "pytest" in res.stdout and "--run-bench 16384" in res.stdout
    assert not (tmp_path / "o").exists()  # a dry run writes nothing


@pytest.mark.smoke
def test_smoke_run_writes_every_step_as_it_finishes(tmp_path):
    out = tmp_path / "gpu"
    res = _run("--smoke", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [r["step"] for r in summary] == ORDER and all(r["rc"] == 0 for r in summary)
    assert json.loads((out / "env.json").read_text())["torch"]
    for ctx in ("4k", "16k"):
        rows = json.loads((out / f"decode_{ctx}.json").read_text())["results"]
        modes = sorted((r["policy"], (r.get("params") or {}).get("t1_attention")) for r in rows)
        assert modes == [("full", None), ("tiered", "auto"), ("tiered", "host"), ("tiered", "stream")]
    serve = json.loads((out / "serve_pressure.json").read_text())
    m = serve["server_metrics"]
    assert serve["rows"][0]["requests"] == 4 and m["kvtier_budget_violations_total"] == 0
    assert 0 < m["kvtier_device_kv_peak_bytes"] <= m["kvtier_device_kv_budget_bytes"]
    assert m["kvtier_demoted_tokens_total"] > 0 and serve["rows"][0]["failed"] == 0  # the budget bites
    rec = json.loads((out / "serve_pressure_recompute.json").read_text())
    assert rec["on_pressure"] == "recompute" and rec["rows"][0]["requests"] == 4 and rec["rows"][0]["failed"] == 0
    assert rec["server_metrics"]["kvtier_demoted_tokens_total"] == 0 and rec["rows"][0]["tokens"] > 0
