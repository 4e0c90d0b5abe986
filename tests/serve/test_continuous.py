"""Continuous batching: requests join the running batch, finish on their own, and under a device-KV budget are
demoted (exactly) before anyone waits or is preempted; every output equals the request's output served alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvtier
from kvtier.compat import cache_kw
from kvtier.attention import fused_cpu
from kvtier.cache.rows import RowsCache
from kvtier.serve.continuous import ContinuousEngine
from kvtier.serve.engine import Engine, EngineConfig, GenRequest, NeverFits
from servers import Collect as _Collect  # (tests/serve/servers.py)

NO_EVICT = {"hbm_ratio": 0.3, "evict_ratio": 0.0, "recent_window": 4, "retier_interval": 8}


class _Watched(ContinuousEngine):
    """Records the device K/V the caches account after every prefill and step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.trace: list[int] = []

    def _note_device(self):
        super()._note_device()
        self.trace.append(self.metrics.device_kv_bytes_now)


def _engine(model, tok, **cfg) -> _Watched:
    return _Watched(model, tok, EngineConfig(**{"max_batch": 16, **cfg})).start()


def _req(prompt, max_tokens, policy="full", params=None, **kw):
    return GenRequest(prompt_ids=list(prompt), max_tokens=max_tokens, sink=_Collect(), policy=policy,
                      params=dict(params or {}), separate_reasoning=False, **kw)


def _sampling_kw(r: GenRequest) -> dict:
    """A request's sampling settings and seed, to send the same request again."""
    return {k: getattr(r, k) for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                                       "frequency_penalty", "repetition_penalty", "seed")}


def _alone(model, tok, req: GenRequest, sink: bool = False):
    """The request's text served alone (a fresh engine, no budget); ``sink``: its whole event record."""
    eng = _engine(model, tok)
    r = _req(req.prompt_ids, req.max_tokens, req.policy, req.params, **_sampling_kw(req))
    eng.submit(r)
    assert r.sink.done.wait(120)
    eng.shutdown(grace_s=1)
    assert r.sink.end[0] == "done"
    return r.sink if sink else r.sink.text


def _prompt(tok, i: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def _long_prompt(model, tok, n=24, steps=120, skip=0):
    """A prompt whose greedy continuation runs ``steps`` tokens without an end of sequence (the ``skip``-th)."""
    for i in range(200):
        p = _prompt(tok, 1000 + i, n)
        c = kvtier.make_cache("full", model)
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([p]), **cache_kw(model, c), max_new_tokens=steps, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
        if tok.eos_token_id not in out[0, n:].tolist():
            if skip == 0:
                return p
            skip -= 1
    raise AssertionError("no prompt without an early end of sequence")


@pytest.mark.parametrize("policy,params", [("full", {}), ("tiered", NO_EVICT)])
def test_short_request_overtakes_a_long_one(tiny, policy, params):
    model, tok = tiny
    eng = _engine(model, tok)
    long = _req(_long_prompt(model, tok), 120, policy, params)
    eng.submit(long)
    while not long.sink.events:  # the long one is decoding
        time.sleep(0.005)
    short = _req(_prompt(tok, 1, 10), 6, policy, params)
    eng.submit(short)
    assert short.sink.done.wait(60) and long.sink.done.wait(60)
    eng.shutdown(grace_s=1)
    assert short.sink.finished_at < long.sink.finished_at  # it joined the running batch, not the queue behind it
    assert short.sink.text == _alone(model, tok, short)
    assert long.sink.text == _alone(model, tok, long)


# the trace's sampling settings beside greedy and T 0.8 / top_p 0.9: every control, and a penalised greedy row
EXTRA_SAMPLING = {2: dict(top_k=20), 4: dict(repetition_penalty=1.3), 5: dict(min_p=0.05, presence_penalty=0.5),
                  8: dict(repetition_penalty=1.2, frequency_penalty=0.3), 11: dict(temperature=1.0, top_p=1.0)}


def _trace(tok, n=12):
    """Staggered requests of mixed lengths, policies and sampling settings."""
    out = []
    for i in range(n):
        policy, params = (("full", {}) if i % 2 == 0 else ("tiered", NO_EVICT))
        sampled = i % 3 == 2
        kw = dict(temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else 1.0, seed=i)
        kw.update(EXTRA_SAMPLING.get(i, {}))
        out.append(_req(_prompt(tok, i, 4 + 7 * (i % 5)), 10 + 9 * (i % 4), policy, params, **kw))
    return out


def _run_trace(eng, reqs, gap=0.02):
    for r in reqs:
        eng.submit(r)
        time.sleep(gap)
    for r in reqs:
        assert r.sink.done.wait(180), f"request {r.id} did not finish"


def test_staggered_trace_equals_each_request_alone(tiny):
    model, tok = tiny
    eng = _engine(model, tok)
    reqs = _trace(tok)
    _run_trace(eng, reqs)
    assert eng.metrics.steps > 0 and max(eng.trace) > 0
    eng.shutdown(grace_s=1)
    for r in reqs:
        assert r.sink.end[0] == "done"
        assert r.sink.text == _alone(model, tok, r), f"request {r.id} ({r.policy}, T={r.temperature})"


def test_the_engine_steps_through_the_checked_direct_step_unless_switched_off(tiny):
    """By default the engine steps a Qwen2-form model through kvtier.step.direct (checked at start, said in the
    startup line); ``direct_step=False`` keeps the model's forward. Each request served alone either way streams the
    same text (the direct step's logits are the model's bit for bit: tests/step/test_direct.py)."""
    model, tok = tiny
    on, off = _engine(model, tok), _engine(model, tok, direct_step=False)
    assert on._direct is not None and "direct step" in on.describe()
    assert off._direct is None and "the model's forward" in off.describe()
    for r in _trace(tok, 6):
        sinks = []
        for eng in (on, off):
            q = _req(r.prompt_ids, r.max_tokens, r.policy, r.params, **_sampling_kw(r))
            eng.submit(q)
            assert q.sink.done.wait(120)
            sinks.append(q.sink)
        assert sinks[0].end[0] == sinks[1].end[0] == "done"
        assert sinks[0].text == sinks[1].text, (r.policy, r.temperature)
    on.shutdown(grace_s=1)
    off.shutdown(grace_s=1)


@pytest.mark.parametrize("policies", [("tiered", "full", "tiered", "full"), ("h2o", "full", "snapkv", "tiered")])
def test_batched_step_rounds_only_in_the_model_matmuls(tiny, policies):
    """What may differ from a row alone, measured: one RowsCache step over four rows against each row stepped
    alone. The attention is each row's own (the same calls; with baseline rows, the kernel's rows and the others'
    put back in row order); the model's matmuls (GEMM at 4 rows, GEMV at one) round differently, bounded here by
    1e-4 on the logits (measured ~1e-6 on tiny-qwen2 in fp32)."""
    model, tok = tiny
    params = {"tiered": NO_EVICT, "h2o": {"budget_ratio": 0.5}, "snapkv": {"budget_ratio": 0.5}}

    def prefilled(i):
        c = kvtier.make_cache(policies[i], model, **params.get(policies[i], {}))
        with torch.no_grad():
            model(input_ids=torch.tensor([_prompt(tok, i, 5 + 6 * i)]), **cache_kw(model, c), use_cache=True)
        return c

    batch, alone = [prefilled(i) for i in range(4)], [prefilled(i) for i in range(4)]
    toks = torch.tensor([[7], [8], [9], [10]])
    with torch.no_grad():
        rc = RowsCache(batch)
        lb = model(input_ids=toks, position_ids=rc.positions(), **cache_kw(model, rc), use_cache=True).logits[:, -1]
        la = torch.cat([model(input_ids=toks[i : i + 1], position_ids=RowsCache([c]).positions(),
                              **cache_kw(model, RowsCache([c])), use_cache=True).logits[:, -1] for i, c in enumerate(alone)])
    diff = (lb - la).abs().max().item()
    assert diff <= 1e-4, f"a batched step's logits moved {diff} from the rows alone"
    for a, b in zip(batch, alone):  # the new token's K/V (projected in a batch of 4 vs alone): the same bound
        if not hasattr(a.layers[1], "tail_k"):  # a baseline's layer: its kept K/V
            torch.testing.assert_close(a.layers[1].k, b.layers[1].k, rtol=0, atol=1e-4)
            continue
        n = a.state.n_total - a.state.layout.n_main
        torch.testing.assert_close(a.layers[1].tail_k[:, :, :n], b.layers[1].tail_k[:, :, :n], rtol=0, atol=1e-4)


@pytest.mark.parametrize("policies", [("full", "tiered", "full", "tiered"), ("h2o", "full", "snapkv", "tiered")])
def test_packed_step_prefills_and_decodes_like_each_row_alone(tiny, policies):
    """One packed forward: two running rows bring their next token and two joining rows their whole prompts, laid
    end to end. Each row's attention is its own cache's (the same calls as alone); only the model's matmuls over
    the packed tokens round differently (a GEMM over 4+N rows vs its own): the same 1e-4 bound on the logits and on
    the K/V each cache stored, for the decode rows and for the prefills."""
    model, tok = tiny
    params = {"tiered": NO_EVICT, "h2o": {"budget_ratio": 0.5}, "snapkv": {"budget_ratio": 0.5}}

    def cache(i):
        return kvtier.make_cache(policies[i], model, **params.get(policies[i], {}))

    def prefill(c, ids):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), **cache_kw(model, c), use_cache=True).logits[0, -1]

    prompts = [_prompt(tok, 40 + i, 9 + 5 * i) for i in range(4)]
    packed = [cache(i) for i in range(4)]
    alone = [cache(i) for i in range(4)]
    for i in (0, 1):  # the running rows: prefilled before the step
        prefill(packed[i], prompts[i])
        prefill(alone[i], prompts[i])
    seqs = [[7], [8], prompts[2], prompts[3]]
    with torch.no_grad():
        rc = RowsCache(packed, lengths=[len(q) for q in seqs])
        pos = rc.positions()
        assert pos[0, :2].tolist() == [len(prompts[0]), len(prompts[1])] and pos[0, 2:2 + len(prompts[2])].tolist() \
            == list(range(len(prompts[2])))
        lp = model(input_ids=torch.tensor([[t for q in seqs for t in q]]), position_ids=pos, **cache_kw(model, rc),
                   use_cache=True, logits_to_keep=rc.last_positions()).logits[0]
        la = []
        for i in (0, 1):
            one = RowsCache([alone[i]])
            la.append(model(input_ids=torch.tensor([seqs[i]]), position_ids=one.positions(), **cache_kw(model, one),
                            use_cache=True).logits[0, -1])
        la += [prefill(alone[i], prompts[i]) for i in (2, 3)]
    assert lp.shape == (4, model.config.vocab_size)
    diff = (lp - torch.stack(la)).abs().max().item()
    assert diff <= 1e-4, f"a packed step's logits moved {diff} from the rows alone"
    for a, b, q in zip(packed, alone, seqs):
        assert a.state.n_total == b.state.n_total
        ka, kb = a.layers[1].assemble()[0] if hasattr(a.layers[1], "assemble") else a.layers[1].k, \
            b.layers[1].assemble()[0] if hasattr(b.layers[1], "assemble") else b.layers[1].k
        torch.testing.assert_close(ka, kb, rtol=0, atol=1e-4)


def test_packed_rows_cache_refuses_what_it_cannot_hold(tiny):
    model, tok = tiny
    full = kvtier.make_cache("full", model)
    with torch.no_grad():
        model(input_ids=torch.tensor([_prompt(tok, 1, 6)]), **cache_kw(model, full), use_cache=True)
    empty = kvtier.make_cache("full", model)
    with pytest.raises(ValueError, match="lengths must give one count per row"):
        RowsCache([full, empty], lengths=[1])
    with pytest.raises(ValueError, match="only an empty cache \\(its prefill\\) or one whose announced prompt has room"):
        RowsCache([full], lengths=[3])
    with pytest.raises(ValueError, match="prefilled cache of batch 1"):
        RowsCache([full, empty])  # a decode step (B, 1) needs every row prefilled
    with pytest.raises(ValueError, match="last_positions is for a packed step"):
        RowsCache([full]).last_positions()


@pytest.mark.parametrize("batched,per_step", [(4096, 8), (50, 3)])
def test_a_burst_is_prefilled_in_shared_steps_beside_the_running_rows(tiny, batched, per_step, caplog):
    """Eight requests that arrive together join in one step (or in chunks of what --max-batched-tokens leaves
    beside the decoding rows), while a running row keeps decoding; every text equals the request's alone.
    At debug level (KVTIER_LOG=debug) each step logs its rows, the prefilling ones and their prompt tokens."""
    import logging
    import re

    caplog.set_level(logging.DEBUG, logger="kvtier.serve.continuous")
    model, tok = tiny
    eng = _Watched(model, tok, EngineConfig(max_batch=16, max_batched_tokens=batched))
    running = _req(_long_prompt(model, tok), 120, "tiered", NO_EVICT)
    burst = [_req(_prompt(tok, 60 + i, 20 + i), 12, "full" if i % 2 else "tiered", {} if i % 2 else NO_EVICT)
             for i in range(8)]
    eng.submit(running)
    eng.start()
    while len(running.sink.events) < 2:
        time.sleep(0.002)
    steps = eng.metrics.steps
    eng._loop_hook = lambda: [eng.submit(r) for r in burst]  # on the engine's thread: all eight wait at once
    for r in [running, *burst]:
        assert r.sink.done.wait(120)
    eng.shutdown(grace_s=1)
    log_ = list(eng.step_log)
    joined = [s for s in log_ if s["chunks"]]
    assert joined[0]["chunks"][0][0] == running.id  # the running row's own prefill
    later = [s for s in joined if s["step"] > joined[0]["step"]]
    ids = {r.id for r in burst}
    assert {k for s in later for k, _ in s["chunks"]} == ids
    assert max(len(s["chunks"]) for s in later) <= per_step
    for s in log_:  # every step within its token budget, decoding rows first
        assert len(s["decode"]) + sum(n for _, n in s["chunks"]) <= batched
    assert eng.metrics.steps > steps + 1  # the running row decoded through the joins
    logged = [tuple(map(int, m.groups())) for m in (re.match(r"step \d+: (\d+) rows, (\d+) joining with (\d+) "
                                                              r"prompt tokens, [0-9.]+ ms", r.getMessage())
                                                     for r in caplog.records) if m]
    assert [(n, t) for _, n, t in logged if n] == [(len(s["chunks"]), sum(n for _, n in s["chunks"])) for s in joined]
    assert len(logged) == eng.metrics.steps
    # the same lines as `kvtier serve` writes them, read back by benchmarks/serve/serve_steps.py
    from kvtier.cli import DEBUG_FORMAT
    from scripts import benchmark_script

    fmt = logging.Formatter(DEBUG_FORMAT)
    text = "\n".join(fmt.format(r) for r in caplog.records)
    parsed = benchmark_script("serve_steps").parse(text)
    assert [(s["rows"], s["joining"], s["prompt_tokens"]) for s in parsed] == logged
    assert [s["step"] for s in parsed] == list(range(parsed[0]["step"], parsed[0]["step"] + len(parsed)))
    assert running.sink.text == _alone(model, tok, running)
    for r in burst:
        assert r.sink.end[0] == "done" and r.sink.text == _alone(model, tok, r), f"request {r.id} ({r.policy})"


def test_a_long_prompt_joins_in_chunks_and_every_running_row_advances_each_step(tiny):
    """With --max-batched-tokens 256, a 3,000-token prompt joins three decoding rows: no step carries more than 256
    tokens, every running row advances one token in every step while the prompt is prefilled (12 chunks), and every
    text equals the request's alone (the long one's too)."""
    model, tok = tiny
    # (no prefix cache: the long prompt's first block is a running prompt's, and every token of it is counted here)
    eng = _Watched(model, tok, EngineConfig(max_batch=8, max_batched_tokens=256, prefix_cache=False))
    running = [_req(_long_prompt(model, tok, 20, 60, skip=i), 60, "full" if i else "tiered", {} if i else NO_EVICT)
               for i in range(3)]
    long = _req(_long_prompt(model, tok, 3000, 8), 8, "tiered", NO_EVICT)
    for r in running:
        eng.submit(r)
    eng.start()
    while any(len(r.sink.events) < 2 for r in running):
        time.sleep(0.002)
    eng._loop_hook = lambda: eng.submit(long)
    for r in [*running, long]:
        assert r.sink.done.wait(300)
    eng.shutdown(grace_s=1)
    log_ = list(eng.step_log)
    mine = [s for s in log_ if any(k == long.id for k, _ in s["chunks"])]
    assert len(mine) >= 3000 // 256 + 1
    assert sum(n for s in mine for k, n in s["chunks"] if k == long.id) == len(long.prompt_ids)
    last = {r.id: max(s["step"] for s in log_ if r.id in s["decode"]) for r in running}
    assert all(last[r.id] > mine[-1]["step"] for r in running)  # they decoded all through the long prefill
    for s in mine:
        assert len(s["decode"]) + sum(n for _, n in s["chunks"]) <= 256
        assert {r.id for r in running} <= set(s["decode"])  # every running row advances one token in every step
    for r in [*running, long]:
        assert r.sink.end[0] == "done" and r.sink.text == _alone(model, tok, r), f"request {r.id} ({r.policy})"


def test_batched_tokens_default_and_a_given_value_wins(tiny):
    """Without --max-batched-tokens a step carries up to 2048 tokens (vLLM's default for its API server on a CPU);
    the startup line says so; a number given is used as is; a bad one is refused naming the flag, one below
    --max-batch too; --prefill-tokens is refused with a message naming its replacement."""
    from kvtier.serve import engine as engine_mod

    model, tok = tiny
    assert engine_mod.default_batched_tokens("cpu") == engine_mod.default_batched_tokens("cuda") == 2048
    eng = ContinuousEngine(model, tok, EngineConfig())
    assert eng.max_batched_tokens == 2048 and "2048 tokens a step" in eng.describe()
    assert ContinuousEngine(model, tok, EngineConfig(max_batched_tokens=300)).max_batched_tokens == 300
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match=r"max_batched_tokens \(--max-batched-tokens\) must be an integer >= 1"):
            EngineConfig(max_batched_tokens=bad)
    with pytest.raises(ValueError, match=r"must be at least max_batch \(--max-batch 8\)"):
        EngineConfig(max_batch=8, max_batched_tokens=4)
    with pytest.raises(ValueError, match=r"--prefill-tokens\) was replaced by max_batched_tokens"):
        EngineConfig(prefill_tokens=512)


def _budget_for(eng, rows: int, tokens: int) -> int:
    return rows * eng._peak_bytes(tokens)


def test_budget_demotes_instead_of_queueing_and_outputs_stay_exact(tiny):
    model, tok = tiny
    probe = _engine(model, tok)
    probe.shutdown(grace_s=0)
    reqs = [_req(_prompt(tok, 20 + i, 30), 60, "full" if i % 2 == 0 else "tiered", {} if i % 2 == 0 else NO_EVICT)
            for i in range(8)]
    budget = _budget_for(probe, 2, 30 + 60)  # about two rows at their peak: eight must share it
    eng = _engine(model, tok, device_kv_budget=budget)
    _run_trace(eng, reqs, gap=0)
    m = eng.metrics
    eng.shutdown(grace_s=1)
    assert max(eng.trace) <= budget and m.device_kv_peak <= budget and m.budget_violations == 0
    assert m.preemptions == 0 and m.demoted_tokens > 0
    assert max(r.sink.end[2]["kvtier"]["demoted_tokens"] for r in reqs) > 0
    for r in reqs:
        assert r.sink.end[0] == "done"
        assert r.sink.text == _alone(model, tok, r), f"request {r.id} ({r.policy})"
    # queue-only at the same budget: never more device KV than the budget either, and no demotion
    q = _engine(model, tok, device_kv_budget=budget, on_pressure="queue")
    reqs2 = [_req(r.prompt_ids, r.max_tokens, r.policy, r.params) for r in reqs]
    _run_trace(q, reqs2, gap=0)
    q.shutdown(grace_s=1)
    assert max(q.trace) <= budget and q.metrics.preemptions == 0
    # no row was limited: a full row moved nothing to host memory (tiered rows move by their own ratios)
    assert all(r.sink.end[2]["kvtier"]["demoted_tokens"] == 0 for r in reqs2 if r.policy == "full")
    assert [r.sink.text for r in reqs2] == [r.sink.text for r in reqs]


def test_host_budget_exhausted_preempts_and_recomputes_without_repeating(tiny):
    model, tok = tiny
    probe = _engine(model, tok)
    probe.shutdown(grace_s=0)
    col = probe.col_bytes
    reqs = [_req(_long_prompt(model, tok, 40, 120, skip=i), 120, "full") for i in range(4)]
    budget = _budget_for(probe, 2, 40 + 120)
    # the host takes one row's demotion, and then the demoted rows' tails outgrow it
    eng = _engine(model, tok, device_kv_budget=budget, host_kv_budget=60 * col)
    _run_trace(eng, reqs, gap=0)
    m = eng.metrics
    eng.shutdown(grace_s=1)
    assert m.preemptions > 0 and m.recomputed_tokens > 0
    assert max(eng.trace) <= budget and m.budget_violations == 0
    assert sum(r.sink.end[2]["kvtier"]["preemptions"] for r in reqs) == m.preemptions
    for r in reqs:
        assert r.sink.end[0] == "done"
        alone = _alone(model, tok, r, sink=True)
        assert r.sink.text == alone.text  # the streamed text equals: no token was sent twice, none lost
        assert r.sink.end[1:2] == alone.end[1:2]
        assert r.sink.end[2]["completion_tokens"] == alone.end[2]["completion_tokens"]


def test_recompute_mode_preempts_the_newest(tiny):
    model, tok = tiny
    probe = _engine(model, tok)
    probe.shutdown(grace_s=0)
    reqs = [_req(_long_prompt(model, tok, 200, 70, skip=i), 70, "full") for i in range(3)]
    eng = _engine(model, tok, device_kv_budget=_budget_for(probe, 2, 260) - 1, on_pressure="recompute")
    _run_trace(eng, reqs, gap=0)
    eng.shutdown(grace_s=1)
    assert eng.metrics.preemptions > 0 and max(eng.trace) <= eng.budget
    for r in reqs:
        assert r.sink.text == _alone(model, tok, r)


def test_cancel_frees_slot_and_bytes_within_a_step_and_all_returns_to_zero(tiny):
    import gc

    model, tok = tiny
    eng = _engine(model, tok)
    victim = _req(_long_prompt(model, tok), 120)
    other = _req(_long_prompt(model, tok, skip=1), 120)
    eng.submit(victim)
    eng.submit(other)
    while len(victim.sink.events) < 3:
        time.sleep(0.002)
    steps = eng.metrics.steps
    eng.cancel(victim)
    assert victim.sink.done.wait(30) and victim.sink.end[1] == "cancelled"
    assert eng.metrics.steps <= steps + 1  # ended at the next step
    assert eng.running <= 1 and other.sink.done.wait(60)
    deadline = time.monotonic() + 10
    while (eng.running or eng.queue_depth) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    gc.collect()
    assert eng.running == 0 and eng.queue_depth == 0 and not eng.rows
    assert len(eng.live_caches) == 0 and eng.metrics.device_kv_bytes_now == 0
    eng.shutdown(grace_s=1)


def test_budget_too_small_for_a_request_is_400_and_others_go_on(tiny):
    """A request that could not run even alone is refused at submit (the app's 400, before a stream starts); one
    that becomes too big while waiting (a resumed request, longer by its generated tokens) is refused by the
    scheduler with the same message; the others go on."""
    model, tok = tiny
    probe = _engine(model, tok)
    probe.shutdown(grace_s=0)
    budget = probe._peak_bytes(20)
    eng = _engine(model, tok, device_kv_budget=budget, on_pressure="queue")
    big, small = _req(_prompt(tok, 80, 300), 8), _req(_prompt(tok, 81, 6), 8)
    with pytest.raises(NeverFits, match="--device-kv-budget .* needs at least"):
        eng.submit(big)
    eng.submit(small)
    assert small.sink.done.wait(60)
    assert not big.sink.events and small.sink.end[0] == "done"
    need = eng._wait_need(big)
    assert eng._never_fits(big, need).startswith(f"--device-kv-budget is {budget} bytes")
    eng.shutdown(grace_s=1)


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--on-pressure"):
        EngineConfig(on_pressure="evict")
    with pytest.raises(ValueError, match="--scheduler"):
        EngineConfig(scheduler="fifo")
    with pytest.raises(ValueError, match="--device-kv-budget"):
        EngineConfig(device_kv_budget=0)
    with pytest.raises(ValueError, match="need --scheduler continuous"):
        EngineConfig(scheduler="static", device_kv_budget=1 << 20)
    from kvtier.config import parse_bytes

    assert parse_bytes("--device-kv-budget", "512MiB") == 512 << 20 and parse_bytes("x", "2GiB") == 2 << 30
    assert parse_bytes("x", "1.5GB") == 1_500_000_000 and parse_bytes("x", "4096") == 4096
    with pytest.raises(ValueError, match="--device-kv-budget must be a size"):
        parse_bytes("--device-kv-budget", "lots")


def test_a_preempted_request_cancelled_while_waiting_ends_once(tiny):
    """A request preempted (it has streamed) and cancelled before it resumes: one "cancelled" end, its slot back."""
    model, tok = tiny
    eng = _engine(model, tok)
    r = _req(_long_prompt(model, tok), 120)
    eng.submit(r)
    while len(r.sink.events) < 3:
        time.sleep(0.002)
    done = threading.Event()

    def preempt_then_cancel():
        row = next(x for x in eng.rows if x.req is r)
        eng._preempt(row)
        eng.cancel(r)
        done.set()

    eng._loop_hook = preempt_then_cancel  # run on the generation thread, between steps
    assert done.wait(30) and r.sink.done.wait(30)
    assert [e[1] for e in r.sink.events if e[0] == "done"] == ["cancelled"]
    deadline = time.monotonic() + 10
    while eng.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.running == 0 and eng.queue_depth == 0
    eng.shutdown(grace_s=1)


def test_metrics_show_the_budget_and_the_pressure(tiny):
    from types import SimpleNamespace

    from kvtier.serve.metrics import render_metrics

    model, tok = tiny
    eng = ContinuousEngine(model, tok, EngineConfig(device_kv_budget=1 << 20, host_kv_budget=1 << 30))
    eng.metrics.demoted_tokens, eng.metrics.preemptions = 7, 2
    text, _ = render_metrics(SimpleNamespace(engine=eng, counts={}))
    for line in ("kvtier_device_kv_budget_bytes 1.048576e+06", "kvtier_demoted_tokens_total 7.0",
                 "kvtier_preemptions_total 2.0", "kvtier_running_rows 0.0", "kvtier_device_kv_peak_bytes 0.0",
                 "kvtier_recomputed_tokens_total 0.0", "kvtier_promoted_tokens_total 0.0",
                 "kvtier_budget_violations_total 0.0", "kvtier_device_kv_bytes 0.0"):
        assert line in text, line
    assert "device-KV budget 1.0 MiB" in eng.describe() and "on pressure: demote" in eng.describe()


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_the_engine_packs_the_linears_on_its_own_thread(tiny, scheduler, monkeypatch):
    """cfg.linear: the generation thread packs the model before start() returns (oneDNN weights reordered on the
    thread that multiplies were measured 1.5x faster there), and serves the same text as the unpacked model."""
    import copy

    import kvtier.step as step
    from kvtier.serve import make_engine
    from kvtier.step.linear import packable

    if not packable(torch.float32):
        pytest.skip("this torch build has no oneDNN")
    model, tok = tiny
    fast = copy.deepcopy(model)
    where = []
    real = step.pack_linears

    def spy(m, mode=None):
        where.append(threading.current_thread().name)
        return real(m, mode)

    monkeypatch.setattr(step, "pack_linears", spy)
    eng = make_engine(fast, tok, EngineConfig(max_batch=4, scheduler=scheduler, linear="packed")).start()
    assert where == ["kvtier-engine"]
    assert step.packed_count(fast) == 7 * model.config.num_hidden_layers + 1
    r = _req(_prompt(tok, 7, 12), 24)
    eng.submit(r)
    assert r.sink.done.wait(60)
    eng.shutdown(grace_s=1)
    assert r.sink.end[0] == "done"
    assert r.sink.text == _alone(model, tok, r)
    with pytest.raises(ValueError, match="linear must be one of"):
        EngineConfig(linear="fast")


def _early_eos_prompt(model, tok, steps=40):
    """A prompt whose greedy continuation hits an end of sequence within ``steps`` tokens."""
    for i in range(400):
        p = _prompt(tok, 3000 + i, 8)
        c = kvtier.make_cache("full", model)
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([p]), **cache_kw(model, c), max_new_tokens=steps, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
        if tok.eos_token_id in out[0, len(p):].tolist():
            return p
    raise AssertionError("no prompt with an early end of sequence")


@pytest.mark.parametrize("scheduler", ["continuous", "static"])
def test_ignore_eos_decodes_max_tokens_through_end_of_sequence(tiny, scheduler):
    """vLLM's ``ignore_eos`` (fixed output lengths for load tests): the row goes on past its end of sequence to
    ``max_tokens``, ends "length", and what it sent before the end of sequence is the text it stops at without it."""
    model, tok = tiny
    p = _early_eos_prompt(model, tok)
    eng = Engine(model, tok, EngineConfig(scheduler="static")) if scheduler == "static" else \
        ContinuousEngine(model, tok, EngineConfig())
    eng.start()
    plain, through = _req(p, 60), _req(p, 60, ignore_eos=True)
    eng.submit(plain)
    assert plain.sink.done.wait(60)
    eng.submit(through)
    assert through.sink.done.wait(60)
    eng.shutdown(grace_s=1)
    assert plain.sink.end[1] == "stop" and plain.sink.end[2]["completion_tokens"] < 60
    assert through.sink.end[1] == "length" and through.sink.end[2]["completion_tokens"] == 60
    assert through.sink.text.startswith(plain.sink.text)


def test_greedy_batch_max_is_the_first_maximum_float_argmax_finds():
    """The engine takes greedy tokens as ``max(dim=-1).indices`` on the model's dtype (no float32 copy of the
    logits): with ties (frequent in bfloat16) that is the first maximum, the token float32 argmax picks alone."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randint(-3, 4, (8, 5000), generator=g).float() / 2).to(dtype)
        assert torch.equal(x.max(dim=-1).indices, x.float().argmax(dim=-1))


def test_kernel_rows_share_one_call_and_attend_as_alone(tiny, monkeypatch):
    """A step's rows whose decode is one fused-kernel call (``full``; tiered and demoted ``full`` rows on the
    kernel's path) are attended by one kernel call across rows; the others (a ``full`` one refusing the kernel, a
    prefill) by their own layers. Each row's output and scores are bit for bit what it gets stepped alone (its own
    layers' update and attend, the same q/k/v), at every layer, packed or batched, mixed or all ``full``, over 240
    steps (buffers grow, tiered rows reassign); the call is really made, over exactly those rows. The later layers
    of a plain ``full`` row take layer 0's column and mask (``RowsLayer.lane``) except in a step where its buffers
    grow: both happen here."""
    model, tok = tiny
    kinds = [("full", {}), ("tiered", NO_EVICT), ("full", {"kernel": "eager"}), ("full", {}), ("full", {}),
             ("full", {})]

    def caches(which):
        out = []
        for i in which:
            policy, params = kinds[i]
            c = kvtier.make_cache(policy, model, **params)
            if i < 5:  # row 5 joins: its prompt is prefilled in the packed step
                with torch.no_grad():
                    model(input_ids=torch.tensor([_prompt(tok, 60 + i, 4 + 9 * i)]), **cache_kw(model, c),
                          use_cache=True)
            if i == 3:
                c.limit_device(4)  # demoted: full -> tiered without eviction (its own attend, with scores)
            out.append(c)
        return out

    cfg = model.config
    Hq, H, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    calls = []
    real = fused_cpu.attend_rows
    monkeypatch.setattr(fused_cpu, "attend_rows", lambda qg, *a: calls.append(qg.shape[0]) or real(qg, *a))
    g = torch.Generator().manual_seed(3)
    cases = [(range(6), [1, 1, 1, 1, 1, 6], 4), (range(5), None, 4), ([0, 4], [1, 1], 2), ([0, 4], None, 2),
             ([1, 2], None, 1), ([2], None, None)]
    lanes = []  # per step: did a plain full row take layer 0's column and mask / its own path at the later layers
    for which, lengths, together in cases:
        rows, alone = caches(which), caches(which)
        # the first step as given, then 240 decode steps: every buffer grows past its first 256 columns
        for step in range(241 if which != range(6) else 1):
            n = sum(lengths) if lengths else len(rows)
            shape = (1, Hq, n, D) if lengths else (n, Hq, 1, D)
            rc = RowsCache(rows, lengths=lengths)
            for layer in range(len(rc.layers)):
                q = torch.randn(*shape, generator=g)
                k = torch.randn(shape[0], H, shape[2], D, generator=g)
                v = torch.randn(shape[0], H, shape[2], D, generator=g)
                calls.clear()
                rc.layers[layer].update(k, v)
                out = rc.layers[layer].attend(q, k, v, None, D ** -0.5)[0]
                assert calls == ([together] if together else []), (list(which), lengths, layer, calls)
                spans = rc.spans or [(i, 1) for i in range(len(rows))]
                for i, (s, m) in enumerate(spans):
                    one = alone[i].layers[layer]  # the row's own layer: its update and attend, no RowsCache
                    cut = (lambda t: t[:, :, s : s + m]) if lengths else (lambda t: t[i : i + 1])
                    one.update(cut(k), cut(v))
                    ref = one.attend(cut(q), cut(k), cut(v), None, D ** -0.5)[0]
                    got = out[:, s : s + m] if lengths else out[i : i + 1]
                    what = (f"row {i} {kinds[list(which)[i]]}, {'packed' if lengths else 'batched'}, step {step}, "
                            f"layer {layer}")
                    assert torch.equal(got, ref), what
                    a, b = rows[i].state, alone[i].state
                    assert torch.equal(a.scores, b.scores) and a.layout.tiers[1].count == b.layout.tiers[1].count, what
                    if a.scores_host is not None:
                        assert torch.equal(a.scores_host, b.scores_host), what
            plain = [i for i, r in enumerate(which) if r in (0, 4) and (lengths is None or lengths[i] == 1)]
            lanes += [rc.layers[0].lane["cols"][i] is not None for i in plain]
            if lengths:
                lengths = [1] * len(rows)
    # the later layers took layer 0's column and mask on most steps, and their own path where the buffers grew
    assert sum(lanes) > len(lanes) // 2 and not all(lanes), lanes


def test_demoted_and_promoted_counters_equal_the_moved_bytes_over_a_pressure_run(tiny):
    """kvtier_demoted_tokens / promoted count every token-column moved between the device and T1 (at admission,
    limit changes and reassignments): over a demoting run they equal the caches' moved bytes divided by the bytes a
    token takes (all layers, K and V)."""
    model, tok = tiny
    probe = _engine(model, tok)
    probe.shutdown(grace_s=0)
    reqs = [_req(_prompt(tok, 20 + i, 30), 60, "full" if i % 2 == 0 else "tiered", {} if i % 2 == 0 else NO_EVICT)
            for i in range(6)]
    eng = _engine(model, tok, device_kv_budget=_budget_for(probe, 2, 30 + 60))
    _run_trace(eng, reqs, gap=0)
    m = eng.metrics
    eng.shutdown(grace_s=1)
    assert m.demoted_tokens > 0 and m.budget_violations == 0
    moved = sum(r.sink.end[2]["kvtier"]["moved_bytes"] for r in reqs)
    assert moved == m.moved_bytes
    assert (m.demoted_tokens + m.promoted_tokens) * eng.col_bytes == m.moved_bytes
    assert sum(r.sink.end[2]["kvtier"]["demoted_tokens"] for r in reqs) == m.demoted_tokens


@pytest.mark.heavy
def test_queue_mode_reserves_what_each_row_s_own_policy_needs(tiny):
    """Queue mode admits a request when its peak fits: a ``full`` row's peak is its one buffer (full_columns), so a
    budget of exactly four such peaks runs four ``full`` rows at once (reserved at the tiered size, it ran three),
    and the device never holds more than the budget."""
    from kvtier.cache.state import full_columns

    model, tok = tiny
    probe = _engine(model, tok)
    probe.shutdown(grace_s=0)
    reqs = [_req(_long_prompt(model, tok, 40, 200, skip=i), 200, "full") for i in range(4)]
    peak = full_columns(40 + 200) * probe.col_bytes
    assert probe._peak_bytes(240, "full") == peak < probe._peak_bytes(240)  # the old reservation was larger
    eng = _engine(model, tok, device_kv_budget=4 * peak, on_pressure="queue")
    _run_trace(eng, reqs, gap=0)
    eng.shutdown(grace_s=1)
    assert max(len(s["decode"]) for s in eng.step_log) == 4
    assert max(eng.trace) <= 4 * peak and eng.metrics.preemptions == 0
    for r in reqs:
        assert r.sink.text == _alone(model, tok, r)


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_come_from_the_sampling_step_and_asking_changes_no_token(tiny, mode):
    """Rows in one batch, sampled and greedy, some asking for logprobs: each asking row's per-token values equal the
    plain reference (log_softmax of the raw or processed logits of a whole-sequence forward) within 1e-4 (the
    engine's step and the forward round apart), its k alternatives are there, and a row asking draws the same
    tokens as the same seeded row not asking."""
    from kvtier.sampling import logprobs_reference

    model, tok = tiny
    eng = ContinuousEngine(model, tok, EngineConfig(max_batch=8, logprobs_mode=mode)).start()
    prompt = _prompt(tok, 7, 12)
    sampled = dict(temperature=0.8, top_p=0.9, top_k=30, seed=3, ignore_eos=True)
    asks = _req(prompt, 10, logprobs=4, **sampled)
    silent = _req(prompt, 10, **sampled)
    greedy = _req(_prompt(tok, 8, 9), 10, logprobs=0, temperature=0.0, repetition_penalty=1.2, ignore_eos=True)
    plain = _req(_prompt(tok, 9, 5), 10, temperature=0.0, ignore_eos=True)
    for r in (asks, silent, greedy, plain):
        eng.submit(r)
    for r in (asks, silent, greedy, plain):
        assert r.sink.done.wait(60)
    eng.shutdown(grace_s=1)
    assert all(e[3] is None for r in (silent, plain) for e in r.sink.events if e[0] == "delta")
    assert asks.sink.text == silent.sink.text
    for r, k in ((asks, 4), (greedy, 0)):
        entries = [e[3] for e in r.sink.events if e[0] == "delta" and e[3] is not None]  # (not the end's flush)
        assert len(entries) == 10 and all(len(e.top) == k for e in entries)
        toks = [e.token for e in entries]
        assert tok.decode(toks, skip_special_tokens=True) == r.sink.text
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids + toks])).logits[0].float()
        n = len(r.prompt_ids)
        for j, e in enumerate(entries):
            ref = logprobs_reference(logits[n - 1 + j], r.sampling(), toks[j], k, mode, (r.prompt_ids, toks[:j]))
            assert abs(e.logprob - ref.logprob) < 1e-4, (j, e.logprob, ref.logprob)
            assert [round(v, 3) for _, v in e.top] == [round(v, 3) for _, v in ref.top]
