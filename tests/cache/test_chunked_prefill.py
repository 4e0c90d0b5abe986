"""Chunked prefill (``open_prompt``): a prompt prefilled piece by piece gives what it gives whole — the same greedy
tokens, the same logits (bit for bit on the ordered path and for ``full``; within the split path's rounding), the
same zero scores and the same tier assignment at every reassignment — and under a device limit the device never
holds more than the limit beside one chunk."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.models import random_model
from kvtier.step.direct import direct_step, rows_logits

SPLIT = {"hbm_ratio": 0.3, "evict_ratio": 0.0, "recent_window": 4, "retier_interval": 8}
ORDERED = {"hbm_ratio": 0.3, "evict_ratio": 0.2, "recent_window": 4, "retier_interval": 8, "attention": "ordered"}
# The model's matmuls over 256 rows and over 3,000 round differently (and SDPA tiles them differently): ~1e-6 in
# float32 at 3,000 tokens; at 300 tokens full and the ordered path give every logit bit for bit (the next tests).
CASES = [("full", {}, 1e-4), ("tiered", SPLIT, 1e-4), ("tiered", ORDERED, 1e-4)]


@pytest.fixture(scope="module")
def tiny():
    return random_model("tiny-qwen2", dtype=torch.float32)


def _row_count_invariant_matmul(model) -> bool:
    """Whether this machine's forward gives a token the same bits in a 64-token chunk as in a 300-token prefill:
    ``full`` on the ordered path, chunked against whole (the premise of a bit-for-bit comparison; on a 2-core AMD
    EPYC with AVX2 only it does not hold, by float rounding outside the cache)."""
    prompt = list(range(3, 303))
    a = _run(model, "full", {"attention": "ordered"}, prompt, None, steps=2)[0]
    b = _run(model, "full", {"attention": "ordered"}, prompt, 64, steps=2)[0]
    return torch.equal(a, b)


def _run(model, policy, params, prompt, chunk, steps=24, limit=None, step=None):
    """Greedy decoding after a whole (``chunk`` None) or chunked prefill: (logits (1 + steps, V), cache, the
    cache's device K/V bytes after every update, the tier map after each reassignment)."""
    c = kvtier.make_cache(policy, model, **params)
    if limit is not None:
        c.limit_device(limit)
    seen, maps = [], []
    if chunk is None:
        lg = rows_logits(model, step, [c], [prompt])
    else:
        c.open_prompt(len(prompt))
        for s in range(0, len(prompt), chunk):
            lg = rows_logits(model, step, [c], [prompt[s : s + chunk]])
            seen.append(c.device_kv_bytes())
    out = [lg[0]]
    retiers = c.state.retiers
    for _ in range(steps):
        lg = rows_logits(model, step, [c], [[int(lg[0, 0].float().argmax())]])
        out.append(lg[0])
        seen.append(c.device_kv_bytes())
        if c.state.retiers != retiers:
            retiers = c.state.retiers
            maps.append(c.tier_map())
    return torch.cat(out), c, seen, maps


@pytest.mark.parametrize("policy,params,bound", CASES, ids=["full", "tiered-split", "tiered-evict-ordered"])
def test_chunks_give_the_whole_prefill(tiny, policy, params, bound):
    """A 3,000-token prompt in chunks of 256: the same greedy tokens and logits (within ``bound``), the same zero
    scores after the prompt, and the same tier map at every reassignment (the first one included)."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, tiny.config.vocab_size, (3000,), generator=g).tolist()
    a, ca, _, ma = _run(tiny, policy, params, prompt, None)
    b, cb, _, mb = _run(tiny, policy, params, prompt, 256)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max().item() <= bound
    assert len(ma) == len(mb) and (policy == "full" or len(ma) >= 2)
    for x, y in zip(ma, mb):
        assert torch.equal(x, y)
    assert torch.equal(ca.tier_map(), cb.tier_map())
    assert ca.stats()["tokens"] == cb.stats()["tokens"]
    # and the same device buffers: a placed chunked prompt's tail starts again empty, as a whole prefill's
    assert [la.dev_k.shape for la in ca.layers] == [lb.dev_k.shape for lb in cb.layers]
    assert ca.device_kv_bytes() == cb.device_kv_bytes()


def test_scores_after_a_chunked_prompt_are_the_whole_prompts(tiny):
    """No chunk adds to the scores (a whole prefill adds none), and the first placement is the whole prompt's."""
    prompt = list(range(5, 205))
    whole = kvtier.make_cache("tiered", tiny, **SPLIT)
    rows_logits(tiny, None, [whole], [prompt])
    chunked = kvtier.make_cache("tiered", tiny, **SPLIT)
    chunked.open_prompt(len(prompt))
    for s in range(0, len(prompt), 48):
        rows_logits(tiny, None, [chunked], [prompt[s : s + 48]])
    assert torch.count_nonzero(chunked.scores()) == 0 and torch.count_nonzero(whole.scores()) == 0
    rows_logits(tiny, None, [whole], [[7]])  # the chunked prompt is placed at the update after its last chunk
    rows_logits(tiny, None, [chunked], [[7]])
    assert torch.equal(whole.tier_map(), chunked.tier_map())


@pytest.mark.parametrize("policy,params", [("full", {}), ("tiered", SPLIT), ("tiered", ORDERED)],
                         ids=["full", "tiered-split", "tiered-evict-ordered"])
def test_a_limited_chunked_prompt_holds_the_limit_beside_one_chunk(tiny, policy, params):
    """Under ``limit_device(50)`` each chunk is placed at the next update: between chunks the device holds at most
    the limit plus one chunk (columns of every layer, K and V), and the tokens are those of the whole prefill."""
    prompt = list(range(3, 303))
    a, _, _, ma = _run(tiny, policy, params, prompt, None, limit=50)
    b, cb, seen, mb = _run(tiny, policy, params, prompt, 64, limit=50)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    if "attention" in params and _row_count_invariant_matmul(tiny):  # the ordered path: every logit bit for bit
        assert torch.equal(a, b)
    else:  # where this CPU's GEMM rounds a 64-row product differently from a 300-row one (AVX2 EPYC): rounding only
        assert (a - b).abs().max().item() <= 1e-4
    col = cb._col_bytes()
    n_chunks = 5
    assert max(seen[:n_chunks]) <= (50 + 64) * col
    for x, y in zip(ma, mb):
        assert torch.equal(x, y)


def test_chunks_beside_decoding_rows_through_the_direct_step():
    """In one packed step a decoding row and a prompt chunk of another row, through the checked direct step in bf16:
    the chunked row's logits and tokens are the ones it gets prefilled whole, and the decoding row's are unchanged."""
    model = random_model("tiny-qwen2", dtype=torch.bfloat16)
    step = direct_step(model)
    assert step is not None
    other, long = list(range(10, 30)), list(range(40, 240))

    def serve(chunk):
        a, b = kvtier.make_cache("full", model), kvtier.make_cache("tiered", model, **SPLIT)
        la = rows_logits(model, step, [a], [other])[0]
        toks_a, got_b = [], None
        if chunk is not None:
            b.open_prompt(len(long))
        pieces = [long] if chunk is None else [long[s : s + chunk] for s in range(0, len(long), chunk)]
        for piece in pieces:
            toks_a.append(int(la[0].float().argmax()))
            lg = rows_logits(model, step, [a, b], [[toks_a[-1]], piece])[0]
            la, got_b = lg[0:1], lg[1:2]
        out_b = [got_b]
        for _ in range(12):
            lg = rows_logits(model, step, [b], [[int(out_b[-1][0].float().argmax())]])[0]
            out_b.append(lg)
        return toks_a, torch.cat(out_b)

    whole_a, whole_b = serve(None)
    chunk_a, chunk_b = serve(64)
    assert chunk_a[: len(whole_a)] == whole_a  # the decoding row: the same tokens whatever rode beside it
    assert torch.equal(whole_b.float().argmax(-1), chunk_b.float().argmax(-1))


def test_open_prompt_refuses_bad_use(tiny):
    c = kvtier.make_cache("tiered", tiny, **SPLIT)
    with pytest.raises(ValueError, match="open_prompt takes the prompt's length"):
        c.open_prompt(0)
    c.open_prompt(10)
    with pytest.raises(ValueError, match="overruns the 10-token prompt"):
        rows_logits(tiny, None, [c], [list(range(12))])
    rows_logits(tiny, None, [c], [list(range(10))])
    with pytest.raises(ValueError, match="open_prompt needs an empty cache"):
        c.open_prompt(5)
