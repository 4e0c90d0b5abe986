"""The drawn tokens' log-probabilities: the batched step's against ``log_softmax`` of the raw or processed logits
(its plain reference, and the definition in float64), the drawn token's value reported, the likeliest alternatives
in order, rows that do not ask untouched, and the same values alone and in a batch."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.sampling import SamplingParams as SP
from kvtier.sampling import logprobs_reference, sample_rows, sample_rows_logprobs
from kvtier.sampling.reference import penalise, processed_logits

from test_sample_rows import LOGITS, OUTPUT, PROMPT, SETTINGS, _expected

MODES = ("raw_logprobs", "processed_logprobs")


def _gens(seeds):
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("p", SETTINGS, ids=lambda p: repr(p))
def test_the_processed_logprob_is_the_log_of_the_probability_the_token_was_drawn_with(p):
    """On the small vocabulary: the drawn token's processed logprob equals the log of the definition's probability
    (float64, Python loops) within 1e-5; the raw one log_softmax of the raw logits."""
    logits = torch.tensor([LOGITS])
    want = _expected(LOGITS, p, PROMPT, OUTPUT)
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    for seed in range(40):
        for mode in MODES:
            toks, (e,) = sample_rows_logprobs(logits, [p], _gens([seed]), [(list(PROMPT), list(OUTPUT))],
                                              logprobs=[3], mode=mode)
            assert e.token == toks[0]
            expect = math.log(want[toks[0]]) if mode == "processed_logprobs" else float(raw[toks[0]])
            assert abs(e.logprob - expect) < 1e-5, (mode, seed, e.logprob, expect)


def _logits(B, V, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, V, generator=g) * 3
    x[:, 7] = x[:, 3]  # a tie
    return x.to(dtype)


MIXED = [SP(0.0), SP(0.6, top_p=0.95), SP(1.0), SP(0.8, top_k=20, min_p=0.05), SP(0.0, repetition_penalty=1.3),
         SP(1.0, presence_penalty=0.5, frequency_penalty=0.3, top_p=0.9), SP(0.7, top_k=1), SP(1e-3)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("V, dtype", [(300, torch.float32), (5000, torch.float32), (5000, torch.bfloat16)])
def test_batched_logprobs_equal_log_softmax_of_the_processed_logits(mode, V, dtype):
    """Every asking row of a mixed batch (greedy, sampled, filtered, penalised, a banned end of sequence): the drawn
    token's value and its k likeliest tokens' equal the plain reference's (log_softmax of the raw logits, or of the
    processed ones: penalties, ban, temperature, top_k, top_p / min_p's left-out tokens at -inf) within 1e-5, the
    alternatives likeliest first; rows that do not ask get None; asking draws the same tokens."""
    B = len(MIXED)
    x = _logits(B, V, dtype=dtype)
    hist = [([1, 2, 3], [4, 4, 5])] * B
    banned = [None, [0], None, None, [0, 1], None, None, None]
    ks = [0, 5, None, 20, 3, 2, 4, 1]
    seeds = [None if p.greedy else 10 + i for i, p in enumerate(MIXED)]
    toks, entries = sample_rows_logprobs(x, MIXED, _gens(seeds), hist, banned, logprobs=ks, mode=mode)
    assert toks == sample_rows(x, MIXED, _gens(seeds), hist, banned)
    for i, (p, k, e) in enumerate(zip(MIXED, ks, entries)):
        if k is None:
            assert e is None
            continue
        ref = logprobs_reference(x[i], p, toks[i], k, mode, hist[i], banned[i])
        assert e.token == toks[i] and len(e.top) == k == len(ref.top)
        assert abs(e.logprob - ref.logprob) < 1e-5, (i, e.logprob, ref.logprob)
        assert math.isfinite(e.logprob)  # the drawn token always had a probability
        vals = [v for _, v in e.top]
        assert vals == sorted(vals, reverse=True)
        # values by rank match; each named token's value is the reference's for that token (ties may name either)
        full = torch.log_softmax(_processed(x[i], p, hist[i], banned[i]) if mode == "processed_logprobs"
                                 else x[i].float(), dim=-1)
        for (tok, v), (_, rv) in zip(e.top, ref.top):
            assert v == pytest.approx(rv, abs=1e-5, rel=0) or (v == rv == float("-inf"))
            assert v == pytest.approx(float(full[tok]), abs=1e-5, rel=0) or v == float(full[tok]) == float("-inf")
    if mode == "processed_logprobs":  # top_p / min_p rows: a left-out token is -inf, the kept ones sum to 1
        for i in (1, 3, 5):
            full = torch.log_softmax(_processed(x[i], MIXED[i], hist[i], banned[i]), dim=-1)
            assert torch.isinf(full).any() and abs(float(full.double().exp().sum()) - 1) < 1e-5
        assert entries[1].top[0][1] > float("-inf") and all(t != 0 for t, v in entries[1].top if v > float("-inf"))


def _processed(x, p, hist, banned):
    y = penalise(x.float(), p, *hist)
    if banned:
        y = y.clone()
        y[banned] = float("-inf")
    return processed_logits(y, p)


def test_a_rows_logprobs_do_not_depend_on_its_batch():
    """The same row alone and at positions in batches of 7 and 32 with other rows sampling differently: the same
    token and the same values, bit for bit."""
    x = _logits(32, 2000, seed=3)
    p = SP(0.6, top_p=0.95)
    for mode in MODES:
        alone_t, (alone,) = sample_rows_logprobs(x[5:6], [p], _gens([42]), logprobs=[5], mode=mode)
        for B in (7, 32):
            params = [SP(0.9, top_k=10 + j) if j != 5 else p for j in range(B)]
            seeds = [42 if j == 5 else 100 + j for j in range(B)]
            ks = [None if j % 2 else 2 for j in range(B)]
            ks[5] = 5
            toks, entries = sample_rows_logprobs(x[:B], params, _gens(seeds), logprobs=ks, mode=mode)
            assert toks[5] == alone_t[0] and entries[5] == alone


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="logprobs_mode .* raw_logprobs, processed_logprobs"):
        sample_rows_logprobs(torch.zeros(1, 4), [SP(0.0)], [None], logprobs=[1], mode="logits")
    with pytest.raises(ValueError, match="one entry per row"):
        sample_rows_logprobs(torch.zeros(2, 4), [SP(0.0)] * 2, [None] * 2, logprobs=[1])
