"""Log-probabilities of the drawn tokens and of their likeliest alternatives, for the rows that ask (OpenAI's ``logprobs``).

Two modes, named as vLLM's ``--logprobs-mode`` names them:
- ``raw_logprobs`` (the default, as vLLM's): ``log_softmax`` of the model's logits, before any sampling setting;
- ``processed_logprobs``: ``log_softmax`` of the logits the token was drawn from: after the penalties (and the
  ``min_tokens`` ban), the temperature and top_k, with the tokens top_p and min_p leave out at ``-inf`` (so the
  drawn token's value is the log of the probability it was drawn with). A greedy row's processed logits are its
  penalised logits (no temperature: it has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
MAX_LOGPROBS = 20  # alternatives a request may ask for (vLLM's default --max-logprobs; OpenAI's chat limit)


def check_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode (--logprobs-mode) must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class TokenLogprobs:
    """One drawn token's log-probability and the ``k`` likeliest tokens' (likeliest first; ``-inf`` for a token
    the sampling settings left out)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def pick(lp: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row i's entry from its log-probabilities ``lp[i]`` (m, V) float: ``tokens[i]``'s value and its ``ks[i]``
    likeliest tokens (one ``topk`` for the rows together)."""
    m, V = lp.shape
    kmax = min(max(ks, default=0), V)
    chosen = lp[torch.arange(m), torch.tensor(tokens, dtype=torch.long)].tolist()
    if kmax:
        vals, ids = lp.topk(kmax, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    out = []
    for i in range(m):
        k = min(ks[i], V)
        top = tuple(zip(ids[i][:k], vals[i][:k])) if k else ()
        out.append(TokenLogprobs(int(tokens[i]), float(chosen[i]), top))
    return out
