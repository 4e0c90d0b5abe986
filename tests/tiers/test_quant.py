from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers.quant import dequantize, quantize


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(1e-3, 1e3), D=st.sampled_from([1, 8, 64, 128]))
def test_round_trip_error_at_most_half_a_step(seed, scale, D):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, D, generator=g) * scale
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.shape == (2, 3, 5, 1)
    err = (dequantize(q, s, torch.float32) - x).abs()
    # scale/2 exactly, plus the float32 rounding of x / scale and of q * scale (a couple of ulps of |x|)
    ulp = torch.finfo(torch.float32).eps
    assert (err <= s / 2 + 2 * ulp * x.abs() + 1e-12).all()
    assert ((err - s / 2) / x.abs().clamp(min=1e-30)).max() < 4 * ulp


def test_zero_rows_and_extremes():
    x = torch.zeros(1, 1, 2, 4)
    x[0, 0, 1] = torch.tensor([1.0, -1.0, 0.5, 0.0])
    q, s = quantize(x)
    y = dequantize(q, s, torch.float32)
    assert torch.equal(y[0, 0, 0], torch.zeros(4))
    assert q[0, 0, 1].tolist() == [127, -127, 64, 0]
    assert torch.isfinite(y).all()
