"""Sampling: one batched step for all rows (``sample_rows``) beside the plain per-row reference it is tested against."""

from .batched import sample_rows
from .params import SamplingParams
from .reference import sample_reference

__all__ = ["SamplingParams", "sample_reference", "sample_rows"]
