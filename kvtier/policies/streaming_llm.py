"""``streaming_llm``: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first ``sink_tokens`` real tokens (the attention sinks) and the most recent tokens up to the
budget; no scores. Evicts at every step once a row is over its budget. The prompt is not protected
(``protect_prompt=False``) as in the paper; set it to keep the prompt whole (the budget then grows to cover it).
Cache size: at most the budget after each step, plus the one incoming token during attention.
"""

from __future__ import annotations

import torch

from ..headwise import EvictionBudget, HeadwiseCache, Scorer
from ..layer_base import check_number
from .base import Policy


class SinkRecentScorer(Scorer):
    name = "streaming_llm"

    def __init__(self, sink_tokens: int):
        self.sink_tokens = sink_tokens

    def priority(self, layer, budgets, scaling):
        st = layer.state
        pos = layer.pos[:, :, : layer.S]
        first_real = st.valid[:, : st.n_total].float().argmax(dim=1)  # (B,) first non-padding position
        is_sink = (pos - first_real.view(-1, 1, 1)) < self.sink_tokens
        prio = pos.float()  # newer first
        return torch.where(is_sink & (pos >= 0), torch.full_like(prio, float("inf")), prio)


class StreamingLLMPolicy(Policy):
    name = "streaming_llm"
    description = "attention sinks + recent window (Xiao et al. 2023)"

    @classmethod
    def build(
        cls,
        num_layers: int,
        budget_ratio: float | None = None,
        budget_tokens: int | None = None,
        sink_tokens: int = 4,
        protect_prompt: bool = False,
    ) -> HeadwiseCache:
        check_number(cls.name, "sink_tokens", sink_tokens, 0, integer=True)
        budget = EvictionBudget(budget_ratio, budget_tokens)
        return HeadwiseCache(SinkRecentScorer(sink_tokens), budget, num_layers, protect_prompt, cls.name)
