"""The transfer engine: owns host<->device copies, staging buffers and their counters; orders them through the seam.

Everything that crosses between host and device memory goes through here, so that bytes and seconds are
counted in one place. On an asynchronous device (CUDA) T1 staging copies run on a side stream from pinned memory
and can be issued for layer i+1 while layer i computes; events order the streams (no global synchronize in the
decode loop). The engine reaches streams, events and pinned memory only through its :class:`~.seam.Seam`: on a
CPU device the same calls are plain copies, still counted; under the tests' simulated device the asynchronous
branch runs on a CPU with every copy deferred.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .seam import Seam, seam_for


@dataclass
class TransferCounters:
    """Bytes and seconds moved between host and device.

    ``stream_h2d_bytes``: T1/T2 tokens streamed to the device for attention, every step.
    ``migration_h2d_bytes`` / ``migration_d2h_bytes``: tokens whose tier changed at a reassignment.
    """

    stream_h2d_bytes: int = 0
    migration_h2d_bytes: int = 0
    migration_d2h_bytes: int = 0
    seconds: float = 0.0
    copies: int = 0
    _pending: list = field(default_factory=list, repr=False)  # (start, end) timing event pairs not yet timed

    @property
    def h2d_bytes(self) -> int:
        return self.stream_h2d_bytes + self.migration_h2d_bytes

    @property
    def d2h_bytes(self) -> int:
        return self.migration_d2h_bytes


class _Slot:
    """One reusable staging area: device copies of a layer's host-resident tensors."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.tag: tuple | None = None  # (layer_idx, step) whose data the slot holds
        self.ready = None  # event: copy finished (asynchronous seams)
        self.consumed = None  # event: compute finished reading


def memcpy_peak_gbps(device: torch.device, mib: int = 256, reps: int = 5) -> float:
    """Host->device copy bandwidth from pinned memory (CUDA), or host memcpy bandwidth (CPU), in GB/s: best of
    ``reps`` copies of ``mib`` MiB."""
    device = torch.device(device)
    seam = seam_for(device)
    n = mib * (1 << 20)
    src = seam.host_empty(n, torch.uint8)
    dst = seam.device_empty(n, torch.uint8, device)
    best = float("inf")
    for _ in range(reps):
        seam.synchronize(device)
        t = time.perf_counter()
        seam.copy_(dst, src)
        seam.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return n / best / 1e9


class TransferEngine:
    """Copies between host and ``device`` with accounting and reusable buffers.

    Args:
        device: the compute device (where T0 lives).
        n_slots: staging slots. One suffices for overlap: a layer releases its slot as soon as its tokens are in
            the work buffer, and the next layer's copy starts then, under this layer's attention and MLP; with
            the work buffer that bounds device staging to two layers' worth of KV.
    """

    def __init__(self, device: torch.device, n_slots: int = 1, seam: Seam | None = None) -> None:
        self.device = torch.device(device)
        self.seam = seam or seam_for(self.device)
        self.asynchronous = self.seam.asynchronous
        self.counters = TransferCounters()
        self.stream = self.seam.new_stream(self.device)  # the side stream staging copies run on
        self.slots = [_Slot() for _ in range(n_slots)]
        self.work: dict[str, torch.Tensor] = {}
        self.allocations = 0  # buffer (re)allocations, to show reuse
        self.kernel_staging_bytes = 0  # staging buffers held by a consumer that stages itself (count_streamed)

    # ---- host memory -------------------------------------------------------------------------
    def host_empty(self, shape, dtype) -> torch.Tensor:
        """Host tensor that asynchronous copies may use (pinned on CUDA)."""
        return self.seam.host_empty(shape, dtype)

    def host_zeros(self, shape, dtype) -> torch.Tensor:
        """Zeroed host tensor (pinned on CUDA): empty slots must hold finite values, since 0 * NaN is NaN."""
        return self.host_empty(shape, dtype).zero_()

    # ---- timing ------------------------------------------------------------------------------
    def _timed(self, fn, stream=None):
        c = self.counters
        c.copies += 1
        if self.asynchronous:
            s = stream or self.seam.current_stream(self.device)
            start = self.seam.timing_event(s)
            out = fn()
            c._pending.append((start, self.seam.timing_event(s)))
            if len(c._pending) > 256:
                self._harvest()
            return out
        t = time.perf_counter()
        out = fn()
        c.seconds += time.perf_counter() - t
        return out

    def _harvest(self) -> None:
        """Fold in the copy timings that have finished, without waiting (keeps the event list short)."""
        c = self.counters
        keep = []
        for s, e in c._pending:
            if self.seam.done(e):
                c.seconds += self.seam.elapsed_s(s, e)
            else:
                keep.append((s, e))
        c._pending = keep

    def resolve_timings(self) -> None:
        """Fold the copy timings into ``counters.seconds`` (synchronizes; call off the hot path)."""
        c = self.counters
        if c._pending:
            self.seam.synchronize(self.device)
            c.seconds += sum(self.seam.elapsed_s(s, e) for s, e in c._pending)
            c._pending.clear()

    # ---- migrations (tier changes) -----------------------------------------------------------
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device copy of a migrating tensor, counted as migration H2D."""
        self.counters.migration_h2d_bytes += t.numel() * t.element_size()
        return self._timed(lambda: self.seam.to_device(t, self.device))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Device -> host copy of a migrating tensor (pinned on CUDA), counted as migration D2H."""
        self.counters.migration_d2h_bytes += t.numel() * t.element_size()

        out = self._timed(lambda: self.seam.copy_(self.host_empty(t.shape, t.dtype), t))
        if self.asynchronous:
            # The host buffer is read by the CPU (quantization) or kept for later H2D; make sure it landed.
            self.seam.sync_stream(self.seam.current_stream(self.device), "to_host.sync")
        return out

    # ---- per-step streaming of host tiers ----------------------------------------------------
    def _buffer(self, store: dict, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = store.get(name)
        if buf is None or buf.numel() < like.numel() or buf.dtype != like.dtype:
            # Geometric headroom: host tiers grow a little at every reassignment, buffers should not follow suit.
            old = buf.numel() if buf is not None and buf.dtype == like.dtype else 0
            buf = self.seam.device_empty(max(like.numel(), old + old // 4, 1), like.dtype, self.device)
            store[name] = buf
            self.allocations += 1
        return buf[: like.numel()].view(like.shape)

    def stage(self, slot_idx: int, tag: tuple, tensors: dict[str, torch.Tensor]) -> None:
        """Start copying host ``tensors`` into staging slot ``slot_idx`` (async on CUDA).

        ``tag`` names the data (layer, step) so that :meth:`take` can tell a prefetch from stale data.
        """
        slot = self.slots[slot_idx]
        seam = self.seam
        if self.asynchronous:
            seam.wait_event(self.stream, slot.consumed, "stage.after_consumed")
            # Allocated on the compute stream, which reads them last: a buffer dropped at growth is then safe to reuse.
            before = self.allocations
            pairs = [(self._buffer(slot.buffers, name, src), src) for name, src in tensors.items()]
            if self.allocations != before:  # fresh memory may still be in use by the compute stream's earlier work
                seam.wait_stream(self.stream, seam.current_stream(self.device), "stage.after_alloc")
            with seam.on_stream(self.stream):

                def copy_all():
                    for dst, src in pairs:
                        seam.copy_(dst, src)

                self.counters.stream_h2d_bytes += sum(src.numel() * src.element_size() for _, src in pairs)
                self._timed(copy_all, stream=self.stream)  # one event pair per layer and step
                slot.ready = seam.record(self.stream, "stage.ready")
        else:
            for name, src in tensors.items():
                dst = self._buffer(slot.buffers, name, src)
                self.counters.stream_h2d_bytes += src.numel() * src.element_size()
                self._timed(lambda d=dst, s=src: d.copy_(s))
        slot.tag = tag

    def take(self, slot_idx: int, tag: tuple, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Device views of ``tensors``: from a matching prefetch, else staged now."""
        slot = self.slots[slot_idx]
        if slot.tag != tag:
            self.stage(slot_idx, tag, tensors)
        if self.asynchronous:
            self.seam.wait_event(self.seam.current_stream(self.device), slot.ready, "take.wait_ready")
        return {name: slot.buffers[name][: src.numel()].view(src.shape) for name, src in tensors.items()}

    def count_streamed(self, nbytes: int, seconds: float, buffer_bytes: int) -> None:
        """Account for ``nbytes`` streamed by a consumer that copies them itself (the fused CPU kernel stages a
        streamed T1 block by block into ``buffer_bytes`` of per-thread buffers), taking ``seconds``."""
        c = self.counters
        c.stream_h2d_bytes += nbytes
        c.seconds += seconds
        c.copies += 1
        if buffer_bytes != self.kernel_staging_bytes:
            self.kernel_staging_bytes = buffer_bytes
            self.allocations += 1  # device memory changed: the owner re-reads staging_bytes()

    def release(self, slot_idx: int) -> None:
        """Mark the slot's data as read, so the next prefetch into it may start."""
        slot = self.slots[slot_idx]
        slot.tag = None
        if self.asynchronous:
            slot.consumed = self.seam.record(self.seam.current_stream(self.device), "release.consumed")

    # ---- assembly buffers --------------------------------------------------------------------
    def work_buffers(self, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Reusable (B, H, cap, D) device buffers where one layer's kept K and V are assembled."""
        k = self.work.get("k")
        if k is None or tuple(k.shape) != tuple(shape) or k.dtype != dtype:
            # Zeros, not empty: unused columns are masked, but 0 * NaN would still poison the output.
            self.work["k"] = self.seam.device_empty(shape, dtype, self.device).zero_()
            self.work["v"] = self.seam.device_empty(shape, dtype, self.device).zero_()
            self.allocations += 1
        return self.work["k"], self.work["v"]

    def staging_bytes(self) -> int:
        """Device memory held by staging slots and work buffers."""
        n = sum(b.numel() * b.element_size() for s in self.slots for b in s.buffers.values())
        return n + sum(b.numel() * b.element_size() for b in self.work.values()) + self.kernel_staging_bytes

    def reset(self) -> None:
        self.resolve_timings() if self.asynchronous else None
        self.counters = TransferCounters()
        for s in self.slots:
            s.tag = None
