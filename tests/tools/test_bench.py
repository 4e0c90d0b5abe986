"""`kvtier bench`: its JSON schema and that it times what it says (not speed)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import prompt_ids
from transformers import DynamicCache
from typer.testing import CliRunner

import kvtier
from kvtier.cli import app
from kvtier.step.direct import direct_step
from kvtier.tools.bench import BenchConfig, _Run, run_bench

runner = CliRunner()


def test_bench_cpu_json_schema(tmp_path):
    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--model", "random:tiny-qwen2", "--context", "32", "--new-tokens", "4",
                              "--batch", "1,2", "--hbm-ratio", "0.3,0.5", "--evict-ratio", "0.03", "--repeats", "1", "--recent-window", "8", "--t1-on-device",
                                  "--attention", "split,ordered", "--t1-attention", "stream,host",
                              "--device", "cpu", "--dtype", "fp32", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "kvtier bench" in res.output and "tiered" in res.output
    data = json.loads(out.read_text())
    assert {"date", "device", "torch", "transformers", "config", "memcpy_peak_gbps", "results", "warmup_steps"} <= set(data)
    rows = data["results"]
    per_batch = ("stock_sdpa", "stock_static", "full", "full") + ("tiered",) * 8
    assert [(r["batch"], r["policy"]) for r in rows] == [(b, p) for b in (1, 2) for p in per_batch]
    assert sum(bool(r["params"].get("t1_on_device")) for r in rows) == 4
    # per tiered point: split/stream, split/host, ordered (streams), t1_on_device
    modes = [(r["params"].get("attention"), r["params"].get("t1_attention")) for r in rows[4:8]]
    assert modes == [("split", "stream"), ("split", "host"), ("ordered", "stream"), (None, "stream")]
    assert [r["t1_mode"] for r in rows[4:7]] == ["stream", "host", "stream"]
    # kvtier's caches decode through the direct step, the stock caches through the model's forward
    assert [r["step"] for r in rows] == ["model", "model"] + ["direct"] * 10 + ["model", "model"] + ["direct"] * 10
    common = {"batch", "policy", "params", "decode_tok_s", "ms_per_step", "ratio_to_full", "ratio_to_stock",
              "peak_device_bytes", "kv_bytes", "allocated_bytes", "seconds_repeats"}
    for r in rows:
        assert common <= set(r)
        assert r["decode_tok_s"] > 0 and set(r["kv_bytes"]) == {"T0", "T1", "T2"}
    for r in rows:
        if r["policy"] == "tiered":
            assert {"transfer_seconds", "transfer_share", "h2d_gbps", "h2d_fraction_of_peak", "h2d_bytes_per_step",
                    "migration_bytes_per_step", "tokens", "retiers", "h2d_floor_ms_per_step"} <= set(r)
            assert r["retiers"] >= 1
            if r["params"].get("t1_on_device"):  # streams only at reassignments, maybe none in 4 timed steps
                assert r["h2d_bytes_per_step"] >= 0
            elif r["t1_mode"] == "host":  # attended where it lives: nothing crosses per step
                assert r["h2d_bytes_per_step"] == 0
            else:
                assert r["h2d_bytes_per_step"] > 0
    assert [r["ratio_to_full"] for r in rows if r["policy"] == "full" and not r["params"]] == [1.0, 1.0]


def test_bench_interleaved_times_every_configuration_step_by_step(tmp_path):
    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--model", "random:tiny-qwen2", "--context", "24", "--new-tokens", "5",
                              "--warmup-steps", "3", "--batch", "2", "--hbm-ratio", "0.3", "--repeats", "2",
                              "--no-warm-repeat", "--interleave", "--recent-window", "4", "--retier-interval", "4",
                              "--attention", "split,ordered", "--t1-attention", "host", "--device", "cpu",
                              "--dtype", "fp32", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in rows] == ["stock_sdpa", "stock_static", "full", "full", "tiered", "tiered"]
    for r in rows:
        assert len(r["seconds_repeats"]) == 2 and r["ms_per_step_median"] > 0 and r["median_ratio_to_full"] > 0
    assert [r["t1_mode"] for r in rows[4:]] == ["host", "stream"]
    assert rows[4]["retiers"] >= 1


def test_bench_times_fused_and_eager_side_by_side(tmp_path):
    """--kernel auto,eager: each split point once per implementation, the row naming what really ran."""
    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", "--model", "random:tiny-qwen2", "--context", "24", "--new-tokens", "3",
                              "--warmup-steps", "3", "--batch", "1", "--hbm-ratio", "0.3", "--repeats", "1",
                              "--no-warm-repeat", "--interleave", "--recent-window", "4", "--retier-interval", "4",
                              "--t1-attention", "host", "--kernel", "auto,eager", "--no-stock", "--device", "cpu",
                              "--dtype", "fp32", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["results"]
    tiered = [r for r in rows if r["policy"] == "tiered"]
    assert [(r["params"]["kernel"], r["kernel"]) for r in tiered] == [("auto", "fused"), ("eager", "eager")]
    assert "host, auto->fused" in res.output and "host, eager" in res.output
    fulls = [(r["params"], r["kernel"]) for r in rows if r["policy"] == "full"]
    assert fulls == [({}, "fused"), ({"kernel": "eager"}, "eager")]  # full's default, and SDPA beside it
    bad = runner.invoke(app, ["bench", "--model", "random:tiny-qwen2", "--kernel", "fast", "--device", "cpu"])
    assert bad.exit_code != 0 and "--kernel values must be among" in bad.output


def test_the_floor_of_a_mixture_of_experts_counts_routed_experts():
    """gpt-oss: the expert weights are found (stacked matrices and biases under ``experts``), and the step's floor
    reads only the experts a batch routes to in expectation (E (1 - (1 - k/E)^B)), multiplying k per row; a dense
    model's floor is every weight."""
    from kvtier.models import random_model
    from kvtier.step import expert_weights, step_weight_bytes
    from kvtier.tools.bench import step_floor

    moe = random_model("tiny-gpt-oss")
    eb, e, k = expert_weights(moe)
    experts = sum(p.numel() * p.element_size() for n, p in moe.named_parameters() if ".experts." in n)
    assert (eb, e, k) == (experts, 4, 2) and 0 < eb < step_weight_bytes(moe)
    assert expert_weights(random_model("tiny-qwen2")) == (0, 0, 0)
    w = step_weight_bytes(moe)
    floors = dict(step_weight_bytes=w, read_peak_gbps=1.0, weight_itemsize=4, expert_weight_bytes=eb, experts=e,
                  experts_per_token=k)
    for batch in (1, 2, 64):
        touched = e * (1 - (1 - k / e) ** batch)
        want = 1e3 * (w - eb * (1 - touched / e)) / 1e9
        assert step_floor(floors, batch) == {"floor_ms": pytest.approx(want), "floor_kind": "bandwidth"}
    dense = dict(floors, expert_weight_bytes=0, experts=0, experts_per_token=0)
    assert step_floor(dense, 1)["floor_ms"] == pytest.approx(1e3 * w / 1e9)
    floors["gemm_peak_gflops"] = 1e-6  # matmul-bound: k of E experts multiplied per row
    assert step_floor(floors, 3)["floor_ms"] == pytest.approx(1e3 * 2 * 3 * (w - eb * (1 - k / e)) / 4 / 1e3)


def test_the_prefill_computes_only_the_last_positions_logits(qwen2):
    """The timed runs' prefill asks for one position's logits (all of them are B x context x vocab: 39.8 GB at
    32 x 4096 for a 151,936-token vocabulary, which ran the largest points out of memory); its next token is the
    one the whole prompt's logits give."""
    class Spy(torch.nn.Module):  # the model's forward, with the logits' shape of every call noted
        def __init__(self, model):
            super().__init__()
            self.model, self.shapes = model, []

        def forward(self, input_ids=None, past_key_values=None, **kw):
            out = self.model(input_ids=input_ids, past_key_values=past_key_values, **kw)
            self.shapes.append(tuple(out.logits.shape))
            return out

    spy = Spy(qwen2)
    ids = prompt_ids(batch=2, length=16)
    run = _Run(spy, ids, lambda: DynamicCache(config=qwen2.config), torch.device("cpu"))
    assert spy.shapes == [(2, 1, qwen2.config.vocab_size)]
    with torch.no_grad():
        whole = qwen2(input_ids=ids, past_key_values=DynamicCache(config=qwen2.config), use_cache=True).logits
    assert whole.shape[1] == 16
    assert torch.equal(run.tok, whole[:, -1].argmax(-1, keepdim=True))


def test_the_direct_step_decodes_the_models_tokens(qwen2, monkeypatch):
    """A kvtier cache's bench steps through the direct step pick the tokens the model's forward picks (tiered with
    reassignments and eviction; full), and --no-direct (BenchConfig.direct False) runs the model's forward."""
    step = direct_step(qwen2)
    ids = prompt_ids(batch=3, length=12)
    for policy, params in (("full", {}), ("tiered", {"hbm_ratio": 0.3, "evict_ratio": 0.1, "recent_window": 4,
                                                      "retier_interval": 4})):
        runs = [_Run(qwen2, ids, lambda: kvtier.make_cache(policy, qwen2, **params), torch.device("cpu"), d)
                for d in (None, step)]
        assert runs[1].direct is step and runs[0].direct is None
        for _ in range(12):
            for r in runs:
                r.step(timed=False)
            assert torch.equal(runs[0].tok, runs[1].tok)
    calls = []
    real = type(step).__call__
    monkeypatch.setattr(type(step), "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    common = dict(model="random:tiny-qwen2", context=16, new_tokens=2, batches=(2,), policies=("full",),
                  repeats=1, warmup_steps=1, stock=False, device="cpu", dtype="fp32")
    rows = run_bench(BenchConfig(direct=False, **common))["results"]
    assert [r["step"] for r in rows] == ["model"] and calls == []
    rows = run_bench(BenchConfig(**common))["results"]
    assert [r["step"] for r in rows] == ["direct"] and calls
    rows = run_bench(BenchConfig(linears=("eager",), **common))["results"]  # eager: transformers' stock step
    assert [r["step"] for r in rows] == ["model"]
