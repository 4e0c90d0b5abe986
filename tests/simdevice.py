"""A simulated asynchronous device for the tests: CUDA's ordering rules enforced on a CPU, through the seam.

:class:`SimSeam` is a :class:`kvtier.transfer.seam.Seam` whose copies are not done when the call returns:

- a copy is queued on the stream it was issued on (the compute stream, or the engine's side stream) and *lands*
  only when an event covering it is waited on (by a stream or by the host), when its stream is synchronized, or
  at a later point a seeded scheduler picks (the device ran ahead); copies on one stream land in order;
- until it lands, a destination the host or the other stream would see holds poison (NaN, or an int8/long value
  that no real code writes), and reading it is a :class:`Hazard`: a read before the copy landed;
- a copy's source written (by the host, or by another stream) while the copy is pending is a hazard;
- a side-stream copy into device memory that the compute stream read (or had allocated: a caching allocator
  hands out memory the compute stream may still use) is a hazard unless the side stream waited for an event
  recorded after that use: a slot overwritten before its reader finished;
- device memory (staging, work buffers, T0 and the tail: every ``device_empty`` and ``to_device``) is a separate
  pool with its own accounting, and pinned host memory another: an op mixing the two, or a host-worker job
  touching device memory, is a hazard (on CUDA it would not even run);
- the host worker is a real thread whose jobs start after seeded delays.

Reads and writes are seen by a ``TorchDispatchMode`` (:meth:`SimSeam.watch`): every aten op's tensor arguments
are reads, the ones its schema marks as written are writes. Any one synchronization point
(:data:`kvtier.transfer.seam.SYNC_POINTS`) can be left out (``skip``): the mutation check.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvtier.transfer.seam import SYNC_POINTS, Seam


class Hazard(AssertionError):
    """An ordering mistake the real device would turn into wrong numbers (or an error)."""


@dataclass(eq=False)
class _Stream:
    name: str
    seq: int = 0  # work items issued so far
    known: dict = field(default_factory=dict)  # other stream -> the seq it is known to have reached (waits)
    pending: list = field(default_factory=list)  # copies issued here, not landed, in order


@dataclass(eq=False)
class _Event:
    stream: _Stream | None  # None: never recorded (waiting on it returns at once, as on CUDA)
    seq: int


@dataclass(eq=False)
class _Copy:
    stream: _Stream
    seq: int
    dst: torch.Tensor
    src: torch.Tensor
    value: torch.Tensor  # the source as the stream reads it
    deferred: bool  # dst holds poison until the copy lands


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.numel() else 0


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.int8:
        t.fill_(-128)  # quantize() clamps to [-127, 127]
    elif t.dtype in (torch.int32, torch.int64):
        t.fill_(-(1 << 30))


class SimSeam(Seam):
    """The simulated device. ``seed`` drives when copies land early and how long the host worker waits;
    ``skip``: synchronization points to leave out (their calls do nothing)."""

    asynchronous = True

    def __init__(self, seed: int = 0, skip: tuple[str, ...] = (), early_landing: float = 0.1,
                 worker_delay_s: float = 0.002) -> None:
        unknown = set(skip) - set(SYNC_POINTS)
        if unknown:
            raise ValueError(f"skip: unknown synchronization points {sorted(unknown)}; known: {sorted(SYNC_POINTS)}")
        self.rng = random.Random(seed)
        self.skip = set(skip)
        self.early_landing = early_landing
        self.worker_delay_s = worker_delay_s
        self.lock = threading.RLock()
        self.compute = _Stream("compute")
        self.streams = [self.compute]
        self.tls = threading.local()  # .stream (current), .quiet (inside the seam), .worker (a host job)
        self.host_mem: dict[int, torch.Tensor] = {}  # pinned storage ptr -> its buffer (held: ptrs stay unique)
        self.device_mem: dict[int, weakref.ref] = {}  # device-pool storage ptr -> (a weak reference to) the storage
        self.device_bytes = 0
        self.device_peak = 0
        self.compute_use: dict[int, int] = {}  # device ptr -> compute seq of its last read (or allocation)
        self.pending_dst: dict[int, list[_Copy]] = {}
        self.pending_src: dict[int, list[_Copy]] = {}
        self.used: set[str] = set()  # synchronization points called
        self.copies = self.landed_early = 0
        self.hazards: list[str] = []

    # ---- bookkeeping -------------------------------------------------------------------------
    def _current(self) -> _Stream:
        return getattr(self.tls, "stream", None) or self.compute

    @contextlib.contextmanager
    def _tls(self, name: str, value):
        """This thread's ``name`` set to ``value`` inside (the seam's own copies, the current stream)."""
        old = getattr(self.tls, name, None)
        setattr(self.tls, name, value)
        try:
            yield
        finally:
            setattr(self.tls, name, old)

    def _quiet(self):
        """Inside: this thread's ops are the seam's own (not checked)."""
        return self._tls("quiet", True)

    def _hazard(self, msg: str) -> None:
        self.hazards.append(msg)
        raise Hazard(msg)

    def is_device(self, t: torch.Tensor) -> bool:
        ref = self.device_mem.get(_ptr(t))
        return ref is not None and ref() is not None

    def is_host(self, t: torch.Tensor) -> bool:
        return _ptr(t) in self.host_mem

    def _land(self, stream: _Stream, upto: int) -> None:
        """Copies of ``stream`` up to seq ``upto`` have happened."""
        while stream.pending and stream.pending[0].seq <= upto:
            c = stream.pending.pop(0)
            if c.deferred:
                with self._quiet():
                    c.dst.copy_(c.value)
                self._unlist(self.pending_dst, _ptr(c.dst), c)
            self._unlist(self.pending_src, _ptr(c.src), c)

    @staticmethod
    def _unlist(table: dict, key: int, c: _Copy) -> None:
        lst = table.get(key, [])
        if c in lst:
            lst.remove(c)
            if not lst:
                table.pop(key)

    def _maybe_run_ahead(self) -> None:
        """The device may have finished some work already: land the oldest copy of a random stream (drawn on the
        main thread only, so that a seed replays the same landings)."""
        if not getattr(self.tls, "worker", False) and self.rng.random() < self.early_landing:
            busy = [s for s in self.streams if s.pending]
            if busy:
                s = self.rng.choice(busy)
                self._land(s, s.pending[0].seq)
                self.landed_early += 1

    def land_all(self) -> None:
        with self.lock:
            for s in self.streams:
                self._land(s, s.seq)

    # ---- memory ------------------------------------------------------------------------------
    def host_empty(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        with self.lock:
            self.host_mem[_ptr(t)] = t
            self.device_mem.pop(_ptr(t), None)
        return t

    def device_empty(self, shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        with self._quiet():
            _poison(t)  # uninitialised device memory
        nbytes = t.numel() * t.element_size()
        storage = t.untyped_storage()
        with self.lock:
            p = _ptr(t)
            self.device_mem[p] = weakref.ref(storage)
            self.device_bytes += nbytes
            self.device_peak = max(self.device_peak, self.device_bytes)
            self.compute.seq += 1
            self.compute_use[p] = self.compute.seq  # the allocator's last user may be the compute stream
        weakref.finalize(storage, self._freed, nbytes)  # the storage outlives the tensor while a view holds it
        return t

    def _freed(self, nbytes: int) -> None:
        with self.lock:
            self.device_bytes -= nbytes

    def memory_allocated(self, device):
        return self.device_bytes

    def max_memory_allocated(self, device):
        return self.device_peak

    # ---- streams and events ------------------------------------------------------------------
    def new_stream(self, device):
        with self.lock:
            s = _Stream(f"side{len(self.streams)}")
            self.streams.append(s)
            return s

    def current_stream(self, device):
        return self._current()

    def on_stream(self, stream):
        return self._tls("stream", stream)

    def _called(self, point: str) -> bool:
        """Note ``point`` as used; whether its call takes effect (not skipped)."""
        self.used.add(point)
        return point not in self.skip

    def record(self, stream, point):
        with self.lock:
            self._maybe_run_ahead()
            if not self._called(point):
                return _Event(None, 0)
            return _Event(stream, stream.seq)

    def _after(self, stream: _Stream, event: _Event | None) -> None:
        if event is None or event.stream is None or event.stream is stream:
            return
        if stream is self.compute:
            self._land(event.stream, event.seq)  # the compute stream runs eagerly: the copies land before it goes on
        stream.known[event.stream] = max(stream.known.get(event.stream, 0), event.seq)

    def wait_event(self, stream, event, point):
        with self.lock:
            if self._called(point):
                self._after(stream, event)
            self._maybe_run_ahead()

    def wait_stream(self, stream, other, point):
        with self.lock:
            if self._called(point):
                self._after(stream, _Event(other, other.seq))

    def sync_event(self, event, point):
        with self.lock:
            if self._called(point) and event is not None and event.stream is not None:
                self._land(event.stream, event.seq)

    def sync_stream(self, stream, point):
        with self.lock:
            if self._called(point):
                self._land(stream, stream.seq)

    def synchronize(self, device):
        self.land_all()

    # ---- copies ------------------------------------------------------------------------------
    def copy_(self, dst, src):
        with self.lock:
            s = self._current()
            self._check_access(reads=[src], writes=[dst], stream=s, op="copy_")
            if s is not self.compute and self.is_device(dst):
                last = self.compute_use.get(_ptr(dst), 0)
                if last > s.known.get(self.compute, 0):
                    self._hazard(f"a {s.name} copy overwrites device memory the compute stream may still be using "
                                 f"(its use at {last}, the stream waited only up to {s.known.get(self.compute, 0)})")
            with self._quiet():
                value = src.clone()
            s.seq += 1
            # the compute stream's own device-side destination is ready for its later work (stream order); a host
            # destination, or any destination of a side-stream copy, is not until an event says so
            deferred = s is not self.compute or self.is_host(dst)
            c = _Copy(s, s.seq, dst, src, value, deferred)
            with self._quiet():
                if deferred:
                    _poison(dst)
                    self.pending_dst.setdefault(_ptr(dst), []).append(c)
                else:
                    dst.copy_(value)
            s.pending.append(c)
            self.pending_src.setdefault(_ptr(src), []).append(c)
            self.copies += 1
            self._maybe_run_ahead()
            return dst

    def to_device(self, t, device):
        return self.copy_(self.device_empty(t.shape, t.dtype, device), t)

    def timing_event(self, stream):
        return _Event(stream, stream.seq)

    def done(self, event):
        return event.stream is None or not any(c.seq <= event.seq for c in event.stream.pending)

    # ---- the host worker ---------------------------------------------------------------------
    def executor(self, name):
        return _SimWorker(self, name)

    # ---- access checks (the dispatch mode) ---------------------------------------------------
    def _check_access(self, reads, writes, stream: _Stream | None, op: str) -> None:
        worker = getattr(self.tls, "worker", False)
        for t in reads:
            p = _ptr(t)
            if p in self.pending_dst:
                self._hazard(f"{op} reads memory whose copy has not landed ({self.pending_dst[p][0].stream.name} stream, "
                             f"{'host worker' if worker else 'main thread'})")
        for t in writes:
            p = _ptr(t)
            if p in self.pending_dst and op != "copy_":
                self._hazard(f"{op} writes memory a pending copy will overwrite")
            host_writer = worker or p in self.host_mem
            for c in self.pending_src.get(p, []):
                if host_writer or c.stream is not (stream or self.compute):
                    self._hazard(f"{op} writes the source of a pending {c.stream.name} copy "
                                 f"({'host' if host_writer else 'device'} write)")
        if op == "copy_":
            return
        touched = list(reads) + list(writes)
        dev = any(self.is_device(t) for t in touched)
        if worker and dev:
            self._hazard(f"{op} on the host worker touches device memory")
        if dev and any(_ptr(t) in self.host_mem for t in touched):
            self._hazard(f"{op} mixes pinned host memory and device memory")
        if not worker:
            for t in reads:
                p = _ptr(t)
                if p in self.compute_use:
                    self.compute.seq += 1
                    self.compute_use[p] = self.compute.seq

    @contextlib.contextmanager
    def watch(self):
        """Check every aten op of this thread (and the host worker's jobs) against the rules above; at the end,
        land what is still in flight."""
        with _Watch(self):
            yield self
        self.land_all()


_METADATA_ONLY = {torch.ops.aten.empty_like, torch.ops.aten.zeros_like, torch.ops.aten.ones_like, torch.ops.aten.full_like,
                  torch.ops.aten.new_empty, torch.ops.aten.new_zeros, torch.ops.aten.new_full,
                  torch.ops.aten.new_empty_strided}


class _Watch(TorchDispatchMode):
    def __init__(self, sim: SimSeam) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        if getattr(sim.tls, "quiet", False) or func.is_view or func.overloadpacket in _METADATA_ONLY:
            return func(*args, **kwargs)  # views and *_like allocations read no data
        reads, writes = [], []
        schema = func._schema
        named = dict(zip((a.name for a in schema.arguments), args))
        named.update(kwargs)
        for a in schema.arguments:
            v = named.get(a.name)
            ts = [x for x in tree_leaves(v) if isinstance(x, torch.Tensor)] if v is not None else []
            ts = [t for t in ts if t.numel()]
            reads += ts
            if a.alias_info is not None and a.alias_info.is_write:
                writes += ts
        if reads or writes:
            with sim.lock:
                sim._check_access(reads, writes, None, str(func))
        return func(*args, **kwargs)


class _SimWorker:
    """The host worker: a real thread; each job starts after a seeded delay and runs under the access checks."""

    def __init__(self, sim: SimSeam, name: str) -> None:
        self.sim = sim
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, fn):
        delay = self.sim.rng.random() * self.sim.worker_delay_s

        def job():
            time.sleep(delay)
            self.sim.tls.worker = True
            try:
                with _Watch(self.sim):
                    return fn()
            finally:
                self.sim.tls.worker = False

        return self.pool.submit(job)

    def shutdown(self, wait: bool = True) -> None:
        self.pool.shutdown(wait=wait)
