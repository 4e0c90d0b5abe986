"""Attention sinks (gpt-oss): a learned logit per query head in every softmax, as one more partial in the merge
(kvtier/attention/merge.py), on every path, against float64 math and transformers' own eager attention.
Proposition 1 on gpt-oss (tiered without eviction = full) is in tests/cache/test_hybrid.py."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import padded_greedy
from transformers import DynamicCache

import kvtier
from kvtier.attention.merge import dense, mask_bias, merge, ordered, partial, sink_partial
from kvtier.models import random_model

BITE = dict(retier_interval=8, recent_window=4, sink_tokens=1, protect_prompt=False)  # tiers and eviction bite


def _reference(qg, k, v, valid, scaling, sinks):
    """float64: softmax over [the valid keys' logits, the head's sink], the sink's weight dropped."""
    B, H, g, D = qg.shape
    s = torch.matmul(qg.double(), k.double().transpose(-1, -2)) * scaling
    s = s.masked_fill(~valid.view(B, 1, 1, -1), float("-inf"))
    col = sinks.double().view(1, H, g, 1).expand(B, H, g, 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(p, v.double()), p


@pytest.mark.parametrize("sink_scale", [0.0, 3.0, 30.0])
def test_the_sink_partial_merges_to_the_softmax_with_sinks(sink_scale):
    """Regions merged with the sinks' partial = ordered with sinks = float64 reference, outputs and weights; a large
    sink takes the weight from every key (outputs shrink towards 0), a row with every key masked but one still
    attends it beside the sink."""
    g_ = torch.Generator().manual_seed(1)
    B, H, g, D, C = 2, 2, 3, 16, 40
    qg = torch.randn(B, H, g, D, generator=g_)
    k, v = torch.randn(B, H, C, D, generator=g_), torch.randn(B, H, C, D, generator=g_)
    valid = torch.rand(B, C, generator=g_) < 0.7
    valid[1] = False
    valid[1, 5] = True
    sinks = torch.randn(H * g, generator=g_) * sink_scale
    ref, p_ref = _reference(qg, k, v, valid, 0.25, sinks)
    out_o, p_o = ordered(qg, k, v, valid.view(B, 1, 1, C), 0.25, sinks)
    assert (out_o.double() - ref).abs().max().item() <= 1e-6
    assert (p_o.double() - p_ref).abs().max().item() <= 1e-6
    cut = 17  # two regions, then the sinks
    parts = [partial(qg, k[:, :, :cut], v[:, :, :cut], mask_bias(valid[:, :cut]), 0.25, True),
             partial(qg, k[:, :, cut:], v[:, :, cut:], mask_bias(valid[:, cut:]), 0.25, True),
             sink_partial(sinks, B, H, g, D)]
    out_s, fs = merge(parts)
    assert (out_s.double() - ref).abs().max().item() <= 1e-6
    w = torch.cat([parts[0].e * fs[0], parts[1].e * fs[1]], dim=-1)
    assert (w.double() - p_ref).abs().max().item() <= 1e-6
    if sink_scale == 30.0:  # some heads' sinks dominate: their keys keep almost no weight
        big = sinks.view(H, g) > 10
        assert big.any() and p_o.sum(-1)[:, big].max().item() < 1e-3


def test_dense_is_the_eager_math_with_sinks():
    """The prefill / sliding-window attention with sinks: causal (no mask) and under a boolean mask (padding and a
    window), grouped query heads, in chunks smaller than the queries — against the float64 reference per query."""
    g_ = torch.Generator().manual_seed(2)
    B, Hq, H, q, D = 2, 6, 2, 11, 8
    query = torch.randn(B, Hq, q, D, generator=g_)
    key, value = torch.randn(B, H, q, D, generator=g_), torch.randn(B, H, q, D, generator=g_)
    sinks = torch.randn(Hq, generator=g_) * 2
    causal = torch.arange(q).view(1, -1) <= torch.arange(q).view(-1, 1)
    window = causal & (torch.arange(q).view(-1, 1) - torch.arange(q).view(1, -1) < 4)
    mask = window.view(1, 1, q, q).expand(B, 1, q, q).clone()
    mask[1, :, :, :3] = False  # row 1 left-padded by 3
    mask[1, :, :3, :] = False
    for m in (None, mask):
        out = dense(query, key, value, m, 0.3, sinks, chunk=4)
        mm = causal.view(1, 1, q, q).expand(B, 1, q, q) if m is None else m
        for i in range(q):
            qg = query[:, :, i : i + 1].reshape(B, H, Hq // H, D)
            for b in range(B):
                ref, _ = _reference(qg[b : b + 1], key[b : b + 1], value[b : b + 1], mm[b, 0, i].view(1, q), 0.3,
                                    sinks)
                assert (out[b, :, i].double() - ref.reshape(Hq, D)).abs().max().item() <= 1e-6


@pytest.fixture(scope="module")
def gpt_oss():
    return random_model("tiny-gpt-oss", dtype=torch.float32)  # 4 layers, sliding (window 8) and full alternating


def _eager_reference(model, steps=128):
    """transformers' own: the gpt-oss eager attention (its sinks) over DynamicCache."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return padded_greedy(ref, DynamicCache(config=ref.config), steps)


def test_full_equals_transformers_eager_gpt_oss_over_128_steps(gpt_oss):
    """Acceptance 1 on tiny gpt-oss (hybrid sliding/full, sinks, experts): ``full`` gives transformers' eager
    attention's tokens over 128 greedy steps of a left-padded batch, far past the 8-token window, on the split and
    the ordered path; logits within float32 rounding of other summation orders (2e-5, as for the models without
    sinks; measured 1.1e-5 on the split path)."""
    seq_ref, log_ref = _eager_reference(gpt_oss)
    for attention in ("split", "ordered"):
        cache = kvtier.make_cache("full", gpt_oss, attention=attention)
        seq, logits = padded_greedy(gpt_oss, cache)
        assert torch.equal(seq, seq_ref), attention
        assert (logits - log_ref).abs().max().item() <= 2e-5, attention
        # full's step on the kernel (with the sinks as logits; SDPA has none), or the ordered reference
        assert cache.stats()["kernel"]["current"] == ("fused" if attention == "split" else None)


@pytest.mark.parametrize("path", [dict(attention="ordered"), dict(t1_attention="host"), dict(t1_attention="stream"),
                                  dict(t1_attention="host", kernel="eager"), dict(t1_attention="stream", kernel="eager"),
                                  dict(policy="full"), dict(policy="full", kernel="eager"),
                                  dict(policy="h2o", budget_ratio=0.5)])
def test_large_sinks_are_followed_on_every_path(gpt_oss, path):
    """Acceptance 2: with every sink raised to +12 the model's outputs change (the sinks take most of the weight),
    and each path — ordered, split with T1 on the host or streamed (the fused kernel, and eager), full (kernel and
    eager merge), a head-wise baseline — follows transformers' eager attention there, not the model without
    sinks."""
    model = copy.deepcopy(gpt_oss)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
                m.sinks.fill_(12.0)
    steps = 24
    seq_ref, log_ref = _eager_reference(model, steps)
    _, log_plain = _eager_reference(gpt_oss, steps)
    assert (log_ref - log_plain).abs().max().item() > 1e-1  # the sinks matter at this size
    params = dict(path)
    policy = params.pop("policy", "tiered")
    if policy == "tiered":
        params = dict(hbm_ratio=0.3, evict_ratio=0.0, **BITE, **params)
    seq, logits = padded_greedy(model, kvtier.make_cache(policy, model, **params), steps)
    if policy == "h2o":  # eviction: its own outputs, but the prefill step (nothing evicted yet) is eager's
        assert (logits[0] - log_ref[0]).abs().max().item() <= 1e-5
    else:
        assert torch.equal(seq, seq_ref) and (logits - log_ref).abs().max().item() <= 1e-5


def test_the_kernel_takes_the_sinks_as_logits():
    """fused_cpu.attend / attend_rows with sinks = the eager regions merged with the sinks' partial (float64), small
    and dominant sinks, bf16 and float32 K/V; the rows entry gives each row what it gets alone."""
    from kvtier.attention import fused_cpu

    if not fused_cpu.available():
        pytest.skip("the fused CPU kernel is not built here")
    g_ = torch.Generator().manual_seed(5)
    B, H, g, D, C = 3, 2, 7, 64, 70
    for dtype in (torch.float32, torch.bfloat16):
        for scale in (0.0, 2.0, 30.0):
            qg = torch.randn(B, H, g, D, generator=g_).to(dtype).float()
            k = torch.randn(B, H, C, D, generator=g_).to(dtype)
            v = torch.randn(B, H, C, D, generator=g_).to(dtype)
            valid = torch.rand(B, C, generator=g_) < 0.8
            sinks = torch.randn(H * g, generator=g_) * scale
            pos = torch.arange(C).expand(B, C).contiguous()
            scores = torch.zeros(B, C + 1, dtype=torch.float64)
            out = fused_cpu.attend(qg, [k], [v], [mask_bias(valid)], [pos], [scores], 1.0, 0.125, sinks=sinks)
            ref, p_ref = _reference(qg, k.float(), v.float(), valid, 0.125, sinks)
            assert (out.double() - ref).abs().max().item() <= 2e-6, (dtype, scale)
            assert (scores[:, :C] - p_ref.sum(dim=(1, 2))).abs().max().item() <= 2e-5, (dtype, scale)
            rows = fused_cpu.attend_rows(qg, [([k[i : i + 1]], [v[i : i + 1]], [mask_bias(valid[i : i + 1])],
                                               [pos[i : i + 1]], None, 0.0) for i in range(B)], 0.125, sinks)
            alone = [fused_cpu.attend(qg[i : i + 1], [k[i : i + 1]], [v[i : i + 1]], [mask_bias(valid[i : i + 1])],
                                      [pos[i : i + 1]], None, 0.0, 0.125, sinks=sinks) for i in range(B)]
            assert torch.equal(rows, torch.cat(alone))
