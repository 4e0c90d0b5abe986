"""``streaming_llm``: StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks").

Keeps the first ``sink_tokens`` real tokens (the attention sinks) and the most recent tokens up to the
budget; no scores. Evicts at every step once a row is over its budget, as the authors' ``StartRecentKVCache``
(``mit-han-lab/streaming-llm``, ``streaming_llm/kv_cache.py``) does after each forward: the kept set after a
step is identical to theirs (``tests/policies/reference/streaming_llm_ref.py``). Differences, by design:

- kvtier attends before it evicts, so the step's attention sees the budget plus the incoming token;
- tokens keep their original positions (RoPE is applied once, when a token is written): there is no
  position shift (the authors' ``pos_shift`` variant re-rotates the kept keys into a contiguous range); an
  evicted gap is simply absent, as in the authors' default path;
- with ``protect_prompt=True`` (off by default, as in the paper) the whole prompt is kept on top of the sinks
  and the newest token, and the rest of the budget goes to the most recent generated tokens; when the prompt
  alone exceeds the budget only it and the newest token are kept (``stats()["budget"]`` shows it).
"""

from __future__ import annotations

import torch

from ..cache.headwise import HeadwiseCache, Scorer
from ..config import EvictionBudget, check_number
from .base import EvictionBaseline


class SinkRecentScorer(Scorer):
    name = "streaming_llm"

    def __init__(self, sink_tokens: int):
        self.sink_tokens = sink_tokens

    def must_keep(self, state, budgets):
        return self.sink_tokens, torch.ones_like(budgets)

    def scores(self, layer, budgets, scaling):
        return layer.pos[:, :, : layer.S].float()  # newer first


class StreamingLLMPolicy(EvictionBaseline):
    name = "streaming_llm"
    description = "attention sinks + recent window (Xiao et al. 2023)"

    @classmethod
    def build(
        cls,
        num_layers: int,
        budget_ratio: float | None = None,
        budget_tokens: int | None = None,
        budget_floor: int | None = None,
        sink_tokens: int = 4,
        protect_prompt: bool = False,
    ) -> HeadwiseCache:
        check_number(cls.name, "sink_tokens", sink_tokens, 0, integer=True)
        budget = EvictionBudget(budget_ratio, budget_tokens, budget_floor)
        return HeadwiseCache(SinkRecentScorer(sink_tokens), budget, num_layers, protect_prompt, cls.name)
