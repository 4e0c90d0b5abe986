"""Prompts at the edge: a one-token prompt is a prefill like any other, for every policy (found by schemathesis: a
completion of "0" crashed the tiered cache, which took the one-token prefill for a decode step)."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.compat import cache_kw
from kvtier.policies import POLICIES

PARAMS = {"tiered": dict(hbm_ratio=0.3, evict_ratio=0.0, retier_interval=4, recent_window=2),
          "evict": dict(evict_ratio=0.0, retier_interval=4, recent_window=2),
          "quant": dict(hbm_ratio=0.3, retier_interval=4, recent_window=2)}


def _generate(model, policy, ids, **params):
    cache = kvtier.make_cache(policy, model, **params)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache),
                             max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:], cache


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_one_token_prompt_generates_under_every_policy(qwen2, policy):
    ids = torch.tensor([[17]])
    params = PARAMS.get(policy, {} if POLICIES[policy].family != "baseline" else {"budget_tokens": 64})
    got, cache = _generate(qwen2, policy, ids, **params)
    full, _ = _generate(qwen2, "full", ids)
    assert got.shape == (1, 12)
    assert sum(cache.stats()["tokens"].values()) == 12  # the prompt + 11 fed-back tokens (the 12th is never fed back)
    if policy != "quant":  # nothing evicted or quantized: the same tokens as the full cache
        assert torch.equal(got, full), policy


@pytest.mark.parametrize("attention", ["split", "ordered"])
def test_one_token_prompt_tiered_equals_full_with_reassignments(qwen2, attention):
    ids = torch.tensor([[5]])
    got, cache = _generate(qwen2, "tiered", ids, hbm_ratio=0.2, evict_ratio=0.0, retier_interval=2, recent_window=1,
                           attention=attention)
    full, _ = _generate(qwen2, "full", ids, attention=attention)
    assert torch.equal(got, full) and cache.stats()["retiers"] > 0
