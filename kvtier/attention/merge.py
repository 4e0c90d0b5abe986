"""Decode attention math: per-region partial softmaxes, their log-sum-exp merge, and the ordered reference.

One decode query per row attends the kept keys of a layer. The keys live in regions (T0 and the tail on the
device, T1 and dequantised T2 wherever they are attended); each region gives a :class:`Partial` and
:func:`merge` combines them exactly as one softmax over the union would (up to float rounding):

    m_r = max_j s_j      l_r = sum_j exp(s_j - m_r)      o_r = sum_j exp(s_j - m_r) v_j
    m = max_r m_r        L = sum_r exp(m_r - m) l_r      out = sum_r exp(m_r - m) o_r / L

The merged, normalised weight of key j in region r is ``exp(s_j - m_r) * exp(m_r - m) / L``: the cumulative score
is rebuilt from each region's kept ``exp(s_j - m_r)`` and its factor ``f_r = exp(m_r - m) / L``.
:func:`ordered` (softmax over keys gathered in position order) is the bit-exact reference kept beside it.

**Attention sinks** (gpt-oss): a learned logit per query head that enters every softmax's denominator and brings
no value. In the merge it is one more partial — ``m = sink``, ``l = 1``, ``o = 0`` (:func:`sink_partial`) — so the
split paths stay exact; :func:`ordered` and :func:`dense` put it beside the keys' logits as transformers' eager
attention does. The weights it leaves to the keys sum to less than 1; the cumulative scores take them as they are.
Pure functions on tensors; no cache state here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_NEG_INF = float("-inf")
EMPTY = -1e30  # the max of a region without keys: finite, far below any real score


@dataclass
class Partial:
    """One region's contribution for every (row, kv-head, query head of the group).

    o: (B, H, g, D) float32, sum_j exp(s_j - m) v_j (unnormalised).
    m: (B, H, g, 1) float32, max score; ``EMPTY`` (-1e30) where the row has no key in the region, so that
       ``exp(s - m)`` and ``exp(m - M)`` are exactly 0 there without a NaN from ``-inf - -inf``.
    l: (B, H, g, 1) float32, sum_j exp(s_j - m).
    e: (B, H, g, C) float32 exp(s_j - m) (0 on masked columns), kept only when scores are wanted.
    """

    o: torch.Tensor
    m: torch.Tensor
    l: torch.Tensor
    e: torch.Tensor | None = None


def mask_bias(valid: torch.Tensor) -> torch.Tensor:
    """(B, C) bool validity -> (B, 1, 1, C) float32 additive mask: 0 where valid, -inf elsewhere."""
    bias = torch.zeros(valid.shape[0], 1, 1, valid.shape[1], dtype=torch.float32, device=valid.device)
    return bias.masked_fill_(~valid.view(bias.shape), _NEG_INF)


def partial(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scaling: float,
            keep_weights: bool) -> Partial:
    """Partial softmax of queries over one region.

    Args:
        qg: (B, H, g, D) queries grouped by kv-head (GQA: g query heads per kv-head), contiguous.
        k, v: (B, H, C, D) the region's keys and values (any dtype; columns may be stale where masked). Pass whole
            buffers: a column slice of a (B, H, cap, D) buffer makes some matmul backends copy it first.
        bias: (B, 1, 1, C) float32, 0 on kept columns and -inf elsewhere (:func:`mask_bias`); the caller keeps it
            across steps. Scaling, masking and the cast to float32 are then one op.
    """
    acc = torch.float64 if qg.dtype == torch.float64 else torch.float32  # statistics in float32 (float64 in tests)
    s = torch.add(bias.to(acc), torch.matmul(qg, k.transpose(-1, -2)), alpha=scaling)  # (B, H, g, C)
    m = s.amax(dim=-1, keepdim=True).clamp_min_(EMPTY)
    e = s.sub_(m).exp_()  # in place: s is not needed any more
    l = e.sum(dim=-1, keepdim=True)
    o = torch.matmul(e.to(v.dtype), v).to(acc)
    return Partial(o, m, l, e if keep_weights else None)


def sink_partial(sinks: torch.Tensor, B: int, H: int, g: int, D: int) -> Partial:
    """The sinks as a region of one logit and no value: ``sinks`` (H * g,) per query head (kv-head major, as
    the model's heads are numbered) -> m (B, H, g, 1) = sink, l = 1, o = 0, float32."""
    m = sinks.detach().to(torch.float32).reshape(1, H, g, 1).expand(B, H, g, 1)
    return Partial(torch.zeros(B, H, g, D, dtype=torch.float32, device=sinks.device), m, torch.ones_like(m))


def combine(parts: list[Partial]) -> tuple[Partial, list[torch.Tensor]]:
    """Partials -> one unnormalised partial (as if their keys were one region) and each input's factor
    ``c_r = exp(m_r - m)`` (B, H, g, 1), so that weights stay recoverable: ``e_r * c_r`` is relative to ``m``.
    Used where the host tiers (T1, deq T2) are attended, so only one partial crosses back."""
    if len(parts) == 1:
        return Partial(parts[0].o, parts[0].m, parts[0].l), [torch.ones_like(parts[0].m)]
    m = parts[0].m
    for p in parts[1:]:
        m = torch.maximum(m, p.m)
    cs = [torch.exp(p.m - m) for p in parts]
    o = sum(p.o * c for p, c in zip(parts, cs))
    l = sum(p.l * c for p, c in zip(parts, cs))
    return Partial(o, m, l), cs


def merge(parts: list[Partial]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Normalised attention output (B, H, g, D) float32 and each partial's weight factor f_r = exp(m_r - m) / L
    (B, H, g, 1). At least one partial must hold a key for every row (the decode token itself always does).
    A region without keys (m = ``EMPTY``) gets factor exp(EMPTY - m) = 0."""
    m = parts[0].m
    for p in parts[1:]:
        m = torch.maximum(m, p.m)
    alphas = [torch.exp(p.m - m) for p in parts]
    total = sum(p.l * a for p, a in zip(parts, alphas))
    fs = [a / total for a in alphas]
    out = sum(p.o * f for p, f in zip(parts, fs))
    return out, fs


def weights(e: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Merged weight of each key summed over all query heads: (B, C) float32 from e (B, H, g, C), f (B, H, g, 1)."""
    B, H, g, C = e.shape
    return torch.bmm(f.reshape(B, 1, H * g), e.reshape(B, H * g, C)).squeeze(1)


def add_weights(scores: torch.Tensor, pos: torch.Tensor, e: torch.Tensor, f: torch.Tensor, scale: float) -> None:
    """scores[b, pos[b, j]] += scale * weights(e, f)[b, j], in the accumulator's dtype: scores (B, N + 1),
    pos (B, C) (empty columns point at the trash column), e (B, H, g, C), f (B, H, g, 1)."""
    scores.scatter_add_(1, pos, (weights(e, f) * scale).to(scores.dtype))


def _softmax(s: torch.Tensor, sinks: torch.Tensor | None, shape: tuple[int, ...] = ()) -> torch.Tensor:
    """Softmax over the last dim of ``s``, float32; with ``sinks`` (one logit per query head, viewed as ``shape``,
    which broadcasts against ``s[..., :1]``) a column of them joins the softmax and is dropped after, as in
    transformers' eager attention (gpt-oss)."""
    if sinks is None:
        return torch.softmax(s, dim=-1, dtype=torch.float32)
    col = sinks.detach().to(s.dtype).view(shape).expand(s.shape[:-1] + (1,))
    return torch.softmax(torch.cat([s, col], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]


def ordered(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float,
            sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: softmax over every kept key gathered in position order.

    Also the one dense decode softmax of the head-wise eviction caches, whose kept keys differ per kv-head.

    Args:
        qg: (B, H, g, D); k, v: (B, H, K, D) in position order; mask: (B, 1, 1, K) or per kv-head (B, H, 1, K) bool.
        sinks: (H * g,) the model's sink logit per query head, or None.
    Returns:
        output (B, H, g, D) in ``v``'s dtype and the weights (B, H, g, K) float32.
    """
    s = torch.matmul(qg, k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~mask, _NEG_INF)
    p = _softmax(s, sinks, (1,) + tuple(s.shape[1:3]) + (1,))  # (B, H, g, K): a sink per (kv-head, group member)
    return torch.matmul(p.to(v.dtype), v), p


def dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float,
          sinks: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Attention of many queries with sinks (a model's prefill, a sliding layer's window), where SDPA has no sink:
    transformers' eager math, chunk by chunk of queries to bound the (q x kv) weights.

    Args:
        query: (B, Hq, q, D); key, value: (B, H, kv, D) (GQA: Hq a multiple of H); mask: (B, 1, q, kv) bool (True:
            attend), or None for causal attention with the queries at the last q positions of the keys;
        sinks: (Hq,) one logit per query head.
    Returns:
        (B, Hq, q, D) in ``value``'s dtype.
    """
    B, Hq, q, D = query.shape
    H, kv = key.shape[1], key.shape[2]
    g = Hq // H
    k = key.repeat_interleave(g, dim=1) if g > 1 else key
    v = value.repeat_interleave(g, dim=1) if g > 1 else value
    outs = []
    for c in range(0, q, chunk):
        qc = query[:, :, c : c + chunk]
        s = torch.matmul(qc, k.transpose(-1, -2)) * scaling  # (B, Hq, n, kv)
        if mask is None:
            n = qc.shape[2]
            rows = torch.arange(kv - q + c, kv - q + c + n, device=s.device).view(-1, 1)
            m = torch.arange(kv, device=s.device).view(1, -1) <= rows
        else:
            m = mask[:, :, c : c + chunk]
        p = _softmax(s.masked_fill(~m, _NEG_INF), sinks, (1, Hq, 1, 1))
        outs.append(torch.matmul(p.to(v.dtype), v))
    return torch.cat(outs, dim=2)


def prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill's attention over its own prompt: SDPA (never building the (q x q) weights; ``mask`` None: causal),
    or with ``sinks`` (SDPA has none) :func:`dense`. query (B, Hq, q, D), key/value (B, H, q, D) -> (B, Hq, q, D)."""
    if sinks is not None:
        return dense(query, key, value, mask, scaling, sinks)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None, scale=scaling,
                                          enable_gqa=True)


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk of a prompt attending the prompt so far: the ``q`` queries sit at the last ``q`` of the ``kv`` key
    positions, each attending its own and earlier ones (SDPA's ``is_causal`` would align them to the first keys).
    query (B, Hq, q, D), key/value (B, H, kv, D) -> (B, Hq, q, D); with ``sinks``: :func:`dense`."""
    q, kv = query.shape[2], key.shape[2]
    if sinks is not None:
        return dense(query, key, value, None, scaling, sinks)
    if q == kv:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    rows = torch.arange(kv - q, kv, device=key.device).view(-1, 1)
    mask = torch.arange(kv, device=key.device).view(1, -1) <= rows  # (q, kv) True: attend
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


def causal_weight_sums(query: torch.Tensor, k: torch.Tensor, key_valid: torch.Tensor, query_valid: torch.Tensor,
                       scaling: float, chunk: int = 256) -> torch.Tensor:
    """The prompt's causal attention weights summed over every real query and every query head of a kv group:
    (B, H, S) float32 (H2O's accumulated attention after prefill). Chunks of ``chunk`` queries bound the memory.

    Args:
        query: (B, Hq, q, D) the prompt's queries, position c attending keys 0..c; k: (B, H, S, D);
        key_valid: (B, S) bool (padding columns get no attention); query_valid: (B, q) bool (padding queries do
        not vote; a padding query that sees no key contributes 0, not NaN).
    """
    B, Hq, q, D = query.shape
    H, S = k.shape[1], k.shape[2]
    g = Hq // H
    acc = torch.zeros(B, H, S, dtype=torch.float32, device=k.device)
    for c in range(0, q, chunk):
        qc = query[:, :, c : c + chunk]
        n = qc.shape[2]
        s = torch.matmul(qc.reshape(B, H, g * n, D), k.transpose(-1, -2)).view(B, H, g, n, -1) * scaling
        causal = torch.arange(S, device=k.device).view(1, -1) <= torch.arange(c, c + n, device=k.device).view(-1, 1)
        mask = causal.view(1, 1, 1, n, -1) & key_valid.view(B, 1, 1, 1, -1)
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        p = torch.nan_to_num(p)
        acc += (p * query_valid[:, c : c + n].view(B, 1, 1, n, 1)).sum(dim=(2, 3))
    return acc


__all__ = ["EMPTY", "Partial", "add_weights", "causal_weight_sums", "chunk_attention", "dense", "mask_bias", "combine", "merge", "ordered",
           "partial", "prompt_attention", "sink_partial", "weights"]
