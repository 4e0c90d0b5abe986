"""Sweeps on a local Ray cluster (CPU only): the same records as without Ray, each key exactly once, and a worker
killed mid-sweep costs nothing but a rerun."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter

import pytest

ray = pytest.importorskip("ray", reason="the kvtier[ray] extra (make venv installs it)")
pytestmark = pytest.mark.heavy  # a Ray cluster per module, killed workers: ~100 s on 2 cores

from kvtier.eval.ray_sweep import RaySweepError, run_eval_ray  # noqa: E402
from kvtier.eval.records import read_records  # noqa: E402
from kvtier.eval.runner import EvalConfig, run_eval  # noqa: E402

MODEL = "random:tiny-qwen2"


def _cfgs(tokens=16):
    return [EvalConfig(model=MODEL, benchmark="rg:basic_arithmetic", policy=p, params=q, limit=6, max_new_tokens=tokens)
            for p, q in (("full", {}), ("tiered", {"hbm_ratio": 0.3, "evict_ratio": 0.1, "retier_interval": 4,
                                                   "recent_window": 4, "protect_prompt": False}))]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _by_key(recs):
    return {(r["config_key"], r["id"], r["sample"]): r for r in recs}


def test_ray_sweep_equals_the_local_sweep(cluster, tmp_path):
    run_eval(_cfgs(), tmp_path / "local", batch_size=2, dtype="fp32")
    keys = run_eval_ray(_cfgs(), tmp_path / "ray", workers=2, gpus_per_task=0, shards=2, batch_size=2, dtype="fp32")
    local, remote = read_records(tmp_path / "local"), read_records(tmp_path / "ray")
    counts = Counter((r["config_key"], r["id"], r["sample"]) for r in remote)
    assert len(counts) == 12 and set(counts.values()) == {1}  # 2 configurations x 6 problems, each exactly once
    assert {r["config_key"] for r in remote} == set(keys)
    shards = sorted(p.name for p in (tmp_path / "ray" / "shards").glob("*.jsonl"))
    assert len(shards) == 4  # one file per (configuration, shard): writers never share a file
    a, b = _by_key(local), _by_key(remote)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k]["completion"] == b[k]["completion"] and a[k]["tier_map"] == b[k]["tier_map"]
    # a rerun schedules nothing
    before = sorted(p.read_bytes() for p in (tmp_path / "ray" / "shards").glob("*.jsonl"))
    run_eval_ray(_cfgs(), tmp_path / "ray", workers=1, gpus_per_task=0, shards=2, batch_size=2, dtype="fp32")
    assert sorted(p.read_bytes() for p in (tmp_path / "ray" / "shards").glob("*.jsonl")) == before


@pytest.mark.parametrize("retries", [0, 1])
def test_killed_worker_then_rerun_completes_every_key_once(cluster, tmp_path, retries):
    out = tmp_path / "run"
    pids: list[int] = []
    killed = threading.Event()

    def kill_one_when_busy():
        while not pids:
            time.sleep(0.05)
        while not list((out / "shards").glob("*.jsonl")):  # a task has started writing
            time.sleep(0.05)
        os.kill(pids[0], signal.SIGKILL)
        killed.set()

    t = threading.Thread(target=kill_one_when_busy, daemon=True)
    t.start()
    try:
        run_eval_ray(_cfgs(tokens=48), out, workers=2, gpus_per_task=0, shards=3, batch_size=1, dtype="fp32",
                     max_retries=retries, on_workers=pids.extend)
        first = "completed"
    except RaySweepError as e:
        first = str(e)
    t.join(timeout=60)
    assert killed.is_set()
    if retries:  # the killed task ran again on a fresh worker: nothing left for a rerun
        assert first == "completed"
        counts = Counter((r["config_key"], r["id"], r["sample"]) for r in read_records(out))
        assert len(counts) == 12 and set(counts.values()) == {1}
    else:  # reported, naming the task, not silently skipped (or the killed worker was between tasks)
        assert first == "completed" or ("failed 1 times" in first and "Rerun" in first), first
    run_eval_ray(_cfgs(tokens=48), out, workers=2, gpus_per_task=0, shards=3, batch_size=1, dtype="fp32")
    counts = Counter((r["config_key"], r["id"], r["sample"]) for r in read_records(out))
    assert len(counts) == 12 and set(counts.values()) == {1}, (first, counts)
    # no shard file holds a torn line after the rerun cut it
    for p in (out / "shards").glob("*.jsonl"):
        for line in p.read_text().splitlines():
            json.loads(line)
