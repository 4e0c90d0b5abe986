"""The sampling step written plainly, one row at a time with full sorts: the reference the batched step is tested against."""

from __future__ import annotations

import torch

from .logprobs import TokenLogprobs
from .params import SamplingParams


def penalise(x: torch.Tensor, p: SamplingParams, prompt: list[int] | None, output: list[int] | None) -> torch.Tensor:
    """The row's logits ``x`` (V,) float32 with ``p``'s penalties applied (a new tensor when any applies).

    ``repetition_penalty`` reads the prompt's and the output's tokens; ``frequency_penalty`` and
    ``presence_penalty`` the output's (each token's count, and whether it appeared)."""
    if not p.penalised:
        return x
    x = x.clone()
    out = torch.tensor(output or [], dtype=torch.long)
    if p.repetition_penalty != 1.0:
        seen = torch.cat([torch.tensor(prompt or [], dtype=torch.long), out]).unique()
        if seen.numel():
            v = x[seen]
            x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    if out.numel() and (p.frequency_penalty or p.presence_penalty):
        ids, counts = out.unique(return_counts=True)
        x[ids] -= p.frequency_penalty * counts.to(x.dtype) + p.presence_penalty
    return x


def uniform(gen: torch.Generator | None) -> float:
    """The row's one uniform draw of the step, in [0, 1), from its own generator."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def _scaled(x: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the logits after the temperature and top_k (V,), their probabilities, top_p's and min_p's cut: tokens less
    likely than it are left out; 0 when neither is set)."""
    x = x * torch.tensor(1.0 / p.temperature, dtype=torch.float32)  # (the batched step's very operation)
    if p.top_k and p.top_k < x.numel():
        kth = x.sort(descending=True).values[p.top_k - 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cut = torch.zeros((), dtype=probs.dtype)
    if p.top_p < 1.0:
        s = probs.sort(descending=True).values
        n = int((s.double().cumsum(0) < p.top_p).sum())  # tokens before the one whose prefix reaches top_p
        cut = s[min(n, s.numel() - 1)]
    if p.min_p:
        cut = torch.maximum(cut, torch.tensor(p.min_p, dtype=torch.float32) * probs.max())
    return x, probs, cut


def weights(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The row's sampling weights (V,) float32 from its penalised logits ``x``: the probabilities after
    temperature and top_k, zero outside top_p's and min_p's sets (see :class:`SamplingParams` for the order).
    Full sorts; ties at every boundary kept."""
    _, probs, cut = _scaled(x, p)
    return probs.masked_fill(probs < cut, 0.0)


def processed_logits(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The logits (V,) float32 a token is drawn from, given the row's penalised logits ``x``: after the temperature
    and top_k, the tokens top_p and min_p leave out at ``-inf`` (their softmax is :func:`weights` normalised). A
    greedy row's are ``x`` itself."""
    if p.greedy:
        return x
    y, probs, cut = _scaled(x, p)
    return y.masked_fill(probs < cut, float("-inf")) if float(cut) > 0 else y


def logprobs_reference(logits: torch.Tensor, p: SamplingParams, token: int, k: int, mode: str = "raw_logprobs",
                       history: tuple[list[int], list[int]] | None = None,
                       banned: list[int] | None = None) -> TokenLogprobs:
    """The drawn ``token``'s log-probability and the ``k`` likeliest tokens' from the row's logits (V,), plainly:
    ``log_softmax`` of the raw logits, or of :func:`processed_logits` (after the penalties and the ``banned``
    tokens at ``-inf``); the alternatives by a full sort."""
    x = logits.float()
    if mode == "processed_logprobs":
        x = penalise(x, p, *(history or (None, None)))
        if banned:
            x = x.clone()
            x[banned] = float("-inf")
        x = processed_logits(x, p)
    lp = torch.log_softmax(x, dim=-1)
    s = lp.sort(descending=True, stable=True)
    top = tuple(zip(s.indices[:k].tolist(), s.values[:k].tolist()))
    return TokenLogprobs(int(token), float(lp[token]), top)


def draw(w: torch.Tensor, u: float) -> int:
    """The index where ``u`` lands in the cumulative weights ``w`` (V,) (in vocabulary order, float64): token j
    with probability w_j / sum(w); a zero weight is never drawn."""
    cum = w.double().cumsum(0)
    j = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True))
    if j >= w.numel() or w[j] == 0:  # u * total rounded onto the total: the last token that has weight
        j = int(w.nonzero()[-1])
    return j


def sample_reference(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None],
                     history: list[tuple[list[int], list[int]]] | None = None) -> list[int]:
    """One token per row of ``logits`` (B, V) (any float dtype): greedy rows take their first maximum, the others
    draw from :func:`weights` with their own generator's one uniform (:func:`draw`). ``history``: each row's
    (prompt tokens, output tokens), read by the penalties."""
    out = []
    for i, p in enumerate(params):
        x = penalise(logits[i].float(), p, *(history[i] if history else (None, None)))
        out.append(int(x.argmax()) if p.greedy else draw(weights(x, p), uniform(gens[i])))
    return out
