"""The transfer engine: owns host<->device copies, staging buffers, streams, events and counters.

Everything that crosses between host and device memory goes through here, so that bytes and seconds are
counted in one place. On CUDA, T1 staging copies run on a side stream from pinned memory and can be issued
for layer i+1 while layer i computes; events order the streams (no global synchronize in the decode loop).
On CPU the same calls are plain copies, still counted, so the logic is testable without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


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
    _pending: list = field(default_factory=list, repr=False)  # CUDA (start, end) event pairs not yet timed

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
        self.ready = None  # CUDA event: copy finished
        self.consumed = None  # CUDA event: compute finished reading


def memcpy_peak_gbps(device: torch.device, mib: int = 256, reps: int = 5) -> float:
    """Host->device copy bandwidth from pinned memory (CUDA), or host memcpy bandwidth (CPU), in GB/s: best of
    ``reps`` copies of ``mib`` MiB."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = mib * (1 << 20)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(n, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(device)
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

    def __init__(self, device: torch.device, n_slots: int = 1) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.counters = TransferCounters()
        self.stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        self.slots = [_Slot() for _ in range(n_slots)]
        self.work: dict[str, torch.Tensor] = {}
        self.allocations = 0  # buffer (re)allocations, to show reuse
        self.kernel_staging_bytes = 0  # staging buffers held by a consumer that stages itself (count_streamed)

    # ---- host memory -------------------------------------------------------------------------
    def host_empty(self, shape, dtype) -> torch.Tensor:
        """Host tensor; pinned when a CUDA device is present so copies can be asynchronous."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.is_cuda)

    def host_zeros(self, shape, dtype) -> torch.Tensor:
        """Zeroed host tensor (pinned on CUDA): empty slots must hold finite values, since 0 * NaN is NaN."""
        return self.host_empty(shape, dtype).zero_()

    # ---- timing ------------------------------------------------------------------------------
    def _timed(self, fn, stream=None):
        c = self.counters
        c.copies += 1
        if self.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s = stream or torch.cuda.current_stream(self.device)
            start.record(s)
            out = fn()
            end.record(s)
            c._pending.append((start, end))
            if len(c._pending) > 256:
                self._harvest()
            return out
        t = time.perf_counter()
        out = fn()
        c.seconds += time.perf_counter() - t
        return out

    def _harvest(self) -> None:
        """Fold in the CUDA timings that have finished, without waiting (keeps the event list short)."""
        c = self.counters
        keep = []
        for s, e in c._pending:
            if e.query():
                c.seconds += s.elapsed_time(e) / 1e3
            else:
                keep.append((s, e))
        c._pending = keep

    def resolve_timings(self) -> None:
        """Fold finished CUDA event timings into ``counters.seconds`` (synchronizes; call off the hot path)."""
        c = self.counters
        if c._pending:
            torch.cuda.synchronize(self.device)
            c.seconds += sum(s.elapsed_time(e) for s, e in c._pending) / 1e3
            c._pending.clear()

    # ---- migrations (tier changes) -----------------------------------------------------------
    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device copy of a migrating tensor, counted as migration H2D."""
        self.counters.migration_h2d_bytes += t.numel() * t.element_size()
        return self._timed(lambda: t.to(self.device, non_blocking=self.is_cuda) if self.is_cuda else t.clone())

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Device -> host copy of a migrating tensor (pinned on CUDA), counted as migration D2H."""
        self.counters.migration_d2h_bytes += t.numel() * t.element_size()

        def copy():
            out = self.host_empty(t.shape, t.dtype)
            out.copy_(t, non_blocking=self.is_cuda)
            return out

        out = self._timed(copy)
        if self.is_cuda:
            # The host buffer is read by the CPU (quantization) or kept for later H2D; make sure it landed.
            torch.cuda.current_stream(self.device).synchronize()
        return out

    # ---- per-step streaming of host tiers ----------------------------------------------------
    def _buffer(self, store: dict, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = store.get(name)
        if buf is None or buf.numel() < like.numel() or buf.dtype != like.dtype:
            # Geometric headroom: host tiers grow a little at every reassignment, buffers should not follow suit.
            old = buf.numel() if buf is not None and buf.dtype == like.dtype else 0
            buf = torch.empty(max(like.numel(), old + old // 4, 1), dtype=like.dtype, device=self.device)
            store[name] = buf
            self.allocations += 1
        return buf[: like.numel()].view(like.shape)

    def stage(self, slot_idx: int, tag: tuple, tensors: dict[str, torch.Tensor]) -> None:
        """Start copying host ``tensors`` into staging slot ``slot_idx`` (async on CUDA).

        ``tag`` names the data (layer, step) so that :meth:`take` can tell a prefetch from stale data.
        """
        slot = self.slots[slot_idx]
        if self.is_cuda:
            if slot.consumed is not None:
                self.stream.wait_event(slot.consumed)
            # Allocated on the compute stream, which reads them last: a buffer dropped at growth is then safe to reuse.
            before = self.allocations
            pairs = [(self._buffer(slot.buffers, name, src), src) for name, src in tensors.items()]
            if self.allocations != before:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))  # fresh memory may still be in use
            with torch.cuda.stream(self.stream):

                def copy_all():
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)

                self.counters.stream_h2d_bytes += sum(src.numel() * src.element_size() for _, src in pairs)
                self._timed(copy_all, stream=self.stream)  # one event pair per layer and step
                slot.ready = torch.cuda.Event()
                slot.ready.record(self.stream)
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
        if self.is_cuda and slot.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.ready)
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
        if self.is_cuda:
            slot.consumed = torch.cuda.Event()
            slot.consumed.record(torch.cuda.current_stream(self.device))

    # ---- assembly buffers --------------------------------------------------------------------
    def work_buffers(self, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Reusable (B, H, cap, D) device buffers where one layer's kept K and V are assembled."""
        k = self.work.get("k")
        if k is None or tuple(k.shape) != tuple(shape) or k.dtype != dtype:
            # Zeros, not empty: unused columns are masked, but 0 * NaN would still poison the output.
            self.work["k"] = torch.zeros(shape, dtype=dtype, device=self.device)
            self.work["v"] = torch.zeros(shape, dtype=dtype, device=self.device)
            self.allocations += 1
        return self.work["k"], self.work["v"]

    def staging_bytes(self) -> int:
        """Device memory held by staging slots and work buffers."""
        n = sum(b.numel() * b.element_size() for s in self.slots for b in s.buffers.values())
        return n + sum(b.numel() * b.element_size() for b in self.work.values()) + self.kernel_staging_bytes

    def reset(self) -> None:
        self.resolve_timings() if self.is_cuda else None
        self.counters = TransferCounters()
        for s in self.slots:
            s.tag = None
