"""`kvtier plan` (the memory planner): hand-computed numbers."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.tools.memplan import plan

runner = CliRunner()


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
