"""Attention over the host-resident tiers (T1, dequantised T2) on the host, for ``t1_attention="host"``.

Per layer and decode step the query goes to the host (B·Hq·D values), the host attends T1 and T2 where they live
and sends back one partial, (o, m, l) = B·Hq·(D+2) values, which the device merges with its own T0 and tail
partials. On an asynchronous device (CUDA) the host part runs on a worker thread while the device attends T0 and
the tail; copies use pinned buffers and events (through the engine's seam, :mod:`kvtier.transfer.seam`), so the
only host wait is the merge waiting for the host's partial.

Scores of host-resident tokens accumulate on the host. The merged weights need the merge's factor for the host
partial, which exists only after the merge on the device: it is copied back (B·Hq floats) and folded in when the
host next works on that layer (or at :meth:`HostAttention.flush`, before a reassignment reads the scores). The
fold order per token is that of the device accumulator (step by step, layer by layer), so both modes give the same
scores. On a CPU device the host is the device: no copies, and the job runs inline unless ``threaded``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..tiers.quant import dequantize
from ..transfer.seam import Seam, seam_for
from .merge import Partial, add_weights, combine, partial


@dataclass
class HostRegion:
    """One host tier of one layer: K/V (B, H, cap, D) buffers (int8 + scales for T2), its (B, 1, 1, cap) additive
    mask (0 occupied, -inf empty) and (B, cap) long positions (trash column where empty)."""

    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor
    pos: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def kv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_scale is None:
            return self.k, self.v
        return dequantize(self.k, self.k_scale, dtype), dequantize(self.v, self.v_scale, dtype)


def host_tiers_partial(qg: torch.Tensor, regions: list[HostRegion], scaling: float, keep: bool, dtype: torch.dtype
                       ) -> tuple[Partial, list[Partial], list[torch.Tensor]]:
    """The host tiers' single partial (their regions combined), the per-region partials and combine factors.
    The same function serves ``"stream"`` (regions staged on the device) and ``"host"`` (regions in host memory),
    so both give the same floats."""
    parts = []
    for r in regions:
        k, v = r.kv(dtype)
        parts.append(partial(qg, k, v, r.bias, scaling, keep))
    merged, cs = combine(parts)
    return merged, parts, cs


def stream_rows_for(batch: int, row_bytes: float, h2d_gbps: float, host_gbps: float, host_latency_s: float) -> int:
    """Rows (of ``batch``) whose host tiers to stream so that the step's host-tier time is least, given that the
    streamed rows (pinned H2D, ``row_bytes`` each) and the host-attended ones (``row_bytes`` each at ``host_gbps``,
    plus one round trip) run side by side: ``argmin_r max(r * row_bytes / h2d, (batch - r) * row_bytes / host +
    latency)``, the latency only when a row is left to the host. Ties go to fewer streamed rows (less PCIe
    traffic). The batch is split by rows because a row's tiers are one contiguous block in host memory (a slot
    range of every row would copy strided); at batch 1 this is the choice of one mode."""
    def cost(r: int) -> float:
        stream = r * row_bytes / (h2d_gbps * 1e9)
        host = (batch - r) * row_bytes / (host_gbps * 1e9) + host_latency_s if r < batch else 0.0
        return max(stream, host)

    return min(range(batch + 1), key=lambda r: (cost(r), r))


class _Done:
    """A finished job (inline execution), shaped like a Future."""

    def __init__(self, value) -> None:
        self._value = value

    def result(self):
        return self._value


class HostAttention:
    """Runs host-tier attention for a cache and owns the host score accumulator's deferred folds.

    Args:
        device: the compute device.
        num_layers: layers of the cache.
        threaded: run host jobs on a worker thread (default: on an asynchronous device only, where they overlap
            device work).
        seam: how to reach the device (default: :func:`kvtier.transfer.seam.seam_for` ``device``; the cache passes
            its engine's).
    """

    def __init__(self, device: torch.device, num_layers: int, threaded: bool | None = None,
                 seam: Seam | None = None) -> None:
        self.device = torch.device(device)
        self.seam = seam or seam_for(self.device)
        self.asynchronous = self.seam.asynchronous  # the query, result and factors cross to/from the host
        self.threaded = self.asynchronous if threaded is None else bool(threaded)
        self.pool: ThreadPoolExecutor | None = self.seam.executor("kvtier-host") if self.threaded else None
        self.num_layers = num_layers
        self.scores: torch.Tensor | None = None  # (B, cap + 1) float64 host accumulator, set by the cache
        self._pending: list[tuple | None] = [None] * num_layers
        self._f_bufs: list[torch.Tensor | None] = [None] * num_layers  # pinned merge factors, one per layer
        self._q: torch.Tensor | None = None  # pinned query buffer
        self._out: torch.Tensor | None = None  # pinned (B, H, g, D + 2) result buffer
        self.jobs = 0

    # ---- per layer and step ------------------------------------------------------------------
    def submit(self, layer: int, qg: torch.Tensor, regions: list[HostRegion], scaling: float, keep: bool,
               inv: float, row0: int = 0) -> Future | _Done:
        """Start the host partial of ``regions`` for queries ``qg`` (B', H, g, D) on the device: the cache's rows
        ``row0 .. row0 + B'`` (the others stream their host tiers), whose scores fold into those accumulator rows."""
        ready = None
        if self.asynchronous:
            seam = self.seam
            if self._q is None or self._q.shape != qg.shape or self._q.dtype != qg.dtype:
                # a new buffer, not the old one resized: a job still reading the old one keeps it
                self._q = seam.host_empty(qg.shape, qg.dtype)
            seam.copy_(self._q, qg)
            ready = seam.record(seam.current_stream(self.device), "host.q_ready")
            q_host = self._q
        else:
            q_host = qg
        job = lambda: self._job(layer, q_host, ready, regions, scaling, keep, inv, row0)  # noqa: E731
        self.jobs += 1
        return self.pool.submit(job) if self.pool is not None else _Done(job())

    def _job(self, layer, q_host, ready, regions, scaling, keep, inv, row0):
        self._fold(layer, inv)  # the previous step's weights for this layer, in order
        if self.asynchronous:
            self.seam.sync_event(ready, "host.wait_q")
        merged, parts, cs = host_tiers_partial(q_host, regions, scaling, keep, q_host.dtype)
        if self.asynchronous:
            B, H, g, D = merged.o.shape
            # The previous result's copy out of this buffer was issued on the compute stream before this job's
            # query copy: waiting for the query ("host.wait_q") waited for it too, so the buffer is free. (A
            # separate event for it was redundant: the simulated device's mutation check showed no test needs it.)
            if self._out is None or self._out.shape != (B, H, g, D + 2):
                self._out = self.seam.host_empty((B, H, g, D + 2), torch.float32)
            self._out[..., :D].copy_(merged.o)
            self._out[..., D : D + 1].copy_(merged.m)
            self._out[..., D + 1 :].copy_(merged.l)
        return merged, parts, cs, [r.pos for r in regions], row0

    def result(self, handle) -> tuple[Partial, tuple]:
        """Wait for the host partial; returns it on the device and the host-side weight state for :meth:`post`."""
        merged, parts, cs, pos, row0 = handle.result()
        if self.asynchronous:
            D = merged.o.shape[-1]
            buf = self.seam.to_device(self._out, self.device)
            merged = Partial(buf[..., :D], buf[..., D : D + 1], buf[..., D + 1 :])
        return merged, (parts, cs, pos, row0)

    def post(self, layer: int, state: tuple, f: torch.Tensor) -> None:
        """Hand back the merge's factor ``f`` (B, H, g, 1) for the host partial; its weights are folded later."""
        event = None
        if self.asynchronous:
            seam = self.seam
            f_host = self._f_bufs[layer]
            if f_host is None or f_host.shape != f.shape:
                f_host = self._f_bufs[layer] = seam.host_empty(f.shape, f.dtype)
            seam.copy_(f_host, f)  # its previous content was folded when this step's job started
            event = seam.record(seam.current_stream(self.device), "host.f_ready")
            f = f_host
        self._pending[layer] = (*state, f, event)

    # ---- score folds -------------------------------------------------------------------------
    def _fold(self, layer: int, inv: float) -> None:
        pend = self._pending[layer]
        if pend is None:
            return
        parts, cs, pos, row0, f, event = pend
        if self.asynchronous:
            self.seam.sync_event(event, "host.wait_f")
        scores = self.scores[row0 : row0 + f.shape[0]]
        for p, c, ps in zip(parts, cs, pos):
            add_weights(scores, ps, p.e, c * f, inv)
        self._pending[layer] = None

    def flush(self, inv: float) -> None:
        """Fold every pending weight into the host accumulator (before the scores are read)."""
        for layer in range(self.num_layers):
            self._fold(layer, inv)

    def drop(self) -> None:
        self._pending = [None] * self.num_layers

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None


__all__ = ["HostAttention", "HostRegion", "host_tiers_partial", "stream_rows_for"]
