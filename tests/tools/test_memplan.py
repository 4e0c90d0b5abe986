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


# ---- hybrid (sliding + full) layers and mixtures of experts ------------------------------------------------------
def test_gpt_oss_120b_plans_its_full_layers_and_keeps_the_windows_on_the_device():
    """Acceptance (hybrid models): 18 of 36 layers slide over 128 tokens. Their K/V stay on the device; the tiers
    split the 18 full layers' K/V (hand-computed: 18 x 8 kv-heads x 64 x (K, V) x 2 bytes = 36,864 B a token)."""
    p = plan("openai/gpt-oss-120b", batch=8, seq_len=32768, hbm_ratio=0.3, evict_ratio=0.03)
    assert p["layers"] == {"full": 18, "sliding": 18, "window": 128}
    assert p["kv_bytes_per_token"] == 18 * 8 * 64 * 2 * 2
    sliding = 18 * 128 * 8 * 64 * 2 * 2 * 8
    full = 32768 * p["kv_bytes_per_token"] * 8
    assert p["sliding_kv_bytes_per_batch"] == sliding
    assert p["sliding_share_of_kv"] == pytest.approx(sliding / (sliding + full))  # 0.39%
    assert p["device_kv_bytes"] == p["bytes_per_batch"]["T0"] + sliding
    assert p["full_kv_bytes_per_batch"] == full + sliding
    assert sum(p["tokens_per_seq"].values()) == 32768


def test_mixture_of_experts_counts_every_expert_in_memory_and_the_routed_ones_per_step():
    """gpt-oss-20b: 32 experts, 4 a token. Memory holds them all (~20.9B parameters); a step at batch 1 reads the
    dense part and 4 experts a layer, at batch 8 the expected distinct ones, 32 x (1 - (1 - 4/32)^8)."""
    from kvtier.tools.memplan import shape_of

    s = shape_of("openai/gpt-oss-20b")
    expert = 3 * 2880 * 2880
    assert s.experts == 32 and s.experts_per_token == 4
    assert 20.5e9 < s.n_params() < 21.5e9
    dense = s.n_params() - 24 * 32 * expert
    assert s.params_read_per_step(1) == pytest.approx(dense + 24 * 4 * expert, rel=1e-9)
    assert s.params_read_per_step(8) == pytest.approx(dense + 24 * 32 * (1 - (1 - 4 / 32) ** 8) * expert, rel=1e-9)
    p = plan("openai/gpt-oss-20b", batch=1, seq_len=4096)
    assert p["weights_read_per_step_bytes"] < p["weights_bytes"] / 4


def test_gemma3_slides_five_layers_in_six_and_a_short_sequence_fills_no_window():
    p = plan("google/gemma-3-4b-it", batch=2, seq_len=512)
    assert p["layers"] == {"full": 5, "sliding": 29, "window": 1024}
    assert p["sliding_kv_bytes_per_batch"] == 29 * 512 * 4 * 256 * 2 * 2 * 2  # min(512, 1024) tokens a layer


def test_dense_models_plan_as_before():
    p = plan("random:qwen2-7b", batch=8, seq_len=4096)
    assert p["layers"] == {"full": 28, "sliding": 0, "window": 0}
    assert p["sliding_kv_bytes_per_batch"] == 0 and p["weights_read_per_step_bytes"] == p["weights_bytes"]
    assert p["device_kv_bytes"] == p["bytes_per_batch"]["T0"]


def test_a_hybrid_config_json_is_read(tmp_path):
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "head_dim": 64, "intermediate_size": 1024, "vocab_size": 1000, "sliding_window": 16,
           "layer_types": ["sliding_attention", "full_attention"] * 2, "num_local_experts": 8,
           "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    p = plan(str(tmp_path), batch=1, seq_len=100)
    assert p["layers"] == {"full": 2, "sliding": 2, "window": 16}
    assert p["kv_bytes_per_token"] == 2 * 2 * 64 * 2 * 2 and p["sliding_kv_bytes_per_batch"] == 2 * 16 * 2 * 64 * 2 * 2
    res = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--batch", "1", "--seq-len", "100"])
    assert res.exit_code == 0 and "2 of 4 layers slide over 16 tokens" in res.output and "mixture of experts" in res.output
