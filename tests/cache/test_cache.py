"""The tiered cache's bookkeeping and data movement: budgets, bytes, migrations, batches, bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_loop, generate, padded_batch, prompt_ids

import kvtier
from kvtier.compat import cache_kw
from kvtier.config import budget
from kvtier.tiers.layout import TAIL
from kvtier.tiers.planner import T0, T1, T2, T3

PARAMS = dict(hbm_ratio=0.3, quant_ratio=0.1, evict_ratio=0.1, retier_interval=8, recent_window=8, sink_tokens=2)


@pytest.mark.parametrize("t1_attention", ["stream", "host"])
def test_tier_counts_bytes_and_migrations_each_retier(qwen2, t1_attention):
    cache = kvtier.make_cache("tiered", qwen2, t1_attention=t1_attention, **PARAMS)
    st = cache.state
    ids = prompt_ids(batch=2, length=16, seed=5)
    seen = {"retiers": 0, "checked": 0}
    prev = {}

    def on_step(step, c):
        s = c.stats()
        # bytes are tokens x bytes per token, per tier
        for t in ("T0", "T1", "T2"):
            assert s["bytes"][t] == s["tokens"][t] * s["bytes_per_token"][t]
        if s["retiers"] == seen["retiers"]:
            # no reassignment: the step streamed exactly the T1 and T2 buffers (or nothing, attending them on the
            # host), and nothing migrated
            if "stream" in prev:
                seen["stream_checked"] = seen.get("stream_checked", 0) + 1
                streamed = s["transfer"]["stream_h2d_bytes"] - prev["stream"]
                held = s["tokens"]["T1"] * s["bytes_per_token"]["T1"] + s["tokens"]["T2"] * s["bytes_per_token"]["T2"]
                if t1_attention == "stream":
                    # whole buffers, one contiguous copy each: slots are stable, so a few may be empty
                    assert streamed == s["allocated_bytes"]["host"] >= held
                else:
                    assert streamed == 0
                assert s["transfer"]["migration_d2h_bytes"] == prev["d2h"]
            prev.update(stream=s["transfer"]["stream_h2d_bytes"], d2h=s["transfer"]["migration_d2h_bytes"],
                        h2d=s["transfer"]["migration_h2d_bytes"], loc=st.loc_tier.clone())
            return
        seen["retiers"] = s["retiers"]
        n = st.layout.n_main
        tiers = st.loc_tier[:, :n]
        valid = st.valid[:, :n]
        # counts per row match the budgets (exactly, once there are enough unprotected tokens for all of them)
        for r in range(2):
            N = int(valid[r].sum())
            prot = 16 + 8  # the prompt and the recent window (sinks lie inside the prompt)
            n3, n2, n0 = budget(0.1, N), budget(0.1, N), max(prot, budget(0.3, N))
            count = {t: int((tiers[r] == t).sum()) for t in (T0, T1, T2, T3)}
            assert sum(count.values()) == N
            assert count[T0] >= prot and count[T3] <= n3 and count[T2] <= n2
            if N - prot >= n3 + n2 + (n0 - prot):
                assert (count[T3], count[T2], count[T0]) == (n3, n2, n0)
                assert count[T1] == N - n3 - n2 - n0
                seen["exact"] = seen.get("exact", 0) + 1
        # a migration moves exactly the tokens whose tier changed, and only those cross the bus
        old = prev["loc"][:, :n].clone()
        old[old == TAIL] = T0
        fp, q8 = s["bytes_per_token"]["T1"], s["bytes_per_token"]["T2"]
        moved = lambda a, b: int(((old == a) & (tiers == b)).sum())  # noqa: E731
        d2h = moved(T0, T1) * fp + moved(T0, T2) * q8
        h2d = moved(T1, T0) * fp + moved(T2, T0) * q8
        assert s["transfer"]["migration_d2h_bytes"] - prev["d2h"] == d2h
        assert s["transfer"]["migration_h2d_bytes"] - prev["h2d"] == h2d
        seen["d2h"] = seen.get("d2h", 0) + d2h
        seen["h2d"] = seen.get("h2d", 0) + h2d
        prev.update(stream=s["transfer"]["stream_h2d_bytes"], d2h=s["transfer"]["migration_d2h_bytes"],
                    h2d=s["transfer"]["migration_h2d_bytes"], loc=st.loc_tier.clone())
        seen["checked"] += 1
        prev.pop("stream")  # the retier step's stream is not checked

    decode_loop(qwen2, cache, ids, steps=100, on_step=on_step)
    assert seen["checked"] >= 10 and seen["exact"] >= 10
    assert seen["d2h"] > 0 and seen["h2d"] > 0  # tokens went both ways
    assert seen["stream_checked"] >= 50


def test_stats_schema_and_effective_ratios(qwen2):
    _, _, cache = generate(qwen2, "tiered", prompt_ids(length=16), new_tokens=80, **PARAMS)
    s = cache.stats()
    assert set(s["tokens"]) == {"T0", "T1", "T2", "T3"}
    assert set(s["bytes"]) == {"T0", "T1", "T2"}
    assert {"h2d_bytes", "d2h_bytes", "seconds"} <= set(s["transfer"])
    assert isinstance(s["retiers"], int) and s["retiers"] >= 9
    assert sum(s["tokens"].values()) == s["logical_tokens"] == 16 + 80 - 1  # the last generated token is never fed back
    assert abs(sum(s["effective_ratios"].values()) - 1.0) < 1e-9


def test_left_padded_batch_matches_each_row_alone(qwen2):
    lengths, total = [10, 16, 6], 16
    ids, mask = padded_batch(lengths, total, seed=11)
    params = dict(PARAMS, quant_ratio=0.0)
    seq, _, cache = generate(qwen2, "tiered", ids, new_tokens=64, attention_mask=mask, **params)
    assert cache.stats()["tokens"]["T3"] > 0
    for r, n in enumerate(lengths):
        alone, _, _ = generate(qwen2, "tiered", ids[r : r + 1, total - n :], new_tokens=64, **params)
        assert torch.equal(seq[r, total:], alone[0, n:]), f"row {r}"


def test_padding_is_never_scored_or_counted(qwen2):
    ids, mask = padded_batch([5, 12], 12, seed=3)
    _, _, cache = generate(qwen2, "tiered", ids, new_tokens=40, attention_mask=mask, **PARAMS)
    st = cache.state
    assert int(st.valid[0, :7].sum()) == 0
    assert torch.equal(st.scores[0, :7], torch.zeros(7, dtype=st.scores.dtype))
    assert cache.stats()["logical_tokens"] == 5 + 12 + 2 * 39


def test_reuse_refused_then_reset_works(qwen2):
    ids = prompt_ids(length=12, seed=7)
    seq, _, cache = generate(qwen2, "tiered", ids, new_tokens=20, **PARAMS)
    other = prompt_ids(length=30, seed=8)
    with pytest.raises(ValueError, match="reset"):
        qwen2.generate(other, attention_mask=torch.ones_like(other), **cache_kw(qwen2, cache), max_new_tokens=5, pad_token_id=0)
    cache.reset()
    assert cache.stats()["tokens"]["T0"] == 0
    out = qwen2.generate(ids, attention_mask=torch.ones_like(ids), **cache_kw(qwen2, cache), max_new_tokens=20, min_new_tokens=20,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(out, seq)


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(hbm_ratio=1.5), "hbm_ratio"),
        (dict(evict_ratio=-0.1), "evict_ratio"),
        (dict(quant_ratio=0.6, hbm_ratio=0.6), r"<= 1"),
        (dict(retier_interval=0), "retier_interval"),
        (dict(recent_window=-1), "recent_window"),
        (dict(hbm_ratio="a"), "hbm_ratio"),
    ],
)
def test_bad_parameters(qwen2, params, match):
    with pytest.raises(ValueError, match=match):
        kvtier.make_cache("tiered", qwen2, **params)


def test_unknown_policy_and_parameter(qwen2):
    with pytest.raises(ValueError, match="policy must be one of"):
        kvtier.make_cache("nope", qwen2)
    with pytest.raises(ValueError, match=r"'hbm'.*'tiered'"):
        kvtier.make_cache("tiered", qwen2, hbm=0.3)
    with pytest.raises(ValueError, match="'full'"):
        kvtier.make_cache("full", qwen2, hbm_ratio=0.3)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama", "tiny-mistral", "tiny-qwen3"])
def test_architectures_match_full(preset):
    from kvtier.models import random_model

    model = random_model(preset, dtype=torch.float32)
    ids = prompt_ids(length=12, seed=1)
    for attention in ("ordered", "split"):
        ref_seq, ref, _ = generate(model, "full", ids, new_tokens=40, attention=attention)
        seq, logits, cache = generate(model, "tiered", ids, new_tokens=40, hbm_ratio=0.2, evict_ratio=0.0,
                                      retier_interval=8, recent_window=4, attention=attention)
        assert cache.stats()["tokens"]["T1"] > 0
        assert torch.equal(seq, ref_seq)
        if attention == "ordered":
            assert torch.equal(logits, ref)
        else:  # the split merge and the full cache's fused kernel sum in other orders
            assert (logits - ref).abs().max().item() <= 1e-5


def test_unsupported_models_are_named():
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    g = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(NotImplementedError, match="gemma2"):
        kvtier.make_cache("tiered", g)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(NotImplementedError, match="qwen2"):
        kvtier.make_cache("tiered", Qwen2ForCausalLM(cfg))


def test_gpt_oss_loads_offline_and_is_marked_as_a_model_with_sinks():
    """The gpt-oss preset builds offline (random weights, hybrid layers, experts); its cache knows the model has
    attention sinks (tests/attention/test_sinks.py runs it)."""
    from kvtier.models import random_model

    model = random_model("tiny-gpt-oss")
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    assert kvtier.make_cache("tiered", model).state.model_sinks
    assert not kvtier.make_cache("tiered", random_model("tiny-qwen2")).state.model_sinks


def test_mla_refusal_points_to_the_design_note_and_the_distills():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8,
                           q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=2,
                           num_experts_per_tok=1, n_group=1, topk_group=1, first_k_dense_replace=1)
    with pytest.raises(NotImplementedError, match=r"latent attention \(MLA\)\. Instead: docs/MLA.md"):
        kvtier.make_cache("tiered", DeepseekV3ForCausalLM(cfg))


def test_prepared_model_still_runs_without_kvtier_cache(qwen2):
    """After make_cache the model uses kvtier's attention; with a plain DynamicCache that is just SDPA."""
    from transformers import DynamicCache

    kvtier.make_cache("full", qwen2)
    ids = prompt_ids(length=10)
    a = qwen2.generate(ids, attention_mask=torch.ones_like(ids), **cache_kw(qwen2, DynamicCache(config=qwen2.config)),
                       max_new_tokens=10, do_sample=False, pad_token_id=0)
    b, _, _ = generate(qwen2, "full", ids, new_tokens=10)
    assert torch.equal(a, b)
