"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023), as in the reference code ``FMInference/H2O``.

Per layer and per kv-head group, every token accumulates the attention it receives: the column sums of the
prompt's attention matrix at prefill (computed in query chunks, never the whole matrix at once), then the
attention of every decoded query. The reference sums over heads one by one; with GQA the query heads of a
group share their K/V, so their attention is summed into the group's score. Once a row is over budget,
it keeps the ``budget - floor(heavy_ratio * budget)`` most recent tokens and fills the rest of the budget with
the highest accumulated scores among the older tokens (heavy:recent = 1:1 by default), evicting at every step
(prefill included) — the selection of ``H2OKVCache_LayerWise`` in ``FMInference/H2O``
(``h2o_hf/utils_real_drop/modify_llama.py``), whose kept sets ``tests/policies/reference/h2o_ref.py`` reproduces.

Budget: ``budget_tokens`` is the reference's fixed ``hh_size + recent_size``; ``budget_ratio`` is a fraction
of each row's *current* logical length (it grows as the chain grows), whereas the authors' simulation code
(``utils_hh``) fixes the ratio's token count once, from the prompt length. kvtier uses the current length so
that every policy's ratio means the same thing as the tiered planner's; pass ``budget_tokens`` for a fixed size.
The prompt is not protected by default (``protect_prompt=False``), as in the paper; with protection the prompt
is kept on top of the recent window and the heavy hitters get what remains of the budget.

Note: the R-KV repository's ``h2o.py`` scores with the last query only; that is not H2O and not this.
Cache size: at most the budget after each step, plus the one incoming token during attention.
"""

from __future__ import annotations

import torch

from ..attention.merge import causal_weight_sums
from ..cache.headwise import HeadwiseCache, Scorer
from ..config import EvictionBudget, check_number
from .base import EvictionBaseline

_PREFILL_CHUNK = 256  # queries per chunk when summing the prompt's attention columns


class H2OScorer(Scorer):
    name = "h2o"
    slot_fields = ("acc",)

    def __init__(self, heavy_ratio: float):
        self.heavy_ratio = heavy_ratio

    def after_prefill(self, layer, query, scaling):
        st = layer.state
        q = query.shape[2]
        key_valid = layer.slot_valid()[:, 0]  # (B, S): the same columns in every kv-head after prefill
        layer.slots["acc"][:, :, : layer.S] += causal_weight_sums(query, layer.k[:, :, : layer.S], key_valid,
                                                                  st.valid[:, :q], scaling, _PREFILL_CHUNK)

    def after_decode(self, layer, query, probs, scaling):
        layer.slots["acc"][:, :, : layer.S] += probs.sum(dim=2)  # sum over the group's query heads

    def recent(self, budgets):
        # in float64 with the planner's epsilon: floor(0.7 * 10) must be 7, not float32's 6
        return budgets - torch.floor(budgets.double() * self.heavy_ratio + 1e-9).long()

    def must_keep(self, state, budgets):
        return 0, self.recent(budgets)

    def scores(self, layer, budgets, scaling):
        return layer.slots["acc"][:, :, : layer.S]


class H2OPolicy(EvictionBaseline):
    name = "h2o"
    description = "heavy hitters + recent window, per kv-head (Zhang et al. 2023)"

    @classmethod
    def build(
        cls,
        num_layers: int,
        budget_ratio: float | None = None,
        budget_tokens: int | None = None,
        budget_floor: int | None = None,
        heavy_ratio: float = 0.5,
        protect_prompt: bool = False,
    ) -> HeadwiseCache:
        check_number(cls.name, "heavy_ratio", heavy_ratio, 0, 1)
        budget = EvictionBudget(budget_ratio, budget_tokens, budget_floor)
        return HeadwiseCache(H2OScorer(heavy_ratio), budget, num_layers, protect_prompt, cls.name)
