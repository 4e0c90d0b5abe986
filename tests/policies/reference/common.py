"""Small helpers shared by the references: plain-Python softmax, dot products, pooling, ranking, and a driver
that feeds random tensors to one kvtier headwise layer."""

from __future__ import annotations

import math

import torch


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def dot(a, b) -> float:
    return sum(float(x) * float(y) for x, y in zip(a, b))


def max_pool(xs: list[float], kernel: int) -> list[float]:
    """Stride 1, same padding (-inf padding, as F.max_pool1d)."""
    r = kernel // 2
    return [max(xs[max(0, i - r) : i + r + 1]) for i in range(len(xs))]


def avg_pool(xs: list[float], kernel: int) -> list[float]:
    """Stride 1, same zero padding counted in the mean (F.avg_pool1d's count_include_pad=True)."""
    r = kernel // 2
    return [sum(xs[max(0, i - r) : i + r + 1]) / kernel for i in range(len(xs))]


def top_positions(positions: list[int], scores: list[float], n: int) -> list[int]:
    """The ``n`` positions with the highest scores. Equal scores: the newer position first.

    The authors' code leaves ties to ``torch.topk`` (unspecified); kvtier fixes them this way, and ties do
    occur (max pooling copies a value to its neighbours)."""
    ranked = sorted(zip(positions, scores), key=lambda ps: (-ps[1], -ps[0]))
    return [p for p, _ in ranked[: max(0, n)]]


def random_qkv(H: int, g: int, T: int, D: int, seed: int, sharp: float = 4.0):
    """(1, H*g, T, D) queries, (1, H, T, D) keys and values; peaked queries so heads disagree."""
    gen = torch.Generator().manual_seed(seed)
    K = torch.randn(1, H, T, D, generator=gen)
    V = torch.randn(1, H, T, D, generator=gen)
    Q = torch.randn(1, H * g, T, D, generator=gen) * sharp
    return Q, K, V


def drive_layer(policy: str, params: dict, Q, K, V, prefill: int, num_layers: int = 1):
    """Feed a kvtier headwise cache the prompt ``[0, prefill)`` then one token per step; after every forward
    record each kv-head's kept positions. Returns (history, cache); history[t][h] is a sorted list."""
    from kvtier.policies import get_policy

    cache = get_policy(policy).build(num_layers, **params)
    H, T, D = K.shape[1], K.shape[2], K.shape[3]
    scale = D**-0.5
    history = []
    for t0, t1 in [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]:
        for layer in cache.layers:
            layer.update(K[:, :, t0:t1], V[:, :, t0:t1], kwargs={})
            layer.attend(Q[:, :, t0:t1], K[:, :, t0:t1], V[:, :, t0:t1], None, scale)
        layer = cache.layers[0]
        history.append([sorted(int(p) for p in layer.pos[0, h, : layer.S] if p >= 0) for h in range(H)])
    return history, cache
