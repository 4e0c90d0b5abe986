"""Fuzz: random command lines over every command's flags end in exit 0, or exit 2 with one ``error:`` line —
never a traceback, never an internal error, never a records file from a rejected command.

Valid values are kept small (a tiny random model, 1-2 problems, a few tokens) so that the runs that do start
finish in a fraction of a second; invalid ones are the kinds users type: 0, negatives, nan, inf, words, huge
numbers, empty strings, paths that are files or do not exist.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DATA_DIR
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from kvtier.cli import app

pytestmark = [pytest.mark.fuzz,  # hundreds of generated command lines: left out of make test-fast
              pytest.mark.skipif(not DATA_DIR.is_dir(), reason="shared benchmark data not found next to the repo")]
runner = CliRunner()

BAD_NUMBERS = ["0", "-1", "nan", "inf", "-inf", "abc", "", "1e9", "1.5", "-0.1", "100000000"]
BAD_WORDS = ["", "nope", "random:nope", "gsm9k", "rg:", "cuda:7", "tpu", "x=y", "=", "1,,2", "full,nope"]


def _mix(good, bad):
    return st.one_of(st.sampled_from(good), st.sampled_from(bad))


RATIO = _mix(["0", "0.1", "0.3", "0.5", "1"], BAD_NUMBERS)
RATIOS = _mix(["0.1", "0.1,0.5", "0.3", "0.03,0.5"], BAD_NUMBERS + ["0.1,abc", "0.5,1.5"])
SMALL = _mix(["1", "2"], BAD_NUMBERS)
TOKENS = _mix(["1", "3", "4"], BAD_NUMBERS)
POLICY = _mix(["full", "tiered", "evict", "quant", "h2o", "rkv", "snapkv", "snapkv_decode", "streaming_llm"], BAD_WORDS)
POLICIES = _mix(["full", "full,tiered", "full,h2o", "tiered,rkv", "full,snapkv_decode,streaming_llm"], BAD_WORDS)
PARAM = _mix(["retier_interval=4", "recent_window=2", "protect_prompt=false", "buffer=4", "lam=paper", "window=2",
              "sink_tokens=1", "heavy_ratio=0.5", "budget_tokens=8"],
             ["lam=3", "buffer=0", "window=-1", "nope=1", "retier_interval=abc", "noequals", "kernel_size=4",
              "protect_prompt=maybe", "budget_tokens=0", "hbm_ratio=nan"])
BENCH = _mix(["gsm8k", "rg:chain_sum"], ["gsm9k", "rg:", "mmlu", ""])
DEVICE = _mix(["cpu", "auto"], ["cuda", "cuda:3", "tpu", ""])
DTYPE = _mix(["fp32", "auto"], ["fp64", "int8", ""])
MODEL = _mix(["random:tiny-qwen2", "random:tiny-llama"], ["random:nope", "/nonexistent/model", "nope", "x.gguf"])
TEMP = _mix(["0", "0.7"], ["nan", "-1", "inf", "abc"])


def flags_for(command: str) -> dict:
    """Each command's flags -> a strategy for its value (None: a boolean flag)."""
    common_eval = {"--model": MODEL, "--device": DEVICE, "--dtype": DTYPE, "--max-new-tokens": TOKENS,
                   "--batch-size": SMALL, "--limit": SMALL, "--temperature": TEMP, "--top-p": RATIO,
                   "--seed": _mix(["0", "3"], ["abc", "1.5"]), "--samples": SMALL, "--benchmark": BENCH,
                   "--data-dir": st.sampled_from([str(DATA_DIR), "/nonexistent/data"])}
    table = {
        "eval": {**common_eval, "--policy": POLICY, "--hbm-ratio": RATIO, "--evict-ratio": RATIO,
                 "--quant-ratio": RATIO, "--budget-ratio": RATIO, "--budget-tokens": TOKENS, "--param": PARAM},
        "sweep": {**common_eval, "--policy": POLICIES, "--hbm-ratio": RATIOS, "--evict-ratio": RATIOS,
                  "--quant-ratio": RATIO, "--compare": _mix(["equal-eviction", "equal-memory", "both"], BAD_WORDS),
                  "--budget-tokens": _mix(["8", "8,16"], BAD_NUMBERS + ["8,x"])},
        "generate": {"--model": MODEL, "--policy": POLICY, "--hbm-ratio": RATIO, "--evict-ratio": RATIO,
                     "--quant-ratio": RATIO, "--budget-ratio": RATIO, "--budget-tokens": TOKENS, "--param": PARAM,
                     "--max-new-tokens": TOKENS, "--device": DEVICE, "--dtype": DTYPE},
        "demo": {"--model": MODEL, "--problems": SMALL, "--benchmark": _mix(["rg:chain_sum"], ["gsm9k", "rg:"]),
                 "--max-new-tokens": TOKENS, "--batch-size": SMALL, "--device": DEVICE, "--dtype": DTYPE},
        "bench": {"--model": MODEL, "--context": _mix(["8", "12"], BAD_NUMBERS), "--new-tokens": _mix(["1", "2"], BAD_NUMBERS),
                  "--batch": _mix(["1"], BAD_NUMBERS + ["1,x"]), "--policy": _mix(["full", "full,tiered"], BAD_WORDS),
                  "--hbm-ratio": RATIOS, "--evict-ratio": RATIOS, "--retier-interval": _mix(["4"], BAD_NUMBERS),
                  "--recent-window": _mix(["2"], BAD_NUMBERS), "--repeats": _mix(["1"], BAD_NUMBERS),
                  "--warmup-steps": _mix(["0", "2"], BAD_NUMBERS),
                  "--attention": _mix(["split", "split,ordered"], BAD_WORDS),
                  "--t1-attention": _mix(["auto", "stream,host"], BAD_WORDS),
                  "--device": DEVICE, "--dtype": DTYPE},
        "plan": {"--model": _mix(["random:tiny-qwen2", "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"], BAD_WORDS),
                 "--batch": _mix(["1", "8"], BAD_NUMBERS), "--seq-len": _mix(["128", "4096"], BAD_NUMBERS),
                 "--hbm-ratio": RATIO, "--evict-ratio": RATIO, "--quant-ratio": RATIO,
                 "--protected-tokens": _mix(["0", "64"], BAD_NUMBERS), "--dtype": _mix(["bf16", "fp32"], BAD_WORDS),
                 "--pcie-gbps": _mix(["50"], BAD_NUMBERS), "--hbm-gbps": _mix(["4800"], BAD_NUMBERS),
                 "--host-gbps": _mix(["150"], BAD_NUMBERS), "--hardware": _mix(["h200", "cpu"], BAD_WORDS), "--json": None},
        "report": {},
    }
    return table[command]


# small, valid sizes unless the fuzz overrides them: the runs that start stay short
DEFAULTS = {
    "eval": ["--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu", "--limit", "1", "--max-new-tokens", "3",
             "--benchmark", "gsm8k"],
    "sweep": ["--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu", "--limit", "1", "--max-new-tokens", "3",
              "--policy", "full", "--benchmark", "gsm8k"],
    "generate": ["--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "3"],
    "demo": ["--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu", "--problems", "1",
             "--max-new-tokens", "3", "--benchmark", "rg:chain_sum"],
    "bench": ["--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu", "--context", "8", "--new-tokens", "1",
              "--batch", "1", "--policy", "full", "--repeats", "1", "--no-stock"],
    "plan": [],
    "report": [],
}


@st.composite
def command_lines(draw, tmp: Path):
    command = draw(st.sampled_from(sorted(DEFAULTS)))
    flags = flags_for(command)
    args = list(DEFAULTS[command])
    for flag in draw(st.lists(st.sampled_from(sorted(flags)), max_size=4, unique=True)) if flags else []:
        strat = flags[flag]
        args += [flag] if strat is None else [flag, draw(strat)]
    out = tmp / f"run{draw(st.integers(0, 3))}"
    if command in ("eval", "sweep", "demo"):
        args += ["--out", str(draw(st.sampled_from([out, tmp / "a_file", out])))]
    if command == "report":
        args = [str(draw(st.sampled_from([out, tmp / "a_file", tmp / "missing", tmp / "bad_records"])))]
    if command == "bench" and draw(st.booleans()):
        args += ["--json", str(draw(st.sampled_from([tmp / "b.json", tmp, tmp / "a_file" / "b.json"])))]
    if command == "generate":
        args = [draw(st.sampled_from(["What is 2 + 2?", ""]))] + args
    return command, args, out


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "a_file").write_text("not a folder")
    (d / "bad_records").mkdir()
    (d / "bad_records" / "records.jsonl").write_text("[1, 2, 3]\n")
    return d


def _records_lines(out: Path) -> int:
    p = out / "records.jsonl"
    return len(p.read_text().splitlines()) if p.is_file() else 0


def test_random_command_lines_end_in_a_clean_exit(fuzz_dir):
    seen = {"ok": 0, "rejected": 0}

    @settings(max_examples=320, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def run(data):
        command, args, out = data.draw(command_lines(fuzz_dir))
        before = _records_lines(out)
        res = runner.invoke(app, [command, *args])
        text = res.output
        assert "Traceback" not in text, (command, args, text)
        assert res.exit_code in (0, 2), (command, args, res.exit_code, text)
        if res.exit_code == 2:
            lines = [x for x in text.strip().splitlines() if x.strip()]
            assert len(lines) == 1 and lines[0].startswith("error:"), (command, args, text)
            assert _records_lines(out) == before, (command, args, "a rejected command wrote records")
            seen["rejected"] += 1
        else:
            seen["ok"] += 1
        if _records_lines(out):  # whatever ran left well-formed records
            for line in (out / "records.jsonl").read_text().splitlines():
                assert isinstance(json.loads(line), dict)

    run()
    assert seen["ok"] >= 20 and seen["rejected"] >= 100, seen
