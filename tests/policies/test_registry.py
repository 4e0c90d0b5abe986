"""Adding a policy is one class registered in kvtier.policies: a toy policy runs through make_cache, a sweep, a report
and the server without any other module naming it."""

from __future__ import annotations

import json

import pytest
import torch

import kvtier
from conftest import DATA_DIR
from kvtier.cache import KVTierCache
from kvtier.compat import cache_kw
from kvtier.config import TierConfig
from kvtier.eval.report import summarize, write_report
from kvtier.eval.runner import run_eval
from kvtier.eval.sweep import expand_grid
from kvtier.models import byte_tokenizer, random_model
from kvtier.policies import (FAMILIES, POLICIES, Policy, equal_memory_baselines, get_policy, of_family, register,
                             unregister, validate_policy)


class ToyPolicy(Policy):
    """Evict the lowest-score share, keep the rest on the device, reassign every 4 steps (an ablation)."""

    name = "toy_evict4"
    description = "test-only: eviction every 4 steps"
    family = "ablation"

    @classmethod
    def build(cls, num_layers: int, evict_ratio: float = 0.25, recent_window: int = 2):
        cfg = TierConfig(0.0, 0.0, evict_ratio, 4, 0, recent_window, False, rest_tier="T0")
        return KVTierCache(cfg, num_layers, retier=True, policy=cls.name)


@pytest.fixture
def toy():
    register(ToyPolicy)
    yield ToyPolicy
    unregister(ToyPolicy.name)
    assert ToyPolicy.name not in POLICIES


@pytest.fixture(scope="module")
def tiny():
    return random_model("tiny-qwen2", dtype=torch.float32), byte_tokenizer()


def test_every_builtin_policy_says_its_family_and_validates_its_values():
    assert set(of_family("reference")) == {"full"} and set(of_family("hierarchy")) == {"tiered"}
    assert set(of_family("ablation")) == {"evict", "quant"}
    assert equal_memory_baselines() == ["h2o", "rkv", "snapkv_decode", "streaming_llm"]  # snapkv budgets the prompt
    for name, cls in POLICIES.items():
        assert cls.family in FAMILIES and cls.name == name
        need = {"budget_ratio": 0.5} if cls.family == "baseline" else {}  # a baseline needs its budget
        assert validate_policy(name, need) == {**cls.params(), **need}
    with pytest.raises(ValueError, match="hbm_ratio must be a number in"):
        validate_policy("tiered", {"hbm_ratio": 2})
    with pytest.raises(ValueError, match="unknown parameter"):
        validate_policy("full", {"hbm_ratio": 0.3})
    with pytest.raises(ValueError, match="family must be one of"):
        register(type("Bad", (ToyPolicy,), {"name": "bad_family", "family": "misc"}))
    with pytest.raises(ValueError, match="already registered"):
        register(type("Dup", (ToyPolicy,), {"name": "tiered"}))


def test_every_policy_says_what_a_server_may_do_with_its_cache(tiny):
    """``chunked_prefill`` and ``can_limit`` are the policy's word for the server's scheduler; the cache it builds
    agrees (it opens a prompt in chunks, and it can be limited, exactly when its policy says so)."""
    model, _ = tiny
    assert {n for n, c in POLICIES.items() if c.chunked_prefill} == {"full", "tiered", "evict", "quant"}
    assert {n for n, c in POLICIES.items() if c.can_limit({})} == {"full", "tiered"}
    for name, cls in POLICIES.items():
        need = {"budget_ratio": 0.5} if cls.family == "baseline" else {}
        cache = kvtier.make_cache(name, model, **need)
        assert bool(getattr(cache, "chunked_prompts", False)) == cls.chunked_prefill, name
        assert bool(getattr(cache, "can_limit", False)) == cls.can_limit(need), name


def test_builtin_grids_are_the_documented_sweep():
    cfgs = expand_grid("m", ["gsm8k"], ["full", "tiered", "evict", "quant", "h2o", "snapkv"], [0.1, 0.5], [0.3, 0.6],
                       compare="both", budget_tokens=[64])
    by = {}
    for c in cfgs:
        by.setdefault(c.policy, []).append(c.params)
    assert by["full"] == [{}]
    assert len(by["tiered"]) == 3 and len(by["quant"]) == 3 and len(by["evict"]) == 2  # hbm 0.6 + evict 0.5 > 1
    assert by["h2o"] == [{"budget_ratio": 0.9}, {"budget_ratio": 0.5}, {"budget_ratio": 0.3, "budget_floor": 128},
                         {"budget_ratio": 0.6, "budget_floor": 128}, {"budget_tokens": 64}]
    assert by["snapkv"] == [{"budget_ratio": 0.9}, {"budget_ratio": 0.5}, {"budget_tokens": 64}]  # no equal memory


def test_a_registered_toy_policy_runs_through_cache_sweep_report(toy, tiny, tmp_path):
    model, tok = tiny
    assert get_policy("toy_evict4") is toy
    # make_cache: a generation with evictions, tokens equal to the same cache built by hand
    ids = torch.randint(3, 200, (1, 12))
    outs = []
    for cache in (kvtier.make_cache("toy_evict4", model, evict_ratio=0.5), toy.build(model.config.num_hidden_layers,
                                                                                     evict_ratio=0.5)):
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, **cache_kw(model, cache), max_new_tokens=12, do_sample=False,
                                       pad_token_id=tok.pad_token_id))
        assert cache.stats()["tokens"]["T3"] > 0
    assert torch.equal(outs[0], outs[1])
    # a sweep: the default grid takes the shared ratios the policy accepts
    cfgs = expand_grid("random:tiny-qwen2", ["gsm8k"], ["full", "toy_evict4"], [0.25, 0.5], [0.3], limit=2,
                       max_new_tokens=6)
    assert [c.params for c in cfgs if c.policy == "toy_evict4"] == [{"evict_ratio": 0.25}, {"evict_ratio": 0.5}]
    run_eval(cfgs, tmp_path / "run", data_dir=DATA_DIR, batch_size=2, device="cpu", dtype="fp32", loaded=(model, tok))
    recs = [json.loads(x) for x in (tmp_path / "run" / "records.jsonl").read_text().splitlines() if x.strip()]
    assert {r["policy"] for r in recs} == {"full", "toy_evict4"} and len(recs) == 6
    # a report: labelled by its family, its eviction ratio read from its parameters, paired with full
    rows = [c for c in summarize(recs)["configs"] if c["policy"] == "toy_evict4"]
    assert sorted(r["evict_ratio"] for r in rows) == [0.25, 0.5]
    assert {r["comparison"] for r in rows} == {"ablation"} and all(r["paired_n"] == 2 for r in rows)
    write_report(tmp_path / "run", tmp_path / "rep")
    assert "toy_evict4" in (tmp_path / "rep" / "summary.md").read_text()


def test_a_registered_toy_policy_is_served(toy, tiny):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvtier.serve.app import ServeSettings, create_app
    from kvtier.serve.engine import Engine, EngineConfig

    model, tok = tiny
    settings = ServeSettings(served_name="tiny", policy="toy_evict4", params={"evict_ratio": 0.5}, max_new_tokens=16)
    app = create_app(Engine(model, tok, EngineConfig(max_batch=2, batch_wait_s=0)), settings)
    with TestClient(app) as client:
        body = {"model": "tiny", "prompt": "2+2=", "max_tokens": 8, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        r2 = client.post("/v1/completions", json={**body, "kvtier": {"policy": "toy_evict4", "evict_ratio": 0.25}})
        assert r2.status_code == 200, r2.text
        bad = client.post("/v1/completions", json={**body, "kvtier": {"policy": "toy_evict4", "hbm_ratio": 0.3}})
        assert bad.status_code == 400 and "unknown parameter" in bad.text
