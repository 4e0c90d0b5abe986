"""`kvtier serve`: the engine against `model.generate`, the text assembly, and the real server over HTTP with the
official `openai` client (random:tiny-qwen2 on 127.0.0.1, a free port)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import kvtier  # noqa: E402
from servers import free_port, start_server, stop_server  # noqa: E402 (tests/serve/servers.py)
from kvtier.compat import cache_kw  # noqa: E402
from kvtier.models import byte_tokenizer  # noqa: E402
from kvtier.serve.continuous import ContinuousEngine  # noqa: E402
from kvtier.serve.engine import Engine, EngineConfig, GenRequest, QueueFull  # noqa: E402
from kvtier.serve.loadgen import rss_mib  # noqa: E402
from kvtier.serve.text import Assembler, Detokenizer  # noqa: E402

TIERED = {"hbm_ratio": 0.3, "evict_ratio": 0.1, "recent_window": 4, "retier_interval": 4}
SERVER_FLAGS = ["--policy", "tiered", "--hbm-ratio", "0.3", "--evict-ratio", "0.1", "--param", "recent_window=4",
                "--param", "retier_interval=4"]


# ---- text assembly ------------------------------------------------------------------------------------
def test_detokenizer_streams_exactly_the_decoded_text():
    """Byte-level tokens that split multi-byte characters: the streamed pieces concatenate to ``decode``."""
    tok = byte_tokenizer()
    text = "naïve café — 思考 ok"
    ids = tok(text).input_ids + [300, 301]  # ids past the tokenizer's table decode to nothing
    d = Detokenizer(tok)
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) + d.flush() == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_assembler_think_split_and_stop_strings(cut):
    """The same text fed in pieces of any size: reasoning before </think>, content after, nothing from a stop
    string on, and the pieces concatenate to the whole."""
    text = "<think>I weigh 2+2.</think>The answer is 4. STOP and more"
    parts = [text[i:i + cut] for i in range(0, len(text), cut)]
    a = Assembler(stop=["STOP"], separate=True)
    got = [a.feed(p) for p in parts] + [a.feed("", final=True)]
    assert "".join(c for c, _ in got) == "The answer is 4. " and "".join(r for _, r in got) == "I weigh 2+2."
    assert a.stopped
    b = Assembler(separate=False)
    got = [b.feed(p) for p in parts] + [b.feed("", final=True)]
    assert "".join(c for c, _ in got) == text and not any(r for _, r in got)
    c = Assembler(separate=True, in_think=True)  # the template opened <think>
    got = [c.feed(x) for x in ("thin", "king</th", "ink>do", "ne")] + [c.feed("", final=True)]
    assert ("".join(x for x, _ in got), "".join(r for _, r in got)) == ("done", "thinking")
    d = Assembler(separate=True)  # no tags at all: everything is content
    got = [d.feed(x) for x in ("<th", "e end")] + [d.feed("", final=True)]
    assert "".join(x for x, _ in got) == "<the end"


# ---- engine vs generate -------------------------------------------------------------------------------
def _reference(model, tok, prompts: list[list[int]], max_new: int, policy: str, params: dict) -> list[list[int]]:
    """Greedy `generate` on the left-padded batch, each row cut at its first end-of-sequence token."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    cache = kvtier.make_cache(policy, model, **params)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=max_new,
                             do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
    rows = []
    for r in out[:, n:].tolist():
        rows.append(r[: r.index(tok.eos_token_id)] if tok.eos_token_id in r else r)
    return rows


class _Collect:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev[0] in ("done", "error"):
            self.done.set()

    @property
    def text(self):
        return "".join(e[1] for e in self.events if e[0] == "delta")

    @property
    def end(self):
        return self.events[-1]


def test_engine_batch_rows_equal_generate_and_finish_independently(tiny):
    """Three requests started together as one batch: each row's text is `generate`'s on the same padded batch,
    cut at its own max_tokens; a row that ends early (its limit, or its client gone) does not change the others."""
    model, tok = tiny
    prompts = [tok(s).input_ids for s in ("a short one", "a rather longer prompt here", "mid size q")]
    ref = _reference(model, tok, prompts, 40, "tiered", TIERED)
    eng = Engine(model, tok, EngineConfig(max_batch=4, batch_wait_s=0.2)).start()
    sinks = [_Collect() for _ in prompts]
    limits = [40, 12, 40]
    reqs = [GenRequest(prompt_ids=p, max_tokens=m, sink=s, policy="tiered", params=TIERED)
            for p, m, s in zip(prompts, limits, sinks)]
    for r in reqs:
        eng.submit(r)
    for s in sinks:
        assert s.done.wait(60)
    for s, ref_ids, lim in zip(sinks, ref, limits):
        want = ref_ids[:lim]
        assert s.text == tok.decode(want, skip_special_tokens=True)
        reason, usage = s.end[1], s.end[2]
        assert reason == ("stop" if len(want) < lim else "length")
        assert usage["kvtier"]["batch_size"] == 3 and usage["prompt_tokens"] in map(len, prompts)
    assert eng.metrics.batches == 1
    # cancel one row mid-way: it ends "cancelled", the others are unchanged
    sinks = [_Collect() for _ in prompts]
    reqs = [GenRequest(prompt_ids=p, max_tokens=40, sink=s, policy="tiered", params=TIERED) for p, s in zip(prompts, sinks)]

    def cancel_after_first(ev, s=sinks[0], r=reqs):
        s(ev)
        if ev[0] == "delta":
            r[0].cancel()

    reqs[0].sink = cancel_after_first
    for r in reqs:
        eng.submit(r)
    for s in sinks:
        assert s.done.wait(60)
    assert sinks[0].end[1] == "cancelled"
    for s, ref_ids in zip(sinks[1:], ref[1:]):
        assert s.text == tok.decode(ref_ids, skip_special_tokens=True)
    # a template that opened <think>: with no </think> in sight, everything is reasoning_content
    s = _Collect()
    eng.submit(GenRequest(prompt_ids=prompts[1], max_tokens=40, sink=s, policy="tiered", params=TIERED, in_think=True))
    assert s.done.wait(60)
    assert "".join(e[2] for e in s.events if e[0] == "delta") == tok.decode(ref[1], skip_special_tokens=True)
    assert not "".join(e[1] for e in s.events if e[0] == "delta")
    eng.shutdown(grace_s=1)
    import gc

    gc.collect()
    assert len(eng.live_caches) == 0 and eng.running == 0


def test_engine_groups_by_settings_bounds_the_queue_and_times_out(tiny):
    model, tok = tiny
    eng = Engine(model, tok, EngineConfig(max_batch=8, max_queue=3, batch_wait_s=0))  # not started: nothing drains
    mk = lambda **kw: GenRequest(prompt_ids=[65, 66], max_tokens=4, sink=_Collect(), **kw)  # noqa: E731
    a, b, c = mk(policy="full"), mk(policy="tiered", params=TIERED), mk(policy="full")
    for r in (a, b, c):
        eng.submit(r)
    with pytest.raises(QueueFull, match="max-queue 3"):
        eng.submit(mk())
    d = mk(policy="full")
    eng.cancel(c)  # a client that hangs up while waiting frees its slot at once
    eng.submit(d)
    assert [r.id for r in eng._take()] == [a.id, d.id]  # same settings share a batch, in arrival order
    assert [r.id for r in eng.waiting] == [b.id]
    late = mk(deadline=time.monotonic() - 1)
    eng.waiting.appendleft(late)
    eng._running = 0
    assert [r.id for r in eng._take()] == [b.id]
    assert late.sink.end[:2] == ("error", 504)
    # a deadline reached mid-generation ends the row with "timeout"
    prompt = next(p for p in ([65 + k] * 8 for k in range(30))
                  if len(_reference(model, tok, [p], 200, "full", {})[0]) == 200)  # no end of sequence for 200 steps
    eng2 = Engine(model, tok, EngineConfig(batch_wait_s=0)).start()
    s = _Collect()

    def slow(ev):  # a sink that takes 5 ms: the 200 steps take > 1 s
        time.sleep(0.005)
        s(ev)

    eng2.submit(GenRequest(prompt_ids=prompt, max_tokens=200, sink=slow, deadline=time.monotonic() + 0.3))
    assert s.done.wait(60) and s.end[1] == "timeout" and 0 < s.end[2]["completion_tokens"] < 200
    eng2.shutdown(grace_s=0)


def test_the_servers_startup_objects_leave_the_collectors_walk_and_later_cycles_are_still_collected():
    """kvtier.serve.freeze_startup_objects (run by serve() once the engine is up): what is alive then is frozen; a
    reference cycle made afterwards (a released cache's, say) is still collected by the idle engine's gc.collect."""
    import gc
    import weakref

    from kvtier.serve import freeze_startup_objects

    class Node:
        pass

    before = Node()
    before.me = before
    try:
        n = freeze_startup_objects()
        assert n == gc.get_freeze_count() > 0
        later = Node()
        later.me = later  # a cycle: only the cyclic collector frees it
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()  # this test process's objects go back to the collector


# ---- the real server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    proc, url = start_server(*SERVER_FLAGS, "--max-batch", "8", "--max-queue", "64", "--max-new-tokens", "64")
    yield proc, url
    code, out = stop_server(proc)
    assert code == 0, out[-3000:]


def _client(url):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_chat_and_completions_streamed_equal_whole_equal_generate(server, tiny):
    proc, url = server
    model, tok = tiny
    client = _client(url)
    assert [m.id for m in client.models.list().data] == ["random:tiny-qwen2"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+2? Think."}]
    whole = client.chat.completions.create(model="random:tiny-qwen2", messages=msgs, max_tokens=48, temperature=0)
    chunks = list(client.chat.completions.create(model="random:tiny-qwen2", messages=msgs, max_tokens=48, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ref = _reference(model, tok, [tok(prompt).input_ids], 48, "tiered", TIERED)[0]
    assert whole.choices[0].message.content == streamed == tok.decode(ref, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == len(tok(prompt).input_ids)
    kv = whole.model_extra["usage"]["kvtier"] if "usage" in (whole.model_extra or {}) else whole.usage.model_extra["kvtier"]
    assert kv["policy"] == "tiered" and kv["params"]["hbm_ratio"] == 0.3 and set(kv["tier_tokens"]) >= {"T0", "T1", "T3"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    # per-request cache settings through extra_body, and the completions endpoint on a raw prompt
    ev = {"policy": "evict", "evict_ratio": 0.5, "recent_window": 4, "retier_interval": 4}
    raw = "Once upon a time"
    whole = client.completions.create(model="random:tiny-qwen2", prompt=raw, max_tokens=40, temperature=0,
                                      extra_body={"kvtier": ev})
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="random:tiny-qwen2", prompt=raw, max_tokens=40, temperature=0, stream=True, extra_body={"kvtier": ev}))
    ref = _reference(model, tok, [tok(raw).input_ids], 40, "evict", {k: v for k, v in ev.items() if k != "policy"})[0]
    assert whole.choices[0].text == streamed == tok.decode(ref, skip_special_tokens=True)
    assert whole.usage.model_extra["kvtier"]["policy"] == "evict"
    # sampling with a seed: the same text again, whether alone or batched with other requests
    import concurrent.futures as cf

    ask = lambda seed: client.chat.completions.create(  # noqa: E731
        model="random:tiny-qwen2", messages=msgs, max_tokens=24, temperature=0.9, top_p=0.95, seed=seed
    ).choices[0].message.content
    alone = ask(7)
    with cf.ThreadPoolExecutor(4) as ex:
        together = list(ex.map(ask, [7, 8, 7, 9]))
    assert together[0] == together[2] == alone and len({alone, together[1], together[3]}) == 3


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "kvtier": {"hbm_ratio": 0.3, "bogus": 1}}, 400, "bogus"),
    ({"messages": [{"role": "user", "content": "x"}], "kvtier": {"hbm_ratio": 1.5}}, 400, "hbm_ratio"),
    ({"messages": [{"role": "user", "content": "x"}], "kvtier": {"policy": "nope"}}, 400, "kvtier.policy"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 65}, 400, "max_tokens must be <= 64"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "4096 positions"),
    ({"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "model"),
    ([1, 2], 400, "JSON object"),
    # output-changing fields kvtier does not honour: one 400 naming each (never silently dropped)
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}, 400, "logit_bias is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    # sampling values out of range: one 400 naming the field
    ({"messages": [{"role": "user", "content": "x"}], "top_k": -3}, 400, "top_k must be an integer"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, 400, "presence_penalty must be"),
    ({"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, 400, "min_p must be"),
    ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, 400, "repetition_penalty must be"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "min_tokens": 8}, 400, "min_tokens must be <="),
])
def test_bad_input_is_one_clear_error_and_the_server_keeps_serving(server, body, status, needle):
    import httpx

    proc, url = server
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + "/v1/chat/completions", content=data, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err.get("param"), err
    ok = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200 and proc.poll() is None


def test_fields_that_change_nothing_are_accepted_and_inert_values_too(server):
    """user, metadata, store, the inert values of unhonoured fields (a text response_format, an empty logit_bias)
    and the sampling fields' off values (top_k -1, penalties 0 and 1) are accepted as OpenAI and vLLM clients send
    them."""
    import httpx

    proc, url = server
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "user": "u1", "metadata": {"a": "b"},
            "store": False, "top_k": -1, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "response_format": {"type": "text"}, "logit_bias": {}}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


def test_min_tokens_holds_the_end_of_sequence_back(server, tiny):
    """min_tokens (vLLM's extension): no end of sequence before that many tokens; a prompt whose greedy answer ends
    after a few tokens runs to min_tokens instead (and, past it, may end)."""
    import httpx

    proc, url = server
    model, tok = tiny
    short = None
    for i in range(200):  # a prompt whose greedy continuation ends early
        raw = f"q{i} " * 3
        r = httpx.post(url + "/v1/completions", json={"prompt": raw, "max_tokens": 40, "temperature": 0}, timeout=30)
        u = r.json()["usage"]
        if r.json()["choices"][0]["finish_reason"] == "stop" and u["completion_tokens"] < 10:
            short = raw
            break
    assert short is not None
    r = httpx.post(url + "/v1/completions", json={"prompt": short, "max_tokens": 40, "temperature": 0,
                                                  "min_tokens": 20}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 20


def test_a_streamed_first_chunk_carries_the_first_token(server):
    """The first SSE chunk goes out with the first token (role and content together), after the prefill, as vLLM's
    does: a client that times its first chunk measures the time to the first token."""
    import httpx

    proc, url = server
    body = {"messages": [{"role": "user", "content": "Tell me a story " * 20}], "max_tokens": 8, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [x for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    first = json.loads(lines[0][6:])["choices"][0]["delta"]
    assert first.get("role") == "assistant" and ("content" in first or "reasoning_content" in first)
    assert sum(1 for x in lines if '"role"' in x) == 1
    # one chunk per token (its text possibly empty), as vLLM streams: 8 tokens, 8 chunks (and one more if text held
    # back, a piece of a character, is flushed at the end), then the finish chunk
    tokens = [x for x in lines if json.loads(x[6:])["choices"] and json.loads(x[6:])["choices"][0]["finish_reason"] is None]
    assert len(tokens) in (8, 9)


def _metrics(url) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_load_100_concurrent_streams_end_in_200_or_429_and_nothing_is_left(server):
    """100 streaming requests at once against --max-batch 8 --max-queue 64: each ends complete ([DONE] after a
    finish_reason) or 429 with Retry-After; ten clients hang up after their first token; afterwards nothing runs,
    nothing waits, no cache is alive and the RSS is back near its idle level."""
    import httpx

    proc, url = server
    body = {"messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 32, "temperature": 0, "stream": True}
    httpx.post(url + "/v1/chat/completions", json=dict(body, stream=False), timeout=60)  # warm
    idle = rss_mib(proc.pid)

    async def one(client, i):
        hang_up = i % 10 == 0
        async with client.stream("POST", url + "/v1/chat/completions",
                                 json=dict(body, max_tokens=64) if hang_up else body) as r:
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), None
            lines = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if hang_up and len(lines) == 2:
                        return "gone", None, None  # hang up mid-stream
            return 200, None, lines

    async def main():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120), limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(100))), 180)

    results = asyncio.run(main())
    codes = [r[0] for r in results]
    assert set(codes) <= {200, 429, "gone"} and codes.count(200) >= 40, codes
    for code, retry, lines in results:
        if code == 429:
            assert retry is not None and int(retry) >= 1
        if code == 200:
            assert lines[-1] == "[DONE]"
            last = json.loads(lines[-2])
            assert last["choices"][0]["finish_reason"] in ("stop", "length")
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        m = _metrics(url)
        if m["kvtier_running_requests"] == 0 and m["kvtier_queue_depth"] == 0 and m["kvtier_live_caches"] == 0:
            break
        time.sleep(0.2)
    assert m["kvtier_running_requests"] == 0 and m["kvtier_queue_depth"] == 0 and m["kvtier_live_caches"] == 0, m
    assert m['kvtier_kv_bytes{location="device",tier="T0"}'] == 0
    assert m['kvtier_requests_total{endpoint="/v1/chat/completions",status="429"}'] == codes.count(429)
    assert rss_mib(proc.pid) < idle + 150, (idle, rss_mib(proc.pid))
    if codes.count("gone"):  # at least one hang-up reached its row before the row's 64 tokens were done
        assert m['kvtier_finished_requests_total{reason="cancelled"}'] >= 1, m
    ok = httpx.post(url + "/v1/chat/completions", json=dict(body, stream=False), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.server
def test_sigterm_finishes_in_flight_streams_and_exits_zero():
    import httpx

    proc, url = start_server("--policy", "full", "--max-new-tokens", "400", "--grace", "20")
    lines: list[str] = []

    def read():
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "temperature": 0,
                                "stream": True}) as r:
            lines.extend(line for line in r.iter_lines() if line.startswith("data: "))

    t = threading.Thread(target=read)
    t.start()
    t_end = time.monotonic() + 30
    while len(lines) < 3 and time.monotonic() < t_end:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert lines and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")
    code, out = stop_server(proc)
    assert code == 0 and "kvtier serve: stopped" in out


@pytest.mark.server
def test_bench_serve_writes_one_row_per_level_and_policy(tmp_path):
    """The load generator end to end on a tiny model (the committed numbers come from benchmarks/results/)."""
    from typer.testing import CliRunner

    from kvtier.cli import app

    out = tmp_path / "bs.json"
    res = CliRunner().invoke(app, ["bench-serve", "--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu",
                                   "--concurrency", "1,3", "--max-tokens", "6", "--requests-per-client", "2",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["policy"]) for r in rows] == [(1, "full"), (1, "tiered"), (3, "full"), (3, "tiered")]
    for r in rows:
        assert r["requests"] + r["rejected_429"] == 2 * r["concurrency"] and 0 < r["tokens"] <= 6 * r["requests"]
        assert r["tok_s"] > 0 and r["ttft_p50_s"] <= r["ttft_p99_s"]
    assert out.with_suffix(".txt").read_text().count("tiered") >= 2
    res = CliRunner().invoke(app, ["bench-serve", "--concurrency", "0", "--json", str(out)])
    assert res.exit_code == 2 and "--concurrency" in res.output


@pytest.mark.server
def test_bench_serve_runs_a_memory_pressure_point(tmp_path):
    """--device-kv-budget and --on-pressure reach the started server; the JSON keeps them and the server's own
    counters (the budget, the device K/V peak, demotions), and the peak never passes the budget."""
    from typer.testing import CliRunner

    from kvtier.cli import app

    out = tmp_path / "bp.json"
    res = CliRunner().invoke(app, ["bench-serve", "--model", "random:tiny-qwen2", "--dtype", "fp32", "--device", "cpu",
                                   "--concurrency", "4", "--max-tokens", "24", "--requests-per-client", "1",
                                   "--policy", "full", "--device-kv-budget", "40KiB", "--on-pressure", "demote",
                                   "--json", str(out)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert got["device_kv_budget"] == "40KiB" and got["on_pressure"] == "demote"
    m = got["server_metrics"]
    assert m["kvtier_device_kv_budget_bytes"] == 40 * 1024
    assert 0 < m["kvtier_device_kv_peak_bytes"] <= m["kvtier_device_kv_budget_bytes"]
    assert m["kvtier_budget_violations_total"] == 0 and m["kvtier_demoted_tokens_total"] > 0  # the budget bit
    res = CliRunner().invoke(app, ["bench-serve", "--model", "random:tiny-qwen2", "--device", "cpu",
                                   "--concurrency", "1", "--on-pressure", "maybe", "--json", str(out)])
    assert res.exit_code != 0 and "--on-pressure" in res.output


@pytest.mark.server
def test_a_request_that_never_fits_the_budget_is_one_400_streamed_or_not():
    """Under a device-KV budget too small for any prompt, a streamed request gets HTTP 400 (not a 200 whose stream
    then carries an error), naming --device-kv-budget; bench-serve counts such requests as failed, not served."""
    import httpx

    from kvtier.serve.loadgen import bench_serve

    proc, url = start_server("--device-kv-budget", "40KiB", "--on-pressure", "recompute", "--max-new-tokens", "16")
    try:
        body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 16}
        for stream in (False, True):
            r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "--device-kv-budget is 40960 bytes" in err["message"] and err["param"] == "messages"
        row = bench_serve(url, [2], [{"policy": "full"}], 1, 16)[0]
        assert row["failed"] == 2 and row["requests"] == 0 and "HTTP 400" in row["first_error"]
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        assert stop_server(proc)[0] == 0


@pytest.mark.parametrize("args, needle", [
    (["--max-batch", "0"], "--max-batch"), (["--max-queue", "-1"], "--max-queue"), (["--port", "70000"], "--port"),
    (["--hbm-ratio", "1.5"], "hbm_ratio"), (["--policy", "nope"], "policy"), (["--reasoning", "maybe"], "--reasoning"),
    (["--request-timeout", "0"], "--request-timeout"), (["--batch-wait", "-1"], "--batch-wait"),
    (["--grace", "-1"], "--grace"), (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "5000"], "positions"), (["--param", "bogus=1"], "bogus"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens"), (["--model", "random:nope"], "preset"),
])
def test_bad_serve_flags_are_one_line_before_anything_listens(args, needle):
    from typer.testing import CliRunner

    from kvtier.cli import app

    res = CliRunner().invoke(app, ["serve", "--model", "random:tiny-qwen2", "--port", str(free_port()), *args])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output


def test_serve_refuses_a_port_in_use():
    from typer.testing import CliRunner

    from kvtier.cli import app

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        res = CliRunner().invoke(app, ["serve", "--model", "random:tiny-qwen2", "--port", str(port)])
    assert res.exit_code == 2 and f"--port {port}: cannot listen there" in res.output


def test_serve_quiets_the_tokenizers_thread_pool_unless_told(monkeypatch):
    """The server sets TOKENIZERS_PARALLELISM=false (the pool's threads spun on the decode step's cores), and leaves
    a value the user set alone."""
    import os

    from kvtier.serve import quiet_tokenizer_threads

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    assert quiet_tokenizer_threads() and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert not quiet_tokenizer_threads() and os.environ["TOKENIZERS_PARALLELISM"] == "true"


def test_requests_without_sampling_fields_get_the_models_generation_config(tiny):
    """A model whose generation_config recommends sampling settings is served with them when a request names none
    (as vLLM's --generation-config auto); the request's own fields win; usage.kvtier.sampling says what applied.
    transformers' library defaults (top_k 50, ...) are not a model's recommendation."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from transformers import GenerationConfig

    from kvtier.sampling import model_defaults
    from kvtier.serve.app import ServeSettings, create_app

    model, tok = tiny
    assert model_defaults(GenerationConfig()) == {} and model_defaults(None) == {}
    assert model_defaults(GenerationConfig(do_sample=False, temperature=0.3)) == {}
    gc = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=7, repetition_penalty=1.1)
    defaults = model_defaults(gc)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "repetition_penalty": 1.1}
    settings = ServeSettings(served_name="tiny", policy="full", max_new_tokens=8, sampling_defaults=defaults)
    with pytest.raises(ValueError, match="top_k must be"):
        ServeSettings(served_name="tiny", policy="full", sampling_defaults={"top_k": -5})
    with pytest.raises(ValueError, match="not sampling fields"):
        ServeSettings(served_name="tiny", policy="full", sampling_defaults={"beam": 2})
    app = create_app(ContinuousEngine(model, tok, EngineConfig(max_batch=2)), settings)
    with TestClient(app) as client:
        body = {"model": "tiny", "prompt": "2+2=", "max_tokens": 4, "seed": 1}
        got = client.post("/v1/completions", json=body).json()["usage"]["kvtier"]["sampling"]
        assert got == {"temperature": 0.6, "top_p": 0.9, "top_k": 7, "min_p": 0.0, "presence_penalty": 0.0,
                       "frequency_penalty": 0.0, "repetition_penalty": 1.1}
        mine = client.post("/v1/completions", json={**body, "temperature": 0, "top_k": None, "min_p": 0.2})
        got = mine.json()["usage"]["kvtier"]["sampling"]
        assert got["temperature"] == 0 and got["top_k"] == 7 and got["min_p"] == 0.2 and got["top_p"] == 0.9
    plain = create_app(ContinuousEngine(model, tok, EngineConfig(max_batch=2)),
                       ServeSettings(served_name="tiny", policy="full", max_new_tokens=8))
    with TestClient(plain) as client:
        got = client.post("/v1/completions", json={"prompt": "2+2=", "max_tokens": 2}).json()["usage"]["kvtier"]
        assert got["sampling"]["temperature"] == 1.0 and got["sampling"]["top_k"] == 0  # OpenAI's defaults


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_in_openais_format_streamed_and_whole(tiny, mode):
    """Chat (``logprobs: true``, ``top_logprobs``) and completions (``logprobs: k``), whole and streamed: one entry
    per token whose bytes make the text, alternatives likeliest first with the greedy token at their head, the
    streamed entries the whole response's; a request that asks for none gets null; bad combinations are one 400
    naming the field, and the static scheduler refuses logprobs."""
    from fastapi.testclient import TestClient

    from kvtier.serve.app import ServeSettings, create_app

    model, tok = tiny
    app = create_app(ContinuousEngine(model, tok, EngineConfig(max_batch=4, logprobs_mode=mode)),
                     ServeSettings(served_name="tiny", policy="full", max_new_tokens=16))
    msgs = [{"role": "user", "content": "What is 2+2?"}]

    def sse(r):
        return [json.loads(line[6:]) for line in r.text.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"]

    with TestClient(app) as client:
        chat = {"messages": msgs, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3}
        whole = client.post("/v1/chat/completions", json=chat).json()
        ch = whole["choices"][0]
        content = ch["logprobs"]["content"]
        n = whole["usage"]["completion_tokens"]
        assert len(content) == (n - 1 if ch["finish_reason"] == "stop" else n) > 0  # an end of sequence has none
        assert bytes(b for e in content for b in e["bytes"]).decode() == ch["message"]["content"]
        for e in content:
            tops = e["top_logprobs"]
            assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
            assert tops[0]["token"] == e["token"] and tops[0]["logprob"] == e["logprob"] <= 0  # greedy: the likeliest
        streamed = sse(client.post("/v1/chat/completions", json={**chat, "stream": True}))
        assert [e for c in streamed if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]] == content
        plain = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0}).json()
        assert plain["choices"][0]["logprobs"] is None
        sampled = client.post("/v1/chat/completions", json={**chat, "temperature": 0.7, "top_p": 0.8, "seed": 5,
                                                             "top_logprobs": 0}).json()["choices"][0]["logprobs"]
        assert sampled["content"] and all(e["top_logprobs"] == [] for e in sampled["content"])

        comp = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "logprobs": 2}
        whole = client.post("/v1/completions", json=comp).json()["choices"][0]
        lp = whole["logprobs"]
        # (a character split over tokens shows as replacement characters in each token's text)
        assert "".join(lp["tokens"]).replace("\ufffd", "") == whole["text"].replace("\ufffd", "")
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) > 0
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert top[t] == v and len(top) <= 3 and max(top.values()) == v
        streamed = sse(client.post("/v1/completions", json={**comp, "stream": True}))
        got = [c["choices"][0]["logprobs"] for c in streamed if c["choices"] and c["choices"][0]["logprobs"]]
        assert [t for g in got for t in g["tokens"]] == lp["tokens"]
        assert [o for g in got for o in g["text_offset"]] == lp["text_offset"]
        assert [v for g in got for v in g["token_logprobs"]] == lp["token_logprobs"]

        for path, body, param in [
            ("/v1/chat/completions", {"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
            ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
            ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
            ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
            ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs"),
        ]:
            r = client.post(path, json={**body, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    static = create_app(Engine(model, tok, EngineConfig(scheduler="static")),
                        ServeSettings(served_name="tiny", policy="full", max_new_tokens=8))
    with TestClient(static) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs" and "static" in r.text


@pytest.mark.server
def test_sigterm_stops_a_server_that_is_still_starting():
    """A start-up held up (here: another process is building the kernels it needs) stops within seconds on
    SIGTERM, saying so, instead of finishing its start first."""
    import subprocess
    import sys

    from kvtier.kernels import build as kbuild

    if kbuild.decode_module() is None:
        pytest.skip("no compiler: nothing is built at start-up")
    directory = kbuild.build_dir(kbuild.build_name())
    lines: list[str] = []
    with kbuild.builder(directory):
        proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--model", "random:tiny-qwen2", "--dtype",
                                 "fp32", "--device", "cpu", "--port", str(free_port())], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        deadline = time.time() + 120
        while time.time() < deadline and not any("waiting for the kernel build" in x for x in lines):
            time.sleep(0.1)
        assert proc.poll() is None and any("waiting for the kernel build" in x for x in lines), lines
        t = time.time()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, lines
        assert time.time() - t < 10
    reader.join(timeout=10)
    assert any("SIGTERM during start-up; stopping" in x for x in lines), lines


def test_five_hundred_silent_connections_do_not_keep_others_out_and_are_closed(server):
    """A client opens 500 connections and never sends a byte: a request beside them is served as usual, and the
    server closes each silent one after its keep-alive timeout (5 s) instead of holding it open forever."""
    import httpx

    proc, url = server
    port = int(url.rsplit(":", 1)[1])
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(500)]
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
        t = time.time()
        for s in silent:
            s.settimeout(max(1.0, 30 - (time.time() - t)))
            assert s.recv(1) == b""  # closed by the server (a timeout here raises)
        assert time.time() - t < 30
    finally:
        for s in silent:
            s.close()
    assert proc.poll() is None
