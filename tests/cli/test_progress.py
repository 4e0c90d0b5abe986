"""Long commands report progress when output is not a terminal (CI, logs): plain lines, not silence."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from kvtier.cli import app


def test_eval_prints_plain_progress_lines_without_a_terminal(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_PROGRESS_INTERVAL", "0")  # every report becomes a line
    res = CliRunner().invoke(app, ["eval", "--model", "random:tiny-qwen2", "--benchmark", "rg:basic_arithmetic",
                                   "--policy", "full", "--limit", "3", "--batch-size", "1", "--max-new-tokens", "8",
                                   "--dtype", "fp32", "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    lines = re.findall(r"^rg:basic_arithmetic full: (\d+)/3 done.* s$", res.output, flags=re.M)
    assert lines == ["0", "1", "2", "3"]
    assert "tok/s" in res.output and "s left" in res.output


def test_plain_progress_is_throttled(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_PROGRESS_INTERVAL", "3600")  # only the first and the last line
    res = CliRunner().invoke(app, ["eval", "--model", "random:tiny-qwen2", "--benchmark", "rg:basic_arithmetic",
                                   "--policy", "full", "--limit", "3", "--batch-size", "1", "--max-new-tokens", "8",
                                   "--dtype", "fp32", "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    assert re.findall(r"^rg:basic_arithmetic full: (\d+)/3 done", res.output, flags=re.M) == ["0", "3"]


def test_bench_prints_plain_progress_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_PROGRESS_INTERVAL", "0")
    res = CliRunner().invoke(app, ["bench", "--model", "random:tiny-qwen2", "--context", "32", "--new-tokens", "4",
                                   "--batch", "1", "--policy", "full", "--repeats", "1", "--warmup-steps", "1",
                                   "--dtype", "fp32", "--no-stock"])
    assert res.exit_code == 0, res.output
    assert re.search(r"^bench: batch 1 repeat 1/1 .* s$", res.output, flags=re.M), res.output


def test_log_level_from_kvtier_log():
    """KVTIER_LOG picks the log level (debug adds timestamps); anything else is one line naming it, exit 2."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "KVTIER_LOG": "verbose"}
    out = subprocess.run([sys.executable, "-m", "kvtier", "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "KVTIER_LOG must be one of debug | info | warning | error, got 'verbose'" in out.stderr
    env["KVTIER_LOG"] = "DEBUG"
    code = "import logging, kvtier.cli as c, sys; sys.argv=['kvtier', '--help']\ntry:\n    c.main()\nexcept SystemExit:\n" \
           "    pass\nprint(logging.getLogger().level)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == str(10), out.stderr
