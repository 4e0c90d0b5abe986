"""SnapKV's selection as released, in loops.

Follows github.com/FasterDecoding/SnapKV at commit 395b54dce7866cb2cffdebdc9f641fd0821a2c30,
``snapkv/monkeypatch/snapkv_utils.py``, ``SnapKVCluster.update_kv`` (called once, on the prompt): when the
prompt has at least ``max_capacity_prompt`` tokens, the last ``window_size`` queries attend over all prompt
keys (a causal mask inside the window; softmax over every key, so the window's keys share the mass), their
weights on the older keys are summed over the window, pooled (avg or max, ``kernel_size``, stride 1, same
padding), and each head keeps the top ``max_capacity_prompt - window_size`` older keys plus the window.
Generated tokens are never evicted.

For grouped queries kvtier sums the votes of a kv group's query heads (they share one K/V); so does this
reference, and for ``g = 1`` it is the released selection. Written from reading that code; nothing is copied.
"""

from __future__ import annotations

import math

from .common import avg_pool, dot, max_pool, softmax, top_positions


def snapkv_history(Q, K, prefill, max_capacity_prompt, window, kernel, pooling):
    H, T, D = K.shape[1], K.shape[2], K.shape[3]
    g = Q.shape[1] // H
    scale = 1.0 / math.sqrt(D)
    kept = [list(range(prefill)) for _ in range(H)]
    if prefill >= max_capacity_prompt:
        past = list(range(prefill - window))
        for h in range(H):
            votes = [0.0] * len(past)
            for qh in range(h * g, (h + 1) * g):
                for qi in range(prefill - window, prefill):
                    seen = list(range(qi + 1))
                    p = softmax([dot(Q[0, qh, qi], K[0, h, j]) * scale for j in seen])
                    for j in past:
                        votes[j] += p[j]
            pooled = (avg_pool if pooling == "avg" else max_pool)(votes, kernel)
            kept[h] = sorted(top_positions(past, pooled, max_capacity_prompt - window) + list(range(prefill - window, prefill)))
    history = [[list(k) for k in kept]]
    for t in range(prefill, T):
        for h in range(H):
            kept[h].append(t)
        history.append([list(k) for k in kept])
    return history
