"""The planner's device limit (memory pressure): ``limit_t0`` against its naive reference, and what it keeps."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtier.config import TierConfig
from kvtier.tiers.planner import PAD, T0, T1, assign_tiers, limit_t0, limit_t0_reference, protected_mask


@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 40), st.integers(0, 40), st.booleans())
def test_limit_t0_matches_reference(seed, B, N, limit, ties):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (B, N), generator=g).double() if ties else torch.rand(B, N, generator=g, dtype=torch.float64)
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[:, : int(torch.randint(0, N, (1,), generator=g))] = False  # left padding
    prompt = torch.zeros(B, N, dtype=torch.bool)
    prompt[:, : N // 2] = True
    cfg = TierConfig(hbm_ratio=0.6, evict_ratio=0.1, recent_window=3, sink_tokens=1)
    prot = protected_mask(valid, prompt & valid, cfg)
    tiers = assign_tiers(scores, valid, prot, torch.zeros_like(valid), cfg)
    lim = torch.full((B,), limit, dtype=torch.long)
    out = limit_t0(tiers, scores, prot, lim)
    assert torch.equal(out, limit_t0_reference(tiers, scores, prot, lim))
    assert bool(((out == T0).sum(1) <= lim).all())
    moved = (tiers != out)
    assert bool((tiers[moved] == T0).all()) and bool((out[moved] == T1).all())  # only T0 -> T1, never T3
    assert torch.equal(out == PAD, tiers == PAD)


def test_unprotected_leave_first_then_coldest():
    scores = torch.tensor([[5.0, 1.0, 3.0, 9.0, 2.0, 2.0]], dtype=torch.float64)
    tiers = torch.full((1, 6), T0, dtype=torch.int8)
    prot = torch.tensor([[True, True, False, False, False, False]])
    out = limit_t0(tiers, scores, prot, torch.tensor([3]))
    # the protected pair stays; of the rest the best (9.0 at 3) stays; 2.0 vs 2.0: the older (4) leaves first
    assert out.tolist() == [[T0, T0, T1, T0, T1, T1]]
    out = limit_t0(tiers, scores, prot, torch.tensor([1]))
    assert out.tolist() == [[T0, T1, T1, T1, T1, T1]]  # protected too, once nothing else is left: colder first
