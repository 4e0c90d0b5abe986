"""`kvtier eval / sweep / report` end to end on a tiny random model and the shared benchmark data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import DATA_DIR, REPO
from typer.testing import CliRunner

from kvtier.cli import app

pytestmark = pytest.mark.skipif(not DATA_DIR.is_dir(), reason="shared benchmark data not found next to the repo")
runner = CliRunner()
TINY = ["--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu"]
FIELDS = {
    "benchmark", "id", "sample", "config_key", "policy", "params", "model", "max_new_tokens", "temperature", "top_p",
    "seed", "completion", "extracted", "gold", "correct", "prompt_tokens", "generated_tokens", "tier_tokens",
    "tier_bytes", "budget_tokens", "problem_hash", "key_inputs", "peak_device_kv_bytes", "peak_device_tokens", "streamed_bytes", "moved_bytes", "batch_size", "batch_seconds", "seconds", "tier_map",
    "kernel", "answer_step", "machine",
}


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("benchmark", ["gsm8k", "math500", "math_level5", "arc_challenge"])
def test_eval_end_to_end_every_record_field(tmp_path, benchmark):
    out = tmp_path / "run"
    res = runner.invoke(app, ["eval", *TINY, "--benchmark", benchmark, "--policy", "tiered", "--hbm-ratio", "0.3",
                              "--evict-ratio", "0.1", "--param", "retier_interval=4", "--param", "recent_window=4",
                              "--param", "protect_prompt=false", "--limit", "3", "--max-new-tokens", "12",
                              "--batch-size", "2", "--data-dir", str(DATA_DIR), "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = _records(out)
    assert len(recs) == 3 and len({r["id"] for r in recs}) == 3
    for r in recs:
        assert set(r) == FIELDS
        assert r["machine"].endswith(f"{torch.get_num_threads()} threads") and "(" in r["machine"]
        assert r["benchmark"] == benchmark and r["policy"] == "tiered" and r["model"] == "random:tiny-qwen2"
        assert r["params"] == {"hbm_ratio": 0.3, "evict_ratio": 0.1, "retier_interval": 4, "recent_window": 4, "protect_prompt": False}
        assert isinstance(r["correct"], bool) and r["gold"]
        assert r["prompt_tokens"] > 0 and 1 <= r["generated_tokens"] <= 12
        assert set(r["tier_tokens"]) == {"T0", "T1", "T2", "T3"} and set(r["tier_bytes"]) == {"T0", "T1", "T2"}
        assert sum(r["tier_tokens"].values()) >= r["prompt_tokens"]
        assert r["seconds"] > 0
        assert r["kernel"] == "fused"  # the split step's implementation that ran (CPU: the fused kernel)
        a = r["answer_step"]  # at the row's last step: every token but the one sampled last is cached
        assert a["tokens"] == r["prompt_tokens"] + r["generated_tokens"] - 1 and a["step"] == r["generated_tokens"] - 1
        assert a["attended"] + a["destroyed"] == a["tokens"] == sum(a["tiers"].values())
        tm = r["tier_map"]  # the final tier of every prompt and completion token, and where each token ends
        assert tm["kind"] == "tiers" and len(tm["prompt"]) == r["prompt_tokens"]
        assert len(tm["completion"]) == len(tm["ends"]) == r["generated_tokens"]
        assert tm["ends"][-1] == len(r["completion"]) and tm["ends"] == sorted(tm["ends"])
        if r["generated_tokens"] == 12:
            # the 12th token was sampled last, never fed back ('.'); the rest of the row is exactly the cache's row
            codes = tm["prompt"] + tm["completion"]
            assert tm["completion"].endswith(".") and "." not in codes[:-1]
            assert {f"T{t}": codes.count(str(t)) for t in range(4)} == r["tier_tokens"]
    if benchmark == "arc_challenge":
        assert all(r["gold"] in "ABCDE" for r in recs)
    assert (out / "summary.md").is_file()


def _eval_cmd(out: Path, limit: int) -> list[str]:
    return [sys.executable, "-m", "kvtier", "eval", *TINY, "--benchmark", "gsm8k", "--policy", "full",
            "--limit", str(limit), "--max-new-tokens", "24", "--batch-size", "1", "--data-dir", str(DATA_DIR),
            "--out", str(out)]


@pytest.mark.heavy
def test_killed_run_resumes_without_loss_or_duplicates(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(_eval_cmd(out, 40), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = out / "records.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if path.exists() and path.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_before = path.read_text().count("\n")
    assert 3 <= n_before < 40, "the run must be killed midway"
    with open(path, "a") as f:
        f.write('{"benchmark": "gsm8k", "id": "gsm8k-9')  # a torn last line, as a kill during a write leaves
    done = subprocess.run(_eval_cmd(out, 40), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    recs = _records(out)
    ids = [r["id"] for r in recs]
    assert sorted(ids) == sorted(f"gsm8k-{i}" for i in range(40))  # each problem exactly once
    again = subprocess.run(_eval_cmd(out, 40), env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and len(_records(out)) == 40  # a finished run adds nothing


def test_sweep_then_report_renders_plots(tmp_path):
    out = tmp_path / "grid"
    res = runner.invoke(app, ["sweep", *TINY, "--benchmark", "gsm8k", "--policy", "full,tiered,evict,h2o,streaming_llm",
                              "--evict-ratio", "0.1,0.5", "--hbm-ratio", "0.3,0.6", "--limit", "2", "--max-new-tokens", "8",
                              "--batch-size", "2", "--data-dir", str(DATA_DIR), "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = _records(out)
    keys = {r["config_key"] for r in recs}
    assert len(keys) == 1 + 3 + 2 + 2 + 2  # full once; tiered 2x2 less hbm 0.6 + evict 0.5 > 1; the rest x2
    assert {r["params"].get("budget_ratio") for r in recs if r["policy"] == "h2o"} == {0.9, 0.5}
    res = runner.invoke(app, ["report", str(out), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    pngs = sorted((tmp_path / "rep").glob("*.png"))
    assert {p.name for p in pngs} >= {"gsm8k_accuracy_vs_eviction.png", "gsm8k_hbm_evict_heatmap.png", "gsm8k_memory_vs_accuracy.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    full = [c for c in summary["configs"] if c["policy"] == "full"][0]
    assert full["retention"] in (None, 1.0)  # undefined when full scores 0 (a random model)
    assert full["identical_to_full"] == 1.0 and full["mcnemar_p"] == 1.0
    assert summary["hbm_independence"] and all(h["hbm_ratios"] == [0.3, 0.6] for h in summary["hbm_independence"])
    assert "Cochran" in (tmp_path / "rep" / "summary.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--benchmark", "mmlu"], "benchmark must be one of"),
        (["--benchmark", "gsm8k", "--data-dir", "/nonexistent/data"], "does not exist"),
        (["--benchmark", "gsm8k", "--param", "windw=3"], "unknown parameter"),
        (["--benchmark", "gsm8k", "--limit", "0"], "--limit"),
        (["--benchmark", "gsm8k", "--policy", "nope"], "policy must be one of"),
    ],
)
def test_bad_input_one_line_nothing_written(tmp_path, args, message):
    out = tmp_path / "run"
    cmd = ["eval", *TINY, "--max-new-tokens", "4", "--out", str(out)] + args
    if "--data-dir" not in args:
        cmd += ["--data-dir", str(DATA_DIR)]
    res = runner.invoke(app, cmd)
    assert res.exit_code == 2
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in res.output
    assert not (out / "records.jsonl").exists()


def test_sampling_records_each_sample(tmp_path):
    out = tmp_path / "s"
    res = runner.invoke(app, ["eval", *TINY, "--benchmark", "rg:gsm_symbolic", "--policy", "full", "--limit", "2",
                              "--samples", "2", "--temperature", "0.7", "--max-new-tokens", "6", "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = _records(out)
    assert sorted((r["id"], r["sample"]) for r in recs) == sorted((f"rg-gsm_symbolic-0-{i}", s) for i in range(2) for s in range(2))


def test_sampled_batches_draw_what_each_row_draws_alone(tmp_path):
    """Sampling is seeded per (problem, sample) row (kvtier.eval.sampling.RowSampler): batch 4 gives the
    completions of batch 1, samples differ from each other, and another --seed gives other completions."""
    got = {}
    for bs, seed in ((1, 0), (4, 0), (4, 1)):
        out = tmp_path / f"b{bs}s{seed}"
        res = runner.invoke(app, ["eval", *TINY, "--benchmark", "gsm8k", "--data-dir", str(DATA_DIR), "--policy", "tiered",
                                  "--param", "recent_window=2", "--param", "retier_interval=4", "--limit", "3",
                                  "--samples", "2", "--temperature", "0.9", "--top-p", "0.9", "--max-new-tokens", "24",
                                  "--batch-size", str(bs), "--seed", str(seed), "--out", str(out)])
        assert res.exit_code == 0, res.output
        recs = _records(out)
        got[(bs, seed)] = {(r["id"], r["sample"]): r["completion"] for r in recs}
        assert {r["batch_size"] for r in recs} == ({1} if bs == 1 else {4, 2})
        assert all(r["key_inputs"]["sampler"] == "row-seeded-v2" for r in recs)
    assert got[(1, 0)] == got[(4, 0)]
    assert len(set(got[(1, 0)].values())) == 6
    assert got[(4, 1)] != got[(4, 0)]


def test_row_sampler_matches_the_distribution_it_claims():
    """Temperature then nucleus: every drawn token is in the top-p set of the tempered softmax, and the draw
    frequencies follow the renormalised probabilities (10k draws, 4-sigma bounds)."""
    import torch

    from kvtier.eval.sampling import RowSampler

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    t, top_p = 0.8, 0.8
    p = torch.softmax(logits / t, -1)[0]
    order = p.argsort(descending=True)
    keep = []
    mass = 0.0
    for j in order.tolist():  # the naive nucleus: add tokens until the mass reaches top_p
        keep.append(j)
        mass += float(p[j])
        if mass >= top_p:
            break
    want = torch.zeros(5)
    want[keep] = p[keep] / p[keep].sum()
    s = RowSampler([123], t, top_p)
    counts = torch.zeros(5)
    for _ in range(10000):
        out = s(None, logits.clone())
        assert torch.isfinite(out).sum() == 1
        counts[int(out[0].argmax())] += 1
    freq = counts / 10000
    sigma = (want * (1 - want) / 10000).sqrt()
    assert torch.all((freq - want).abs() <= 4 * sigma + 1e-9), (freq, want)
    assert counts[[j for j in range(5) if j not in keep]].sum() == 0


def test_demo_table_on_a_tiny_model(tmp_path):
    res = runner.invoke(app, ["demo", *TINY, "--problems", "2", "--max-new-tokens", "70", "--batch-size", "2",
                              "--out", str(tmp_path / "demo")])
    assert res.exit_code == 0, res.output
    from kvtier.eval.demo import DEMO_CONFIGS

    recs = _records(tmp_path / "demo")
    assert len(recs) == 2 * len(DEMO_CONFIGS)
    assert "tiered (hbm 0.3, evict 0.03, protect_prompt False" in res.output and "same text / answer as full" in res.output
    # the console wraps a long temporary path anywhere (xdist's adds "popen-gw0/"): look for the name unwrapped
    assert (tmp_path / "demo" / "report.html").is_file() and "report.html" in res.output.replace("\n", "")
    assert all("tier_map" in r for r in recs)


def test_sweep_from_a_config_file(tmp_path):
    cfg = {"benchmark": "gsm8k", "policy": ["full", "tiered", "rkv"], "evict_ratio": [0.2], "hbm_ratio": "0.3",
           "limit": 1, "max_new_tokens": 4, "policy_params": {"rkv": {"buffer": 4}, "tiered": {"recent_window": 2}}}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "grid"
    res = runner.invoke(app, ["sweep", *TINY, "--config", str(path), "--data-dir", str(DATA_DIR), "--out", str(out)])
    assert res.exit_code == 0, res.output
    params = sorted(json.dumps(r["params"], sort_keys=True) for r in _records(out))
    assert params == sorted([
        "{}",
        json.dumps({"evict_ratio": 0.2, "hbm_ratio": 0.3, "quant_ratio": 0.0, "recent_window": 2}, sort_keys=True),
        json.dumps({"budget_ratio": 0.8, "buffer": 4}, sort_keys=True),
    ])
    res = runner.invoke(app, ["sweep", *TINY, "--config", str(tmp_path / "missing.json"), "--out", str(out)])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_sweep_compares_at_equal_eviction_equal_memory_and_fixed_budgets(tmp_path):
    """One config file, both comparisons and absolute budgets; the report labels each row and its budget."""
    cfg = {"benchmark": "gsm8k", "policy": "full,tiered,h2o,snapkv_decode,snapkv", "evict_ratio": "0.5",
           "hbm_ratio": [0.3], "compare": "both", "budget_tokens": "40", "limit": 2, "max_new_tokens": 10,
           "policy_params": {"tiered": {"recent_window": 4, "retier_interval": 4}, "snapkv_decode": {"buffer": 4}}}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "grid"
    res = runner.invoke(app, ["sweep", *TINY, "--config", str(path), "--data-dir", str(DATA_DIR), "--out", str(out),
                              "--batch-size", "2"])
    assert res.exit_code == 0, res.output
    recs = _records(out)
    got = {(r["policy"], json.dumps({k: v for k, v in r["params"].items() if k != "buffer"}, sort_keys=True)) for r in recs}
    want = {("full", "{}"), ("tiered", json.dumps({"evict_ratio": 0.5, "hbm_ratio": 0.3, "quant_ratio": 0.0,
                                                   "recent_window": 4, "retier_interval": 4}, sort_keys=True))}
    for pol in ("h2o", "snapkv_decode"):
        want |= {(pol, '{"budget_ratio": 0.5}'), (pol, '{"budget_floor": 4, "budget_ratio": 0.3}'), (pol, '{"budget_tokens": 40}')}
    want |= {("snapkv", '{"budget_ratio": 0.5}'), ("snapkv", '{"budget_tokens": 40}')}  # no equal memory: prompt-only
    assert got == want
    for r in recs:
        if r["policy"] in ("h2o", "snapkv_decode", "snapkv"):
            assert r["budget_tokens"] >= 1 and r["tier_tokens"]["T0"] <= r["budget_tokens"] + 4
        else:
            assert r["budget_tokens"] is None
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    md = (out / "summary.md").read_text()
    for label in ("equal memory (hbm 0.3)", "equal eviction (0.5)", "fixed budget (40 tokens)", "reference", "hierarchy"):
        assert label in md
    rows = json.loads((out / "summary.json").read_text())["configs"]
    mem = [r for r in rows if r["comparison"].startswith("equal memory")]
    assert len(mem) == 2 and all(r["evict_ratio"] is None and r["mean_budget_tokens"] > 0 for r in mem)
    assert "| recent_window=4, retier_interval=4 |" in md  # the tiered row's own settings are shown


def test_report_labels_equal_memory_without_a_floor_and_shows_settings():
    """With the hierarchy's prompt unprotected the sweep's equal-memory budget has no floor (the same numbers as
    equal eviction at 1 - hbm): the row is labelled by what it was run for, and the settings column tells
    tiered rows with equal ratios apart."""
    from kvtier.eval.report import comparison, settings

    filled = {"budget_ratio": 0.3, "budget_floor": None, "budget_tokens": None}
    assert comparison("h2o", filled, {"budget_ratio": 0.3, "budget_floor": None}) == "equal memory (hbm 0.3)"
    assert comparison("h2o", filled, {"budget_ratio": 0.3}) == "equal eviction (0.7)"
    assert comparison("h2o", {**filled, "budget_floor": 64}, {"budget_ratio": 0.3}) == "equal memory (hbm 0.3)"
    assert settings({"protect_prompt": False, "hbm_ratio": 0.3, "evict_ratio": 0.03, "quant_ratio": 0.0}) == "protect_prompt=False"
    assert settings({"attention": "ordered", "hbm_ratio": 0.5, "quant_ratio": 0.1}) == "attention=ordered, quant_ratio=0.1"
    assert settings({"budget_ratio": 0.3, "budget_floor": None}) == ""


@pytest.mark.parametrize("args, message", [(["--compare", "same-memory"], "--compare"),
                                           (["--budget-tokens", "12,x"], "--budget-tokens"),
                                           (["--budget-tokens", "0"], "--budget-tokens")])
def test_sweep_bad_comparison_flags(tmp_path, args, message):
    res = runner.invoke(app, ["sweep", *TINY, "--policy", "full,h2o", "--limit", "1", "--data-dir", str(DATA_DIR),
                              "--out", str(tmp_path / "x"), *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "x" / "records.jsonl").exists()


def test_reasoning_gym_task_options():
    from kvtier.eval.datasets import DataError, load_problems, parse_rg

    assert parse_rg("chain_sum?min_terms=3&max_digits=2&allow_negation=true&x=a") == (
        "chain_sum", {"min_terms": 3, "max_digits": 2, "allow_negation": True, "x": "a"})
    easy = load_problems("rg:chain_sum?min_terms=2&max_terms=2&max_digits=1", limit=5)
    # two one-digit terms: "a op b =" with single digits only
    assert all(len([t for t in p.question.split(":")[-1].split() if t.isdigit()]) == 2 for p in easy)
    assert all(len(t) == 1 for p in easy for t in p.question.split(":")[-1].split() if t.isdigit())
    assert easy.fingerprint != load_problems("rg:chain_sum", limit=5).fingerprint
    with pytest.raises(DataError, match="cannot build task 'chain_sum'"):
        load_problems("rg:chain_sum?bogus=1", limit=1)
    with pytest.raises(DataError, match="key=value"):
        load_problems("rg:chain_sum?min_terms", limit=1)


def test_sweep_parts_are_sub_grids_of_one_run(tmp_path):
    """``parts``: each sub-grid overrides the top level (policy_params merged per policy); a configuration listed in
    two parts runs once; run-wide keys may not be set per part; --dry-run lists the configurations, runs nothing."""
    cfg = {"benchmark": "gsm8k", "limit": 2, "max_new_tokens": 4, "hbm_ratio": "0.3",
           "policy_params": {"tiered": {"recent_window": 2, "retier_interval": 4}},
           "parts": [{"policy": "full,tiered", "evict_ratio": "0.2"},
                     {"policy": "full,tiered", "evict_ratio": "0.5", "limit": 1,
                      "policy_params": {"tiered": {"attention": "ordered"}}}]}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "grid"
    res = runner.invoke(app, ["sweep", *TINY, "--config", str(path), "--data-dir", str(DATA_DIR), "--out", str(out),
                              "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "4 configurations" in res.output and "attention=ordered" in res.output and not out.exists()
    res = runner.invoke(app, ["sweep", *TINY, "--config", str(path), "--data-dir", str(DATA_DIR), "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = sorted((r["policy"], r["id"], json.dumps(r["params"], sort_keys=True)) for r in _records(out))
    t1 = json.dumps({"evict_ratio": 0.2, "hbm_ratio": 0.3, "quant_ratio": 0.0, "recent_window": 2,
                     "retier_interval": 4}, sort_keys=True)
    t2 = json.dumps({"attention": "ordered", "evict_ratio": 0.5, "hbm_ratio": 0.3, "quant_ratio": 0.0,
                     "recent_window": 2, "retier_interval": 4}, sort_keys=True)
    assert got == sorted([("full", "gsm8k-0", "{}"), ("full", "gsm8k-1", "{}"),  # full once, at the larger limit
                          ("tiered", "gsm8k-0", t1), ("tiered", "gsm8k-1", t1), ("tiered", "gsm8k-0", t2)])
    res = runner.invoke(app, ["report", str(out), "--claims"])
    assert res.exit_code == 0, res.output
    md = (out / "claims.md").read_text()
    assert md.count("**not testable here**") == 7 and "| gsm8k | 2 |" in md  # no claim's configurations; 2 chains
    assert json.loads((out / "claims.json").read_text())["chains"][0]["n"] == 2
    for bad, message in (({"parts": [{"policy": "full", "batch_size": 2}]}, "whole run"),
                         ({"parts": []}, "non-empty list"),
                         ({"parts": [{"policy": "full", "bogus": 1}]}, "parts[0]: unknown key(s) ['bogus']")):
        path.write_text(json.dumps({"benchmark": "gsm8k", **bad}))
        res = runner.invoke(app, ["sweep", *TINY, "--config", str(path), "--out", str(tmp_path / "bad")])
        assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output, res.output


def test_file_benchmark_seeded_subset():
    """``math500?shuffle=S``: a fixed permutation, so a larger limit extends the same subset; ids, prompts and
    grading are those of the base benchmark; anything else after ``?`` is one DataError."""
    from kvtier.eval.datasets import DataError, load_problems
    from kvtier.eval.grading import grade
    from kvtier.eval.prompts import user_message

    head = load_problems("math500", DATA_DIR, limit=10)
    a = load_problems("math500?shuffle=0", DATA_DIR, limit=10)
    b = load_problems("math500?shuffle=0", DATA_DIR, limit=20)
    c = load_problems("math500?shuffle=1", DATA_DIR, limit=10)
    everything = {p.id: p for p in load_problems("math500", DATA_DIR)}
    assert [p.id for p in b[:10]] == [p.id for p in a] and [p.id for p in a] != [p.id for p in head]
    assert [p.id for p in a] != [p.id for p in c] and len({p.id for p in b}) == 20
    assert all(everything[p.id].question == p.question and everything[p.id].gold == p.gold for p in b)
    assert a.fingerprint == b.fingerprint != c.fingerprint != head.fingerprint
    assert user_message("math500?shuffle=0", a[0]) == user_message("math500", a[0])
    assert grade("math500?shuffle=0", "\\boxed{" + a[0].gold + "}", a[0].gold)
    for bad in ("math500?seed=1", "math500?shuffle=x", "nope?shuffle=1"):
        with pytest.raises(DataError, match="shuffle"):
            load_problems(bad, DATA_DIR)


def test_gsm8k_steps_strata():
    """``gsm8k?steps=lo-hi``: exactly the problems whose reference solution has lo..hi lines before ``####``,
    with the whole file's ids, in file order (or a seeded order with ``&shuffle``); the strata partition the file;
    a bad range, a repeated option or steps on another benchmark is one DataError naming the options."""
    import json

    from kvtier.eval.datasets import DataError, gsm8k_steps, load_problems

    lines = [json.loads(x) for x in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines() if x.strip()]
    everything = load_problems("gsm8k", DATA_DIR)
    want = {p.id for p, r in zip(everything, lines) if 3 <= gsm8k_steps(r["answer"]) <= 4}
    mid = load_problems("gsm8k?steps=3-4", DATA_DIR)
    assert {p.id for p in mid} == want and len(mid) == len(want) > 0
    assert [p.id for p in mid] == [p.id for p in everything if p.id in want]  # file order
    assert gsm8k_steps("a\n\nb <<1+1=2>>\n#### 2") == 2 and gsm8k_steps("#### 3") == 0
    strata = [load_problems(s, DATA_DIR) for s in ("gsm8k?steps=1-2", "gsm8k?steps=3-4", "gsm8k?steps=5-99")]
    assert sum(len(s) for s in strata) == len(everything)
    assert len({p.id for s in strata for p in s}) == len(everything)
    two = load_problems("gsm8k?steps=2", DATA_DIR, limit=5)
    assert all(gsm8k_steps(lines[int(p.id.split("-")[1])]["answer"]) == 2 for p in two)
    shuf = load_problems("gsm8k?steps=3-4&shuffle=0", DATA_DIR, limit=10)
    assert {p.id for p in shuf} <= want and [p.id for p in shuf] != [p.id for p in mid[:10]]
    assert len({mid.fingerprint, shuf.fingerprint, everything.fingerprint, two.fingerprint}) == 4
    for bad in ("gsm8k?steps=0", "gsm8k?steps=4-3", "gsm8k?steps=x", "gsm8k?steps=2&steps=3", "math500?steps=2",
                "gsm8k?steps=2&seed=1"):
        with pytest.raises(DataError, match="steps"):
            load_problems(bad, DATA_DIR)
    with pytest.raises(DataError, match="no gsm8k problem"):
        load_problems("gsm8k?steps=50-60", DATA_DIR)


@pytest.mark.parametrize("spec", sorted(p.name for p in (REPO / "benchmarks" / "sweeps").glob("*.json")))
def test_committed_sweep_specs_list_their_configurations(spec, tmp_path):
    """Every campaign spec in benchmarks/sweeps parses and expands (``--dry-run``: no model, no records): a typo in
    a spec is found here, not hours into a run."""
    res = runner.invoke(app, ["sweep", "--config", str(REPO / "benchmarks" / "sweeps" / spec), "--out",
                              str(tmp_path / "dry"), "--dry-run", "--data-dir", str(DATA_DIR)])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "dry" / "records.jsonl").exists()
