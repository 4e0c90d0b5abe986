"""Each row's tokens attended and destroyed at the step it wrote its answer, not over the padded batch's end.

A static batch (``model.generate``) keeps stepping after a row has emitted its end-of-sequence token: the row's
padding enters the cache, its quotas grow with it, and a reassignment may still demote or destroy tokens the
answer was written from. A record's final ``tier_map`` / ``tier_tokens`` show that end state; the question a
claim asks is what the row attended *when it wrote its answer*. :class:`AnswerSteps` is a stopping criterion
(transformers' extension point for looking at every step; it never stops anything) that, at the step a row's
last token is an end token, reads that row's placement from the cache (:func:`kvtier.tiers.tiermap.cache_codes`:
the tokens cached so far, i.e. the prompt and every generated token but the end token itself). Rows that never
end are read after the batch (:meth:`AnswerSteps.finish`), where the cache holds the same tokens.

Counts per row (``as_record``): ``tokens`` cached, ``attended`` (the tiered family: T0 + T1 + T2; per-head
baselines: the mean over (layer, kv-head) pairs of the tokens still held, to 0.1 token), ``destroyed`` (tokens -
attended), ``tiers`` (T0-T3 counts; None for per-head baselines) and ``step`` (decode steps taken, the end token's
own step excluded).
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteria

from ..tiers.tiermap import SHARE, cache_codes


def row_counts(kind: str, codes: torch.Tensor) -> dict:
    """Counts of one row's codes ((N,) int8: -1 padding; tiers 0-3, or share percentages 0-100)."""
    real = codes[codes >= 0].to(torch.int64)
    n = int(real.numel())
    if kind == SHARE:
        attended = round(float(real.sum()) / 100.0, 1)
        return {"tokens": n, "attended": attended, "destroyed": round(n - attended, 1), "tiers": None}
    tiers = {f"T{t}": int((real == t).sum()) for t in range(4)}
    return {"tokens": n, "attended": n - tiers["T3"], "destroyed": tiers["T3"], "tiers": tiers}


class AnswerSteps(StoppingCriteria):
    """Snapshots each row's placement at the step its answer ended (see the module doc).

    ``end_ids``: token ids that end a row (its end-of-sequence ids and the pad id, as the runner counts
    ``generated_tokens``); ``prompt_len``: the batch's padded prompt width (``input_ids`` columns before the
    first generated token)."""

    def __init__(self, cache, end_ids: set[int], prompt_len: int) -> None:
        self.cache = cache
        self.end_ids = torch.tensor(sorted(end_ids), dtype=torch.long)
        self.prompt_len = prompt_len
        self.rows: dict[int, dict] = {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1].cpu()
        ended = torch.isin(last, self.end_ids).nonzero().flatten().tolist()
        new = [r for r in ended if r not in self.rows]
        if new:
            self._snap(new, input_ids.shape[1] - self.prompt_len - 1)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def _snap(self, rows: list[int], step: int) -> None:
        kind, codes = cache_codes(self.cache)
        for r in rows:
            self.rows[r] = {**row_counts(kind, codes[r]), "step": step}

    def finish(self, batch: int, steps: int) -> None:
        """After the batch: rows that never ended, read from the cache as it is (``steps`` decode steps taken)."""
        rest = [r for r in range(batch) if r not in self.rows]
        if rest:
            self._snap(rest, steps)

    def as_record(self, row: int) -> dict:
        return dict(self.rows[row])
