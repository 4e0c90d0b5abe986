"""The asynchrony seam: streams, events, pinned host memory and non-blocking copies, behind one small interface.

The transfer engine (:mod:`.engine`) and the host-attention worker (:mod:`kvtier.attention.host`) reach the device
only through a :class:`Seam`, so the code that orders asynchronous copies is one code path whatever the device:
:class:`CudaSeam` maps every call onto ``torch.cuda``; :class:`CpuSeam` makes every copy synchronous and every wait
a no-op (a CPU device has nothing in flight). The tests add a third, simulated asynchronous device
(``tests/simdevice.py``) under which the asynchronous branches run on a CPU and every ordering mistake is caught.

Every call that orders work (an event recorded, a stream or the host waiting) names its synchronization point,
one of :data:`SYNC_POINTS`: the simulated device can leave one out and show that a test fails without it.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch

#: Every synchronization point of the engine and the host-attention worker, and what it orders.
SYNC_POINTS: dict[str, str] = {
    "stage.after_consumed": "a staging copy waits until the compute stream has read the slot's previous data",
    "stage.after_alloc": "a staging copy into fresh device memory waits for the compute stream's earlier work",
    "stage.ready": "the side stream records that a slot's copies have landed",
    "take.wait_ready": "the compute stream waits for the slot's copies before reading them",
    "release.consumed": "the compute stream records that it has read a slot (the next copy into it may start)",
    "to_host.sync": "the host waits for a migrating token's device-to-host copy before reading or keeping it",
    "host.q_ready": "the compute stream records that the query's copy to the host has landed",
    "host.wait_q": "the host worker waits for the query before attending T1/T2 with it (and so for the previous "
                   "result's copy out of the pinned result buffer, issued before it on the same stream)",
    "host.f_ready": "the compute stream records that the merge factor's copy to the host has landed",
    "host.wait_f": "the host worker waits for the merge factor before folding the host tiers' scores",
}


class Seam:
    """How the engine reaches a device. ``asynchronous``: a copy may still be in flight when the call returns,
    so readers and writers must be ordered by events; false for a CPU device, where every call is immediate.

    Events are opaque: :meth:`record` makes one, the waits take it; ``None`` is an event that never needs waiting
    for (what a synchronous seam returns)."""

    asynchronous = False

    # ---- memory ------------------------------------------------------------------------------
    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory that asynchronous copies may read or write (pinned on CUDA)."""
        raise NotImplementedError

    def device_empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Device memory for staging and work buffers."""
        raise NotImplementedError

    def memory_allocated(self, device: torch.device) -> int | None:
        """Device bytes allocated now (None where the device keeps no such count)."""
        return None

    def max_memory_allocated(self, device: torch.device) -> int | None:
        return None

    # ---- streams and events ------------------------------------------------------------------
    def new_stream(self, device: torch.device) -> Any:
        return None

    def current_stream(self, device: torch.device) -> Any:
        return None

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        """Work issued inside runs on ``stream``."""
        yield

    def record(self, stream: Any, point: str) -> Any:
        """An event marking the work issued so far on ``stream``."""
        return None

    def wait_event(self, stream: Any, event: Any, point: str) -> None:
        """Work issued later on ``stream`` runs after ``event``."""

    def wait_stream(self, stream: Any, other: Any, point: str) -> None:
        """Work issued later on ``stream`` runs after everything issued so far on ``other``."""

    def sync_event(self, event: Any, point: str) -> None:
        """The calling host thread waits for ``event``."""

    def sync_stream(self, stream: Any, point: str) -> None:
        """The calling host thread waits for everything issued on ``stream``."""

    def synchronize(self, device: torch.device) -> None:
        """The host waits for all the device's work (off the hot path: timings, tests)."""

    # ---- copies ------------------------------------------------------------------------------
    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """``dst.copy_(src)`` on the current stream, asynchronous where the seam is."""
        return dst.copy_(src)

    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A new device tensor holding ``t`` (always a copy), asynchronous where the seam is."""
        return t.to(device, copy=True)

    # ---- timing (CUDA events; the engine times synchronous seams with the host clock) --------
    def timing_event(self, stream: Any) -> Any:
        return None

    def done(self, event: Any) -> bool:
        return True

    def elapsed_s(self, start: Any, end: Any) -> float:
        return 0.0

    # ---- the host worker ---------------------------------------------------------------------
    def executor(self, name: str) -> ThreadPoolExecutor:
        """One worker thread for host jobs that overlap the device's work."""
        return ThreadPoolExecutor(1, thread_name_prefix=name)


class CpuSeam(Seam):
    """A CPU device: host and device memory are the same, every copy completes before the call returns."""

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def device_empty(self, shape, dtype, device):
        return torch.empty(shape, dtype=dtype, device=device)


class CudaSeam(Seam):
    """A CUDA device: pinned host memory, side streams, events and non-blocking copies (``torch.cuda``)."""

    asynchronous = True

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def device_empty(self, shape, dtype, device):
        return torch.empty(shape, dtype=dtype, device=device)

    def memory_allocated(self, device):
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device):
        return torch.cuda.max_memory_allocated(device)

    def new_stream(self, device):
        return torch.cuda.Stream(device=device)

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    @contextlib.contextmanager
    def on_stream(self, stream):
        with torch.cuda.stream(stream):
            yield

    def record(self, stream, point):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event, point):
        if event is not None:
            stream.wait_event(event)

    def wait_stream(self, stream, other, point):
        stream.wait_stream(other)

    def sync_event(self, event, point):
        if event is not None:
            event.synchronize()

    def sync_stream(self, stream, point):
        stream.synchronize()

    def synchronize(self, device):
        torch.cuda.synchronize(device)

    def copy_(self, dst, src):
        return dst.copy_(src, non_blocking=True)

    def to_device(self, t, device):
        return t.to(device, non_blocking=True, copy=True)

    def timing_event(self, stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def done(self, event):
        return event.query()

    def elapsed_s(self, start, end):
        return start.elapsed_time(end) / 1e3


_override: Seam | None = None


def seam_for(device: torch.device) -> Seam:
    """The seam for ``device`` (CUDA or not), unless :func:`use_seam` chose one."""
    if _override is not None:
        return _override
    return CudaSeam() if torch.device(device).type == "cuda" else CpuSeam()


@contextlib.contextmanager
def use_seam(seam: Seam) -> Iterator[Seam]:
    """Caches created inside reach their device through ``seam`` (the tests' simulated device)."""
    global _override
    old, _override = _override, seam
    try:
        yield seam
    finally:
        _override = old


__all__ = ["SYNC_POINTS", "CpuSeam", "CudaSeam", "Seam", "seam_for", "use_seam"]
