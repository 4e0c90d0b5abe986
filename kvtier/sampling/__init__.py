"""Sampling: one batched step for all rows (``sample_rows``) beside the plain per-row reference it is tested against."""

from .batched import sample_rows
from .params import OPENAI_DEFAULTS, SamplingParams, model_defaults
from .reference import sample_reference

__all__ = ["OPENAI_DEFAULTS", "SamplingParams", "model_defaults", "sample_reference", "sample_rows"]
