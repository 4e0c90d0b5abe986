"""RowSampler at the edges of its temperature range (found by schemathesis: temperature 2e-207 gave NaN probabilities), and its draws are the sampling step's."""

from __future__ import annotations

import torch

from kvtier.eval.sampling import RowSampler
from kvtier.sampling import SamplingParams, sample_reference


def test_a_vanishing_temperature_draws_the_argmax_not_nan():
    scores = torch.tensor([[1.0, 3.0, 2.0, -float("inf")], [0.5, -1.0, 4.0, 3.9]])
    for t in (2e-207, 1e-300, 1e-45, 1e-6):
        out = RowSampler([1, 2], t)(None, scores)
        assert out.argmax(-1).tolist() == [1, 2] and bool(torch.isfinite(out).sum(-1).eq(1).all())


def test_ordinary_temperatures_draw_what_the_reference_draws():
    """A normal temperature draws from softmax(s / T) with the row's generator: the plain per-row reference, given
    the same seeds, draws the same tokens."""
    torch.manual_seed(0)
    scores = torch.randn(3, 50)
    s = RowSampler([7, 8, 9], 0.7, 0.9)
    ref = [torch.Generator().manual_seed(seed) for seed in (7, 8, 9)]
    for _ in range(20):
        out = s(None, scores)
        want = sample_reference(scores, [SamplingParams(0.7, 0.9)] * 3, ref)
        assert out.argmax(-1).tolist() == want
