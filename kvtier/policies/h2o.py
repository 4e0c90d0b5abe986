"""``h2o``: Heavy-Hitter Oracle (Zhang et al., 2023), as in the reference code ``FMInference/H2O``.

Per layer and per kv-head group, every token accumulates the attention it receives: the column sums of the
prompt's attention matrix at prefill (computed in query chunks, never the whole matrix at once), then the
attention of every decoded query. The reference sums over heads one by one; with GQA the query heads of a
group share their K/V, so their attention is summed into the group's score. Once a row is over budget,
it keeps the ``heavy_ratio`` share of the budget with the highest accumulated score among the older tokens
plus the most recent tokens for the rest (heavy:recent = 1:1 by default), evicting at every step.
The prompt is not protected by default (``protect_prompt=False``), as in the paper.

Note: the R-KV repository's ``h2o.py`` scores with the last query only; that is not H2O and not this.
Cache size: at most the budget after each step, plus the one incoming token during attention.
"""

from __future__ import annotations

import torch

from ..headwise import EvictionBudget, HeadwiseCache, Scorer
from ..layer_base import check_number
from .base import Policy

_PREFILL_CHUNK = 256  # queries per chunk when summing the prompt's attention columns


class H2OScorer(Scorer):
    name = "h2o"
    slot_fields = ("acc",)

    def __init__(self, heavy_ratio: float):
        self.heavy_ratio = heavy_ratio

    def after_prefill(self, layer, query, scaling):
        st = layer.state
        B, Hq, q, D = query.shape
        k = layer.k[:, :, : layer.S]
        H = k.shape[1]
        g = Hq // H
        valid = layer.slot_valid()[:, :1]  # (B, 1, S): padding columns get no attention
        acc = torch.zeros(B, H, layer.S, dtype=torch.float32, device=layer.device)
        for c in range(0, q, _PREFILL_CHUNK):
            qc = query[:, :, c : c + _PREFILL_CHUNK]
            n = qc.shape[2]
            s = torch.matmul(qc.reshape(B, H, g * n, D), k.transpose(-1, -2)).view(B, H, g, n, -1) * scaling
            causal = torch.arange(layer.S, device=layer.device).view(1, -1) <= torch.arange(c, c + n, device=layer.device).view(-1, 1)
            mask = causal.view(1, 1, 1, n, -1) & valid.view(B, 1, 1, 1, -1)
            p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
            p = torch.nan_to_num(p)  # a padding query sees no key: its row is all -inf
            qvalid = st.valid[:, c : c + n].view(B, 1, 1, n, 1)  # padding queries do not vote
            acc += (p * qvalid).sum(dim=(2, 3))
        layer.slots["acc"][:, :, : layer.S] += acc

    def after_decode(self, layer, query, probs, scaling):
        layer.slots["acc"][:, :, : layer.S] += probs.sum(dim=2)  # sum over the group's query heads

    def priority(self, layer, budgets, scaling):
        st = layer.state
        pos = layer.pos[:, :, : layer.S]
        heavy = (budgets.float() * self.heavy_ratio).floor().long()
        recent = (budgets - heavy).to(layer.device).view(-1, 1, 1)
        is_recent = pos >= (st.n_total - recent)
        acc = layer.slots["acc"][:, :, : layer.S]
        return torch.where(is_recent, torch.full_like(acc, float("inf")), acc)


class H2OPolicy(Policy):
    name = "h2o"
    description = "heavy hitters + recent window, per kv-head (Zhang et al. 2023)"

    @classmethod
    def build(
        cls,
        num_layers: int,
        budget_ratio: float | None = None,
        budget_tokens: int | None = None,
        heavy_ratio: float = 0.5,
        protect_prompt: bool = False,
    ) -> HeadwiseCache:
        check_number(cls.name, "heavy_ratio", heavy_ratio, 0, 1)
        budget = EvictionBudget(budget_ratio, budget_tokens)
        return HeadwiseCache(H2OScorer(heavy_ratio), budget, num_layers, protect_prompt, cls.name)
