"""What the engine counts (:class:`Metrics`) and ``GET /metrics``: those counters in Prometheus text, read at scrape
time (a custom collector on a registry of the server's own, so that several servers in one process do not share
metrics)."""

from __future__ import annotations

import time
from collections import deque

FINISH_REASONS = ("stop", "length", "timeout", "cancelled")


class Metrics:
    """What the engine counts; :mod:`kvtier.serve.app` exports it (Prometheus). Plain numbers, written by the
    generation thread, read by the server's; no locks needed for single assignments."""

    TTFT_BOUNDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

    def __init__(self) -> None:
        self.batches = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished: dict[str, int] = {r: 0 for r in FINISH_REASONS}
        self.kv_bytes: dict[tuple[str, str], int] = {}
        self.streamed_bytes = 0
        self.moved_bytes = 0
        self.reassignments = 0
        self.ttft_le = [0] * len(self.TTFT_BOUNDS)  # cumulative histogram of arrival -> first token
        self.ttft_n, self.ttft_sum = 0, 0.0
        self._recent: deque = deque()  # (time, tokens) of the last window
        # continuous batching under a device-KV budget (kvtier.serve.continuous)
        self.steps = 0
        self.device_kv_budget: int | None = None
        self.device_kv_bytes_now = 0
        self.device_kv_peak = 0
        self.host_kv_bytes_now = 0
        self.host_kv_peak = 0  # the most T1/T2 bytes the running rows held after any step
        self.budget_violations = 0  # steps that ended over the budget (0 unless the accounting is wrong)
        self.demoted_tokens = 0
        self.promoted_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0

    def observe_ttft(self, x: float) -> None:
        self.ttft_n += 1
        self.ttft_sum += x
        for j, b in enumerate(self.TTFT_BOUNDS):
            self.ttft_le[j] += x <= b

    def add_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generated_tokens += n
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - 10.0:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last 10 s."""
        now = time.monotonic()
        return sum(n for t, n in self._recent if t >= now - 10.0) / 10.0


def _collector(srv):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Collector:
        def collect(self):
            eng, m = srv.engine, srv.engine.metrics
            req = CounterMetricFamily("kvtier_requests", "HTTP requests by endpoint and status", labels=["endpoint", "status"])
            for (ep, st), n in sorted(srv.counts.items()):
                req.add_metric([ep, str(st)], n)
            yield req
            fin = CounterMetricFamily("kvtier_finished_requests", "requests finished, by reason", labels=["reason"])
            for r, n in m.finished.items():
                fin.add_metric([r], n)
            yield fin
            yield GaugeMetricFamily("kvtier_queue_depth", "requests waiting for a batch", value=eng.queue_depth)
            yield GaugeMetricFamily("kvtier_running_requests", "rows of the running batch not finished", value=eng.running)
            yield CounterMetricFamily("kvtier_batches", "batches started", value=m.batches)
            yield CounterMetricFamily("kvtier_prompt_tokens", "prompt tokens of the requests started (those "
                                      "the prefix cache gave included)", value=m.prompt_tokens)
            yield CounterMetricFamily("kvtier_generated_tokens", "tokens generated", value=m.generated_tokens)
            yield GaugeMetricFamily("kvtier_tokens_per_second", "generated tokens per second over the last 10 s",
                                    value=m.tokens_per_second())
            kv = GaugeMetricFamily("kvtier_kv_bytes", "KV bytes of the running batch by tier and location",
                                   labels=["tier", "location"])
            for tier, where in (("T0", "device"), ("T1", "host"), ("T2", "host")):
                kv.add_metric([tier, where], m.kv_bytes.get((tier, where), 0))
            yield kv
            yield CounterMetricFamily("kvtier_streamed_bytes", "T1/T2 bytes copied host->device to attend them",
                                      value=m.streamed_bytes)
            yield CounterMetricFamily("kvtier_moved_bytes", "bytes moved between tiers at reassignments", value=m.moved_bytes)
            yield CounterMetricFamily("kvtier_reassignments", "tier reassignments (summed over batches)", value=m.reassignments)
            yield GaugeMetricFamily("kvtier_live_caches", "KV caches still referenced (0 when idle)",
                                    value=len(eng.live_caches))
            yield GaugeMetricFamily("kvtier_running_rows", "rows decoding now (continuous batching)", value=eng.running)
            yield GaugeMetricFamily("kvtier_device_kv_budget_bytes", "device-KV budget (0: none)",
                                    value=m.device_kv_budget or 0)
            yield GaugeMetricFamily("kvtier_device_kv_bytes", "device K/V of the running rows now, from their caches",
                                    value=m.device_kv_bytes_now)
            yield GaugeMetricFamily("kvtier_device_kv_peak_bytes", "highest device K/V after any prefill or step",
                                    value=m.device_kv_peak)
            yield GaugeMetricFamily("kvtier_host_kv_peak_bytes", "highest host K/V (T1/T2) of the running rows after "
                                    "any step: the host memory a result at a device budget also used",
                                    value=m.host_kv_peak)
            yield CounterMetricFamily("kvtier_demoted_tokens", "token-columns moved from the device to T1 (at "
                                      "admission, limit changes and reassignments; counted when a row's cache is "
                                      "released)", value=m.demoted_tokens)
            yield CounterMetricFamily("kvtier_promoted_tokens", "token-columns moved from T1 back to the device "
                                      "(counted when a row's cache is released)",
                                      value=m.promoted_tokens)
            yield CounterMetricFamily("kvtier_preemptions", "rows preempted (recomputed later)", value=m.preemptions)
            yield CounterMetricFamily("kvtier_recomputed_tokens", "tokens prefilled again after a preemption",
                                      value=m.recomputed_tokens)
            yield CounterMetricFamily("kvtier_budget_violations", "steps that ended over the device-KV budget",
                                      value=m.budget_violations)
            store = getattr(eng, "prefix", None)  # the continuous engine's prefix cache (None: off, or static)
            yield CounterMetricFamily("kvtier_prefix_cache_queries_tokens", "prompt tokens looked up in the prefix "
                                      "cache (at each request's start)", value=store.queried_tokens if store else 0)
            yield CounterMetricFamily("kvtier_prefix_cache_hit_tokens", "of them found (whole blocks, not computed "
                                      "again)", value=store.hit_tokens if store else 0)
            pc = GaugeMetricFamily("kvtier_prefix_cache_bytes", "bytes of K/V the prefix cache holds, by tier",
                                   labels=["tier"])
            pc.add_metric(["device"], 0)  # (kept in host memory: a hit copies its blocks into the row's cache)
            pc.add_metric(["host"], store.bytes if store else 0)
            yield pc
            yield GaugeMetricFamily("kvtier_prefix_cache_blocks", "blocks the prefix cache holds",
                                    value=len(store) if store else 0)
            yield CounterMetricFamily("kvtier_prefix_cache_evicted_blocks", "blocks dropped, least recently used "
                                      "first, to stay within --prefix-cache-host-bytes",
                                      value=store.evicted_blocks if store else 0)
            buckets = [(str(b), c) for b, c in zip(m.TTFT_BOUNDS, m.ttft_le)] + [("+Inf", m.ttft_n)]
            yield HistogramMetricFamily("kvtier_time_to_first_token_seconds", "arrival to first token",
                                        buckets=buckets, sum_value=m.ttft_sum)

    return Collector()


def render_metrics(srv) -> tuple[str, str]:
    """(text, content type) of one scrape."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    reg = getattr(srv, "_registry", None)
    if reg is None:
        reg = srv._registry = CollectorRegistry()
        reg.register(_collector(srv))
    return generate_latest(reg).decode(), CONTENT_TYPE_LATEST
