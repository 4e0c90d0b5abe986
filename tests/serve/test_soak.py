"""The soak driver (kvtier/serve/soak.py) for 30 s against a tiny server under a device-KV budget: its mix reaches
every kind, and the run's invariants hold (no budget breach, no unexpected answer, idle afterwards, sampled texts
equal to their solo reruns)."""

from __future__ import annotations

import json

import pytest
from servers import start_server, stop_server

from kvtier.serve.soak import SoakConfig, run_soak, write_soak


def test_the_config_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="duration_s"):
        SoakConfig("http://x", 0)
    with pytest.raises(ValueError, match="fault shares"):
        SoakConfig("http://x", 1, cancel_share=0.6, bad_share=0.6)
    with pytest.raises(ValueError, match="short_tokens"):
        SoakConfig("http://x", 1, short_tokens=(9, 3))


@pytest.mark.server
def test_a_thirty_second_soak_on_a_tiny_server_keeps_every_invariant(tmp_path):
    proc, url = start_server("--device-kv-budget", "48KiB", "--max-batch", "8", "--max-new-tokens", "512",
                             env_keys="soak-key")
    try:
        cfg = SoakConfig(url, 30, clients=6, api_key="soak-key", short_tokens=(8, 48), long_tokens=(96, 256),
                         cancel_share=0.15, vanish_share=0.1, bad_share=0.1, wrong_key_share=0.05, slow_share=0.05,
                         sampled_share=0.4, sample_every_s=5, server_pid=proc.pid, seed=1)
        result = run_soak(cfg)
    finally:
        code, out = stop_server(proc)
    assert code == 0, out[-2000:]
    v = result["verdict"]
    assert v["unexpected"] == 0, v["unexpected_details"]
    assert v["budget_breaches"] == 0 and v["idle_after"], (v, result["idle"])
    assert v["reruns_equal"].split("/")[0] == v["reruns_equal"].split("/")[1] != "0", result["reruns"]
    assert all(v["by_kind"].get(k, 0) > 0 for k in ("cancel", "vanish", "bad", "wrong_key", "slow")), v["by_kind"]
    assert v["by_outcome"]["done"] > 20 and v["demoted_tokens"] > 0  # real traffic, and the budget bit
    assert len(result["samples"]) >= 5 and all(s["rss_mib"] for s in result["samples"])
    paths = write_soak(result, tmp_path)
    assert json.loads(paths["json"].read_text())["verdict"] == v
