"""The prefix cache: a hit gives the tokens a cold prefill gives, it is counted in whole blocks, tenants never share
prefixes, it holds under a device budget and within its host bytes, least recently used blocks go first, and off
it changes nothing."""

from __future__ import annotations


import pytest
import torch

import kvtier
from kvtier.serve.continuous import ContinuousEngine
from kvtier.serve.engine import EngineConfig, GenRequest
from kvtier.serve.prefix import PrefixConfig, PrefixStore, block_keys, salt_of
from kvtier.step.direct import rows_logits
from servers import Collect as _Collect  # (tests/serve/servers.py)

NO_EVICT = {"hbm_ratio": 0.3, "evict_ratio": 0.0, "recent_window": 4, "retier_interval": 8}
ORDERED = {"hbm_ratio": 0.3, "evict_ratio": 0.2, "recent_window": 4, "retier_interval": 8, "attention": "ordered"}
CASES = [("full", {}), ("tiered", NO_EVICT), ("tiered", ORDERED)]
IDS = ["full", "tiered-split", "tiered-evict-ordered"]


def _tokens(seed: int, n: int, lo: int = 3, hi: int = 250) -> list[int]:
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the store, without a model ---------------------------------------------------------------------------
def test_block_keys_chain_the_prefix_and_the_salt():
    a = _tokens(1, 70)
    ka = block_keys(a, b"", 16)
    assert len(ka) == 4 and len(set(ka)) == 4  # 70 tokens: four whole blocks, the last six tokens have no key
    b = list(a)
    b[40] += 1  # a change in block 2 changes its key and every key after it, none before
    kb = block_keys(b, b"", 16)
    assert kb[:2] == ka[:2] and all(x != y for x, y in zip(kb[2:], ka[2:]))
    salted = block_keys(a, salt_of("key-1", None), 16)
    assert all(x != y for x, y in zip(salted, ka))
    assert block_keys(a, salt_of("key-1", None), 16) == salted  # deterministic
    assert salt_of("key-1", None) != salt_of("key-2", None) != salt_of("key-1", "s")
    assert salt_of(None, None) == b"" and salt_of("ab", "c") != salt_of("a", "bc")  # (parts length-prefixed)
    # a chain continued from its last key is the chain hashed whole (the engine hashes a growing sequence once)
    assert block_keys(a[:32], b"s", 16) + block_keys(a[32:64], block_keys(a[:32], b"s", 16)[-1], 16) == \
        block_keys(a[:64], b"s", 16)


def _kv(n: int, fill: float = 0.0, L: int = 2, H: int = 1, D: int = 4) -> torch.Tensor:
    return torch.full((L, 2, H, n, D), fill) + torch.arange(n).view(1, 1, 1, n, 1)


def test_store_matches_whole_blocks_and_leaves_a_token_to_prefill():
    s = PrefixStore(host_bytes=1 << 20, block=4)
    toks = list(range(10, 22))  # 12 tokens: 3 blocks
    keys = block_keys(toks, b"", 4)
    assert s.match(keys, 12) == 0 and s.take(keys, 0, 12) is None
    assert s.put(keys, 0, _kv(12)) == 3 and len(s) == 3
    assert s.match(keys, 12) == 8  # all three held, but the prompt's last token must be computed: two blocks
    assert s.match(keys, 13) == 12
    got = s.take(keys, 12, 13)
    assert torch.equal(got, _kv(12)) and s.queried_tokens == 12 + 13 and s.hit_tokens == 12
    other = block_keys([10, 11, 12, 99, 14, 15, 16, 17], b"", 4)
    assert s.match(other, 20) == 0 and s.missing(other) == 0
    assert s.put(keys, 0, _kv(12)) == 0  # held already: kept as they are
    with pytest.raises(ValueError, match=r"prefix_block_tokens \(--prefix-block-tokens\) must be an integer >= 1"):
        PrefixStore(block=0)
    with pytest.raises(ValueError, match=r"prefix_cache_host_bytes \(--prefix-cache-host-bytes\)"):
        PrefixConfig(host_bytes=-1)
    with pytest.raises(ValueError, match=r"prefix_cache \(--prefix-cache\) must be True or False"):
        PrefixConfig(enabled="yes")


def test_store_drops_the_least_recently_used_blocks_chain_ends_first_and_stays_within_its_bytes():
    block_bytes = _kv(4).numel() * 4
    s = PrefixStore(host_bytes=6 * block_bytes, block=4)
    a, b, c = (block_keys(list(range(i * 100, i * 100 + 12)), b"", 4) for i in (1, 2, 3))
    s.put(a, 0, _kv(12))
    s.put(b, 0, _kv(12))
    assert s.bytes == 6 * block_bytes and s.evicted_blocks == 0
    s.take(a, 8, 13)  # a's first two blocks were used last; its third was not
    s.put(c, 0, _kv(12))
    assert s.bytes <= s.host_bytes and s.evicted_blocks == 3
    # gone: a's unused end, then b's blocks from its end (each chain was stored and refreshed last to first)
    assert s.missing(a) == 2 and s.missing(b) == 1 and s.missing(c) == 3
    s.put(b, 0, _kv(8))  # b's second block back: the oldest block goes, a's end, not its start
    assert s.missing(a) == 1 and s.missing(b) == 2 and s.bytes == s.host_bytes
    small = PrefixStore(host_bytes=2 * block_bytes, block=4)
    assert small.put(c, 0, _kv(12)) == 2 and small.missing(c) == 2  # too long for the store: its leading blocks


# ---- the cache: a loaded prefix is a prefill's ------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from kvtier.models import random_model

    return random_model("tiny-qwen2", dtype=torch.float32)


def _decode(model, c, first_logits, steps):
    out = [first_logits[0]]
    lg = first_logits
    for _ in range(steps):
        lg = rows_logits(model, None, [c], [[int(lg[0, 0].float().argmax())]])
        out.append(lg[0])
    return torch.cat(out)


@pytest.mark.parametrize("policy,params", CASES, ids=IDS)
def test_a_loaded_prefix_gives_what_a_cold_prefill_gives(model, policy, params):
    """Another prompt's first 160 tokens, copied out of its cache after its whole prefill and loaded into a new
    cache: the rest prefilled, 24 greedy steps: the same tokens as the same prompt prefilled cold (whole, and in
    chunks at the same boundary), logits within 1e-4 (the model's matmuls over other row counts round
    differently), the same tier map, zero scores."""
    shared = _tokens(7, 160, 0, model.config.vocab_size)
    donor_prompt = shared + _tokens(8, 90, 0, model.config.vocab_size)
    prompt = shared + _tokens(9, 140, 0, model.config.vocab_size)
    donor = kvtier.make_cache(policy, model, **params)
    rows_logits(model, None, [donor], [donor_prompt])
    kv = donor.prompt_kv(0, 160)
    L, H, D = model.config.num_hidden_layers, model.config.num_key_value_heads, donor.state.head_dim
    assert kv.shape == (L, 2, H, 160, D)

    hit = kvtier.make_cache(policy, model, **params)
    hit.open_prompt(len(prompt))
    hit.load_prompt(kv, model.config.num_attention_heads)
    a = _decode(model, hit, rows_logits(model, None, [hit], [prompt[160:]]), 24)

    cold = kvtier.make_cache(policy, model, **params)
    b = _decode(model, cold, rows_logits(model, None, [cold], [prompt]), 24)
    chunked = kvtier.make_cache(policy, model, **params)
    chunked.open_prompt(len(prompt))
    rows_logits(model, None, [chunked], [prompt[:160]])
    c = _decode(model, chunked, rows_logits(model, None, [chunked], [prompt[160:]]), 24)
    assert torch.equal(a.argmax(-1), b.argmax(-1)) and torch.equal(a.argmax(-1), c.argmax(-1))
    assert (a - b).abs().max().item() <= 1e-4 and (a - c).abs().max().item() <= 1e-4
    assert torch.equal(hit.tier_map(), cold.tier_map())
    if policy != "full":
        assert hit.state.retiers == cold.state.retiers >= 2


def test_a_loaded_prefix_under_a_device_limit_keeps_the_device_within_the_limit_and_one_piece(model):
    """Loaded in pieces of the tail reserve under a T0 limit: between pieces the device holds at most the limit
    beside one piece (as a chunked prefill), and the tokens are the cold prefill's."""
    prompt = _tokens(11, 400, 0, model.config.vocab_size)
    donor = kvtier.make_cache("tiered", model, **NO_EVICT)
    rows_logits(model, None, [donor], [prompt])
    kv = donor.prompt_kv(0, 320)
    c = kvtier.make_cache("tiered", model, **NO_EVICT)
    c.limit_device(50)
    c.open_prompt(len(prompt))
    seen = []
    orig = c.state.chunk_attended

    def watch(hq):
        orig(hq)
        seen.append(c.device_kv_bytes())

    c.state.chunk_attended = watch
    piece = c.tail_reserve()
    c.load_prompt(kv, model.config.num_attention_heads, piece=piece)
    col = c._col_bytes()
    assert len(seen) == -(-320 // piece) and max(seen) <= (50 + piece) * col + c.state.engine.staging_bytes() + \
        col * (piece - 1)  # (the tail is allocated in granules)
    lg = rows_logits(model, None, [c], [prompt[320:]])
    a = _decode(model, c, lg, 16)
    cold = kvtier.make_cache("tiered", model, **NO_EVICT)
    b = _decode(model, cold, rows_logits(model, None, [cold], [prompt]), 16)
    assert torch.equal(a.argmax(-1), b.argmax(-1)) and (a - b).abs().max().item() <= 1e-4


def test_load_prompt_and_prompt_kv_refuse_what_they_cannot_do(model):
    c = kvtier.make_cache("tiered", model, **NO_EVICT)
    kv = torch.zeros(model.config.num_hidden_layers, 2, model.config.num_key_value_heads, 8, 16)
    with pytest.raises(ValueError, match="needs an announced prompt"):
        c.load_prompt(kv, 4)
    c.open_prompt(8)
    with pytest.raises(ValueError, match="at least one is left to prefill"):
        c.load_prompt(kv, 4)
    with pytest.raises(ValueError, match=r"kv must be \(layers="):
        c.load_prompt(kv[:1], 4)
    ev = kvtier.make_cache("tiered", model, hbm_ratio=0.2, evict_ratio=0.5, recent_window=4, retier_interval=4,
                           protect_prompt=False)
    lg = rows_logits(model, None, [ev], [_tokens(3, 64, 0, model.config.vocab_size)])
    _decode(model, ev, lg, 8)
    assert not ev.lossless
    with pytest.raises(ValueError, match="not all held exactly"):
        ev.prompt_kv(0, 64)


# ---- the engine -----------------------------------------------------------------------------------------
def _req(prompt, max_tokens, policy="full", params=None, **kw):
    return GenRequest(prompt_ids=list(prompt), max_tokens=max_tokens, sink=_Collect(), policy=policy,
                      params=dict(params or {}), separate_reasoning=False, ignore_eos=True, **kw)


def _serve(eng, *reqs):
    """Each request in turn, alone in the engine: its text and usage."""
    out = []
    for r in reqs:
        eng.submit(r)
        assert r.sink.done.wait(120)
        assert r.sink.events[-1][0] == "done", r.sink.events[-1]
        out.append((r.sink.text, r.sink.usage))
    return out


@pytest.mark.parametrize("policy,params", CASES, ids=IDS)
def test_miss_then_hit_gives_a_cold_servers_tokens_and_counts_whole_blocks(tiny, policy, params):
    """A prompt served twice, then a longer prompt sharing its first 80 tokens: the same greedy text as a server
    with no prefix cache; the first is a miss, the second reuses its whole blocks (96 of 100 tokens: one token is
    always computed), the third its 80 shared tokens (five blocks); /metrics' counters say so."""
    model, tok = tiny
    a = _tokens(21, 100)
    b = a[:80] + _tokens(22, 50)
    eng = ContinuousEngine(model, tok, EngineConfig(max_batch=4)).start()
    cold = ContinuousEngine(model, tok, EngineConfig(max_batch=4, prefix_cache=False)).start()
    try:
        got = _serve(eng, *(_req(p, 24, policy, params) for p in (a, a, b)))
        want = _serve(cold, *(_req(p, 24, policy, params) for p in (a, a, b)))
    finally:
        eng.shutdown(grace_s=1)
        cold.shutdown(grace_s=1)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [u["prompt_tokens_details"]["cached_tokens"] for _, u in got] == [0, 96, 80]
    assert [u["kvtier"]["cached_prompt_tokens"] for _, u in got] == [0, 96, 80]
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 0 for _, u in want)
    assert eng.prefix.queried_tokens == 100 + 100 + 130 and eng.prefix.hit_tokens == 96 + 80
    assert cold.prefix is None and "no prefix cache" in cold.describe()


class _Drawn(ContinuousEngine):
    """Keeps every finished row's drawn tokens (``drawn[request id]``), to build a chat's next turn from them."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.drawn: dict[int, list[int]] = {}

    def _finish(self, row, reason):
        self.drawn[row.req.id] = list(row.generated)
        super()._finish(row, reason)


def test_a_request_arriving_with_another_reuses_what_that_one_has_computed_so_far(tiny):
    """Two prompts sharing 256 tokens arrive together; with 128 prompt tokens a step the first is prefilled over
    three steps and the second waits for room: it starts with the shared blocks the first has stored chunk by chunk,
    and both give the cold server's texts."""
    model, tok = tiny
    a = _tokens(61, 300)
    b = a[:256] + _tokens(62, 44)

    def run(prefix: bool):
        eng = ContinuousEngine(model, tok, EngineConfig(max_batch=4, max_batched_tokens=128, prefix_cache=prefix))
        ra, rb = _req(a, 16), _req(b, 16)
        eng.submit(ra)
        eng.submit(rb)
        eng.start()
        for r in (ra, rb):
            assert r.sink.done.wait(120) and r.sink.events[-1][0] == "done"
        eng.shutdown(grace_s=1)
        return [r.sink.text for r in (ra, rb)], [r.sink.usage["prompt_tokens_details"]["cached_tokens"] for r in (ra, rb)]

    texts, cached = run(True)
    cold, _ = run(False)
    assert texts == cold and cached == [0, 256]


def test_prompt_and_answer_serve_the_next_turn_of_a_chat(tiny):
    """A lossless row (full) gives its prompt and its answer at the end: a next prompt that repeats both hits
    beyond the first prompt's blocks; a row that destroyed tokens gives its prompt's blocks only."""
    model, tok = tiny
    p = _tokens(31, 40)
    eng = _Drawn(model, tok, EngineConfig(max_batch=2)).start()
    try:
        r1 = _req(p, 40)
        _serve(eng, r1)
        (_, u2), = _serve(eng, _req(p + eng.drawn[r1.id] + _tokens(32, 20), 8))
        assert u2["prompt_tokens_details"]["cached_tokens"] == (40 + 39) // 16 * 16  # prompt + the fed answer
        lossy = {"hbm_ratio": 0.2, "evict_ratio": 0.5, "recent_window": 4, "retier_interval": 4,
                 "protect_prompt": False}
        q = _tokens(33, 40)
        r3 = _req(q, 40, "tiered", lossy)
        _serve(eng, r3)
        (_, u4), = _serve(eng, _req(q + eng.drawn[r3.id] + _tokens(34, 20), 8, "tiered", lossy))
        assert u4["prompt_tokens_details"]["cached_tokens"] == 32  # its prompt's two whole blocks only
    finally:
        eng.shutdown(grace_s=1)


def test_tenants_never_share_a_prefix_and_cache_salt_separates_one_tenants_requests(tiny):
    """Over HTTP: two API keys, the same prompt: the second key gets no hit; the same key again: a hit;
    ``cache_salt`` separates two requests of one key; a bad cache_salt is a 400 naming it."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from kvtier.serve.app import ServeSettings, create_app

    model, tok = tiny
    app = create_app(ContinuousEngine(model, tok, EngineConfig(max_batch=2)),
                     ServeSettings(served_name="tiny", policy="full", max_new_tokens=8, api_keys=("k1", "k2")))
    prompt = "The same long system prompt, shared by every request of this test. " * 2

    def cached(key, **extra):
        r = client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with TestClient(app) as client:
        assert cached("k1") == 0
        assert cached("k2") == 0  # another tenant: no hit
        assert cached("k1") > 0 and cached("k2") > 0
        assert cached("k1", cache_salt="conversation-a") == 0
        assert cached("k1", cache_salt="conversation-a") > 0
        bad = client.post("/v1/completions", headers={"Authorization": "Bearer k1"},
                          json={"prompt": prompt, "max_tokens": 2, "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        metrics = client.get("/metrics").text
    for name in ("kvtier_prefix_cache_queries_tokens_total", "kvtier_prefix_cache_hit_tokens_total",
                 'kvtier_prefix_cache_bytes{tier="host"}', 'kvtier_prefix_cache_bytes{tier="device"}',
                 "kvtier_prefix_cache_evicted_blocks_total", "kvtier_prefix_cache_blocks"):
        assert name in metrics


def test_under_a_device_budget_hits_hold_and_neither_budget_is_exceeded(tiny):
    """A device budget that makes rows start demoted (T0 limits) and a store of a few blocks: prompts sharing a
    prefix still hit and give the cold server's texts; the device K/V never went over its budget; the store
    never over its bytes."""
    model, tok = tiny
    probe = ContinuousEngine(model, tok, EngineConfig(max_batch=4))
    budget = 2 * probe._peak_bytes(130)  # two rows' worth: four running rows start limited
    col = probe.col_bytes
    store_bytes = 12 * 16 * col  # twelve blocks
    shared = _tokens(41, 96)
    prompts = [shared + _tokens(42 + i, 30) for i in range(6)]
    cfg = dict(max_batch=4, device_kv_budget=budget, prefix_cache_host_bytes=store_bytes)

    def run(prefix: bool):
        eng = ContinuousEngine(model, tok, EngineConfig(**cfg, prefix_cache=prefix)).start()
        seen = []
        orig = eng._note_device

        def note():
            orig()
            if eng.prefix is not None:
                seen.append(eng.prefix.bytes)

        eng._note_device = note
        first = _req(prompts[0], 30, "tiered", NO_EVICT)
        _serve(eng, first)  # the shared prefix is in the store
        reqs = [_req(p, 30, "tiered", NO_EVICT) for p in prompts[1:]]
        for r in reqs:
            eng.submit(r)
        for r in reqs:
            assert r.sink.done.wait(120) and r.sink.events[-1][0] == "done"
        eng.shutdown(grace_s=1)
        return eng, [first.sink.text] + [r.sink.text for r in reqs], [r.sink.usage for r in reqs], seen

    eng, texts, usage, seen = run(True)
    _, cold, _, _ = run(False)
    assert texts == cold
    assert all(u["prompt_tokens_details"]["cached_tokens"] == 96 for u in usage)
    assert eng.metrics.device_kv_peak <= budget and eng.metrics.budget_violations == 0
    assert any(u["kvtier"]["demoted_tokens"] for u in usage)  # the budget did bind
    assert max(seen) <= store_bytes and eng.prefix.evicted_blocks > 0


def test_the_static_scheduler_and_head_wise_baselines_do_not_reuse(tiny):
    """A head-wise baseline scores its whole prompt at prefill: it neither takes nor gives prefixes (its usage
    says 0 cached); the others are unaffected."""
    model, tok = tiny
    p = _tokens(51, 64)
    eng = ContinuousEngine(model, tok, EngineConfig(max_batch=2)).start()
    try:
        outs = _serve(eng, _req(p, 8, "snapkv", {"budget_ratio": 0.5}), _req(p, 8, "snapkv", {"budget_ratio": 0.5}),
                      _req(p, 8), _req(p, 8))
    finally:
        eng.shutdown(grace_s=1)
    assert [u["prompt_tokens_details"]["cached_tokens"] for _, u in outs] == [0, 0, 0, 48]
    assert eng.prefix.queried_tokens == 128  # the baseline's requests were never looked up
