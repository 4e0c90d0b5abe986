"""One request's sampling settings, checked once: temperature, top_k, top_p, min_p and the three penalties."""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily (vLLM's rule; 1 / T would overflow the logits)


@dataclass(frozen=True)
class SamplingParams:
    """What a row draws from. A ``temperature`` of 0 (or below :data:`GREEDY_BELOW`) is greedy: the first maximum
    of the penalised logits.

    The order of the processing (both :func:`~kvtier.sampling.reference.sample_reference` and
    :func:`~kvtier.sampling.batched.sample_rows` follow it): the penalties on the raw logits (``repetition_penalty``
    over the prompt's and the output's tokens, as vLLM and transformers do: a positive logit divided by it, a
    negative one multiplied; ``frequency_penalty`` times each output token's count and ``presence_penalty`` once for
    each output token, subtracted, as OpenAI does), then the temperature, then ``top_k`` (the tokens whose logit is at
    least the k-th largest: ties at the boundary are kept), then ``top_p`` on the distribution the top-k leaves (the
    tokens at least as likely as the last one of the smallest most-likely-first prefix whose mass reaches ``top_p``:
    ties kept), then ``min_p`` (tokens at least ``min_p`` times as likely as the most likely one)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, as vLLM takes it): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or not (
                    (lo < v if lo_open else lo <= v) and v <= hi):
                side = "(" if lo_open else "["
                raise ValueError(f"{name} must be a number in {side}{lo}, {hi}], got {v!r}")

        number("temperature", 0.0, 100.0)
        number("top_p", 0.0, 1.0, lo_open=True)
        number("min_p", 0.0, 1.0)
        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 100.0, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 for off, got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in OPENAI_DEFAULTS}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def filtered(self) -> bool:
        """Whether any of top_k, top_p, min_p cuts the distribution."""
        return bool(self.top_k or self.top_p < 1.0 or self.min_p)


# the sampling fields a request may leave out, with what OpenAI's API gives then
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                   "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def model_defaults(generation_config) -> dict:
    """The sampling defaults a model's ``generation_config`` recommends: the fields its creator set (transformers'
    ``to_diff_dict``: not the library's own defaults), as vLLM's ``--generation-config auto`` reads them; ``{}`` when
    it sets none or says ``do_sample: false``."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict() if hasattr(generation_config, "to_diff_dict") else dict(generation_config)
    if diff.get("do_sample") is False:
        return {}
    out = {k: diff[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if diff.get(k) is not None}
    SamplingParams(**{**OPENAI_DEFAULTS, **out})  # a value out of range is the model's error: say so at startup
    return out
