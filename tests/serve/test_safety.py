"""`kvtier serve` on a network: API keys on /v1/*, a published schema that schemathesis attacks, and bounds per request
(body size, stop strings, a client that stops reading its stream)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from servers import start_server, stop_server  # noqa: E402 (tests/serve/servers.py)
from kvtier.models import byte_tokenizer, random_model  # noqa: E402

KEYS = ("alpha-key-7f3c", "beta-key-91d2")  # long enough that a match in the logs cannot be an accident
BODY = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def keyed():
    """A server whose keys come from KVTIER_API_KEY (two, comma-separated), /metrics protected too."""
    proc, url = start_server("--max-new-tokens", "8", "--protect-metrics", env_keys=",".join(KEYS))
    yield proc, url
    code, out = stop_server(proc)
    assert code == 0, out
    for k in KEYS:  # the keys never reach the server's output (its log lines, its startup line)
        assert k not in out


def _auth(key):
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


@pytest.mark.parametrize("key, status", [(None, 401), ("wrong-key", 401), (KEYS[0][:-1], 401), (KEYS[0], 200),
                                         (KEYS[1], 200)])
def test_every_v1_route_wants_a_key(keyed, key, status):
    import httpx

    _, url = keyed
    calls = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", BODY),
             ("POST", "/v1/chat/completions", {**BODY, "stream": True}),
             ("POST", "/v1/completions", {"prompt": "2+2=", "max_tokens": 3, "temperature": 0})]
    for method, path, body in calls:
        r = httpx.request(method, url + path, json=body, headers=_auth(key), timeout=60)
        assert r.status_code == status, (path, r.text)
        if status == 401:
            err = r.json()["error"]
            assert err["code"] == 401 and "API key" in err["message"] and r.headers["www-authenticate"] == "Bearer"
            assert KEYS[0] not in r.text and KEYS[1] not in r.text
    # /health stays open; /metrics is protected here, and shows no key when read
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    m = httpx.get(url + "/metrics", headers=_auth(key), timeout=10)
    assert m.status_code == status
    assert all(k not in m.text for k in KEYS)


def test_the_openai_client_with_and_without_the_key(keyed):
    import openai

    _, url = keyed
    bad = openai.OpenAI(base_url=url + "/v1", api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="random:tiny-qwen2", messages=BODY["messages"], max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEYS[1], max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == ["random:tiny-qwen2"]
    whole = good.chat.completions.create(model="random:tiny-qwen2", messages=BODY["messages"], max_tokens=3,
                                         temperature=0)
    chunks = list(good.completions.create(model="random:tiny-qwen2", prompt="2+2=", max_tokens=3, temperature=0,
                                          stream=True))
    assert whole.usage.completion_tokens >= 1 and chunks


def test_the_schema_is_published_and_schemathesis_finds_nothing(keyed, tmp_path):
    """schemathesis (a dev dependency) generates requests from /openapi.json for every operation, with the key, and
    checks: no 5xx, every status and content type documented, every response conforms to its schema."""
    import httpx

    _, url = keyed
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/Chat")
    assert {"200", "400", "401", "413", "429"} <= set(chat["responses"])
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    block = spec["components"]["schemas"]["CacheBlock"]["properties"]["hbm_ratio"]
    assert "maximum" in json.dumps(block)  # the kvtier block's ranges are in the schema
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or shutil.which("schemathesis")
    if exe is None:
        pytest.fail("schemathesis is not installed: it is a dev dependency (pip install -e '.[dev]')")
    res = subprocess.run([exe, "run", url + "/openapi.json", "-H", f"Authorization: Bearer {KEYS[0]}",
                          "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
                                      "response_schema_conformance,response_headers_conformance",
                          "--max-examples", "20", "--max-time", "60", "--request-timeout", "30",
                          "--generation-deterministic", "--no-color"],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)  # its cache lands there
    assert res.returncode == 0 and "No issues found" in res.stdout, res.stdout[-6000:]
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=_auth(KEYS[0]), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None


def test_a_huge_body_is_refused_unread_and_too_many_stops_are_400(keyed):
    import httpx

    _, url = keyed
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        # 10 MiB announced, 64 KiB sent: the 413 comes back without the server waiting for the rest
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEYS[0]}\r\nContent-Length: {10 << 20}\r\n\r\n".encode() + b"[" * (64 << 10))
        t0 = time.monotonic()
        got = b""
        while b"--max-body-bytes" not in got and time.monotonic() - t0 < 10:  # the answer, then the server closes
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        reply = got.decode(errors="replace")
        assert reply.startswith("HTTP/1.1 413") and "--max-body-bytes" in reply and time.monotonic() - t0 < 10, reply
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, "stop": [f"s{i}" for i in range(1000)]},
                   headers=_auth(KEYS[0]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop" and "at most 4" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, "stop": "x" * 1000}, headers=_auth(KEYS[0]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = httpx.post(url + "/v1/chat/completions", json={**BODY, "messages": BODY["messages"] * 600},
                   headers=_auth(KEYS[0]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.server
def test_a_public_host_without_a_key_warns_once():
    proc, url = start_server("--max-new-tokens", "8", host="0.0.0.0")
    _, out = stop_server(proc)
    assert out.count("without an API key") == 1, out


def test_settings_refuse_bad_keys_and_never_show_them():
    from kvtier.serve.app import ServeSettings

    s = ServeSettings(served_name="m", policy="full", api_keys=(KEYS[0],))
    assert KEYS[0] not in repr(s) and s.key_ok(f"Bearer {KEYS[0]}") and not s.key_ok(f"Basic {KEYS[0]}")
    assert not s.key_ok(None) and not s.key_ok("Bearer ") and not s.key_ok(f"Bearer {KEYS[0]}x")
    for bad in ("", " lead", "has space"):
        with pytest.raises(ValueError, match="--api-key") as e:
            ServeSettings(served_name="m", policy="full", api_keys=(bad,))
        assert bad.strip() == "" or bad not in str(e.value)
    with pytest.raises(ValueError, match="--protect-metrics needs --api-key"):
        ServeSettings(served_name="m", policy="full", protect_metrics=True)
    with pytest.raises(ValueError, match="--max-body-bytes"):
        ServeSettings(served_name="m", policy="full", max_body_bytes=0)


def test_a_client_that_stops_reading_its_stream_is_cancelled_within_the_buffer():
    """In process, through the ASGI interface: the client takes the response head and one chunk, then never reads
    again (its send blocks). Deltas pile up only to --max-stream-buffer; then the row is cancelled, its batch ends and
    its cache is freed, long before the 4000 tokens it asked for."""
    from kvtier.serve.app import ServeSettings, create_app
    from kvtier.serve.engine import Engine, EngineConfig

    model, tok = random_model("tiny-qwen2", dtype=torch.float32), byte_tokenizer()
    settings = ServeSettings(served_name="tiny", policy="tiered", params={"recent_window": 4}, max_new_tokens=4000,
                             position_limit=4096, max_stream_buffer=16)
    engine = Engine(model, tok, EngineConfig(max_batch=2, batch_wait_s=0)).start()
    app = create_app(engine, settings)
    srv = app.state.server
    body = json.dumps({"prompt": "count: 1 2 3", "max_tokens": 4000, "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

    async def scenario():
        never = asyncio.Event()
        sent: list[dict] = []
        got_body = [False]

        async def receive():
            if not got_body[0]:
                got_body[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # the client never disconnects, it just stops reading

        async def send(msg):
            sent.append(msg)
            if msg["type"] == "http.response.body" and sum(m["type"] == "http.response.body" for m in sent) > 1:
                await never.wait()  # back-pressure: the transport is full, the write never completes

        task = asyncio.create_task(app(scope, receive, send))
        t_end = time.monotonic() + 120
        while srv.stream_cuts == 0 and time.monotonic() < t_end and not task.done():
            await asyncio.sleep(0.05)
        while (engine.running or engine.queue_depth) and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        task.cancel()
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert srv.stream_cuts == 1 and srv.peak_buffered <= settings.max_stream_buffer
    assert engine.running == 0 and engine.metrics.finished["cancelled"] == 1
    import gc

    t_end = time.monotonic() + 30
    while engine.live_caches and time.monotonic() < t_end:  # the generation thread lets go of the batch's cache
        gc.collect()
        time.sleep(0.05)
    assert len(engine.live_caches) == 0  # the row's cache went with its batch
    assert engine.metrics.generated_tokens < 200  # cut long before the 4000 tokens asked for
    engine.shutdown(grace_s=0)
