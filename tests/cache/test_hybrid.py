"""Hybrid sliding/full models (Gemma 3): the policy takes the full-attention layers, each sliding layer keeps its
window on the device and attends as transformers' SDPA does (kvtier/cache/sliding.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_loop, padded_batch, padded_greedy
from transformers import DynamicCache

import kvtier
from kvtier.models import random_model

BITE = dict(retier_interval=8, recent_window=4, sink_tokens=1, protect_prompt=False)  # tiers and eviction bite


@pytest.fixture(scope="module")
def gemma3():
    return random_model("tiny-gemma3", dtype=torch.float32)  # 5 sliding layers (window 8), then 1 full


def test_full_equals_transformers_own_cache_over_128_steps(gemma3):
    """Acceptance 1: ``full`` gives DynamicCache's tokens over 128 greedy steps of a left-padded batch, far past the
    8-token window; logits within the split path's rounding (its full layer sums in another order), and the
    ordered path too."""
    seq_ref, log_ref = padded_greedy(gemma3, DynamicCache(config=gemma3.config))
    for attention in ("split", "ordered"):
        seq, logits = padded_greedy(gemma3, kvtier.make_cache("full", gemma3, attention=attention))
        assert torch.equal(seq, seq_ref), attention
        assert (logits - log_ref).abs().max().item() <= 1e-5, attention


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-gpt-oss"])  # gpt-oss: sinks and experts too
def test_tiered_without_eviction_equals_full_and_eviction_bites(preset):
    """Proposition 1 on a hybrid model: tiered (T0 30%, the rest in T1 attended on the host or streamed) gives full's
    tokens — bit for bit on the ordered path; evicting half the chain changes the outputs."""
    model = random_model(preset, dtype=torch.float32)
    seq_full, log_full = padded_greedy(model, kvtier.make_cache("full", model))
    for t1 in ("host", "stream"):
        cache = kvtier.make_cache("tiered", model, hbm_ratio=0.3, evict_ratio=0.0, t1_attention=t1, **BITE)
        seq, logits = padded_greedy(model, cache)
        assert cache.stats()["tokens"]["T1"] > 0 and cache.stats()["retiers"] > 0
        assert torch.equal(seq, seq_full) and (logits - log_full).abs().max().item() <= 1e-5, t1
    ordered = dict(attention="ordered")
    seq_o, log_o = padded_greedy(model, kvtier.make_cache("tiered", model, hbm_ratio=0.3, evict_ratio=0.0,
                                                          **ordered, **BITE))
    seq_fo, log_fo = padded_greedy(model, kvtier.make_cache("full", model, **ordered))
    assert torch.equal(seq_o, seq_fo) and torch.equal(log_o, log_fo)
    evicted = kvtier.make_cache("evict", model, evict_ratio=0.5, **BITE)
    _, log_e = padded_greedy(model, evicted)
    # a random model settles into repeating one token, so its greedy tokens may not show it; its logits do
    assert evicted.stats()["tokens"]["T3"] > 0 and (log_e - log_full).abs().max().item() > 1e-2


def test_sliding_layers_keep_their_window_and_the_tiers_hold_the_full_layers(gemma3):
    """Each sliding layer holds its last window - 1 positions (left padding included); the policy's state counts
    the one full layer, so the scores are the mean over the full layer's heads; stats() reports the windows'
    bytes apart from the tiers'."""
    cache = kvtier.make_cache("tiered", gemma3, hbm_ratio=0.3, evict_ratio=0.1, **BITE)
    ids, mask = padded_batch([20, 13, 7], 20, seed=4)
    decode_loop(gemma3, cache, ids, steps=1, attention_mask=mask)
    sliding = cache.sliding_layers()
    assert len(sliding) == 5 and len(cache.layers) == 6 and cache.state.num_layers == 1
    c = gemma3.config
    for layer in sliding:
        assert layer.keys.shape == (3, c.num_key_value_heads, 7, c.head_dim) and layer.seen == 21
    s = cache.stats()["sliding"]
    assert s == {"layers": 5, "window": 8, "device_bytes": 5 * 2 * 3 * c.num_key_value_heads * 7 * c.head_dim * 4}
    sums = cache.scores().sum(1)  # one decode step: each row's weights sum to 1 over its tokens
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
    assert cache.get_seq_length() == 21 and cache.model_shape[0] == 6


@pytest.mark.parametrize("policy, params", [("h2o", dict(budget_ratio=0.5)), ("streaming_llm", dict(budget_ratio=0.5))])
def test_baselines_take_the_full_layers_of_a_hybrid_model(gemma3, policy, params):
    cache = kvtier.make_cache(policy, gemma3, **params)
    seq, _ = padded_greedy(gemma3, cache, steps=48)
    assert seq.shape[1] == 20 + 48 and len(cache.sliding_layers()) == 5
    assert cache.kept_mask().shape[0] == 1  # the full layer's kept positions
    assert cache.stats()["sliding"]["layers"] == 5


def test_serving_a_hybrid_model_is_refused_with_the_reason(gemma3):
    from kvtier.models import byte_tokenizer
    from kvtier.serve.engine import Engine

    with pytest.raises(ValueError, match="does not serve hybrid sliding/full models .* sliding layers' windows"):
        Engine(gemma3, byte_tokenizer())


def test_a_rows_step_refuses_a_hybrid_model_before_its_forward(gemma3):
    from kvtier.cache.rows import RowsCache

    caches = [kvtier.make_cache("full", gemma3) for _ in range(2)]
    with pytest.raises(ValueError, match="RowsCache does not take a hybrid sliding/full model"):
        RowsCache(caches, lengths=[3, 4])
