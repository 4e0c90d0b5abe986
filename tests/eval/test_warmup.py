"""First-use costs are paid before the first timed batch (issue #29's "every tok/s excludes one-time costs"): one
untimed generation per configuration, reported in the progress, and the records are what they were without it."""

from __future__ import annotations

import json

import torch
from conftest import DATA_DIR

import kvtier
from kvtier.eval import runner
from kvtier.eval.runner import EvalConfig, run_eval
from kvtier.models import byte_tokenizer, random_model
from kvtier.step.decode import step_for


def test_each_configuration_is_warmed_up_once_untimed_and_reported(tmp_path, monkeypatch):
    model, tok = random_model("tiny-qwen2", dtype=torch.float32), byte_tokenizer()
    cfgs = [EvalConfig(model="random:tiny-qwen2", benchmark="gsm8k", policy=p, params=q, limit=2, max_new_tokens=6)
            for p, q in (("full", {}), ("tiered", {"hbm_ratio": 0.3, "evict_ratio": 0.1, "recent_window": 2}))]
    step_for(model)  # the direct step's one check of this model (its own throwaway caches) before counting
    built = []
    real = kvtier.make_cache
    monkeypatch.setattr(kvtier, "make_cache", lambda policy, m, **kw: built.append(policy) or real(policy, m, **kw))
    seen = []
    run_eval(cfgs, tmp_path / "a", data_dir=DATA_DIR, batch_size=2, device="cpu", dtype="fp32", loaded=(model, tok),
             on_progress=lambda p: seen.append(dict(p)))
    # the warm-up's two caches first, then one per batch (one batch of 2 per configuration)
    assert built == ["full", "tiered", "full", "tiered"]
    assert seen[0]["done"] == 0 and seen[0]["warmup_seconds"] > 0 and seen[0]["seconds"] == 0.0
    # the same records as generation without the warm-up
    monkeypatch.setattr(runner, "warm_up", lambda *a, **k: 0.0)
    run_eval(cfgs, tmp_path / "b", data_dir=DATA_DIR, batch_size=2, device="cpu", dtype="fp32", loaded=(model, tok))
    read = lambda d: sorted((r["config_key"], r["id"], r["completion"], r["tier_map"]["completion"])  # noqa: E731
                            for r in map(json.loads, (d / "records.jsonl").read_text().splitlines()))
    assert read(tmp_path / "a") == read(tmp_path / "b")
