"""Tier assignment: vectorized vs a naive per-token reference, budgets, protection."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import TierConfig, budget
from kvtier.tiers.planner import PAD, T0, T1, T2, T3, assign_tiers, assign_tiers_reference, protected_mask


def _case(seed, B, N, ties):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(B, N, generator=g)
    if ties:
        scores = (scores * 4).floor()  # many equal scores: tie-breaking must agree too
    pads = torch.randint(0, N // 2 + 1, (B,), generator=g)
    valid = torch.arange(N).unsqueeze(0) >= pads.unsqueeze(1)
    prompt = valid & (torch.arange(N).unsqueeze(0) < (pads + torch.randint(0, 6, (B,), generator=g)).unsqueeze(1))
    evicted = valid & (torch.rand(B, N, generator=g) < 0.1)
    return scores, valid, prompt, evicted


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    B=st.integers(1, 4),
    N=st.integers(1, 60),
    ratios=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
    sink=st.integers(0, 5),
    recent=st.integers(0, 10),
    protect_prompt=st.booleans(),
    ties=st.booleans(),
    rest=st.sampled_from(["T0", "T1", "T2"]),
)
def test_vectorized_matches_reference(seed, B, N, ratios, sink, recent, protect_prompt, ties, rest):
    h, q, e = ratios
    total = h + q + e
    if total > 1:
        h, q, e = h / total * 0.999, q / total * 0.999, e / total * 0.999
    cfg = TierConfig(hbm_ratio=h, quant_ratio=q, evict_ratio=e, sink_tokens=sink, recent_window=recent,
                     protect_prompt=protect_prompt, rest_tier=rest)
    scores, valid, prompt, evicted = _case(seed, B, N, ties)
    prot = protected_mask(valid, prompt, cfg)
    fast = assign_tiers(scores, valid, prot, evicted, cfg)
    ref = assign_tiers_reference(scores, valid, prot, evicted, cfg)
    assert torch.equal(fast, ref)
    # invariants
    assert (fast[~valid] == PAD).all()
    assert (fast[prot] == T0).all()
    assert (fast[evicted & ~prot] == T3).all()


def test_budgets_and_ranking():
    N = 100
    cfg = TierConfig(hbm_ratio=0.3, quant_ratio=0.2, evict_ratio=0.1, sink_tokens=0, recent_window=0, protect_prompt=False)
    scores = torch.arange(N, dtype=torch.float32).unsqueeze(0)  # position i has score i
    valid = torch.ones(1, N, dtype=torch.bool)
    none = torch.zeros(1, N, dtype=torch.bool)
    tiers = assign_tiers(scores, valid, none, none, cfg)[0]
    assert (tiers[:10] == T3).all()  # lowest 10% evicted
    assert (tiers[10:30] == T2).all()  # next 20% int8
    assert (tiers[30:70] == T1).all()  # middle 40% host
    assert (tiers[70:] == T0).all()  # top 30% device


def test_protected_set_larger_than_t0_budget():
    N = 50
    cfg = TierConfig(hbm_ratio=0.1, quant_ratio=0.0, evict_ratio=0.2, sink_tokens=4, recent_window=10)
    scores = torch.rand(1, N)
    valid = torch.ones(1, N, dtype=torch.bool)
    prompt = torch.zeros(1, N, dtype=torch.bool)
    prompt[0, :20] = True
    prot = protected_mask(valid, prompt, cfg)
    assert int(prot.sum()) == 30  # prompt 20 (sinks inside it) + recent 10
    tiers = assign_tiers(scores, valid, prot, torch.zeros_like(valid), cfg)[0]
    assert int((tiers == T0).sum()) == 30  # T0 is just the protected set
    assert int((tiers == T3).sum()) == budget(0.2, N)
    assert int((tiers == T1).sum()) == N - 30 - 10


def test_protection_counts_real_tokens_only():
    cfg = TierConfig(sink_tokens=2, recent_window=3, protect_prompt=False)
    valid = torch.tensor([[False, False, True, True, True, True, True, True, True]])
    prot = protected_mask(valid, torch.zeros_like(valid), cfg)[0].tolist()
    assert prot == [False, False, True, True, False, False, True, True, True]


def test_budget_floor_is_robust():
    assert budget(0.29, 100) == 29
    assert budget(0.03, 1000) == 30
    assert budget(0.5, 3) == 1
