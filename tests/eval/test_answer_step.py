"""Each row's placement read at the step its answer ended (kvtier/eval/answer_step.py), not at the batch's end."""

from __future__ import annotations

import torch

from kvtier.eval.answer_step import AnswerSteps, row_counts
from kvtier.tiers.tiermap import SHARE, TIERS


class _Growing:
    """A cache stand-in whose tier map changes every step: row r's codes are all ``step % 4`` after ``step``
    steps, with one left-padding column in row 1 (what :func:`cache_codes` reads via ``tier_map``)."""

    def __init__(self, batch: int, prompt: int) -> None:
        self.batch, self.n, self.step = batch, prompt, 0

    def advance(self) -> None:
        self.step += 1
        self.n += 1

    def tier_map(self) -> torch.Tensor:
        codes = torch.full((self.batch, self.n), self.step % 4, dtype=torch.int8)
        codes[1, 0] = -1
        return codes


def test_each_row_is_read_once_at_the_step_it_ended():
    eos, pad, prompt = 7, 9, 5
    cache = _Growing(3, prompt)
    snap = AnswerSteps(cache, {eos, pad}, prompt)
    # row 0 ends at its 2nd token, row 1 at its 3rd (then pads), row 2 never ends (4 tokens)
    tokens = [[1, eos, pad, pad], [2, 3, eos, pad], [4, 4, 4, 4]]
    ids = torch.zeros(3, prompt, dtype=torch.long)
    for t in range(4):
        ids = torch.cat([ids, torch.tensor([[row[t]] for row in tokens])], dim=1)
        # generate calls the criteria after appending token t + 1; the cache holds prompt + t tokens then
        assert not snap(ids, torch.zeros(3, 10)).any()
        cache.advance()
    snap.finish(3, ids.shape[1] - prompt - 1)
    # the stand-in's codes after s steps are all s % 4; its length then was prompt + s
    assert snap.as_record(0) == {"tokens": prompt + 1, "attended": prompt + 1, "destroyed": 0, "step": 1,
                                 "tiers": {"T0": 0, "T1": prompt + 1, "T2": 0, "T3": 0}}
    r1 = snap.as_record(1)  # one padding column left out
    assert r1["step"] == 2 and r1["tokens"] == prompt + 2 - 1 and r1["tiers"]["T2"] == prompt + 1
    r2 = snap.as_record(2)  # read after the batch: 4 steps, all T0 again (4 % 4)
    assert r2["step"] == 3 and r2["tokens"] == prompt + 4 and r2["tiers"]["T0"] == prompt + 4


def test_counts_of_tiers_and_of_per_head_shares():
    codes = torch.tensor([-1, 0, 0, 1, 2, 3, 3], dtype=torch.int8)
    assert row_counts(TIERS, codes) == {"tokens": 6, "attended": 4, "destroyed": 2,
                                        "tiers": {"T0": 2, "T1": 1, "T2": 1, "T3": 2}}
    share = torch.tensor([-1, 100, 100, 50, 25, 0], dtype=torch.int8)  # percent of (layer, kv-head) pairs holding it
    assert row_counts(SHARE, share) == {"tokens": 5, "attended": 2.8, "destroyed": 2.2, "tiers": None}
