"""The baselines against loop references written from their authors' released code (``tests/reference/``):
identical kept sets per kv-head after every forward, on random fp32 tensors (the references run in float64)."""

from __future__ import annotations

import pytest
from reference.common import drive_layer, random_qkv
from reference.h2o_ref import h2o_history
from reference.rkv_ref import rkv_history
from reference.snapkv_ref import snapkv_history
from reference.streaming_llm_ref import streaming_history


def _heads_differ(history) -> bool:
    return any(len({tuple(h) for h in step}) > 1 for step in history)


@pytest.mark.parametrize(
    "seed, H, g, prefill, steps, budget, window, buffer, kernel, lam",
    [
        (0, 2, 2, 30, 40, 12, 4, 6, 3, 0.07),
        (1, 2, 1, 9, 50, 16, 4, 8, 5, 0.1),   # prompt under the budget: grows until a buffer boundary
        (2, 1, 4, 12, 30, 12, 4, 5, 3, 0.5),  # prompt exactly at the budget: compressed at prefill (a no-op)
        (3, 2, 2, 40, 60, 20, 8, 16, 7, 0.07),
        (4, 3, 2, 16, 45, 10, 3, 7, 3, 0.9),
    ],
)
def test_rkv_kept_sets_match_authors_code(seed, H, g, prefill, steps, budget, window, buffer, kernel, lam):
    Q, K, V = random_qkv(H, g, prefill + steps, 8, seed)
    params = dict(budget_tokens=budget, window=window, buffer=buffer, kernel_size=kernel, lam=lam)
    got, cache = drive_layer("rkv", params, Q, K, V, prefill)
    want = rkv_history(Q.double(), K.double(), prefill, budget, window, buffer, kernel, lam)
    assert got == want
    assert cache.stats()["retiers"] > 0 and (H == 1 or _heads_differ(got))


@pytest.mark.parametrize("seed, H, g, prefill, steps, budget, window, buffer, kernel",
                         [(0, 2, 2, 30, 40, 12, 4, 6, 7), (1, 2, 1, 10, 60, 14, 8, 16, 7), (2, 3, 2, 20, 30, 9, 3, 4, 3)])
def test_snapkv_decode_kept_sets_match_authors_code(seed, H, g, prefill, steps, budget, window, buffer, kernel):
    Q, K, V = random_qkv(H, g, prefill + steps, 8, seed)
    params = dict(budget_tokens=budget, window=window, buffer=buffer, kernel_size=kernel)
    got, _ = drive_layer("snapkv_decode", params, Q, K, V, prefill)
    want = rkv_history(Q.double(), K.double(), prefill, budget, window, buffer, kernel, 1.0, redundancy=False)
    assert got == want and _heads_differ(got)


@pytest.mark.parametrize("seed, H, g, prefill, steps, hh, recent",
                         [(0, 2, 1, 10, 40, 6, 6), (1, 2, 2, 25, 30, 5, 7), (2, 3, 1, 4, 50, 10, 6), (3, 1, 2, 18, 20, 12, 4)])
def test_h2o_kept_sets_match_authors_code(seed, H, g, prefill, steps, hh, recent):
    Q, K, V = random_qkv(H, g, prefill + steps, 8, seed)
    budget = hh + recent
    got, _ = drive_layer("h2o", dict(budget_tokens=budget, heavy_ratio=hh / budget), Q, K, V, prefill)
    want = h2o_history(Q.double(), K.double(), prefill, hh, recent)
    assert got == want
    assert H == 1 or _heads_differ(got)


@pytest.mark.parametrize("prefill, steps, start, recent", [(10, 40, 4, 8), (30, 10, 4, 12), (3, 30, 2, 5), (12, 12, 0, 6)])
def test_streaming_llm_kept_sets_match_authors_code(prefill, steps, start, recent):
    Q, K, V = random_qkv(2, 2, prefill + steps, 8, 0)
    got, _ = drive_layer("streaming_llm", dict(budget_tokens=start + recent, sink_tokens=start), Q, K, V, prefill)
    want = streaming_history(prefill, prefill + steps, start, recent)
    assert got == [[w, w] for w in want]


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("seed, H, g, prefill, budget, window, kernel",
                         [(0, 2, 1, 40, 16, 8, 5), (1, 2, 2, 30, 12, 4, 3), (2, 3, 2, 20, 20, 6, 5), (3, 2, 1, 9, 16, 4, 3)])
def test_snapkv_kept_sets_match_authors_code(seed, H, g, prefill, budget, window, kernel, pooling):
    Q, K, V = random_qkv(H, g, prefill + 10, 8, seed)
    params = dict(budget_tokens=budget, window=window, kernel_size=kernel, pooling=pooling)
    got, _ = drive_layer("snapkv", params, Q, K, V, prefill)
    want = snapkv_history(Q.double(), K.double(), prefill, budget, window, kernel, pooling)
    assert got == want
    assert prefill <= budget or _heads_differ(got)
