"""``snapkv``: SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You Are Looking for Before Generation").

Prompt-only compression, once, at the end of prefill, as ``SnapKVCluster.update_kv`` in the authors' code
(``FasterDecoding/SnapKV``, ``snapkv/monkeypatch/snapkv_utils.py``; ``tests/policies/reference/snapkv_ref.py`` reproduces
its kept sets): once the prompt reaches the budget, the last ``window`` prompt queries attend over *all* prompt
keys (causal inside the window, softmax over every key a query sees), their weights on the older keys are
summed over the window (and over the query heads of a kv group, which share their keys), pooled along the
sequence (``pooling`` "avg" as the authors' default, or "max"; ``kernel_size``) and each kv-head keeps the top
``budget - window`` older prompt tokens plus the window. Generated tokens are never evicted. The budget covers
the prompt only: ``budget_tokens`` prompt tokens or ``budget_ratio`` of it.

The R-KV paper's "SnapKV" row is a decode-time variant: ``snapkv_decode``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.headwise import HeadwiseCache, Scorer
from ..config import EvictionBudget, check_number
from .base import EvictionBaseline


def snapkv_scores(q_win: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scaling: float, kernel_size: int,
                  pooling: str) -> torch.Tensor:
    """Keep-priority of prompt slots from the window's queries.

    Args:
        q_win: (B, Hq, w, D) the last prompt queries; keys: (B, H, S, D) the prompt keys; valid: (B, H, S) bool.
    Returns:
        (B, H, S): pooled votes for the first S - w slots, +inf for the window.
    """
    B, H, S, D = keys.shape
    g = q_win.shape[1] // H
    w = min(q_win.shape[2], S - 1)
    past = S - w
    qg = q_win[:, :, -w:].float().reshape(B, H, g, w, D)
    logits = torch.matmul(qg, keys.float().transpose(-1, -2).unsqueeze(2)) * scaling  # (B, H, g, w, S)
    # query i of the window sits at position past + i and sees keys 0 .. past + i (and no padding)
    causal = torch.arange(S, device=keys.device).view(1, -1) <= (past + torch.arange(w, device=keys.device)).view(-1, 1)
    seen = causal.view(1, 1, 1, w, S) & valid[:, :, None, None, :]
    logits = logits.masked_fill(~seen, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(logits, dim=-1))  # normalised over every key the query sees
    votes = probs[..., :past].sum(dim=(2, 3))  # (B, H, past)
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    votes = pool(votes.reshape(B * H, 1, past), kernel_size, stride=1, padding=kernel_size // 2).reshape(B, H, past)
    return torch.cat([votes, torch.full((B, H, w), float("inf"), device=keys.device)], dim=-1)


class SnapKVScorer(Scorer):
    name = "snapkv"

    def __init__(self, window: int, kernel_size: int, pooling: str):
        self.window, self.kernel_size, self.pooling = window, kernel_size, pooling

    def after_prefill(self, layer, query, scaling):
        layer.aux["q"] = query[:, :, -self.window :]

    def must_keep(self, state, budgets):
        return 0, torch.full_like(budgets, self.window)

    def budgets(self, state):
        # the budget applies to the prompt; every generated token is kept
        return state.budget.per_row(state.n_prompt) + (state.n_real - state.n_prompt)

    def should_compress(self, layer, counts, budgets):
        return layer.state.decode_steps == 0 and bool((counts > budgets).any())

    def scores(self, layer, budgets, scaling):
        return snapkv_scores(layer.aux["q"], layer.k[:, :, : layer.S], layer.slot_valid(), scaling,
                             self.kernel_size, self.pooling)


class SnapKVPolicy(EvictionBaseline):
    name = "snapkv"
    description = "prompt-only compression by the last prompt queries' votes (Li et al. 2024)"

    equal_memory = False  # its budget covers the prompt only: it does not bound the device tokens

    @classmethod
    def build(
        cls,
        num_layers: int,
        budget_ratio: float | None = None,
        budget_tokens: int | None = None,
        window: int = 32,
        kernel_size: int = 5,
        pooling: str = "avg",
    ) -> HeadwiseCache:
        check_number(cls.name, "window", window, 1, integer=True)
        check_number(cls.name, "kernel_size", kernel_size, 1, integer=True)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd for policy 'snapkv' (same padding), got {kernel_size}")
        if pooling not in ("avg", "max"):
            raise ValueError(f"pooling must be 'avg' or 'max' for policy 'snapkv', got {pooling!r}")
        budget = EvictionBudget(budget_ratio, budget_tokens)
        return HeadwiseCache(SnapKVScorer(window, kernel_size, pooling), budget, num_layers, False, cls.name)
