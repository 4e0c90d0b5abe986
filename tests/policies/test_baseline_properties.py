"""Property tests for the per-head baselines: prompt protection, must-keep sets and budgets, at every step.

Random prompt lengths (1-300), budgets (ratio or tokens), protection on/off, left padding and 1-300 decode
steps, on random tensors fed straight to a two-layer cache (no model, so hundreds of cases run in seconds).
What must hold after every forward, in every layer and kv-head:

- with ``protect_prompt`` every real prompt position is kept;
- the newest token and the policy's own must-keep set are kept (StreamingLLM's sinks, H2O's recent window,
  R-KV's and decode-SnapKV's observation window, SnapKV's prompt window and every generated token);
- the kept count never exceeds max(budget, |protected ∪ must-keep|) (+ ``buffer`` between R-KV compressions),
  and the host-side counts equal what the device holds.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import budget as floor_budget
from kvtier.policies import get_policy

H, G, D, LAYERS = 2, 2, 8, 2
POLICIES = ["streaming_llm", "h2o", "rkv", "snapkv_decode", "snapkv"]


def _budget(spec, n: int, n_prompt: int, floor: int | None) -> int:
    kind, value = spec
    b = min(n, value) if kind == "tokens" else max(1, floor_budget(value, n))
    return b if floor is None else max(b, n_prompt + min(floor, n - n_prompt))


def _must_keep(policy, params, n_total, pad, prompt_end, budget) -> set[int]:
    """Positions the policy keeps whatever their score, from its documented rules (not from its code)."""
    real = range(pad, n_total)
    keep = {n_total - 1}  # the newest token
    if policy == "streaming_llm":
        keep |= set(list(real)[: params.get("sink_tokens", 4)])
    elif policy == "h2o":
        recent = budget - math.floor(budget * params.get("heavy_ratio", 0.5) + 1e-9)
        keep |= set(range(max(pad, n_total - recent), n_total))
    elif policy in ("rkv", "snapkv_decode"):
        keep |= set(range(max(pad, n_total - params.get("window", 8)), n_total))
    elif policy == "snapkv":
        keep |= set(range(max(pad, prompt_end - params.get("window", 32)), n_total))  # prompt window + generated
    return keep


@st.composite
def cases(draw):
    policy = draw(st.sampled_from(POLICIES))
    prompt = draw(st.integers(1, 300))
    steps = draw(st.integers(1, 300))
    pad = draw(st.integers(0, prompt - 1))  # row 0 is left-padded by this much
    if draw(st.booleans()):
        spec = ("tokens", draw(st.integers(1, 400)))
    else:
        spec = ("ratio", draw(st.floats(0.05, 1.0)))
    params = {"budget_tokens": spec[1]} if spec[0] == "tokens" else {"budget_ratio": spec[1]}
    if policy != "snapkv" and draw(st.integers(0, 3)) == 0:
        params["budget_floor"] = draw(st.integers(0, 50))  # the equal-memory floor: prompt + newest generated
    protect = policy != "snapkv" and draw(st.booleans())
    if policy != "snapkv":
        params["protect_prompt"] = protect
    if policy == "streaming_llm":
        params["sink_tokens"] = draw(st.integers(0, 8))
    if policy == "h2o":
        params["heavy_ratio"] = draw(st.sampled_from([0.0, 0.3, 0.5, 0.8, 1.0]))
    if policy in ("rkv", "snapkv_decode"):
        params["window"] = draw(st.integers(1, 12))
        params["buffer"] = draw(st.integers(1, 40))
        params["kernel_size"] = draw(st.sampled_from([1, 3, 7]))
    if policy == "snapkv":
        params["window"] = draw(st.integers(1, 40))
    return policy, prompt, steps, pad, spec, params, protect, draw(st.integers(0, 10_000))


@pytest.mark.heavy
@settings(max_examples=240, deadline=None)
@given(cases())
def test_headwise_invariants(case):
    policy, P, steps, pad, spec, params, protect, seed = case
    gen = torch.Generator().manual_seed(seed)
    T = P + steps
    K = torch.randn(LAYERS, 2, H, T, D, generator=gen)
    V = torch.randn(LAYERS, 2, H, T, D, generator=gen)
    Q = torch.randn(LAYERS, 2, H * G, T, D, generator=gen) * 3
    valid = torch.ones(2, P, dtype=torch.bool)
    valid[0, :pad] = False
    causal = torch.tril(torch.ones(P, P, dtype=torch.bool))
    mask = (causal.view(1, 1, P, P) & valid.view(2, 1, 1, P)) if pad else None
    cache = get_policy(policy).build(LAYERS, **params)
    buffer = params.get("buffer", 0) if policy in ("rkv", "snapkv_decode") else 0
    pads = [pad, 0]
    for step, (t0, t1) in enumerate([(0, P)] + [(t, t + 1) for t in range(P, T)]):
        for i, layer in enumerate(cache.layers):
            layer.update(K[i, :, :, t0:t1], V[i, :, :, t0:t1], kwargs={})
            layer.attend(Q[i, :, :, t0:t1], K[i, :, :, t0:t1], V[i, :, :, t0:t1], mask if t0 == 0 else None, D**-0.5)
        n_total = t1
        kept = cache.kept_mask()  # (L, B, H, N)
        assert kept.shape == (LAYERS, 2, H, n_total)
        for b in range(2):
            n_real = n_total - pads[b]
            n_prompt_real = P - pads[b]
            if policy == "snapkv":
                budget = _budget(spec, n_prompt_real, n_prompt_real, None) + (n_total - P)
            else:
                budget = _budget(spec, n_real, n_prompt_real, params.get("budget_floor"))
            forced = _must_keep(policy, params, n_total, pads[b], P, budget)
            if protect:
                forced |= set(range(pads[b], P))
            limit = min(n_real, max(budget, len(forced)))
            row = kept[:, b]  # (L, H, N)
            assert not row[..., : pads[b]].any(), "padding is never kept"
            assert row[..., sorted(forced)].all(), (policy, step, b, sorted(set(forced) - set(row[0, 0].nonzero().flatten().tolist())))
            counts = row.sum(-1)  # (L, H)
            assert (counts == counts[0, 0]).all(), "every layer and head of a row keeps as many tokens"
            assert int(counts[0, 0]) <= limit + buffer, (policy, step, b, int(counts[0, 0]), limit, buffer)
            if not buffer:  # evicting every step: exactly the limit once over it
                assert int(counts[0, 0]) == min(n_real, limit) or policy == "snapkv" and step > 0
        for layer in cache.layers:
            assert torch.equal(layer.counts, kept[layer.layer_idx, :, 0].sum(-1))  # host arithmetic == device
    s = cache.stats()
    assert s["tokens"]["T0"] == int(kept[0, :, 0].sum())
    assert s["tokens"]["T0"] + s["tokens"]["T3"] == (T - pad) + T
