"""benchmarks/serve/peer/run.py: the commands it runs (vLLM's client on the random dataset, unique prompts, --ignore-eos,
the same sampling for both servers) and the table it builds from the cells (medians, spreads, ratios to vLLM)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from scripts import benchmark_script


def _args(**kw):
    a = dict(vllm_python="/v/bin/python", model_dir="/m", kvtier_model="qwen", kvtier_dtype="bf16", vllm_dtype="bfloat16",
             max_model_len=8192, max_batch=32, max_batched_tokens=0, hbm_ratio=0.3, evict_ratio=0.03, vllm_kv_gib=4,
             vllm_block_size=128, w3_budget_tokens=8192, col_bytes=12288, cpu_bind="0-1", seed=0)
    a.update(kw)
    return SimpleNamespace(**a)


def test_both_servers_get_the_same_client_command_and_their_own_settings(tmp_path):
    run = benchmark_script("peer/run")
    a = _args()
    cc = run.client_cmd(a, 8000, "W2", 8, "sampled", tmp_path / "x.json")
    i = cc.index
    assert cc[i("--dataset-name") + 1] == "random" and cc[i("--random-input-len") + 1] == "3500"
    assert cc[i("--random-output-len") + 1] == "256" and cc[i("--max-concurrency") + 1] == "8"
    assert "--ignore-eos" in cc and cc[i("--temperature") + 1] == "0.6" and cc[i("--top-p") + 1] == "0.95"
    greedy = run.client_cmd(a, 8000, "W1", 32, "greedy", tmp_path / "x.json")
    assert greedy[greedy.index("--temperature") + 1] == "0" and "--top-p" not in greedy
    # every cell and repeat draws its own prompts (no prefix-cache reuse across cells); systems share them
    seeds = {run.cell_seed(0, w, c, s, r) for w, (_, _, cs, _) in run.WORKLOADS.items() for c in cs
             for s in run.SAMPLING for r in range(3)}
    assert len(seeds) == sum(len(cs) for _, _, cs, _ in run.WORKLOADS.values()) * len(run.SAMPLING) * 3
    vcmd, venv = run.server_cmd("vllm", a, 8000, "W3")
    assert vcmd[vcmd.index("--num-gpu-blocks-override") + 1] == "64"  # 8192 tokens in 128-token blocks
    assert venv["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    kcmd, _ = run.server_cmd("kvtier-tiered", a, 8000, "W3")
    assert kcmd[kcmd.index("--device-kv-budget") + 1] == str(8192 * 12288)  # the same bytes as vLLM's pool
    assert kcmd[kcmd.index("--policy") + 1] == "tiered" and "--hbm-ratio" in kcmd
    assert float(kcmd[kcmd.index("--request-timeout") + 1]) >= 86400  # no deadline vLLM does not have
    shared = run.client_cmd(a, 8000, "W4", 32, "greedy", tmp_path / "x.json")
    i = shared.index
    assert shared[i("--dataset-name") + 1] == "prefix_repetition" and shared[i("--num-prompts") + 1] == "64"
    assert shared[i("--prefix-repetition-prefix-len") + 1] == "2000"
    assert shared[i("--prefix-repetition-suffix-len") + 1] == "100"
    assert shared[i("--prefix-repetition-output-len") + 1] == "256" and "--random-input-len" not in shared
    kfull, _ = run.server_cmd("kvtier-full", a, 8000, "W1")
    assert kfull[kfull.index("--policy") + 1] == "full" and "--device-kv-budget" not in kfull


def test_the_table_holds_medians_spreads_and_ratios(tmp_path):
    run = benchmark_script("peer/run")
    cells = []
    for rep, (v, k) in enumerate([(100, 90), (110, 120), (90, 95)]):
        for system, tp, itl in (("vllm", v, 50), ("kvtier-full", k, 55)):
            cells.append({"system": system, "workload": "W1", "clients": 8, "sampling": "greedy", "repeat": rep,
                          "ok": True, "output_throughput": tp, "p99_ttft_ms": 200, "median_ttft_ms": 100 + rep,
                          "median_itl_ms": 40,
                          "p99_itl_ms": itl, "prefix_cache_hits": 16 if system == "vllm" else 0,
                          "prefix_cache_queries": 512 if system == "vllm" else 0, "preemptions": 0})
    cells.append({"system": "vllm", "workload": "W1", "clients": 8, "sampling": "greedy", "repeat": 3, "ok": False})
    (tmp_path / "cells.jsonl").write_text("\n".join(json.dumps(c) for c in cells) + "\n")
    text = run.table(tmp_path)
    vllm = next(x for x in text.splitlines() if "| vllm |" in x)
    kv = next(x for x in text.splitlines() if "| kvtier-full |" in x)
    assert "| 3 | 100.0 (90.0-110.0) |" in vllm and "48/1536" in vllm
    assert "| 3 | 95.0 (90.0-120.0) | 0.95x |" in kv and "| 1.10x |" in kv and "| 0 |" in kv
    assert "| 101 | 1.00x |" in kv  # TTFT p50: medians of both
    assert run.done_cells(tmp_path / "cells.jsonl") == {("vllm", "W1", 8, "greedy", r) for r in range(3)} | {
        ("kvtier-full", "W1", 8, "greedy", r) for r in range(3)}


def test_w3t_gives_vllm_the_budget_and_kvtiers_host_bytes_and_caps_kvtier_to_them(tmp_path):
    run = benchmark_script("peer/run")
    a = _args(out=tmp_path)
    try:
        run.server_cmd("vllm", a, 8000, "W3T", 0)
        raise AssertionError("W3T without a W3 cell of kvtier must be refused")
    except RuntimeError as e:
        assert "W3,W3T" in str(e)
    host = 300 * 12288 + 5  # 300 tokens and a few bytes: rounded up to 301 tokens
    cell = {"system": "kvtier-tiered", "workload": "W3", "clients": 16, "sampling": "greedy", "repeat": 0, "ok": True,
            "host_kv_peak_bytes": host, "device_kv_peak_bytes": 8192 * 12288}
    (tmp_path / "cells.jsonl").write_text(json.dumps(cell) + "\n")
    vcmd, _ = run.server_cmd("vllm", a, 8000, "W3T", 0)
    assert vcmd[vcmd.index("--num-gpu-blocks-override") + 1] == str(-(-(8192 + 301) // 128))  # 67 blocks
    kcmd, _ = run.server_cmd("kvtier-tiered", a, 8000, "W3T", 0)
    assert kcmd[kcmd.index("--host-kv-budget") + 1] == str(host)
    assert kcmd[kcmd.index("--device-kv-budget") + 1] == str(8192 * 12288)
    w3, _ = run.server_cmd("vllm", a, 8000, "W3", 0)
    assert w3[w3.index("--num-gpu-blocks-override") + 1] == "64" and "--host-kv-budget" not in w3
