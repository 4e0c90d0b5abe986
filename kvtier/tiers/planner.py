"""Tier assignment: pure index logic, no tensors move here.

Input per cache: one cumulative score per (row, position), which positions are real (not left padding),
protected or already evicted. Output: a tier per (row, position).

Rules (per row b, with N_b real positions, P_b protected, E_b already evicted):
    n3 = floor(evict_ratio * N_b)   total evicted after this call (evictions are final, so E_b counts)
    n2 = floor(quant_ratio * N_b)
    n0 = max(P_b, floor(hbm_ratio * N_b))
Unprotected, alive positions are ranked by score (ties: the newer position ranks higher). The lowest
``n3 - E_b`` go to T3, the next lowest ``n2`` to T2, the highest ``n0 - P_b`` to T0 and the middle to
``cfg.rest_tier`` (T1 for the hierarchy; T0 or T2 for the eviction-only and precision ablations).
When the protected set is larger than a budget allows, eviction and quantization keep their share first
and T0 shrinks to the protected set; protected positions are never quantized or evicted.
"""

from __future__ import annotations

import torch

from ..config import TierConfig, budget

T0, T1, T2, T3 = 0, 1, 2, 3
PAD = -1  # left padding: never scored, never counted, never moved
REST = {"T0": T0, "T1": T1, "T2": T2}


def protected_mask(valid: torch.Tensor, prompt: torch.Tensor, cfg: TierConfig) -> torch.Tensor:
    """Positions that always live in T0.

    Args:
        valid: (B, N) bool, real (non-padding) positions.
        prompt: (B, N) bool, positions that arrived with the prompt.
    Returns:
        (B, N) bool.
    """
    prot = prompt & valid if cfg.protect_prompt else torch.zeros_like(valid)
    rank_fwd = torch.cumsum(valid.int(), dim=1)  # 1 for the first real token
    rank_bwd = torch.flip(torch.cumsum(torch.flip(valid.int(), [1]), dim=1), [1])  # 1 for the last one
    prot = prot | (valid & (rank_fwd <= cfg.sink_tokens))
    prot = prot | (valid & (rank_bwd <= cfg.recent_window))
    return prot


def row_budgets(n_real: torch.Tensor, n_protected: torch.Tensor, cfg: TierConfig) -> dict[str, torch.Tensor]:
    """Per-row token budgets (B,) int64: n0, n2, n3 (T1 is the remainder)."""
    n_list = n_real.tolist()
    n3 = torch.tensor([budget(cfg.evict_ratio, n) for n in n_list], dtype=torch.long)
    n2 = torch.tensor([budget(cfg.quant_ratio, n) for n in n_list], dtype=torch.long)
    n0 = torch.tensor([budget(cfg.hbm_ratio, n) for n in n_list], dtype=torch.long)
    n0 = torch.maximum(n0, n_protected.cpu().long())
    return {"n0": n0, "n2": n2, "n3": n3}


def assign_tiers(
    scores: torch.Tensor,
    valid: torch.Tensor,
    protected: torch.Tensor,
    evicted: torch.Tensor,
    cfg: TierConfig,
) -> torch.Tensor:
    """Vectorized tier assignment.

    Args:
        scores: (B, N) cumulative attention (float64 in the cache; any float dtype works).
        valid: (B, N) bool real positions.
        protected: (B, N) bool (subset of valid).
        evicted: (B, N) bool positions already in T3 (they stay there).
    Returns:
        (B, N) int8 tiers in {PAD, T0, T1, T2, T3}.
    """
    scores, valid, protected, evicted = (t.cpu() for t in (scores, valid, protected, evicted))
    B, N = scores.shape
    protected = protected & valid
    evicted = evicted & valid & ~protected
    cand = valid & ~protected & ~evicted
    n_real = valid.sum(1)
    b = row_budgets(n_real, protected.sum(1), cfg)
    m = cand.sum(1)
    e = (b["n3"] - evicted.sum(1)).clamp(min=0)
    e = torch.minimum(e, m)
    q = torch.minimum(b["n2"], m - e)
    a = torch.minimum((b["n0"] - protected.sum(1)).clamp(min=0), m - e - q)

    # Rank candidates by score, best first; ties favour the newer position (flip, then stable sort).
    key = torch.where(cand, scores.double(), torch.full_like(scores, float("-inf"), dtype=torch.float64))
    order = torch.sort(torch.flip(key, [1]), dim=1, descending=True, stable=True).indices
    order = (N - 1) - order  # back to positions
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(N).expand(B, N).contiguous())

    a_, m_, e_, q_ = (t.unsqueeze(1) for t in (a, m, e, q))
    tiers = torch.full((B, N), REST[cfg.rest_tier], dtype=torch.int8)
    tiers[rank < a_] = T0
    tiers[(rank >= m_ - e_ - q_) & (rank < m_ - e_)] = T2
    tiers[(rank >= m_ - e_) & (rank < m_)] = T3
    tiers[~cand] = T0
    tiers[evicted] = T3
    tiers[~valid] = PAD
    return tiers


def assign_tiers_reference(
    scores: torch.Tensor,
    valid: torch.Tensor,
    protected: torch.Tensor,
    evicted: torch.Tensor,
    cfg: TierConfig,
) -> torch.Tensor:
    """Naive per-token version of :func:`assign_tiers`, written as the rules read (for tests)."""
    B, N = scores.shape
    out = torch.full((B, N), PAD, dtype=torch.int8)
    for r in range(B):
        real = [p for p in range(N) if bool(valid[r, p])]
        prot = [p for p in real if bool(protected[r, p])]
        gone = [p for p in real if bool(evicted[r, p]) and p not in prot]
        cands = [p for p in real if p not in prot and p not in gone]
        cands.sort(key=lambda p: (-float(scores[r, p]), -p))  # best first, newer wins ties
        n = len(real)
        n3, n2 = budget(cfg.evict_ratio, n), budget(cfg.quant_ratio, n)
        n0 = max(len(prot), budget(cfg.hbm_ratio, n))
        e = min(max(n3 - len(gone), 0), len(cands))
        q = min(n2, len(cands) - e)
        a = min(max(n0 - len(prot), 0), len(cands) - e - q)
        for p in prot:
            out[r, p] = T0
        for p in gone:
            out[r, p] = T3
        for i, p in enumerate(cands):
            if i < a:
                out[r, p] = T0
            elif i >= len(cands) - e:
                out[r, p] = T3
            elif i >= len(cands) - e - q:
                out[r, p] = T2
            else:
                out[r, p] = REST[cfg.rest_tier]
    return out


def limit_t0(tiers: torch.Tensor, scores: torch.Tensor, protected: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Cap each row's T0 at ``limit[b]`` tokens (memory pressure): the T0 tokens that rank lowest go to T1.

    T1 is exact, so this changes no output beyond the split attention's rounding (Proposition 1). Rank, highest
    kept first: unprotected tokens leave before protected ones (the protected set stays on the device while it
    fits), then lower score first, then older first (the planner's tie rule).

    Args:
        tiers: (B, N) int8 from :func:`assign_tiers`; scores: (B, N) float; protected: (B, N) bool;
        limit: (B,) long, tokens each row may keep in T0 (>= 0).
    Returns:
        (B, N) int8, ``tiers`` with the demoted T0 tokens in T1.
    """
    B, N = tiers.shape
    on0 = tiers == T0
    if not bool((on0.sum(1) > limit.cpu()).any()):
        return tiers
    pos = torch.arange(N).expand(B, N)
    # stable sorts from the least significant key to the most: position (newer first), score, protected
    order = torch.sort(pos, dim=1, descending=True, stable=True).indices
    for key in (scores.cpu().double(), protected.cpu().double()):
        k = torch.where(on0, key, torch.full_like(key, float("-inf"))).gather(1, order)
        order = order.gather(1, torch.sort(k, dim=1, descending=True, stable=True).indices)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(N).expand(B, N).contiguous())
    out = tiers.clone()
    out[on0 & (rank >= limit.cpu().view(B, 1))] = T1
    return out


def limit_t0_reference(tiers: torch.Tensor, scores: torch.Tensor, protected: torch.Tensor,
                       limit: torch.Tensor) -> torch.Tensor:
    """Naive per-row version of :func:`limit_t0`, written as the rule reads (for tests)."""
    out = tiers.clone()
    for r in range(tiers.shape[0]):
        t0 = [p for p in range(tiers.shape[1]) if int(tiers[r, p]) == T0]
        t0.sort(key=lambda p: (bool(protected[r, p]), float(scores[r, p]), p), reverse=True)
        for p in t0[int(limit[r]):]:
            out[r, p] = T1
    return out
