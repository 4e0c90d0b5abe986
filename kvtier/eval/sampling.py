"""Seeded sampling per row for ``generate``: a ``LogitsProcessor`` over the one sampling step (:func:`kvtier.sampling.sample_rows`), so a sampled batch draws what each of its rows would draw alone.

``generate``'s own sampler takes one ``torch.multinomial`` over the whole batch from the global generator, so a
row's tokens depend on which other rows share its batch. :class:`RowSampler` is a ``LogitsProcessor`` (the
extension point ``generate`` offers) that gives every row its own ``torch.Generator``, seeded from the (problem,
sample) it decodes, and draws through the same batched step the server uses (temperature, top_k, top_p, min_p; one
uniform per row per step); it returns scores that are ``-inf`` everywhere but the drawn token, and ``generate`` runs
greedy (``do_sample=False``) on them. A row's draws then depend on its own seed and logits only; logits of a padded
batch equal those of the row alone up to float rounding (the tests check the tokens match at batch 1 and 4).
"""

from __future__ import annotations

import torch

from ..sampling import SamplingParams, sample_rows


class RowSampler:
    """``(input_ids (B, T), scores (B, V)) -> scores`` with one sampled token per row. A temperature below
    :data:`~kvtier.sampling.params.GREEDY_BELOW` draws the row's first maximum (its T -> 0 limit)."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float = 1.0, device="cpu", top_k: int = 0,
                 min_p: float = 0.0):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature!r}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        self.params = SamplingParams(float(temperature), float(top_p), int(top_k), float(min_p))
        self.temperature, self.top_p = self.params.temperature, self.params.top_p
        self.gens = []
        for s in seeds:  # on the CPU, where the step draws (a device's logits come over once a step)
            g = torch.Generator()
            g.manual_seed(int(s) % (2**63))
            self.gens.append(g)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        toks = sample_rows(scores.detach().cpu(), [self.params] * len(self.gens), self.gens)
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(toks), device=scores.device), torch.tensor(toks, device=scores.device)] = 0.0
        return out
