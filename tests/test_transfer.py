"""Transfer engine, `kvtier bench` (schema, not speed) and `kvtier plan` (hand-computed numbers)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import decode_loop, prompt_ids
from typer.testing import CliRunner

import kvtier
from kvtier.cli import app
from kvtier.compat import cache_kw
from kvtier.tools.memplan import plan
from kvtier.transfer import TransferEngine

runner = CliRunner()
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_staging_and_work_buffers_are_reused(qwen2):
    cache = kvtier.make_cache("tiered", qwen2, hbm_ratio=0.2, evict_ratio=0.05, retier_interval=8, recent_window=4,
                              protect_prompt=False)
    seen = []

    def on_step(step, c):
        eng = c.state.engine
        seen.append((eng.allocations, eng.staging_bytes()))

    decode_loop(qwen2, cache, prompt_ids(batch=2, length=8), steps=200, on_step=on_step)
    allocs = [a for a, _ in seen]
    # buffers grow geometrically with T1 and in 256-column granules with the sequence: a handful of growth
    # events over 200 steps, never one per step
    grew = sum(b > a for a, b in zip(allocs, allocs[1:]))
    assert grew <= 20, allocs[::10]
    assert allocs[-1] - allocs[100] <= 8
    st = cache.stats()
    assert st["tokens"]["T1"] > 0
    # device staging: one layer's host tiers (with 25% growth headroom) plus one layer's work buffer (256-column
    # granules): at most two layers' worth of KV
    per_layer_kv = st["bytes_per_token"]["T0"] // qwen2.config.num_hidden_layers
    assert st["allocated_bytes"]["staging"] <= 2 * (st["logical_tokens"] + 256 * 2) * per_layer_kv


def test_counters_equal_tokens_moved_times_bytes_per_token():
    eng = TransferEngine(torch.device("cpu"))
    x = torch.randn(2, 10, 8)  # (H, tokens, D) float32
    y = eng.to_host(x)
    z = eng.to_device(y[:, :3])
    assert torch.equal(y, x) and torch.equal(z, x[:, :3])
    assert eng.counters.migration_d2h_bytes == 2 * 10 * 8 * 4
    assert eng.counters.migration_h2d_bytes == 2 * 3 * 8 * 4
    got = eng.take(0, ("layer", 1), {"k": x, "v": x[:, :5]})
    assert torch.equal(got["k"], x) and torch.equal(got["v"], x[:, :5])
    assert eng.counters.stream_h2d_bytes == (10 + 5) * 2 * 8 * 4
    eng.release(0)
    before = eng.allocations
    eng.take(0, ("layer", 2), {"k": x[:, :7], "v": x[:, :2]})  # smaller: reuses the same buffers
    assert eng.allocations == before
    assert eng.counters.seconds >= 0 and eng.counters.copies == 6


def test_prefetched_slot_is_used_once():
    eng = TransferEngine(torch.device("cpu"))
    x = torch.randn(2, 4, 8)
    eng.stage(0, ("L3", 7), {"k": x})
    n = eng.counters.stream_h2d_bytes
    eng.take(0, ("L3", 7), {"k": x})  # the prefetch matches: no second copy
    assert eng.counters.stream_h2d_bytes == n
    eng.release(0)
    eng.take(0, ("L3", 7), {"k": x})  # released: staged again
    assert eng.counters.stream_h2d_bytes == 2 * n


@cuda
def test_cuda_tiered_matches_full_bitwise():
    from kvtier.models import random_model

    model = random_model("tiny-qwen2", device="cuda", dtype=torch.float32)
    ids = prompt_ids(length=16).cuda()
    outs = []
    for policy, params in (("full", dict(attention="ordered")),
                           ("tiered", dict(hbm_ratio=0.1, evict_ratio=0.0, retier_interval=8, recent_window=4,
                                           attention="ordered"))):
        cache = kvtier.make_cache(policy, model, **params)
        o = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache), max_new_tokens=96, min_new_tokens=96,
                           do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        outs.append(torch.stack(o.logits))
        if policy == "tiered":
            s = cache.stats()
            assert s["tokens"]["T1"] > 0 and s["transfer"]["stream_h2d_bytes"] > 0 and s["transfer"]["seconds"] > 0
            assert cache.layers[0].k1.is_pinned()
    assert torch.equal(outs[0], outs[1])


@cuda
def test_cuda_rows_split_between_host_and_stream():
    """On CUDA: host rows on the worker thread with pinned q / partial / factor copies, streamed rows through the
    staging slot (prefetched), one merge: the tokens and placements of streaming every row, logits within 1e-5."""
    from kvtier.models import random_model

    model = random_model("tiny-qwen2", device="cuda", dtype=torch.float32)
    ids = torch.cat([prompt_ids(length=20, seed=s) for s in range(3)]).cuda()
    params = dict(hbm_ratio=0.2, evict_ratio=0.1, quant_ratio=0.1, retier_interval=8, recent_window=8, sink_tokens=2,
                  protect_prompt=False)
    out = {}
    for mode in ("stream", "both", "host"):
        cache = kvtier.make_cache("tiered", model, t1_attention="stream" if mode == "stream" else "host"
                                  if mode == "host" else "auto", **params)
        if mode == "both":
            cache.state.fixed_stream_rows = 2
        o = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache), max_new_tokens=64,
                           min_new_tokens=64, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=0)
        out[mode] = (o.sequences, torch.stack(o.logits), cache.tier_map(), cache.stats())
    for mode in ("both", "host"):
        assert torch.equal(out[mode][0], out["stream"][0]) and torch.equal(out[mode][2], out["stream"][2]), mode
        assert (out[mode][1] - out["stream"][1]).abs().max().item() <= 1e-5, mode
    st = out["both"][3]
    assert st["t1_attention"]["current"] == "both" and st["t1_attention"]["stream_rows"] == 2
    assert 0 < st["transfer"]["stream_h2d_bytes"] < out["stream"][3]["transfer"]["stream_h2d_bytes"]


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


def test_plan_matches_hand_computed_values():
    p = plan("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", batch=8, seq_len=32768, hbm_ratio=0.3, evict_ratio=0.03,
             pcie_gbps=50.0)
    assert p["kv_bytes_per_token"] == 28 * 4 * 128 * 2 * 2 == 57_344
    assert p["int8_bytes_per_token"] == 28 * 4 * (128 + 4) * 2
    n3, n0 = 983, 9830  # floor(0.03 * 32768), floor(0.3 * 32768)
    assert p["tokens_per_seq"] == {"T0": n0, "T1": 32768 - n0 - n3, "T2": 0, "T3": n3}
    assert p["bytes_per_batch"]["T0"] == 8 * n0 * 57_344
    assert p["device_bytes_saved"] == 8 * (32768 - n0) * 57_344
    assert p["pcie_bytes_per_step"] == 8 * (32768 - n0 - n3) * 57_344
    assert abs(p["step_floor_ms"]["pcie"] - p["pcie_bytes_per_step"] / 50e9 * 1e3) < 1e-9
    assert plan("meta-llama/Meta-Llama-3-70B", 1, 1)["kv_bytes_per_token"] == 327_680
    assert plan("random:qwen2-7b", 1, 100, dtype="fp32")["kv_bytes_per_token"] == 2 * 57_344
    q = plan("random:qwen2-7b", 2, 1000, hbm_ratio=0.2, evict_ratio=0.1, quant_ratio=0.3)
    assert q["tokens_per_seq"] == {"T0": 200, "T1": 400, "T2": 300, "T3": 100}
    assert q["bytes_per_seq"]["T2"] == 300 * 28 * 4 * 132 * 2
    prot = plan("random:qwen2-7b", 1, 1000, hbm_ratio=0.1, protected_tokens=300)
    assert prot["tokens_per_seq"]["T0"] == 300


def test_plan_floors_per_t1_mode_match_hand_computed_values():
    """Qwen2-7B shapes, batch 8, 4K context, hbm 0.5, no eviction, on the h200 profile (4800 / 55 / 150 GB/s)."""
    p = plan("random:qwen2-7b", batch=8, seq_len=4096, hbm_ratio=0.5, evict_ratio=0.0, hardware="h200")
    fp = 57_344  # 28 layers x 4 kv-heads x 128 x K,V x 2 bytes
    w = p["weights_bytes"]
    t0 = t1 = 8 * 2048 * fp  # 0.94 GB each
    full = 8 * 4096 * fp
    ms = lambda b, gbps: 1e3 * b / (gbps * 1e9)  # noqa: E731
    f = p["step_floor_ms"]
    assert abs(f["full_cache"] - ms(w + full, 4800)) < 1e-9
    assert abs(f["stream"] - max(ms(t1, 55), ms(w + t0 + t1, 4800))) < 1e-9  # PCIe-bound: 17.1 ms
    assert abs(f["host"] - max(ms(t1, 150), ms(w + t0, 4800))) < 1e-9  # host-bound: 6.3 ms
    x = 55 / (55 + 150)
    assert abs(f["both"] - max(ms(t1, 205), ms(w + t0 + x * t1, 4800))) < 1e-9  # 4.6 ms
    assert p["best_mode"] == "both"
    assert abs(p["throughput_ratio_floor"] - f["full_cache"] / f["both"]) < 1e-12
    assert abs(p["throughput_ratio_floor_by_mode"]["stream"] - f["full_cache"] / f["stream"]) < 1e-12
    # the smallest hbm_ratio whose best floor is within 5% of the full cache's, found by hand on a 0.01 grid
    small = p["smallest_hbm_ratio_within_5pct"]["best"]
    def best(h):
        n0 = int(h * 4096 + 1e-9)
        a, b = 8 * n0 * fp, 8 * (4096 - n0) * fp
        return min(max(ms(b, 55), ms(w + a + b, 4800)), max(ms(b, 150), ms(w + a, 4800)),
                   max(ms(b, 205), ms(w + a + x * b, 4800)))
    first = next(i / 100 for i in range(101) if best(i / 100) <= 1.05 * ms(w + full, 4800))
    assert small == first and 0 < small < 1
    # explicit bandwidths override the profile; the cpu profile exists; bad values are named
    o = plan("random:qwen2-7b", 1, 4096, hardware="cpu", host_gbps=10.0)
    assert o["hardware"]["host_gbps"] == 10.0 and o["hardware"]["hbm_gbps"] == 40.0
    with pytest.raises(ValueError, match="--hardware"):
        plan("random:qwen2-7b", 1, 10, hardware="tpu")
    with pytest.raises(ValueError, match="--host-gbps"):
        plan("random:qwen2-7b", 1, 10, host_gbps=0)
    res = runner.invoke(app, ["plan", "--model", "random:qwen2-7b", "--batch", "8", "--seq-len", "4096",
                              "--hbm-ratio", "0.5", "--evict-ratio", "0"])
    assert res.exit_code == 0 and "stream" in res.output and "host" in res.output and "both (best)" in res.output


def test_plan_reads_a_config_json(tmp_path):
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256,
           "intermediate_size": 512, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert plan(str(tmp_path), 1, 10)["kv_bytes_per_token"] == 2 * 2 * 32 * 2 * 2
    res = runner.invoke(app, ["plan", "--model", "org/unknown-model"])
    assert res.exit_code == 2 and "config.json" in res.output
    res = runner.invoke(app, ["plan", "--model", "random:qwen2-7b", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["kv_bytes_per_token"] == 57_344
