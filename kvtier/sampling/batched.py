"""The sampling step for a whole batch at once: every row's own settings and generator, no full-vocabulary sort, one pass of each kind over the (rows, vocabulary) logits.

What it computes is :func:`kvtier.sampling.reference.sample_reference`'s, row for row (the tests compare tokens and
distributions); how differs:
- greedy rows without penalties or banned tokens take the caller's one-pass first maximum of the raw logits
  (``greedy_pick``: the server's ``argmax_rows``), bit for bit what greedy decoding gave before;
- top_k's threshold comes from one ``topk`` over the rows that set it, not a sort;
- top_p's cut from the most likely tokens (a partial selection of 64; then the tokens above a threshold, sorted);
  a row whose top_p mass lies below every threshold (a flat tail) from a histogram of its probabilities by their
  float bits: only the tokens of the bin where the running mass crosses top_p are sorted; a row whose kept tokens
  all lie among its 64 likeliest is drawn from them alone, as the reference draws (no pass over its vocabulary);
- the draw finds a row's uniform in two levels: sums of ``BLOCK``-token blocks, then the cumulative sum of the one
  block it falls in, not a cumulative sum over the whole vocabulary (the block sums are float32: a draw can differ
  from the reference's float64 running sum only where its uniform lands within ~1e-7 of a token's boundary).
Every step is row-local, so a row draws what it would draw alone, in a batch of any size with any neighbours.
"""

from __future__ import annotations

from typing import Callable

import torch

from .logprobs import TokenLogprobs, check_mode, pick
from .params import SamplingParams
from .reference import penalise, uniform

BLOCK = 1024  # tokens a block of the two-level draw
# top_p's first partial selection, and the thresholds tried next (the tokens above one are sorted) before a histogram:
# the embedded 0.5B model's next-token distributions after random prompts need 4 - 3,187 tokens for top_p 0.95 at
# T 0.6 (32 prompts; 6 of them within 64), 5K - 70K at T 1.0; above 1e-5 its rows keep >= 95% of their mass in at
# most 3,342 tokens, above 1e-7 nearly all of it. At 32 such rows the second try was a topk of 4,096 (~21 ms of
# the step's ~46, 2-core EPYC, fp32); the thresholds cost a compare and a compaction per row (~8 ms).
CANDIDATES = 64
THRESHOLDS = (1e-5, 1e-7)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None],
                history: list[tuple[list[int], list[int]]] | None = None, banned: list[list[int] | None] | None = None,
                greedy_pick: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
    """One token per row of ``logits`` (B, V) (float32 or bfloat16): row i under ``params[i]``, drawing with
    ``gens[i]`` (one uniform a step; None for greedy rows). ``history[i]``: the row's (prompt tokens, output tokens),
    read only by the penalties. ``banned[i]``: tokens the row may not take this step (their logits set to -inf
    first: ``min_tokens`` bans the end-of-sequence tokens). ``greedy_pick``: ``(R, V) -> (R,)`` first maxima of raw
    logits (default ``x.float().argmax(-1)``)."""
    return sample_rows_logprobs(logits, params, gens, history, banned, greedy_pick)[0]


def sample_rows_logprobs(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None],
                         history: list[tuple[list[int], list[int]]] | None = None,
                         banned: list[list[int] | None] | None = None,
                         greedy_pick: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         logprobs: list[int | None] | None = None,
                         mode: str = "raw_logprobs") -> tuple[list[int], list[TokenLogprobs | None]]:
    """:func:`sample_rows`'s tokens, and for each row whose ``logprobs[i]`` is a number k (None: the row does not
    ask) its token's log-probability and its k likeliest tokens' (:mod:`kvtier.sampling.logprobs`; ``mode``
    ``raw_logprobs`` or ``processed_logprobs``), computed for the rows that ask only."""
    B, V = logits.shape
    if len(params) != B or len(gens) != B:
        raise ValueError(f"params and gens must have one entry per row ({B}), got {len(params)} and {len(gens)}")
    want = logprobs or [None] * B
    if len(want) != B:
        raise ValueError(f"logprobs must have one entry per row ({B}), got {len(want)}")
    processed = check_mode(mode) == "processed_logprobs"
    lps: dict[int, torch.Tensor] = {}  # processed mode: row -> its log-probabilities (V,), as they are known
    out = [0] * B
    ban = banned or [None] * B
    plain = [i for i, p in enumerate(params) if p.greedy and not p.penalised and not ban[i]]
    if plain:
        pick_ = greedy_pick or (lambda x: x.float().argmax(dim=-1))
        picked = pick_(logits if len(plain) == B else logits[plain]).tolist()
        for i, t in zip(plain, picked):
            out[i] = int(t)
            if processed and want[i] is not None:  # a plain greedy row's processed logits are its raw ones
                lps[i] = torch.log_softmax(logits[i].float(), dim=-1)
    rest = [i for i in range(B) if i not in set(plain)]
    if rest:
        x = logits[rest].float() if len(rest) < B else (  # (n, V): its own float32 copy
            logits.clone() if logits.dtype == torch.float32 else logits.float())
        for r, i in enumerate(rest):
            p = params[i]
            if ban[i]:
                x[r, ban[i]] = float("-inf")
            if p.penalised:
                x[r] = penalise(x[r], p, *(history[i] if history else (None, None)))
        sampled = []
        for r, i in enumerate(rest):
            if params[i].greedy:
                out[i] = int(x[r].argmax())
                if processed and want[i] is not None:
                    lps[i] = torch.log_softmax(x[r], dim=-1)
            else:
                sampled.append(r)
        if sampled:
            rows = [rest[r] for r in sampled]
            xs = x if len(sampled) == len(rest) else x[sampled]
            # xs now holds the logits after T and top_k; w the probabilities, masked by the cut except in the rows
            # whose kept tokens are all among their most likely few (cand: row -> their ids and probabilities)
            w, cut, cand = _weights_rows(xs, [params[i] for i in rows], mask_candidates=False)
            if processed:
                for j, i in enumerate(rows):
                    if want[i] is not None:  # top_p's and min_p's left-out tokens: below the cut (see below)
                        y = xs[j].masked_fill(w[j] < cut[j], float("-inf")) if float(cut[j]) > 0 else xs[j]
                        lps[i] = torch.log_softmax(y, dim=-1)
            u = torch.tensor([uniform(gens[i]) for i in rows], dtype=torch.float64)
            full = [j for j in range(len(rows)) if j not in cand]
            if full:  # (every row through draw_rows when some row needs it: a gather of the others cost as much)
                toks = draw_rows(w, u).tolist()
                for j in full:
                    out[rows[j]] = int(toks[j])
            for j, (ids, vals) in cand.items():
                out[rows[j]] = draw_kept(ids, vals, float(u[j]))
    asking = [i for i in range(B) if want[i] is not None]
    entries: list[TokenLogprobs | None] = [None] * B
    if asking:
        lp = torch.stack([lps[i] for i in asking]) if processed else torch.log_softmax(
            _rows(logits, asking).float(), dim=-1)
        for i, e in zip(asking, pick(lp, [out[i] for i in asking], [int(want[i]) for i in asking])):
            entries[i] = e
    return out, entries


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` without the gather's copy when ``rows`` is every row in order (a (32, 152K) gather took ~10 ms)."""
    return x if len(rows) == x.shape[0] else x[rows]


def weights_rows(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """:func:`kvtier.sampling.reference.weights` for every row of ``x`` (n, V) float32 (penalised logits) at once;
    ``x`` may be overwritten."""
    return _weights_rows(x, params)[0]


def _weights_rows(x: torch.Tensor, params: list[SamplingParams], mask_candidates: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """:func:`weights_rows`'s weights (n, V), each row's top_p / min_p cut (n,) (0: neither set), and the rows whose
    kept tokens all lie among the ``CANDIDATES`` most likely (row -> their ids and probabilities: the kept tokens
    exactly, ties at the cut included); with ``mask_candidates=False`` and every cut row such a row, no weight is
    masked (the caller draws them from the candidates: no pass over the vocabulary); a masked pass covers all rows. ``x`` is left holding the logits after
    the temperature and top_k (the processed logits but for the cut). A token is left out where its probability is
    below its row's cut: a probability that underflowed to 0 is below any cut too."""
    n, V = x.shape
    inv = torch.tensor([1.0 / p.temperature for p in params], dtype=torch.float32)
    x.mul_(inv[:, None])
    ks = [p.top_k if p.top_k and p.top_k < V else 0 for p in params]
    if any(ks):
        kmax = max(ks)
        rows = [r for r, k in enumerate(ks) if k]
        vals = _rows(x, rows).topk(kmax, dim=-1).values  # (m, kmax), largest first
        kth = torch.full((n,), float("-inf"))
        kth[rows] = vals[torch.arange(len(rows)), torch.tensor([ks[r] - 1 for r in rows])]
        x.masked_fill_(x < kth[:, None], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    cut = torch.zeros(n, dtype=probs.dtype)
    top_p = [r for r, p in enumerate(params) if p.top_p < 1.0]
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if top_p:
        cuts, first = _top_p_cuts(_rows(probs, top_p), [params[r].top_p for r in top_p])
        cut[top_p] = cuts
        found = {top_p[m]: v for m, v in first.items()}
    min_p = [r for r, p in enumerate(params) if p.min_p]
    if min_p:
        floor = torch.tensor([params[r].min_p for r in min_p], dtype=torch.float32) * _rows(probs, min_p).amax(dim=-1)
        cut[min_p] = torch.maximum(cut[min_p], floor)
    cand = {}
    for r, (ids, vals) in found.items():
        keep = vals >= cut[r]  # min_p's floor only raises the cut: still within the candidates
        cand[r] = (ids[keep], vals[keep])
    # one masked pass over every row unless no row needs it (a pass row by row was measured slower than one for all:
    # 32 rows of 152K, 2-core EPYC)
    if (top_p or min_p) and (mask_candidates or any(float(cut[r]) > 0 and r not in cand for r in range(n))):
        probs.masked_fill_(probs < cut[:, None], 0.0)
    return probs, cut, cand


def _top_p_cuts(probs: torch.Tensor, top_ps: list[float]
                ) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Each row's top_p cut (the probability of the last token of the smallest most-likely-first prefix whose mass
    reaches its top_p), and for the rows cut within the first partial selection whose last token is below the cut
    (so no token at the cut lies beyond it) that selection's ids and probabilities (row -> (ids, probs)).
    ``probs`` (m, V). First from the ``CANDIDATES`` most likely tokens (one ``topk`` for every row); a row whose mass
    is not reached within them from its tokens above a threshold (``THRESHOLDS``, tried in turn: only those are
    sorted); a row whose mass lies below every threshold (a flat tail) from a histogram of its probabilities: the
    mass of every bin above the one where the running mass crosses top_p is kept whole, and only that bin's tokens
    are sorted. The running sums are the same floats either way (the same values in the same order), so the cut
    is the one a full sort gives."""
    m, V = probs.shape
    p = torch.tensor(top_ps, dtype=torch.float64)
    cuts = torch.empty(m, dtype=probs.dtype)
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    k = min(CANDIDATES, V)
    s, ids = probs.topk(k, dim=-1)
    n = (s.double().cumsum(-1) < p[:, None]).sum(-1)  # tokens before the one that reaches top_p
    todo = []
    for r in range(m):
        if int(n[r]) < k or k == V:
            c = s[r, min(int(n[r]), k - 1)]
            cuts[r] = c
            if k == V or float(s[r, k - 1]) < float(c):
                first[r] = (ids[r], s[r])
        else:
            todo.append(r)
    for t in THRESHOLDS:
        left = []
        for r in todo:
            row = probs[r]
            vals = row[row > t]  # the tokens above the threshold: a few thousand of a 152K vocabulary
            if float(vals.double().sum()) < float(p[r]):
                left.append(r)
                continue
            vals = vals.sort(descending=True).values
            j = int((vals.double().cumsum(0) < p[r]).sum())
            if j >= vals.numel():  # the sums' rounding: not reached within them after all
                left.append(r)
                continue
            cuts[r] = vals[j]
        todo = left
        if not todo:
            return cuts, first
    cuts[todo] = _top_p_cuts_by_histogram(probs[todo], p[todo])
    return cuts, first


HIST_BINS = 1 << 15  # the top 15 bits of a float32 >= 0: its exponent and 7 bits of mantissa, in order


def _top_p_cuts_by_histogram(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`_top_p_cuts` for rows whose top_p mass lies past the partial selection: ``probs`` (m, V) float32."""
    m, V = probs.shape
    keys = probs.view(torch.int32) >> 16  # (m, V): a non-negative float's bits order as the float does
    offs = torch.arange(m, dtype=torch.int64)[:, None] * HIST_BINS
    mass = torch.bincount((keys + offs).flatten(), weights=probs.flatten().double(), minlength=m * HIST_BINS)
    down = mass.view(m, HIST_BINS).flip(-1).cumsum(-1)  # (m, bins): mass of the bins from the top down to each
    pos = (down < p[:, None]).sum(-1).clamp_(max=HIST_BINS - 1)  # bins wholly before top_p is reached
    cuts = torch.empty(m, dtype=probs.dtype)
    for r in range(m):
        b = HIST_BINS - 1 - int(pos[r])
        above = float(down[r, int(pos[r]) - 1]) if int(pos[r]) else 0.0
        s = probs[r][keys[r] == b].sort(descending=True).values  # the crossing bin's tokens only
        if not s.numel():  # the mass summed short of top_p by rounding: every token with a probability stays
            cuts[r] = probs[r][probs[r] > 0].min()
            continue
        n = int(((s.double().cumsum(0) + above) < float(p[r])).sum())
        cuts[r] = s[min(n, s.numel() - 1)]
    return cuts


def draw_kept(ids: torch.Tensor, vals: torch.Tensor, u: float) -> int:
    """:func:`kvtier.sampling.reference.draw` over a row's kept tokens only: ``ids`` (m,) and their weights
    ``vals`` (m,) float32 (every other token weighs 0), taken in vocabulary order as the reference takes them, so
    the float64 running sums and the token drawn are the reference's over the whole row."""
    order = ids.argsort()
    w = vals[order].double()
    cum = w.cumsum(0)
    j = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64), right=True))
    j = min(j, len(cum) - 1)  # u * total rounded onto the total: the last kept token (each kept one has weight)
    return int(ids[order[j]])


def draw_rows(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's index where its ``u`` (n,) float64 in [0, 1) lands in its cumulative weights ``w`` (n, V) float32
    (zero weights never drawn) -> (n,) int64: the sums of ``BLOCK``-token blocks (float32, one pass; their running
    sum in float64) pick the block, the block's own cumulative sum (float64) the token."""
    n, V = w.shape
    full = V // BLOCK
    sums = [w[:, : full * BLOCK].view(n, full, BLOCK).sum(dim=-1)] if full else []
    if V > full * BLOCK:
        sums.append(w[:, full * BLOCK :].sum(dim=-1, keepdim=True))
    bc = torch.cat(sums, dim=-1).double().cumsum(dim=-1)  # (n, blocks)
    target = u * bc[:, -1]
    b = torch.searchsorted(bc, target[:, None], right=True).squeeze(1).clamp_(max=bc.shape[1] - 1).tolist()
    tok = torch.empty(n, dtype=torch.long)
    for r in range(n):
        lo = b[r] * BLOCK
        blk = w[r, lo : lo + BLOCK]
        inner = blk.double().cumsum(0) + (float(bc[r, b[r] - 1]) if b[r] else 0.0)
        j = int(torch.searchsorted(inner, target[r : r + 1], right=True))
        if j >= blk.numel() or float(blk[j]) == 0.0:  # u * total rounded past what the block's own sum reaches
            nz = blk.nonzero()
            tok[r] = lo + int(nz[-1]) if nz.numel() else int(w[r].nonzero()[-1])
        else:
            tok[r] = lo + j
    return tok
