"""Baselines: exactness at full budget, budgets held at every step, naive references for H2O and R-KV."""

from __future__ import annotations

import math

import pytest
import torch

import kvtier
from conftest import decode_loop, forced_logits, generate, prompt_ids
from kvtier.config import budget as floor_budget
from kvtier.planner import T3

FULL_BUDGET = {
    "tiered": dict(hbm_ratio=0.3, evict_ratio=0.0, retier_interval=8, recent_window=8),
    "evict": dict(evict_ratio=0.0, retier_interval=8, recent_window=8),
    "quant": dict(hbm_ratio=1.0, retier_interval=8, recent_window=8),
    "streaming_llm": dict(budget_ratio=1.0),
    "h2o": dict(budget_ratio=1.0),
    "rkv": dict(budget_ratio=1.0, buffer=16),
    "snapkv": dict(budget_ratio=1.0),
}


def _padded_pair():
    ids = torch.cat([prompt_ids(length=16, seed=21), prompt_ids(length=16, seed=22)])
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    ids[0, :6] = 0
    return ids, mask


def test_registry_lists_every_policy():
    assert set(kvtier.POLICIES) == {"full", "tiered", "evict", "quant", "streaming_llm", "h2o", "rkv", "snapkv"}


@pytest.mark.parametrize("policy", sorted(FULL_BUDGET))
def test_full_budget_equals_full(qwen2, policy):
    ids, mask = _padded_pair()
    _, ref, _ = generate(qwen2, "full", ids, new_tokens=96, attention_mask=mask)
    _, logits, cache = generate(qwen2, policy, ids, new_tokens=96, attention_mask=mask, **FULL_BUDGET[policy])
    assert cache.stats()["tokens"]["T3"] == 0
    assert (logits - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "policy, params, slack",
    [
        ("streaming_llm", dict(budget_ratio=0.5), 0),
        ("streaming_llm", dict(budget_tokens=24, sink_tokens=4), 0),
        ("h2o", dict(budget_ratio=0.4), 0),
        ("h2o", dict(budget_tokens=20), 0),
        ("rkv", dict(budget_tokens=24, buffer=16), 16),
        ("rkv", dict(budget_ratio=0.5, buffer=8), 8),
    ],
)
def test_headwise_policies_hold_their_budget_every_step(qwen2, policy, params, slack):
    cache = kvtier.make_cache(policy, qwen2, **params)
    ids = prompt_ids(batch=2, length=16, seed=31)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding in row 0
    seen = []

    def check(step, c):
        st = c.state
        budgets = st.budgets()
        assert torch.equal(st.n_real, st.valid[:, : st.n_total].sum(1).cpu())
        for layer in c.layers:
            counts = layer.kept_counts()
            assert torch.equal(counts, layer.counts)  # host-side arithmetic == what the device holds
            assert (counts <= budgets + slack).all(), (step, counts, budgets)
            assert layer.S <= int(budgets.max()) + slack + 1
        seen.append(int(c.layers[0].kept_counts().sum()))

    decode_loop(qwen2, cache, ids, steps=100, on_step=check, attention_mask=mask)
    assert cache.stats()["tokens"]["T3"] > 0 and len(seen) == 100
    assert cache.state.n_real.tolist() == [11 + 100, 16 + 100]


def test_evict_policy_holds_budget_up_to_its_retier_buffer(qwen2):
    cache = kvtier.make_cache("evict", qwen2, evict_ratio=0.4, retier_interval=8, recent_window=4, protect_prompt=False)
    st = cache.state

    def check(step, c):
        s = c.stats()
        n_at_retier = int(st.valid[:, : st.layout.n_main].sum(1).max()) if st.retiers else 0
        since = st.n_total - st.layout.n_main
        kept_per_row = (st.valid[:, : st.n_total] & (st.loc_tier[:, : st.n_total] != T3)).sum(1)
        assert s["tokens"]["T1"] == s["tokens"]["T2"] == 0
        assert (kept_per_row <= n_at_retier - floor_budget(0.4, n_at_retier) + since).all()

    decode_loop(qwen2, cache, prompt_ids(batch=2, length=12, seed=3), steps=80, on_step=check)
    assert cache.stats()["tokens"]["T3"] > 0


def test_evict_and_tiered_evict_the_same_positions(qwen2):
    ids, mask = _padded_pair()
    common = dict(evict_ratio=0.3, retier_interval=8, recent_window=8, sink_tokens=2)
    _, la, evict = generate(qwen2, "evict", ids, new_tokens=80, attention_mask=mask, **common)
    _, lb, tiered = generate(qwen2, "tiered", ids, new_tokens=80, attention_mask=mask, hbm_ratio=0.2, **common)
    n = evict.state.n_total
    gone_a = evict.state.loc_tier[:, :n] == T3
    gone_b = tiered.state.loc_tier[:, :n] == T3
    assert gone_a.sum() > 0 and torch.equal(gone_a, gone_b)
    assert torch.equal(la, lb)
    assert tiered.stats()["tokens"]["T1"] > 0 and evict.stats()["tokens"]["T1"] == 0


def test_quant_policy_stores_int8_and_is_boundedly_lossy(qwen2):
    seq = prompt_ids(length=90, seed=41)
    ref = forced_logits(qwen2, kvtier.make_cache("full", qwen2), seq, 16)
    cache = kvtier.make_cache("quant", qwen2, hbm_ratio=0.2, retier_interval=8, recent_window=4, protect_prompt=False)
    logits = forced_logits(qwen2, cache, seq, 16)
    s = cache.stats()
    assert s["tokens"]["T2"] > 0 and s["tokens"]["T1"] == 0
    assert s["bytes"]["T2"] == s["tokens"]["T2"] * s["bytes_per_token"]["T2"]
    assert s["bytes_per_token"]["T2"] < s["bytes_per_token"]["T0"] / 1.5  # int8 + scales vs fp32
    diff = (logits - ref).abs().max().item()
    assert 1e-4 < diff < 1.0


@pytest.mark.parametrize(
    "policy, params, match",
    [
        ("h2o", dict(budget_ratio=0.5, window=8), r"'window'.*'h2o'"),
        ("streaming_llm", dict(budget_ratio=0.5, heavy_ratio=0.5), r"'heavy_ratio'.*'streaming_llm'"),
        ("rkv", dict(budget_ratio=0.5, kernel=7), r"'kernel'.*'rkv'"),
        ("evict", dict(evict_ratio=0.2, hbm_ratio=0.3), r"'hbm_ratio'.*'evict'"),
        ("quant", dict(quant_ratio=0.2), r"'quant_ratio'.*'quant'"),
        ("h2o", dict(), "exactly one"),
        ("h2o", dict(budget_ratio=0.5, budget_tokens=10), "exactly one"),
        ("rkv", dict(budget_ratio=1.5), "budget_ratio"),
        ("streaming_llm", dict(budget_tokens=0), "budget_tokens"),
        ("rkv", dict(budget_tokens=10, kernel_size=4), "kernel_size"),
        ("h2o", dict(budget_tokens=10, heavy_ratio=2), "heavy_ratio"),
        ("snapkv", dict(budget_ratio=0.5, pooling="mean"), "pooling"),
        ("snapkv", dict(budget_ratio=0.5, buffer=3), r"'buffer'.*'snapkv'"),
    ],
)
def test_bad_policy_parameters(qwen2, policy, params, match):
    with pytest.raises(ValueError, match=match):
        kvtier.make_cache(policy, qwen2, **params)


# ---- naive references, written from the papers, against the vectorized layers ---------------------------
def _drive(policy, params, steps, prefill, H=2, g=2, D=8, seed=0, sharp=4.0):
    """Feed one layer random (B=1) keys/values/queries directly; yield kept positions per head after each call."""
    from kvtier.policies import get_policy

    torch.manual_seed(seed)
    T = prefill + steps
    K = torch.randn(1, H, T, D)
    V = torch.randn(1, H, T, D)
    Q = torch.randn(1, H * g, T, D) * sharp  # peaked attention: heads disagree about heavy hitters
    cache = get_policy(policy).build(1, **params)
    layer = cache.layers[0]
    scale = D**-0.5
    history = []
    for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]:
        kw = {}
        layer.update(K[:, :, t0:t1], V[:, :, t0:t1], kwargs=kw)
        layer.attend(Q[:, :, t0:t1], None, scale)
        kept = [sorted(int(p) for p in layer.pos[0, h, : layer.S] if p >= 0) for h in range(H)]
        history.append(kept)
    return history, (Q, K, V, scale)


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def _dot(a, b):
    return sum(float(x) * float(y) for x, y in zip(a, b))


def h2o_reference(Q, K, scale, prefill, budget, heavy_ratio, H, g):
    """H2O (Zhang et al. 2023, Alg. 1 with the reference code's accumulation), one kv-head group at a time."""
    T = K.shape[2]
    heavy = int(math.floor(budget * heavy_ratio))
    recent = budget - heavy
    out = []
    kept = [list(range(prefill)) for _ in range(H)]
    acc = [dict() for _ in range(H)]

    def observe(h, t, keys):
        for qh in range(h * g, (h + 1) * g):
            p = _softmax([_dot(Q[0, qh, t], K[0, h, j]) * scale for j in keys])
            for j, pj in zip(keys, p):
                acc[h][j] = acc[h].get(j, 0.0) + pj

    def evict(h, n_total):
        if len(kept[h]) <= budget:
            return
        rec = [j for j in kept[h] if j >= n_total - recent]
        old = [j for j in kept[h] if j < n_total - recent]
        top = sorted(old, key=lambda j: -acc[h][j])[: budget - len(rec)]
        kept[h] = sorted(top + rec)

    for h in range(H):
        for t in range(prefill):
            observe(h, t, list(range(t + 1)))
        evict(h, prefill)
    out.append([list(k) for k in kept])
    for t in range(prefill, T):
        for h in range(H):
            kept[h].append(t)
            observe(h, t, kept[h])
            evict(h, t + 1)
        out.append([list(k) for k in kept])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_h2o_matches_naive_reference(seed):
    H, g, prefill, steps, budget = 2, 2, 10, 40, 12
    got, (Q, K, V, scale) = _drive("h2o", dict(budget_tokens=budget, heavy_ratio=0.6), steps, prefill, H=H, g=g, seed=seed)
    want = h2o_reference(Q.double(), K.double(), scale, prefill, budget, 0.6, H, g)
    assert got == want
    assert any(k[0] != k[1] for k in got)  # heads really choose differently


def rkv_reference(Q, K, scale, prefill, budget, window, buffer, kernel, lam, thr, H, g):
    """R-KV (Cai et al. 2025): importance - redundancy, recomputed from scratch with loops."""
    T = K.shape[2]
    kept = [list(range(prefill)) for _ in range(H)]
    queries: list[int] = list(range(prefill))[-window:]
    since = 0
    out = []

    def compress(h):
        keys = kept[h]
        S = len(keys)
        w = min(window, len(queries), S - 1)
        past, win = keys[: S - w], keys[S - w :]
        qs = queries[-w:]
        # importance: per window query, max over the group's heads of the logits, softmax over past keys
        a = [0.0] * len(past)
        for qi in qs:
            logits = [max(_dot(Q[0, qh, qi], K[0, h, j]) * scale for qh in range(h * g, (h + 1) * g)) for j in past]
            for idx, pj in enumerate(_softmax(logits)):
                a[idx] += pj / len(qs)
        imp = [max(a[max(0, i - kernel // 2) : i + kernel // 2 + 1]) for i in range(len(past))]
        # redundancy over all kept keys
        norm = [math.sqrt(_dot(K[0, h, j], K[0, h, j])) + 1e-8 for j in keys]
        cos = [[(0.0 if i == j else _dot(K[0, h, keys[i]], K[0, h, keys[j]]) / (norm[i] * norm[j])) for j in range(S)] for i in range(S)]
        for i in range(S):
            newest = max([j for j in range(S) if cos[i][j] > thr], default=0)
            cos[i][newest] = 0.0
        mean = [sum(cos[i][j] for i in range(S)) / S for j in range(S)]
        red = _softmax(mean)
        score = [lam * imp[i] - (1 - lam) * red[i] for i in range(len(past))]
        top = sorted(range(len(past)), key=lambda i: -score[i])[: budget - w]
        kept[h] = sorted([past[i] for i in top] + win)

    if prefill > budget + buffer:
        for h in range(H):
            compress(h)
    out.append([list(k) for k in kept])
    for t in range(prefill, T):
        queries = (queries + [t])[-window:]
        since += 1
        for h in range(H):
            kept[h].append(t)
        if len(kept[0]) > budget and (since >= buffer or len(kept[0]) > budget + buffer):
            for h in range(H):
                compress(h)
            since = 0
        out.append([list(k) for k in kept])
    return out


@pytest.mark.parametrize("seed, lam", [(0, 0.1), (1, 0.07), (2, 0.5)])
def test_rkv_matches_naive_reference(seed, lam):
    H, g, prefill, steps = 2, 2, 30, 40
    params = dict(budget_tokens=12, window=4, buffer=6, kernel_size=3, lam=lam, threshold=0.3)
    got, (Q, K, V, scale) = _drive("rkv", params, steps, prefill, H=H, g=g, seed=seed)
    want = rkv_reference(Q.double(), K.double(), scale, prefill, 12, 4, 6, 3, lam, 0.3, H, g)
    assert got == want


def test_snapkv_compresses_the_prompt_only(qwen2):
    ids, mask = _padded_pair()
    cache = kvtier.make_cache("snapkv", qwen2, budget_tokens=6, window=3, kernel_size=3)
    decode_loop(qwen2, cache, ids, steps=30, attention_mask=mask)
    for layer in cache.layers:
        assert torch.equal(layer.kept_counts(), torch.tensor([6 + 30, 6 + 30]))
        # every generated token is still there, in every head
        gen = layer.pos[:, :, : layer.S] >= 16
        assert (gen.sum(-1) == 30).all()
    assert cache.stats()["tokens"]["T3"] == (10 - 6) + (16 - 6)


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_votes_match_naive_reference(pooling):
    from kvtier.policies.snapkv import snapkv_scores

    torch.manual_seed(3)
    B, H, g, S, D, w, k = 1, 2, 2, 14, 8, 4, 3
    keys = torch.randn(B, H, S, D)
    q = torch.randn(B, H * g, w, D) * 3
    valid = torch.ones(B, H, S, dtype=torch.bool)
    got = snapkv_scores(q, keys, valid, D**-0.5, k, pooling)
    past = S - w
    for h in range(H):
        votes = [0.0] * past
        for qh in range(h * g, (h + 1) * g):
            for i in range(w):
                p = _softmax([_dot(q[0, qh, i], keys[0, h, j]) * D**-0.5 for j in range(past)])
                for j in range(past):
                    votes[j] += p[j]
        for j in range(past):
            win = [votes[x] for x in range(j - k // 2, j + k // 2 + 1) if 0 <= x < past]
            want = max(win) if pooling == "max" else sum(win) / k  # avg pooling counts the zero padding
            assert abs(float(got[0, h, j]) - want) < 1e-5
        assert torch.isinf(got[0, h, past:]).all()
