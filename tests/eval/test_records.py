"""Records you can trust: one test per reported defect (issue #11, rows 1-21), the two-writer race and a
SIGKILLed holder, and the resume key. CLI through typer's runner (in process) unless real processes matter."""

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
from conftest import DATA_DIR, REPO, prompt_ids
from typer.testing import CliRunner

import kvtier
from kvtier.cli import app
from kvtier.compat import cache_kw
from kvtier.models import preset_config

pytestmark = pytest.mark.skipif(not DATA_DIR.is_dir(), reason="shared benchmark data not found next to the repo")
runner = CliRunner()
TINY = ["--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu"]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]


def _eval(out: Path, *args: str, data_dir: Path | str = DATA_DIR):
    return runner.invoke(app, ["eval", *TINY, "--benchmark", "gsm8k", "--policy", "full", "--limit", "3",
                               "--max-new-tokens", "4", "--batch-size", "3", "--data-dir", str(data_dir),
                               "--out", str(out), *args])


def _one_error(res, *needles: str) -> str:
    """Exit code 2, exactly one line of output starting with 'error:', no traceback, containing the needles."""
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _write_gsm8k(root: Path, rows: list, raw_lines: list[str] | None = None) -> Path:
    (root / "gsm8k").mkdir(parents=True, exist_ok=True)
    lines = raw_lines if raw_lines is not None else [json.dumps(r) for r in rows]
    (root / "gsm8k" / "test.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
    return root


GSM = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(1, 5)]


# ---- 1. two writers on one folder; a SIGKILLed holder ------------------------------------------------------
def _eval_proc(out: Path, limit: int, new_tokens: int = 24) -> list[str]:
    return [sys.executable, "-m", "kvtier", "eval", *TINY, "--benchmark", "gsm8k", "--policy", "full",
            "--limit", str(limit), "--max-new-tokens", str(new_tokens), "--batch-size", "1", "--data-dir", str(DATA_DIR),
            "--out", str(out)]


@pytest.mark.heavy
def test_one_writer_per_folder_and_a_killed_holder_is_taken_over(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # the holder is slow (long generations) so that it still holds the folder when the second one starts
    holder = subprocess.Popen(_eval_proc(out, 30, new_tokens=300), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    path = out / "records.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (path.exists() and path.read_text().count("\n") >= 2):
        time.sleep(0.05)
    second = subprocess.run(_eval_proc(out, 30), env=env, capture_output=True, text=True, timeout=300)
    assert holder.poll() is None, "the holder must still be running"
    assert second.returncode == 2, second.stderr
    lines = [x for x in (second.stdout + second.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "in use by another kvtier process" in lines[0] and f"PID {holder.pid}" in lines[0]
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    n_killed = path.read_text().count("\n")
    assert 2 <= n_killed < 30
    again = subprocess.run(_eval_proc(out, 30, new_tokens=300), env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    ids = [r["id"] for r in _records(out)]
    assert sorted(ids) == sorted(f"gsm8k-{i}" for i in range(30))  # every problem exactly once


def test_report_counts_each_problem_once_even_with_duplicated_lines(tmp_path):
    out = tmp_path / "run"
    assert _eval(out).exit_code == 0
    text = (out / "records.jsonl").read_text()
    (out / "records.jsonl").write_text(text + text)  # what two unlocked writers used to leave
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "summary.json").read_text())["configs"]
    assert [r["n"] for r in rows] == [3]


# ---- 2-4. the resume key -----------------------------------------------------------------------------------
def test_dtype_is_part_of_the_key(tmp_path):
    out = tmp_path / "run"
    assert _eval(out).exit_code == 0
    res = runner.invoke(app, ["eval", "--model", "random:tiny-qwen2", "--dtype", "bf16", "--device", "cpu",
                              "--benchmark", "gsm8k", "--policy", "full", "--limit", "3", "--max-new-tokens", "4",
                              "--data-dir", str(DATA_DIR), "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = _records(out)
    assert len(recs) == 6 and {r["key_inputs"]["dtype"] for r in recs} == {"float32", "bfloat16"}
    assert len({r["config_key"] for r in recs}) == 2
    assert "dtype = ['bfloat16', 'float32']" in (out / "summary.md").read_text()


def test_the_kernel_choice_at_its_default_leaves_the_key_alone(tmp_path):
    """``kernel`` (how the split step computes: rounding only) joined the policies after records existed: at its
    default it is not part of the key, so earlier records still resume; set explicitly it is; records say which
    kernel ran."""
    from kvtier.eval.runner import EvalConfig

    base = dict(model="random:tiny-qwen2", benchmark="gsm8k", policy="tiered", params={"hbm_ratio": 0.3})
    ident = {"model": "m"}
    plain = EvalConfig(**base).key_inputs(ident)
    assert "kernel" not in plain["params"] and plain["params"]["attention"] == "split"
    assert EvalConfig(**dict(base, params={"hbm_ratio": 0.3, "kernel": "auto"})).key(ident) == EvalConfig(**base).key(ident)
    assert EvalConfig(**dict(base, params={"hbm_ratio": 0.3, "kernel": "eager"})).key(ident) != EvalConfig(**base).key(ident)
    out = tmp_path / "run"
    assert _eval(out, "--policy", "tiered", "--param", "protect_prompt=false").exit_code == 0
    assert {r["kernel"] for r in _records(out)} == {"fused"}


def test_other_questions_with_the_same_ids_are_not_reused(tmp_path):
    a = _write_gsm8k(tmp_path / "a", GSM)
    b = _write_gsm8k(tmp_path / "b", [dict(r, question=r["question"].replace("+", "*"), answer="#### 7") for r in GSM])
    out = tmp_path / "run"
    assert _eval(out, data_dir=a).exit_code == 0
    assert _eval(out, data_dir=b).exit_code == 0
    recs = _records(out)
    assert len(recs) == 6
    new = [r for r in recs if r["key_inputs"]["problem_set"] == recs[-1]["key_inputs"]["problem_set"]]
    assert len(new) == 3 and {r["gold"] for r in new} == {"7"}
    assert _eval(out, data_dir=a).exit_code == 0 and len(_records(out)) == 6  # a's records are reused


def test_sampling_does_not_depend_on_the_batch_size(tmp_path):
    common = ["--temperature", "0.9", "--samples", "2", "--max-new-tokens", "8"]
    assert _eval(tmp_path / "b3", *common).exit_code == 0
    res = runner.invoke(app, ["eval", *TINY, "--benchmark", "gsm8k", "--policy", "full", "--limit", "3", *common,
                              "--batch-size", "1", "--data-dir", str(DATA_DIR), "--out", str(tmp_path / "b1")])
    assert res.exit_code == 0, res.output
    a = {(r["id"], r["sample"]): r["completion"] for r in _records(tmp_path / "b3")}
    b = {(r["id"], r["sample"]): r["completion"] for r in _records(tmp_path / "b1")}
    assert a == b and len(a) == 6
    assert len({a[("gsm8k-0", 0)], a[("gsm8k-0", 1)]}) == 2  # the samples are really different draws


def test_a_default_given_explicitly_is_the_same_configuration(tmp_path):
    """Row 9: --hbm-ratio 0.3, then --param hbm_ratio=0.3 --param evict_ratio=0.03 (the defaults) into one
    folder: one configuration; a third with another eviction ratio; report and heatmap work."""
    out = tmp_path / "run"
    assert _eval(out, "--policy", "tiered", "--hbm-ratio", "0.3").exit_code == 0
    res = _eval(out, "--policy", "tiered", "--param", "hbm_ratio=0.3", "--param", "evict_ratio=0.03")
    assert res.exit_code == 0, res.output
    assert len(_records(out)) == 3
    assert _eval(out, "--policy", "tiered", "--evict-ratio", "0.1").exit_code == 0
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "gsm8k_hbm_evict_heatmap.png").is_file()
    assert len(json.loads((out / "summary.json").read_text())["configs"]) == 2


# ---- 5-7, 10-13. validate everything before anything runs --------------------------------------------------
@pytest.mark.parametrize("args, needles", [
    (["--hbm-ratio", "1.5", "--policy", "full,tiered"], ["--hbm-ratio", "[0, 1]"]),          # 5
    (["--evict-ratio", "-0.1", "--policy", "full,tiered"], ["--evict-ratio", "[0, 1]"]),     # 6
    (["--evict-ratio", "nan"], ["--evict-ratio", "finite"]),
    (["--policy", "full,h2o", "--evict-ratio", "1"], ["h2o", "no grid point"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["--max-new-tokens", "100000000"], ["--max-new-tokens", "4096 positions"]),
])
def test_sweep_rejects_bad_grids_before_running(tmp_path, args, needles):
    out = tmp_path / "grid"
    res = runner.invoke(app, ["sweep", *TINY, "--benchmark", "gsm8k", "--limit", "1", "--data-dir", str(DATA_DIR),
                              "--out", str(out), *args])
    _one_error(res, *needles)
    assert not out.exists()  # nothing written, not even the folder


def test_sweep_says_which_points_it_skips(tmp_path):
    res = runner.invoke(app, ["sweep", *TINY, "--policy", "tiered", "--hbm-ratio", "0.3,0.8", "--evict-ratio", "0.5",
                              "--limit", "1", "--max-new-tokens", "2", "--data-dir", str(DATA_DIR),
                              "--out", str(tmp_path / "g")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "skipped 1 grid point" in text and "hbm 0.8 + evict 0.5" in text


def test_flags_override_the_config_file(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"policy": "full,tiered,h2o", "limit": 5, "max_new_tokens": 3, "evict_ratio": "0.2"}))
    out = tmp_path / "g"
    res = runner.invoke(app, ["sweep", *TINY, "--config", str(cfg), "--limit", "2", "--policy", "full",
                              "--data-dir", str(DATA_DIR), "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = _records(out)
    assert len(recs) == 2 and {r["policy"] for r in recs} == {"full"}
    assert {r["max_new_tokens"] for r in recs} == {3}  # not given on the command line: the file's value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"polcy": "full"}))
    _one_error(runner.invoke(app, ["sweep", *TINY, "--config", str(bad), "--out", str(tmp_path / "x")]), "unknown key", "polcy")


@pytest.mark.parametrize("args, needles", [
    (["--policy", "tiered", "--hbm-ratio", "-0.1"], ["hbm_ratio", "[0, 1]"]),     # 10
    (["--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),                     # 11
    (["--temperature", "nan"], ["--temperature", "finite"]),                       # 12
    (["--temperature", "inf"], ["--temperature", "finite"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--max-new-tokens", "100000000"], ["4096 positions"]),                       # 13
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"], ["--device"]),  # 15
    (["--param", "lam=3", "--policy", "rkv", "--budget-ratio", "0.5"], ["lam"]),
])
def test_eval_rejects_bad_input_before_loading_anything(tmp_path, args, needles):
    out = tmp_path / "run"
    _one_error(_eval(out, *args), *needles)
    assert not out.exists()


def test_prompt_plus_new_tokens_beyond_the_positions_is_refused_before_generating(tmp_path):
    """The preset allows 4096 positions; prompts are ~370 tokens, so 3900 new tokens fit alone but not with them."""
    out = tmp_path / "run"
    _one_error(_eval(out, "--max-new-tokens", "3900"), "prompt tokens", "4096 positions")
    assert not (out / "records.jsonl").exists()


@pytest.mark.parametrize("args, needles", [(["--context", "0"], ["context", ">= 1"]), (["--new-tokens", "0"], ["new_tokens"]),
                                           (["--hbm-ratio", "2"], ["--hbm-ratio"]), (["--batch", "0"], ["batch"])])
def test_bench_zero_is_not_the_default(args, needles):
    _one_error(runner.invoke(app, ["bench", *TINY, *args]), *needles)


def test_bench_json_folder_is_refused_before_running(tmp_path):
    t = time.perf_counter()
    res = runner.invoke(app, ["bench", *TINY, "--json", str(tmp_path) + "/"])
    _one_error(res, "--json", "is a directory")
    assert time.perf_counter() - t < 20


def test_bench_writes_each_finished_batch(tmp_path):
    from kvtier.tools.bench import BenchConfig, run_bench

    seen = []
    cfg = BenchConfig(model="random:tiny-qwen2", context=8, new_tokens=2, batches=(1, 2), policies=("full",),
                      hbm_ratios=(0.3,), repeats=1, warmup_steps=1, stock=False, device="cpu", dtype="fp32")
    res = run_bench(cfg, on_rows=lambda partial: seen.append([r["batch"] for r in partial["results"]]))
    assert seen == [[1], [1, 2]] and [r["batch"] for r in res["results"]] == [1, 2]
    out = tmp_path / "b.json"
    result = runner.invoke(app, ["bench", *TINY, "--context", "8", "--new-tokens", "2", "--batch", "1", "--policy", "full",
                                 "--repeats", "1", "--no-stock", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["results"][0]["batch"] == 1 and not out.with_name("b.json.tmp").exists()


# ---- 8. report is read-only -------------------------------------------------------------------------------
def test_report_never_rewrites_records(tmp_path):
    out = tmp_path / "run"
    assert _eval(out).exit_code == 0
    path = out / "records.jsonl"
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # a complete last record without its newline
    before = path.read_bytes()
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0, res.output
    assert path.read_bytes() == before
    assert json.loads((out / "summary.json").read_text())["configs"][0]["n"] == 3
    path.write_bytes(before + b'\n{"benchmark": "gsm8k", "id": "gsm')  # a torn tail
    torn = path.read_bytes()
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0 and path.read_bytes() == torn
    # the next writer cuts the torn tail and keeps the complete record
    assert _eval(out, "--limit", "4").exit_code == 0
    assert sorted(r["id"] for r in _records(out)) == [f"gsm8k-{i}" for i in range(4)]


# ---- 15-17. bad files and paths: one line naming the file and the line -------------------------------------
def test_bad_records_line_names_the_line(tmp_path):
    out = tmp_path / "run"
    assert _eval(out).exit_code == 0
    path = out / "records.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + ["[1, 2, 3]"] + lines[1:]) + "\n")
    _one_error(runner.invoke(app, ["report", str(out)]), "records.jsonl line 2", "not a kvtier record")
    _one_error(_eval(out, "--limit", "4"), "line 2")  # a writer refuses it too, and appends nothing
    assert len(path.read_text().splitlines()) == 4


@pytest.mark.parametrize("case, needles", [
    ("missing", ["line 2", "missing field", "question"]),
    ("malformed", ["line 4", "not valid JSON"]),
    ("empty", ["holds no problems"]),
    ("not_object", ["line 1", "JSON object"]),
])
def test_bad_data_files(tmp_path, case, needles):
    good = [json.dumps(r) for r in GSM]
    raw = {"missing": [good[0], json.dumps({"answer": "#### 1"}), good[2]],
           "malformed": good[:3] + ['{"question": "tab\there", "answer": "#### 1"'],
           "empty": [], "not_object": ["[1]"]}[case]
    root = _write_gsm8k(tmp_path / "d", [], raw)
    out = tmp_path / "run"
    msg = _one_error(_eval(out, data_dir=root), *needles)
    assert str(root / "gsm8k" / "test.jsonl") in msg
    assert not (out / "records.jsonl").exists()


def test_arc_answer_key_outside_the_labels(tmp_path):
    (tmp_path / "d" / "arc_challenge").mkdir(parents=True)
    row = {"id": "x1", "question": "?", "choices": [{"label": "A", "text": "a"}, {"label": "B", "text": "b"}], "answerKey": "Z"}
    (tmp_path / "d" / "arc_challenge" / "test.jsonl").write_text(json.dumps(row) + "\n")
    res = runner.invoke(app, ["eval", *TINY, "--benchmark", "arc_challenge", "--data-dir", str(tmp_path / "d"),
                              "--out", str(tmp_path / "run")])
    _one_error(res, "line 1", "answerKey 'Z'", "['A', 'B']")


def test_paths_that_cannot_work(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    _one_error(_eval(f), "--out", "is a file")
    _one_error(runner.invoke(app, ["eval", "--model", str(tmp_path / "nope" / "model"), "--out", str(tmp_path / "r"),
                                   "--data-dir", str(DATA_DIR)]), "does not exist")
    _one_error(runner.invoke(app, ["report", str(tmp_path / "missing")]), "not a run folder")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 64}))
    _one_error(runner.invoke(app, ["plan", "--model", str(cfg)]), "num_attention_heads")
    cfg.write_text("{not json")
    _one_error(runner.invoke(app, ["plan", "--model", str(cfg)]), "not a JSON model config")


@pytest.mark.parametrize("args, needles", [(["--protected-tokens", "-5"], ["--protected-tokens"]),
                                           (["--hbm-gbps", "inf"], ["--hbm-gbps", "finite"]),
                                           (["--pcie-gbps", "nan"], ["--pcie-gbps"])])
def test_plan_rejects_impossible_numbers(args, needles):  # 21
    _one_error(runner.invoke(app, ["plan", "--model", "random:tiny-qwen2", *args]), *needles)


# ---- 18-20. a cache and the model it serves ----------------------------------------------------------------
def _model_with(layers: int, kv_heads: int = 2):
    from transformers import Qwen2Config

    d = preset_config("tiny-qwen2").to_dict()
    d.update(num_hidden_layers=layers, num_key_value_heads=kv_heads)
    d.pop("layer_types", None)
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(Qwen2Config(**d)).eval()


@pytest.mark.parametrize("policy", ["tiered", "h2o"])
@pytest.mark.parametrize("made_for, used_on, needles", [((2, 2), (4, 2), ["2 layers", "4 layers"]),
                                                        ((4, 2), (2, 2), ["4 layers", "2 layers"]),
                                                        ((2, 2), (2, 4), ["kv-heads"])])
def test_a_cache_refuses_a_model_of_another_shape(policy, made_for, used_on, needles):
    a, b = _model_with(*made_for), _model_with(*used_on)
    params = {"budget_ratio": 0.5} if policy == "h2o" else {}
    cache = kvtier.make_cache(policy, a, **params)
    kvtier.prepare_model(b)
    with pytest.raises(ValueError) as e:
        b.generate(prompt_ids(length=8), **cache_kw(b, cache), max_new_tokens=3, do_sample=False, pad_token_id=0)
    for n in needles:
        assert n in str(e.value)


@pytest.mark.parametrize("policy", ["full", "tiered", "h2o"])
def test_right_padding_is_refused(qwen2, policy):
    ids = prompt_ids(batch=2, length=10, seed=1)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    cache = kvtier.make_cache(policy, qwen2, **({"budget_ratio": 0.5} if policy == "h2o" else {}))
    with pytest.raises(ValueError, match="right padding is not supported.*padding_side = 'left'"):
        qwen2.generate(ids, attention_mask=mask, **cache_kw(qwen2, cache), max_new_tokens=2, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("policy", ["tiered", "h2o"])
@pytest.mark.parametrize("second", [1, 3])
def test_reuse_with_another_batch_size_is_a_value_error(qwen2, policy, second):
    cache = kvtier.make_cache(policy, qwen2, **({"budget_ratio": 0.5} if policy == "h2o" else {}))
    qwen2.generate(prompt_ids(batch=2, length=8), **cache_kw(qwen2, cache), max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match="cache.reset"):
        qwen2.generate(prompt_ids(batch=second, length=8), **cache_kw(qwen2, cache), max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_num_return_sequences_works_as_independent_rows(qwen2):
    """generate expands the prompt rows before the first forward, so each return sequence is a row of the
    cache: the README says this works (it used to say it is refused)."""
    ids = prompt_ids(length=10, seed=2)
    torch.manual_seed(0)
    out = qwen2.generate(ids, **cache_kw(qwen2, kvtier.make_cache("tiered", qwen2, hbm_ratio=0.3)), max_new_tokens=6, do_sample=True,
                         num_return_sequences=3, pad_token_id=0)
    torch.manual_seed(0)
    ref = qwen2.generate(ids, **cache_kw(qwen2, kvtier.make_cache("full", qwen2)), max_new_tokens=6, do_sample=True,
                         num_return_sequences=3, pad_token_id=0)
    assert out.shape == (3, 16) and torch.equal(out, ref)
    with pytest.raises(NotImplementedError, match="beam search"):
        qwen2.generate(ids, **cache_kw(qwen2, kvtier.make_cache("tiered", qwen2)), max_new_tokens=4, num_beams=2, do_sample=False,
                       pad_token_id=0)
