"""The batched sampling step against its plain reference and against the definition: distributions (chi-square over
20,000 seeded draws), the exact token sets of top_k / top_p / min_p with ties, the same tokens per row alone and in
batches of any size, greedy rows untouched, and bad settings named."""

from __future__ import annotations

import pytest
import torch

from kvtier.sampling import SamplingParams as SP
from kvtier.sampling import sample_reference, sample_rows
from kvtier.sampling.batched import draw_rows, weights_rows
from kvtier.sampling.reference import penalise, weights

# chi-square critical values at p = 0.001 by degrees of freedom (a statistic above it rejects the distribution)
CHI2_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def _expected(logits: list[float], p: SP, prompt=(), output=()) -> torch.Tensor:
    """The probabilities the settings define, computed from the definition in float64 with Python loops."""
    x = [float(v) for v in logits]
    counts = {t: list(output).count(t) for t in set(output)}
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    x = [v / p.temperature for v in x]
    if p.top_k:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else float("-inf") for v in x]
    m = max(x)
    e = [0.0 if v == float("-inf") else 2.718281828459045 ** (v - m) for v in x]
    probs = [v / sum(e) for v in e]
    keep = [True] * len(x)
    if p.top_p < 1:
        order = sorted(probs, reverse=True)
        mass, cut = 0.0, order[-1]
        for v in order:
            mass += v
            if mass >= p.top_p:
                cut = v
                break
        keep = [k and v >= cut for k, v in zip(keep, probs)]
    if p.min_p:
        keep = [k and v >= p.min_p * max(probs) for k, v in zip(keep, probs)]
    w = torch.tensor([v if k else 0.0 for v, k in zip(probs, keep)], dtype=torch.float64)
    return w / w.sum()


SETTINGS = [
    SP(1.0), SP(0.7), SP(0.8, top_p=0.8), SP(1.2, top_k=3), SP(1.0, min_p=0.15),
    SP(0.9, top_p=0.9, top_k=5, min_p=0.05), SP(1.0, presence_penalty=0.8, frequency_penalty=0.4),
    SP(1.0, repetition_penalty=1.5),
]
LOGITS = [2.0, 1.5, 1.0, 0.5, -0.5, -1.0, 0.8, -2.0]
PROMPT, OUTPUT = (0, 3), (1, 1, 2)


@pytest.mark.parametrize("p", SETTINGS, ids=lambda p: repr(p))
@pytest.mark.parametrize("fast", [True, False], ids=["batched", "reference"])
def test_twenty_thousand_draws_follow_the_defined_distribution(p, fast):
    want = _expected(LOGITS, p, PROMPT, OUTPUT)
    rows, calls = 500, 40
    logits = torch.tensor([LOGITS] * rows)
    counts = torch.zeros(len(LOGITS), dtype=torch.float64)
    for c in range(calls):
        gens = [torch.Generator().manual_seed(c * rows + i) for i in range(rows)]
        hist = [(list(PROMPT), list(OUTPUT))] * rows
        toks = (sample_rows if fast else sample_reference)(logits, [p] * rows, gens, hist)
        counts += torch.bincount(torch.tensor(toks), minlength=len(LOGITS)).double()
    n = rows * calls
    assert counts[want == 0].sum() == 0  # nothing outside the kept set
    live = want > 0
    chi2 = float((((counts - n * want) ** 2)[live] / (n * want[live])).sum())
    assert chi2 < CHI2_001[int(live.sum()) - 1], (chi2, counts / n, want)


def test_the_kept_sets_are_the_definitions_with_ties_kept():
    # top_k 2 with a tie for second place keeps all three; top_p with a tie at its cut keeps both
    x = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0])
    assert weights(x.clone(), SP(1.0, top_k=2)).nonzero().flatten().tolist() == [0, 1, 2]
    probs = torch.softmax(x, -1)
    mass = float(probs[0] + probs[1])  # top_p reached exactly at the first of the tied pair
    assert weights(x.clone(), SP(1.0, top_p=mass - 1e-6)).nonzero().flatten().tolist() == [0, 1, 2]
    assert weights(x.clone(), SP(1.0, top_p=0.01)).nonzero().flatten().tolist() == [0]  # the most likely always
    # min_p: at least min_p times the most likely
    ratio = float(probs[3] / probs[0])
    assert weights(x.clone(), SP(1.0, min_p=ratio * 0.999)).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert weights(x.clone(), SP(1.0, min_p=ratio * 1.001)).nonzero().flatten().tolist() == [0, 1, 2]
    # the batched step keeps exactly the reference's set, row by row, on hand-made and on random logits
    g = torch.Generator().manual_seed(0)
    rows = [x, torch.tensor([1.0] * 5), torch.tensor([5.0, 5.0, -1.0, 5.0, 0.0])]
    rows += [torch.randn(5, generator=g) * 3 for _ in range(20)]
    for p in (SP(1.0, top_k=2), SP(0.7, top_p=0.6), SP(1.0, min_p=0.3), SP(0.5, top_k=3, top_p=0.7, min_p=0.1)):
        fast = weights_rows(torch.stack(rows), [p] * len(rows))
        for i, r in enumerate(rows):
            assert torch.equal(fast[i] > 0, weights(r.clone(), p) > 0), (p, r)


@pytest.mark.parametrize("V", [5000, 151_936])
def test_batched_draws_equal_the_reference_and_do_not_depend_on_the_batch(V):
    """Large vocabularies (several draw blocks; top_p past the partial selection's first and second tries on flat
    rows): the batched step draws the reference's tokens, and a row draws the same alone and in batches of 1, 7
    and 32 beside rows that sample differently."""
    g = torch.Generator().manual_seed(1)
    B = 32
    logits = torch.randn(B, V, generator=g) * torch.linspace(0.2, 12, B)[:, None]  # flat rows to peaked ones
    logits = logits.bfloat16()
    kinds = [SP(0.0), SP(1.0), SP(0.6, top_p=0.95), SP(0.7, top_k=20), SP(1.0, min_p=0.05),
             SP(0.6, top_p=0.95, top_k=40), SP(0.8, repetition_penalty=1.2), SP(0.0, presence_penalty=1.0)]
    params = [kinds[i % len(kinds)] for i in range(B)]
    hist = [([3, 4, 5], [int(logits[i].float().argmax()), 7]) for i in range(B)]
    seeds = list(range(100, 100 + B))
    gens = lambda idx: [torch.Generator().manual_seed(seeds[i]) for i in idx]  # noqa: E731
    everything = sample_rows(logits, params, gens(range(B)), hist)
    assert everything == sample_reference(logits, params, gens(range(B)), hist)
    for size in (1, 7):
        for start in range(0, B, size * 3):
            idx = list(range(start, min(start + size, B)))
            got = sample_rows(logits[idx], [params[i] for i in idx], gens(idx), [hist[i] for i in idx])
            assert got == [everything[i] for i in idx]


def test_a_cut_within_the_first_candidates_draws_from_them_as_the_reference_draws():
    """Peaked rows whose top_p (and min_p) set lies among their 64 most likely tokens are drawn from those alone
    (no pass over the vocabulary): over 300 seeds the reference's token every time, ties at the cut kept; a row
    whose tie at the cut runs past the 64th token takes the whole-row path and still draws the reference's."""
    from kvtier.sampling.batched import _weights_rows

    V = 151_936
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, V, generator=g) - 30.0
    x[:, :40] = torch.randn(3, 40, generator=g) * 2 + 10  # 40 likely tokens, spread over the vocabulary below
    x = x[:, torch.randperm(V, generator=g)]
    x[1, x[1].topk(8).indices] = x[1].max() + 5  # 8 tied tokens hold most of the mass: top_p 0.5 cuts inside them
    x[2] = -30.0
    x[2, :100] = 5.0  # 100 equally likely tokens: the cut's tie runs past the 64th
    params = [SP(0.6, top_p=0.95), SP(1.0, top_p=0.5), SP(1.0, top_p=0.3, min_p=0.5)]
    _, cut, cand = _weights_rows(x.clone(), params, mask_candidates=False)
    assert set(cand) == {0, 1} and all(float(v.min()) >= float(cut[r]) for r, (_, v) in cand.items())
    assert len(cand[1][0]) == 8  # every token tied at the cut is kept
    for seed in range(300):
        gens = lambda: [torch.Generator().manual_seed(seed * 3 + i) for i in range(3)]  # noqa: E731
        assert sample_rows(x, params, gens()) == sample_reference(x, params, gens())


def test_greedy_rows_are_the_first_maximum_bit_for_bit():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 0.0, -5.0]]).bfloat16()
    assert sample_rows(x, [SP(0.0)] * 2, [None, None]) == [1, 0]
    picked = []
    assert sample_rows(x, [SP(0.0)] * 2, [None, None], greedy_pick=lambda t: picked.append(t) or t.float().argmax(-1))
    assert picked and picked[0].dtype == torch.bfloat16  # the raw logits, uncopied, go to the caller's pick
    # a banned token (min_tokens holds the end of sequence back) is never taken, greedy or sampled
    assert sample_rows(x, [SP(0.0)] * 2, [None, None], banned=[[1, 2], None]) == [3, 0]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    for _ in range(50):
        assert sample_rows(x, [SP(1.0)] * 2, gens, banned=[[1, 2], [0, 2]])[0] not in (1, 2)


def test_penalties_follow_openai_and_vllm():
    x = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = penalise(x, SP(1.0, repetition_penalty=2.0), prompt=[0], output=[1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]  # positive divided, negative multiplied; prompt and output alike
    out = penalise(x, SP(1.0, frequency_penalty=0.5, presence_penalty=0.25), prompt=[3], output=[2, 2, 0])
    assert out.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.25, 0.5]  # the prompt does not count for these two


def test_the_draw_lands_where_the_cumulative_weights_say():
    w = torch.zeros(3, 3000)
    w[0, 2500] = 1.0
    w[1, [10, 1500]] = 1.0
    w[2, [0, 2999]] = torch.tensor([3.0, 1.0])
    u = torch.tensor([0.999999, 0.49, 0.8], dtype=torch.float64)
    assert draw_rows(w, u).tolist() == [2500, 10, 2999]
    assert draw_rows(w, torch.tensor([0.0, 0.5, 0.74], dtype=torch.float64)).tolist() == [2500, 1500, 0]


def test_bad_settings_name_the_field():
    for kw, needle in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
                       (dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence_penalty"),
                       (dict(repetition_penalty=0), "repetition_penalty"), (dict(top_k=1.5), "top_k")):
        with pytest.raises(ValueError, match=needle):
            SP(**kw)
    assert SP(top_k=-1).top_k == 0 and SP(1e-6).greedy and not SP(1e-4).greedy
    with pytest.raises(ValueError, match="one entry per row"):
        sample_rows(torch.zeros(2, 4), [SP()], [None])
