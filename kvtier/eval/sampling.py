"""Seeded sampling per row, so a sampled batch draws what each of its rows would draw alone.

``generate``'s own sampler takes one ``torch.multinomial`` over the whole batch from the global generator, so a
row's tokens depend on which other rows share its batch. :class:`RowSampler` is a ``LogitsProcessor`` (the
extension point ``generate`` offers) that gives every row its own ``torch.Generator``, seeded from the (problem,
sample) it decodes: temperature, then top-p (nucleus), then one draw per row per step; it returns scores that are
``-inf`` everywhere but the drawn token, and ``generate`` runs greedy (``do_sample=False``) on them. A row's draws
then depend on its own seed and logits only; logits of a padded batch equal those of the row alone up to float
rounding (the tests check the tokens match at batch 1 and 4).
"""

from __future__ import annotations

import torch


class RowSampler:
    """``(input_ids (B, T), scores (B, V)) -> scores`` with one sampled token per row."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float = 1.0, device="cpu"):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.gens = []
        for s in seeds:
            g = torch.Generator(device=device)
            g.manual_seed(int(s) % (2**63))
            self.gens.append(g)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float() / self.temperature  # (B, V)
        if bool(torch.isfinite(logits.amax(dim=-1)).all()):
            probs = torch.softmax(logits, dim=-1)
        else:
            # a temperature so small that s / T overflows (or rounds to 0 in float32): draw from the T -> 0 limit,
            # uniform over the row's maxima, instead of NaN probabilities
            s = scores.float()
            top = (s == s.amax(dim=-1, keepdim=True)).float()
            probs = top / top.sum(dim=-1, keepdim=True)
        if self.top_p < 1:
            sp, idx = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the most likely token always stays)
            drop = (sp.cumsum(-1) - sp) >= self.top_p
            sp = sp.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, idx, sp)
        out = torch.full_like(scores, float("-inf"))
        for i, g in enumerate(self.gens):
            tok = torch.multinomial(probs[i], 1, generator=g)
            out[i, tok] = 0.0
        return out
