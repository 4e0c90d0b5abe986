"""``GET /metrics``: the engine's counters in Prometheus text, read at scrape time (a custom collector on a
registry of the server's own, so that several servers in one process do not share metrics)."""

from __future__ import annotations


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
            yield CounterMetricFamily("kvtier_prompt_tokens", "prompt tokens prefilled", value=m.prompt_tokens)
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
