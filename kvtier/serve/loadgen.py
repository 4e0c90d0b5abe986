"""``kvtier bench-serve``: closed-loop streaming clients against a running ``kvtier serve``.

Each of ``c`` clients sends its requests one after another (streaming chat completions, greedy, the cache policy
per request through the body's ``kvtier`` object), so ``c`` is the number of requests in flight. Per level and
policy: total generated tokens per second of wall time, time to first token (request sent -> first text chunk)
and inter-token latency (gaps between text chunks: one per token, except where a multi-byte character or a
possible stop string is held back a step), p50/p99. Policies are
run in turn at each level, in one server, so the ratios compare like with like.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES = (
    "A shop sells pencils at {a} cents each. Mia buys {b} pencils and pays with {c} dollars. How much change, in cents, does she get?",
    "A train travels {a} km in {b} hours, then {c} km more in 2 hours. What is its average speed in km/h?",
    "Tom has {a} marbles. He gives {b} to Ann and then buys {c} more. How many marbles does Tom have now?",
    "A rectangle is {a} cm long and {b} cm wide. A square has the same perimeter. What is the square's area in cm^2?",
    "A farmer has {a} cows and {b} chickens. Each cow eats {c} kg of hay a day. How many legs are on the farm, and how much hay is eaten in a week?",
    "If {a} workers build a wall in {b} days, how many days do {c} workers need for the same wall?",
)


def questions(n: int, seed: int = 0) -> list[str]:
    """``n`` short reasoning questions (fixed by ``seed``) that make a chat model think out loud."""
    rng = random.Random(seed)
    return [rng.choice(TEMPLATES).format(a=rng.randint(3, 90), b=rng.randint(2, 30), c=rng.randint(2, 20))
            + " Please reason step by step." for _ in range(n)]


@dataclass
class Level:
    """One (concurrency, policy) measurement."""

    concurrency: int
    policy: str
    requests: int = 0
    rejected: int = 0
    failed: int = 0  # answered with an error (a 4xx/5xx other than 429, or an error event inside the stream)
    first_error: str | None = None
    tokens: int = 0
    seconds: float = 0.0
    ttft: list = field(default_factory=list)
    itl: list = field(default_factory=list)

    def row(self) -> dict:
        return {"concurrency": self.concurrency, "policy": self.policy, "requests": self.requests,
                "rejected_429": self.rejected, "failed": self.failed, "first_error": self.first_error,
                "tokens": self.tokens, "seconds": round(self.seconds, 3),
                "tok_s": self.tokens / self.seconds if self.seconds else 0.0,
                "ttft_p50_s": pct(self.ttft, 50), "ttft_p99_s": pct(self.ttft, 99),
                "itl_p50_ms": 1e3 * pct(self.itl, 50), "itl_p99_ms": 1e3 * pct(self.itl, 99)}


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile, linear between order statistics (NaN without data)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server a tool or test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int | None) -> float | None:
    """A process's resident memory in MiB from /proc (None where it cannot be read)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def wait_until_up(url: str, proc, timeout_s: float) -> None:
    """Wait for a server started as ``proc`` (a ``subprocess.Popen`` with its output piped) to answer ``/health``;
    ``ValueError`` with the end of its output if it exits first, or if it is not up in ``timeout_s`` (then it is
    killed)."""
    import httpx

    t_end = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ValueError(f"the server exited: {proc.stdout.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > t_end:
            proc.kill()
            raise ValueError(f"the server did not come up in {timeout_s:g} s")
        time.sleep(0.5)


def server_counters(url: str, api_key: str | None = None) -> dict[str, float]:
    """A kvtier server's own ``kvtier_*`` samples from ``/metrics`` (preemptions, demotions, device K/V...),
    histogram buckets left out; empty if ``/metrics`` cannot be read."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(url + "/metrics", timeout=30, headers=headers).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("kvtier_") and "_bucket" not in line.split(" ", 1)[0]:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


class RequestFailed(Exception):
    """The server answered a request with an error (counted per level, not fatal to the run)."""


@dataclass
class Streamed:
    """One streamed completion: its generated tokens (from the usage chunk), time to first text chunk, and the
    gaps between text chunks."""

    tokens: int = 0
    ttft: float | None = None
    itl: list = field(default_factory=list)


async def stream_chat(client, url: str, body: dict) -> Streamed | None:
    """POST ``body`` to ``url``'s chat completions and read its server-sent events; None after a 429 (having
    waited its ``Retry-After``); any other non-200 status, or an error event in the stream, raises
    :class:`RequestFailed`."""
    t0 = time.perf_counter()
    out, last = Streamed(), None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code == 429:
            await asyncio.sleep(float(r.headers.get("retry-after", 1)))
            return None
        if r.status_code != 200:
            raise RequestFailed(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RequestFailed(f"error event: {json.dumps(chunk['error'])[:300]}")
            if chunk.get("usage"):
                out.tokens += chunk["usage"]["completion_tokens"]
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                if d.get("content") or d.get("reasoning_content"):
                    now = time.perf_counter()
                    if last is None:
                        out.ttft = now - t0
                    else:
                        out.itl.append(now - last)
                    last = now
    return out


async def _one(client, url: str, question: str, policy: dict, max_tokens: int, lv: Level) -> None:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "kvtier": policy}
    try:
        s = await stream_chat(client, url, body)
    except RequestFailed as e:
        lv.failed += 1
        lv.first_error = lv.first_error or str(e)
        return
    if s is None:
        lv.rejected += 1
        return
    lv.tokens += s.tokens
    lv.ttft += [] if s.ttft is None else [s.ttft]
    lv.itl += s.itl
    lv.requests += 1


async def run_level(url: str, concurrency: int, policy: dict, per_client: int, max_tokens: int, seed: int,
                    headers: dict | None = None) -> Level:
    import httpx

    lv = Level(concurrency, policy.get("policy", "?"))
    qs = questions(concurrency * per_client, seed)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits, headers=headers) as client:

        async def worker(k: int):
            for j in range(per_client):
                await _one(client, url, qs[k * per_client + j], policy, max_tokens, lv)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        lv.seconds = time.perf_counter() - t0
    return lv


def bench_serve(url: str, concurrency: list[int], policies: list[dict], per_client: int, max_tokens: int,
                seed: int = 0, on_level=None, api_key: str | None = None) -> list[dict]:
    """Every level x policy (policies in turn at each level); rows as :meth:`Level.row`. ``api_key``: sent as a
    Bearer token (a server started with ``--api-key``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    rows = []
    for c in concurrency:
        for pol in policies:
            lv = asyncio.run(run_level(url, c, pol, per_client, max_tokens, seed, headers))
            rows.append({**lv.row(), "params": {k: v for k, v in pol.items() if k != "policy"}})
            if on_level:
                on_level(rows[-1])
    base = {r["policy"]: r["tok_s"] for r in rows if r["concurrency"] == min(concurrency)}
    full = {r["concurrency"]: r["tok_s"] for r in rows if r["policy"] == "full"}
    for r in rows:
        r["tok_s_vs_lowest_concurrency"] = r["tok_s"] / base[r["policy"]] if base.get(r["policy"]) else None
        r["tok_s_vs_full"] = r["tok_s"] / full[r["concurrency"]] if full.get(r["concurrency"]) else None
    return rows
