"""H2O's selection as released, in loops.

Follows github.com/FMInference/H2O at commit ac75c2a8a9e76832b2a4139b9363373b56336bfb,
``h2o_hf/utils_real_drop/modify_llama.py``: ``H2OKVCache_LayerWise`` (``_update_hh_score``, ``__call__``) and
the attention that calls it. Each forward attends over the cache plus the new tokens (softmax, causal at
prefill), adds every query's attention to its key's heavy-hitter score (summed over queries), and then, when
the cache holds more than ``hh_size + recent_size`` tokens, keeps the ``recent_size`` newest and the
``hh_size`` highest-scoring older ones (scores of kept tokens carry over).

The released code is written for multi-head attention (one score per head). With grouped queries kvtier
sums the scores of a kv group's query heads, since they share one K/V; this reference does the same, and for
``g = 1`` it is exactly the released selection. Written from reading that code; nothing is copied.
"""

from __future__ import annotations

import math

from .common import dot, softmax, top_positions


def h2o_history(Q, K, prefill, hh_size, recent_size):
    H, T, D = K.shape[1], K.shape[2], K.shape[3]
    g = Q.shape[1] // H
    scale = 1.0 / math.sqrt(D)
    cache_size = hh_size + recent_size
    kept = [list(range(prefill)) for _ in range(H)]
    score = [dict() for _ in range(H)]

    def observe(h, t, keys):
        for qh in range(h * g, (h + 1) * g):
            for j, p in zip(keys, softmax([dot(Q[0, qh, t], K[0, h, j]) * scale for j in keys])):
                score[h][j] = score[h].get(j, 0.0) + p

    def evict(h):
        keys = kept[h]
        if len(keys) <= cache_size:
            return
        older, recent = keys[: len(keys) - recent_size], keys[len(keys) - recent_size :]
        heavy = top_positions(older, [score[h][j] for j in older], hh_size)
        kept[h] = sorted(heavy + recent)

    history = []
    for h in range(H):
        for t in range(prefill):
            observe(h, t, list(range(t + 1)))
        evict(h)
    history.append([list(k) for k in kept])
    for t in range(prefill, T):
        for h in range(H):
            kept[h].append(t)
            observe(h, t, kept[h])
            evict(h)
        history.append([list(k) for k in kept])
    return history
