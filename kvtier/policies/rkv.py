"""``rkv``: R-KV (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models").

Follows the authors' released code (``Zefan-Cai/R-KV`` at d15c976: ``rkv/compression/r1_kv.py``,
``rkv/utils.py``, ``rkv/modeling.py``); ``tests/policies/reference/rkv_ref.py`` reproduces its kept sets. Per layer and
kv-head, a compression keeps the ``window`` newest tokens and the top ``budget - window`` older ones by

- importance: the attention logits of the last ``window`` queries on the older keys, pooled over the query
  heads of a kv group by max (the code's ``compute_attention_scores``), softmax over the older keys, mean over
  the window queries, then max-pooled along the sequence (``kernel_size``, stride 1, same padding);
- redundancy: cosine similarity between all kept keys (diagonal zeroed); for every key, its most recent
  duplicate (similarity > ``threshold``) has that similarity zeroed so the newest copy is protected; mean
  over rows, softmax over keys;
- score = ``lam`` * importance - (1 - ``lam``) * redundancy.

When: at prefill as soon as the prompt reaches the budget (the code calls ``update_kv`` on the prompt), then
at every decode step whose preceding length (prompt + generated, padding included, as the code's
``self.length``) is a multiple of ``buffer`` (the code's ``divide_length``, ``divide_method="step_length"``).
Between compressions the cache grows by up to ``buffer`` tokens.

lambda: the paper's text says 0.1, the released code (``--mix_lambda`` default, ``R1KV(mix_lambda=0.07)``)
uses 0.07. kvtier defaults to the code's value; ``lam="code"`` (0.07) and ``lam="paper"`` (0.1) name them.
Budgets: ``budget_tokens`` is the code's ``--kv_budget`` (128 ... 4096 in the paper); ``budget_ratio`` is a
fraction of the current length. Differences, by design: kvtier attends before it compresses (the code
compresses first, so the compressing step's attention sees fewer tokens; kept sets are the same); padding
slots (batch > 1) are left out of similarity rows, columns and the softmax; with ``protect_prompt=True`` (off
by default, as in the paper) the prompt is kept on top of the window and the scores fill what remains.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache.headwise import HeadwiseCache, Scorer
from ..config import EvictionBudget, check_number
from .base import EvictionBaseline

LAMBDAS = {"code": 0.07, "paper": 0.1}


class RKVScorer(Scorer):
    name = "rkv"

    def __init__(self, window: int, buffer: int, kernel_size: int, lam: float, threshold: float,
                 redundancy: bool = True):
        self.window, self.buffer, self.kernel_size, self.lam, self.threshold = window, buffer, kernel_size, lam, threshold
        self.redundancy = redundancy

    def _remember(self, layer, query):
        prev = layer.aux.get("q")
        q = query if prev is None else torch.cat([prev, query], dim=2)
        layer.aux["q"] = q[:, :, -self.window :]

    def after_prefill(self, layer, query, scaling):
        self._remember(layer, query)

    def after_decode(self, layer, query, probs, scaling):
        self._remember(layer, query)

    def should_compress(self, layer, counts, limits):
        st = layer.state
        if not bool((counts > limits).any()):
            return False
        # prefill: as soon as the prompt reaches the budget; decode: when the length before this step is a
        # multiple of ``buffer`` (the authors' step_length schedule)
        return st.decode_steps == 0 or (st.n_total - 1) % self.buffer == 0

    def must_keep(self, state, budgets):
        return 0, torch.full_like(budgets, self.window)

    def scores(self, layer, budgets, scaling):
        return rkv_scores(
            layer.aux["q"], layer.k[:, :, : layer.S], layer.slot_valid(), scaling,
            self.window, self.kernel_size, self.lam, self.threshold, redundancy=self.redundancy,
        )


def rkv_scores(q_win, keys, valid, scaling, window, kernel_size, lam, threshold, redundancy=True):
    """R-KV keep-priority per slot.

    Args:
        q_win: (B, Hq, w, D) the last queries; keys: (B, H, S, D); valid: (B, H, S) bool.
    Returns:
        (B, H, S) float32: the score for older slots, +inf for the ``window`` most recent slots.
        Without ``redundancy`` the score is the pooled importance alone (R-KV's decode-time SnapKV).
    """
    B, H, S, D = keys.shape
    Hq = q_win.shape[1]
    g = Hq // H
    w = min(window, q_win.shape[2], S - 1)
    past = S - w
    kf = keys.float()
    # importance
    qg = q_win[:, :, -w:].float().reshape(B, H, g, w, D)
    logits = torch.matmul(qg, kf[:, :, :past].transpose(-1, -2).unsqueeze(2)) * scaling  # (B, H, g, w, past)
    logits = logits.max(dim=2).values  # pool the group's query heads (reference: max)
    logits = logits.masked_fill(~valid[:, :, None, :past], float("-inf"))
    attn = torch.nan_to_num(torch.softmax(logits, dim=-1)).mean(dim=2)  # (B, H, past)
    importance = F.max_pool1d(attn.reshape(B * H, 1, past), kernel_size, stride=1, padding=kernel_size // 2)
    importance = importance.reshape(B, H, past)
    if not redundancy:
        return torch.cat([importance, torch.full((B, H, w), float("inf"), device=keys.device)], dim=-1)
    # redundancy
    kn = kf / (kf.norm(dim=-1, keepdim=True) + 1e-8)
    cos = torch.matmul(kn, kn.transpose(-1, -2))  # (B, H, S, S)
    pair_ok = valid.unsqueeze(-1) & valid.unsqueeze(-2)
    cos = cos.masked_fill(~pair_ok | torch.eye(S, dtype=torch.bool, device=keys.device), 0.0)
    idx = torch.arange(S, device=keys.device).view(1, 1, 1, S)
    newest = torch.where(cos > threshold, idx, torch.zeros_like(idx)).max(dim=-1).values  # (B, H, S)
    cos = cos.scatter(-1, newest.unsqueeze(-1), 0.0)
    n_rows = valid.sum(-1, keepdim=True).clamp(min=1).float()
    mean_sim = cos.sum(dim=-2) / n_rows  # mean over (valid) rows
    redundancy = torch.softmax(mean_sim.masked_fill(~valid, float("-inf")), dim=-1)
    redundancy = torch.nan_to_num(redundancy)[:, :, :past]
    score = lam * importance - (1 - lam) * redundancy
    return torch.cat([score, torch.full((B, H, w), float("inf"), device=keys.device)], dim=-1)


def check_schedule(policy: str, window, buffer, kernel_size) -> None:
    """The observation window, compression interval and pooling kernel shared by R-KV and decode-time SnapKV."""
    for name, val in (("window", window), ("buffer", buffer), ("kernel_size", kernel_size)):
        check_number(policy, name, val, 1, integer=True)
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd for policy {policy!r} (same padding), got {kernel_size}")


class RKVPolicy(EvictionBaseline):
    name = "rkv"
    description = "importance minus redundancy, per kv-head (Cai et al. 2025; the authors' code)"

    @classmethod
    def build(
        cls,
        num_layers: int,
        budget_ratio: float | None = None,
        budget_tokens: int | None = None,
        budget_floor: int | None = None,
        window: int = 8,
        buffer: int = 128,
        kernel_size: int = 7,
        lam: float | str = 0.07,
        threshold: float = 0.5,
        protect_prompt: bool = False,
    ) -> HeadwiseCache:
        check_schedule(cls.name, window, buffer, kernel_size)
        if isinstance(lam, str):
            if lam not in LAMBDAS:
                raise ValueError(f"lam must be a number in [0, 1] or one of {sorted(LAMBDAS)} for policy 'rkv', got {lam!r}")
            lam = LAMBDAS[lam]
        check_number(cls.name, "lam", lam, 0, 1)
        check_number(cls.name, "threshold", threshold, 0, 1)
        budget = EvictionBudget(budget_ratio, budget_tokens, budget_floor)
        return HeadwiseCache(RKVScorer(window, buffer, kernel_size, lam, threshold), budget, num_layers, protect_prompt, cls.name)
