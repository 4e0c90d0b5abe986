"""The paper's claims, as tests on tiny random-weight models (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import forced_logits, generate, model_and_loop, prompt_ids
from transformers import DynamicCache

import kvtier
from kvtier.compat import cache_kw


@pytest.mark.parametrize("model_name", ["qwen2", "llama", "qwen2_fast", "qwen2_fast+direct"])
def test_proposition1_output_independent_of_hbm_ratio(model_name, request):
    """Proposition 1: with nothing evicted or quantized, where kept tokens live changes nothing (bit-exact with
    the ordered attention, which fixes the summation order); on the stock step and the prepared one
    (``qwen2_fast``: packed linears, fused norms; ``+direct``: each decode step through kvtier.step.direct)."""
    model, loop = model_and_loop(request, model_name)
    ids = prompt_ids(length=16)
    ref_seq, ref_logits, _ = generate(model, "full", ids, new_tokens=128, attention="ordered", custom_generate=loop)
    for hbm in (0.0, 0.1, 0.5, 1.0):
        seq, logits, cache = generate(
            model, "tiered", ids, new_tokens=128, custom_generate=loop, hbm_ratio=hbm, evict_ratio=0.0,
            quant_ratio=0.0, retier_interval=8, recent_window=8, sink_tokens=2, attention="ordered",
        )
        st = cache.stats()
        assert st["retiers"] >= 15
        assert torch.equal(seq, ref_seq), f"hbm_ratio={hbm}"
        assert torch.equal(logits, ref_logits), f"hbm_ratio={hbm}: max diff {(logits - ref_logits).abs().max()}"
        if hbm < 1.0:
            assert st["tokens"]["T1"] > 0  # the split really happened
        assert st["tokens"]["T3"] == 0


@pytest.mark.parametrize("model_name", ["qwen2", "qwen2_fast", "qwen2_fast+direct"])
def test_proposition1_with_eviction_only_evicted_set_matters(model_name, request):
    """At a fixed eviction ratio, the HBM ratio changes no logit: the output depends on T3 only."""
    model, loop = model_and_loop(request, model_name)
    ids = prompt_ids(length=16, seed=1)
    runs = [
        generate(model, "tiered", ids, new_tokens=96, custom_generate=loop, hbm_ratio=h, evict_ratio=0.25,
                 retier_interval=8, recent_window=8, sink_tokens=2, attention="ordered")
        for h in (0.0, 0.3, 0.75)
    ]
    ref = runs[0][1]
    for seq, logits, cache in runs[1:]:
        assert cache.stats()["tokens"]["T3"] > 0
        assert (logits - ref).abs().max().item() <= 1e-5
        assert torch.equal(logits, ref)  # position-ordered attention makes it bit-exact


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_full_matches_stock_transformers(qwen2, impl):
    """kvtier's "full" equals stock transformers (DynamicCache) within 1e-4 on every step's logits."""
    ids = prompt_ids(batch=2, length=12, seed=2)
    _, logits, _ = generate(qwen2, "full", ids, new_tokens=48)
    qwen2.set_attn_implementation(impl)
    out = qwen2.generate(
        ids, attention_mask=torch.ones_like(ids), **cache_kw(qwen2, DynamicCache(config=qwen2.config)), max_new_tokens=48,
        min_new_tokens=48, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    stock = torch.stack(out.logits)
    assert (logits - stock).abs().max().item() <= 1e-4


def test_eviction_shrinks_cache_and_changes_output(qwen2):
    ids = prompt_ids(length=16, seed=3)
    _, ref, full = generate(qwen2, "full", ids, new_tokens=96)
    _, logits, cache = generate(qwen2, "tiered", ids, new_tokens=96, evict_ratio=0.5, hbm_ratio=0.3,
                                retier_interval=8, recent_window=8, sink_tokens=2)
    st, fs = cache.stats(), full.stats()
    kept = st["tokens"]["T0"] + st["tokens"]["T1"] + st["tokens"]["T2"]
    assert kept < fs["tokens"]["T0"]
    assert st["tokens"]["T3"] >= 0.4 * st["logical_tokens"]
    assert (logits - ref).abs().max().item() > 1e-3


def test_quantization_changes_output_boundedly(qwen2):
    """T2 is lossy: with the same tokens fed to both caches, logits move measurably but stay close."""
    seq = prompt_ids(length=80, seed=4)
    ref = forced_logits(qwen2, kvtier.make_cache("full", qwen2, attention="ordered"), seq, 16)
    cache = kvtier.make_cache("tiered", qwen2, evict_ratio=0.0, hbm_ratio=0.0, quant_ratio=0.5, retier_interval=8,
                              recent_window=4, sink_tokens=1, protect_prompt=False, attention="ordered")
    logits = forced_logits(qwen2, cache, seq, 16)
    assert cache.stats()["tokens"]["T2"] > 0
    first_retier = 9  # prefill + 8 decode steps run before the first reassignment: exact until then
    assert torch.equal(logits[:first_retier], ref[:first_retier])
    diff = (logits[first_retier:] - ref[first_retier:]).abs().max().item()
    assert 1e-4 < diff < 0.5


def test_full_matches_stock_with_left_padding(qwen2):
    """With a left-padded batch, kvtier's "full" still equals stock SDPA + DynamicCache within 1e-4."""
    ids = prompt_ids(batch=3, length=14, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[2, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    _, logits, _ = generate(qwen2, "full", ids, new_tokens=40, attention_mask=mask)
    qwen2.set_attn_implementation("sdpa")
    out = qwen2.generate(
        ids, attention_mask=mask, **cache_kw(qwen2, DynamicCache(config=qwen2.config)), max_new_tokens=40, min_new_tokens=40,
        do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    assert (logits - torch.stack(out.logits)).abs().max().item() <= 1e-4


def test_t1_on_device_changes_nothing_but_the_traffic(qwen2):
    """A device copy of the host tiers between reassignments: same floats, streaming only at reassignments."""
    ids = prompt_ids(batch=2, length=16, seed=9)
    params = dict(hbm_ratio=0.2, evict_ratio=0.1, quant_ratio=0.1, retier_interval=8, recent_window=8, sink_tokens=2)
    for attention in ("split", "ordered"):
        _, ref, plain = generate(qwen2, "tiered", ids, new_tokens=96, t1_attention="stream", attention=attention,
                                 **params)
        _, logits, mirrored = generate(qwen2, "tiered", ids, new_tokens=96, t1_on_device=True, attention=attention,
                                       **params)
        assert torch.equal(logits, ref)
        a, b = plain.stats(), mirrored.stats()
        assert a["tokens"] == b["tokens"] and b["tokens"]["T1"] > 0 and b["tokens"]["T2"] > 0
        # streamed once per layer and reassignment instead of once per layer and step
        assert 0 < b["transfer"]["stream_h2d_bytes"] < a["transfer"]["stream_h2d_bytes"] / 4
        # every layer keeps its copy: device staging grows from one layer's worth to all of them
        assert b["allocated_bytes"]["staging"] > a["allocated_bytes"]["staging"] > 0
