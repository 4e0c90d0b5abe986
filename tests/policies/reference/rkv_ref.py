"""R-KV's selection as released, in loops.

Follows github.com/Zefan-Cai/R-KV at commit d15c9767e67c2bd9807128fecc35223fa2484a69:

- ``rkv/compression/r1_kv.py``, ``R1KV.update_kv``: below the budget nothing happens; otherwise each kv-head
  keeps its ``window_size`` newest keys and the ``budget - window_size`` older keys with the highest
  ``mix_lambda * importance - (1 - mix_lambda) * similarity``;
- ``rkv/compression/snapkv.py``, ``SnapKV.update_kv``: the same selection by importance alone (the R-KV
  paper's "SnapKV" row; kvtier's ``snapkv_decode``);
- ``rkv/utils.py``: ``compute_attention_scores`` (q.k / sqrt(d), then the max over a kv group's query heads)
  and ``cal_similarity`` (threshold 0.5, ``retain_direction="last"``);
- ``rkv/modeling.py``: the query cache holds the last ``window_size`` queries (the prompt's included);
  ``update_kv`` runs on the prompt at prefill, and during decoding in each forward that follows one whose
  running length (``self.length``, prompt + generated) is a multiple of ``divide_length``
  (``divide_method="step_length"``).

Written from reading that code; nothing is copied. Ties between equal scores: see ``common.top_positions``.
"""

from __future__ import annotations

import math

from .common import dot, max_pool, softmax, top_positions


def _importance(Q, K, h, g, queries, past, scale, kernel):
    acc = [0.0] * len(past)
    for qi in queries:
        logits = [max(dot(Q[0, qh, qi], K[0, h, j]) * scale for qh in range(h * g, (h + 1) * g)) for j in past]
        for a, p in enumerate(softmax(logits)):
            acc[a] += p / len(queries)
    return max_pool(acc, kernel)


def _similarity(K, h, keys, threshold):
    """cal_similarity: per key, the softmax over keys of the mean (over rows) cosine similarity, with the
    diagonal and, in each row, the newest key above ``threshold`` (column 0 when there is none) zeroed."""
    S = len(keys)
    norm = [math.sqrt(dot(K[0, h, j], K[0, h, j])) + 1e-8 for j in keys]
    cos = [[0.0 if a == b else dot(K[0, h, keys[a]], K[0, h, keys[b]]) / (norm[a] * norm[b]) for b in range(S)]
           for a in range(S)]
    for a in range(S):
        above = [b for b in range(S) if cos[a][b] > threshold]
        cos[a][max(above) if above else 0] = 0.0
    return softmax([sum(cos[a][b] for a in range(S)) / S for b in range(S)])


def rkv_history(Q, K, prefill, budget, window, divide_length, kernel, lam, redundancy=True, threshold=0.5):
    """Kept positions per kv-head after the prefill and after every decode step.

    Q: (1, H*g, T, D), K: (1, H, T, D) float64 (RoPE already applied); the first ``prefill`` positions are
    the prompt. Needs ``budget > window`` and ``prefill >= window`` (the code asserts the first).
    """
    H, T, D = K.shape[1], K.shape[2], K.shape[3]
    g = Q.shape[1] // H
    scale = 1.0 / math.sqrt(D)
    kept = [list(range(prefill)) for _ in range(H)]
    queries = list(range(prefill))[-window:]

    def update_kv():
        for h in range(H):
            keys = kept[h]
            if len(keys) < budget:
                continue
            past, recent = keys[:-window], keys[-window:]
            score = _importance(Q, K, h, g, queries, past, scale, kernel)
            if redundancy:
                sim = _similarity(K, h, keys, threshold)[: len(past)]
                score = [lam * a - (1 - lam) * s for a, s in zip(score, sim)]
            kept[h] = sorted(top_positions(past, score, budget - window) + recent)

    history = []
    update_kv()  # prefill: the flag starts as None, so the prompt is compressed as soon as it reaches the budget
    length = prefill
    compress_next = length % divide_length == 0
    history.append([list(k) for k in kept])
    for t in range(prefill, T):
        queries = (queries + [t])[-window:]
        for h in range(H):
            kept[h].append(t)
        if compress_next:
            update_kv()
        length += 1
        compress_next = length % divide_length == 0
        history.append([list(k) for k in kept])
    return history
