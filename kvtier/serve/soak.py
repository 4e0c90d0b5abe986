"""A soak run against a kvtier server: a closed-loop mix of requests for a duration, its state sampled as it goes, its invariants judged at the end.

The mix (each request drawn by a seeded generator): short chat and reasoning-length answers (``ignore_eos`` on half
of the long ones), streamed or whole, greedy or seeded-sampled; cancelled mid-stream; vanishing (the connection
reset without a word); malformed or over a limit; a wrong API key; slow readers. Every ``sample_every_s`` the
server's ``/metrics`` and RSS are read: running and waiting rows, device K/V against its budget, the host peak,
preemptions, demotions, budget violations, live caches, the client's requests in flight, and the latencies of the
requests that ended since. At the end the server must fall idle (no row, no waiting request, no device K/V, no live
cache), and some seeded-sampled requests are sent again, alone and whole, and must return the same text (a token
sent twice, or lost, in a stream shows there). A client's last request runs to its end after the duration. Talks HTTP only: no model here. The command is
``benchmarks/serve/soak.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import socket
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .loadgen import pct, rss_mib, server_counters

log = logging.getLogger(__name__)

FAULTS = ("cancel", "vanish", "bad", "wrong_key", "slow")
EXPECTED_ERRORS = {400, 401, 413, 422, 429}  # a documented answer to a bad, unkeyed or unlucky request


@dataclass
class SoakConfig:
    """What to send and for how long. Shares are of all requests (the faults' shares sum to at most 1; the rest are
    plain requests, ``long_share`` of them reasoning-length, ``stream_share`` streamed, ``sampled_share`` sampled
    with a seed)."""

    url: str
    duration_s: float
    clients: int = 8
    api_key: str | None = None
    short_tokens: tuple[int, int] = (64, 256)
    long_tokens: tuple[int, int] = (1024, 4096)
    long_share: float = 0.2
    stream_share: float = 0.7
    sampled_share: float = 0.2
    cancel_share: float = 0.10
    vanish_share: float = 0.05
    bad_share: float = 0.05
    wrong_key_share: float = 0.02
    slow_share: float = 0.02
    reruns: int = 8
    sample_every_s: float = 10.0
    idle_timeout_s: float = 60.0
    host_kv_budget_bytes: int | None = None
    server_pid: int | None = None
    seed: int = 0

    def __post_init__(self):
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        for name in ("long_share", "stream_share", "sampled_share", *(f"{f}_share" for f in FAULTS)):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v}")
        if sum(getattr(self, f"{f}_share") for f in FAULTS) > 1.0:
            raise ValueError("the fault shares (cancel, vanish, bad, wrong_key, slow) must sum to at most 1")
        for name in ("short_tokens", "long_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        if self.sample_every_s <= 0 or self.reruns < 0:
            raise ValueError("sample_every_s must be > 0 and reruns >= 0")


@dataclass
class Outcome:
    """One request as the client saw it. ``outcome``: done, cancelled, vanished, refused (a documented error: 4xx
    for a bad, unkeyed or over-limit request, 429 when busy) or unexpected (anything else: a 5xx, a broken stream,
    a wrong answer to a fault)."""

    kind: str
    start: float
    end: float
    outcome: str
    status: int | None = None
    tokens: int = 0
    ttft: float | None = None
    detail: str = ""


@dataclass
class _Run:
    cfg: SoakConfig
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    sampled: list[tuple[dict, str]] = field(default_factory=list)  # (body, text) of finished seeded-sampled requests
    in_flight: int = 0

    def now(self) -> float:
        return time.monotonic() - self.t0


def _headers(key: str | None) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _pick(rng: random.Random, cfg: SoakConfig) -> str:
    x = rng.random()
    for f in FAULTS:
        share = getattr(cfg, f"{f}_share")
        if f == "wrong_key" and not cfg.api_key:
            continue  # a server without keys takes any key
        if x < share:
            return f
        x -= share
    return "plain"


def _body(rng: random.Random, cfg: SoakConfig, i: int, stream: bool) -> dict:
    long = rng.random() < cfg.long_share
    lo, hi = cfg.long_tokens if long else cfg.short_tokens
    body = {"messages": [{"role": "user", "content": f"Request {i}: think step by step about {rng.randrange(10**6)}."}],
            "max_tokens": rng.randint(lo, hi), "stream": stream, "temperature": 0.0}
    if long and rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < cfg.sampled_share:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
    return body


async def _stream(client, run: _Run, body: dict, key: str | None, stop_after: int | None = None,
                  delay: float = 0.0) -> Outcome:
    """POST a streamed chat completion and read its events: text, the usage, a finish reason, then [DONE] last.
    ``stop_after``: hang up after that many text chunks; ``delay``: seconds between reads (a slow reader)."""
    t = run.now()
    text, tokens, ttft, finished, done = [], 0, None, False, False
    async with client.stream("POST", run.cfg.url + "/v1/chat/completions", json=body, headers=_headers(key)) as r:
        if r.status_code != 200:
            await r.aread()
            kind = "refused" if r.status_code in EXPECTED_ERRORS else "unexpected"
            return Outcome("stream", t, run.now(), kind, r.status_code, detail=f"HTTP {r.status_code}")
        async for line in r.aiter_lines():
            if delay:
                await asyncio.sleep(delay)
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            if done:
                return Outcome("stream", t, run.now(), "unexpected", 200, detail="an event after [DONE]")
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return Outcome("stream", t, run.now(), "unexpected", 200, detail=json.dumps(chunk["error"])[:200])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices", []):
                piece = (ch.get("delta") or {}).get("content") or ""
                if piece:
                    ttft = run.now() - t if ttft is None else ttft
                    text.append(piece)
                finished = finished or ch.get("finish_reason") is not None
            if stop_after is not None and len(text) >= stop_after:
                return Outcome("cancel", t, run.now(), "cancelled", 200, tokens=len(text), ttft=ttft)
    if not (finished and done):
        return Outcome("stream", t, run.now(), "unexpected", 200, detail="the stream ended without a finish or [DONE]")
    if "seed" in body:
        run.sampled.append((body, "".join(text)))
    return Outcome("stream", t, run.now(), "done", 200, tokens=tokens, ttft=ttft)


async def _whole(client, run: _Run, body: dict, key: str | None, raw: bytes | None = None) -> Outcome:
    t = run.now()
    url = run.cfg.url + "/v1/chat/completions"
    headers = {**_headers(key), "Content-Type": "application/json"}
    r = await client.post(url, content=raw, headers=headers) if raw is not None else \
        await client.post(url, json=body, headers=headers)
    if r.status_code != 200:
        kind = "refused" if r.status_code in EXPECTED_ERRORS else "unexpected"
        return Outcome("whole", t, run.now(), kind, r.status_code, detail=r.text[:200])
    msg = r.json()["choices"][0]["message"]
    if "seed" in body:
        run.sampled.append((body, msg.get("content") or ""))
    return Outcome("whole", t, run.now(), "done", 200, tokens=r.json()["usage"]["completion_tokens"],
                   ttft=run.now() - t)


async def _vanish(run: _Run, body: dict) -> Outcome:
    """Send a streamed request on a raw socket, read its first bytes, and reset the connection (no close, no word)."""
    t = run.now()
    host, port = run.cfg.url.split("//", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port.rstrip("/")))
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in _headers(run.cfg.api_key).items())
            + "\r\n").encode()
    writer.write(head + data)
    await writer.drain()
    try:
        await asyncio.wait_for(reader.read(256), 30)
    finally:
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        writer.close()
    return Outcome("vanish", t, run.now(), "vanished")


_BAD = (  # (what, raw body or None, body changes): each must get a documented 4xx
    ("not JSON", b"{not json", None),
    ("max_tokens 0", None, {"max_tokens": 0}),
    ("max_tokens past the model", None, {"max_tokens": 10**9}),
    ("an unknown role", None, {"messages": [{"role": "wizard", "content": "hi"}]}),
)


async def _one(client, run: _Run, rng: random.Random, i: int) -> Outcome:
    cfg = run.cfg
    kind = _pick(rng, cfg)
    stream = kind in ("cancel", "slow", "vanish") or (kind == "plain" and rng.random() < cfg.stream_share)
    body = _body(rng, cfg, i, stream)
    if kind in ("cancel", "slow"):
        out = await (_stream(client, run, body, cfg.api_key, stop_after=rng.randint(1, 8)) if kind == "cancel" else
                     _stream(client, run, dict(body, max_tokens=min(body["max_tokens"], 32)), cfg.api_key, delay=0.2))
        out.kind = kind
        return out
    if kind == "vanish":
        return await _vanish(run, body)
    if kind == "wrong_key":
        out = await _whole(client, run, dict(body, stream=False), cfg.api_key + "-wrong")
        out.kind = "wrong_key"
        if out.status != 401:
            out.outcome, out.detail = "unexpected", f"a wrong key got HTTP {out.status}"
        return out
    if kind == "bad":
        what, raw, change = _BAD[i % len(_BAD)]
        out = await _whole(client, run, {**dict(body, stream=False), **(change or {})}, cfg.api_key, raw=raw)
        out.kind, out.detail = "bad", what
        if out.outcome == "done" or out.status == 429:
            out.outcome, out.detail = "unexpected", f"{what} got HTTP {out.status}"
        return out
    return await (_stream(client, run, body, cfg.api_key) if stream else _whole(client, run, body, cfg.api_key))


async def _client(client, run: _Run, c: int, end: float) -> None:
    rng = random.Random(run.cfg.seed * 1_000_003 + c)
    i = 0
    while run.now() < end:
        run.in_flight += 1
        try:
            out = await _one(client, run, rng, c * 1_000_000 + i)
        except Exception as e:  # noqa: BLE001 - a transport failure is a finding, not a crash of the run
            out = Outcome("error", run.now(), run.now(), "unexpected", detail=f"{type(e).__name__}: {e}"[:200])
        finally:
            run.in_flight -= 1
        run.outcomes.append(out)
        if out.status == 429:
            await asyncio.sleep(1.0)
        i += 1


def _metric(m: dict, name: str) -> float:
    """A sample's value by name (counters with or without their ``_total``; labelled samples summed)."""
    return sum(v for k, v in m.items() if k.split("{", 1)[0] in (name, name + "_total"))


def _sample(run: _Run, since: float) -> dict:
    m = server_counters(run.cfg.url, run.cfg.api_key)
    ended = [o for o in run.outcomes if o.end >= since and o.outcome == "done"]
    lat = [o.end - o.start for o in ended]
    ttft = [o.ttft for o in ended if o.ttft is not None]
    return {"t": round(run.now(), 2), "rss_mib": rss_mib(run.cfg.server_pid), "in_flight": run.in_flight,
            "running": _metric(m, "kvtier_running_rows"), "waiting": _metric(m, "kvtier_queue_depth"),
            "device_kv_bytes": _metric(m, "kvtier_device_kv_bytes"),
            "device_kv_budget_bytes": _metric(m, "kvtier_device_kv_budget_bytes"),
            "host_kv_peak_bytes": _metric(m, "kvtier_host_kv_peak_bytes"),
            "live_caches": _metric(m, "kvtier_live_caches"), "preemptions": _metric(m, "kvtier_preemptions"),
            "demoted_tokens": _metric(m, "kvtier_demoted_tokens"),
            "budget_violations": _metric(m, "kvtier_budget_violations"),
            "generated_tokens": _metric(m, "kvtier_generated_tokens"), "requests": len(run.outcomes),
            "done": len(ended), "latency_p50_s": _p(lat, 50), "latency_p99_s": _p(lat, 99), "ttft_p99_s": _p(ttft, 99)}


def _p(xs: list[float], q: float) -> float | None:
    """The q-th percentile, None without data (JSON has no NaN)."""
    return pct(xs, q) if xs else None


async def _sampler(run: _Run, end: float) -> None:
    since = 0.0
    while run.now() < end:
        await asyncio.sleep(min(run.cfg.sample_every_s, max(0.0, end - run.now())))
        now = run.now()
        run.samples.append(await asyncio.to_thread(_sample, run, since))
        since = now


def _idle(run: _Run) -> dict:
    """Wait (up to ``idle_timeout_s``) until the server holds nothing; the last sample either way."""
    deadline = time.monotonic() + run.cfg.idle_timeout_s
    while True:
        s = _sample(run, run.now())
        if not (s["running"] or s["waiting"] or s["device_kv_bytes"] or s["live_caches"]) or time.monotonic() > deadline:
            return s
        time.sleep(0.5)


def _reruns(run: _Run) -> list[dict]:
    """Some seeded-sampled requests again, alone and whole (the shortest ones: a rerun takes a solo request's time):
    each must give the text it gave under load."""
    import httpx

    out = []
    for body, text in sorted(run.sampled, key=lambda x: x[0]["max_tokens"])[: run.cfg.reruns]:
        r = httpx.post(run.cfg.url + "/v1/chat/completions", json=dict(body, stream=False), timeout=600,
                       headers=_headers(run.cfg.api_key))
        again = (r.json()["choices"][0]["message"].get("content") or "") if r.status_code == 200 else None
        out.append({"streamed": body["stream"], "max_tokens": body["max_tokens"], "equal": again == text,
                    "status": r.status_code})
    return out


def judge(result: dict) -> dict:
    """The soak's figures, each beside its goal: budget breaches, unexpected answers, sampled texts unequal to their
    solo reruns, idle afterwards; RSS drift (the server's RSS once idle afterwards over its RSS after the warm-up:
    under load RSS follows the K/V it holds, in the host tier too, so only an idle server's RSS can show a leak);
    and slow degradation: the p99 of seconds per generated token (a request's time over its tokens: a long answer is
    not a slow one) of the requests that ended in the last window over those of the first."""
    samples, outs, cfg = result["samples"], result["outcomes"], result["config"]
    budget = [s for s in samples if s["device_kv_budget_bytes"] and s["device_kv_bytes"] > s["device_kv_budget_bytes"]]
    host = cfg.get("host_kv_budget_bytes")
    host_over = bool(host) and any(s["host_kv_peak_bytes"] > host for s in samples)
    last = samples[-1] if samples else {}
    warm = [s for s in samples if s["t"] >= min(60.0, 0.2 * cfg["duration_s"]) and s["rss_mib"] is not None]
    idle = result["idle"]
    window = min(300.0, cfg["duration_s"] / 4)
    per_token = [(o["end"], (o["end"] - o["start"]) / o["tokens"]) for o in outs if o["outcome"] == "done" and o["tokens"]]
    first = [x for end, x in per_token if end <= window]
    tail = [x for end, x in per_token if cfg["duration_s"] - window <= end <= cfg["duration_s"]]
    return {
        "requests": len(outs),
        "by_outcome": {k: sum(o["outcome"] == k for o in outs) for k in ("done", "cancelled", "vanished", "refused",
                                                                        "unexpected")},
        "by_kind": {k: sum(o["kind"] == k for o in outs) for k in sorted({o["kind"] for o in outs})},
        "generated_tokens": last.get("generated_tokens", 0.0),
        "budget_breaches": len(budget) + int(max((s["budget_violations"] for s in samples), default=0)) + int(host_over),
        "unexpected": sum(o["outcome"] == "unexpected" for o in outs),
        "unexpected_details": sorted({o["detail"] for o in outs if o["outcome"] == "unexpected"})[:10],
        "reruns_equal": f"{sum(r['equal'] for r in result['reruns'])}/{len(result['reruns'])}",
        "idle_after": not (idle["running"] or idle["waiting"] or idle["device_kv_bytes"] or idle["live_caches"]),
        "rss_drift": (idle["rss_mib"] / warm[0]["rss_mib"] - 1) if warm and idle.get("rss_mib") else None,
        "rss_mib": {"after_warm_up": warm[0]["rss_mib"] if warm else None, "peak": max((s["rss_mib"] for s in warm),
                    default=None), "idle_after": idle.get("rss_mib")},
        "p99_per_token_last_over_first": (pct(tail, 99) / pct(first, 99)) if first and tail else None,
        "per_token_requests": {"first_window": len(first), "last_window": len(tail), "window_s": window},
        "preemptions": last.get("preemptions", 0.0), "demoted_tokens": last.get("demoted_tokens", 0.0),
    }


def run_soak(cfg: SoakConfig) -> dict:
    """Run the mix for ``cfg.duration_s``, then wait for the server to fall idle and rerun the sampled requests:
    ``{"config", "samples", "outcomes", "idle", "reruns", "verdict"}`` (:func:`judge`'s figures in ``verdict``)."""
    import httpx

    run = _Run(cfg)

    async def main():
        limits = httpx.Limits(max_connections=cfg.clients * 2, max_keepalive_connections=cfg.clients)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
            end = cfg.duration_s
            await asyncio.gather(_sampler(run, end), *(_client(client, run, c, end) for c in range(cfg.clients)))

    asyncio.run(main())
    log.info("soak: %d requests in %.0f s; waiting for the server to fall idle", len(run.outcomes), run.now())
    idle = _idle(run)
    result = {"config": asdict(cfg), "samples": run.samples, "outcomes": [asdict(o) for o in run.outcomes],
              "idle": idle, "reruns": _reruns(run)}
    result["verdict"] = judge(result)
    return result


def write_soak(result: dict, out: Path) -> dict[str, Path]:
    """soak.json and (with matplotlib) soak.png: RSS, device K/V against its budget, and latency over time."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "soak.json"}
    paths["json"].write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    s = result["samples"]
    t = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    ax[0].plot(t, [x["rss_mib"] or 0 for x in s])
    ax[0].set_ylabel("server RSS (MiB)")
    ax[1].plot(t, [x["device_kv_bytes"] / 2**20 for x in s], label="device K/V")
    ax[1].plot(t, [x["device_kv_budget_bytes"] / 2**20 for x in s], "--", label="budget")
    ax[1].plot(t, [x["host_kv_peak_bytes"] / 2**20 for x in s], ":", label="host K/V peak")
    ax[1].set_ylabel("MiB")
    ax[1].legend(fontsize=8)
    ax[2].plot(t, [x["latency_p50_s"] or float("nan") for x in s], label="p50")
    ax[2].plot(t, [x["latency_p99_s"] or float("nan") for x in s], label="p99")
    ax[2].set_ylabel("request latency (s)")
    ax[2].set_xlabel("minutes")
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    paths["png"] = out / "soak.png"
    fig.savefig(paths["png"], dpi=100)
    plt.close(fig)
    return paths
