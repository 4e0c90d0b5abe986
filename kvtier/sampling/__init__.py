"""Sampling: one batched step for all rows (``sample_rows``) beside the plain per-row reference it is tested against, and the drawn tokens' log-probabilities."""

from .batched import sample_rows, sample_rows_logprobs
from .logprobs import LOGPROBS_MODES, MAX_LOGPROBS, TokenLogprobs
from .params import OPENAI_DEFAULTS, SamplingParams, model_defaults
from .reference import logprobs_reference, sample_reference

__all__ = ["LOGPROBS_MODES", "MAX_LOGPROBS", "OPENAI_DEFAULTS", "SamplingParams", "TokenLogprobs",
           "logprobs_reference", "model_defaults", "sample_reference", "sample_rows", "sample_rows_logprobs"]
