"""The engines' common ground (:class:`EngineBase`: a bounded wait list, one generation thread owning the model, submit / cancel / shutdown) and the static engine (:class:`Engine`: batches through generate).

The continuous engine (:mod:`kvtier.serve.continuous`, the default) is the other sibling of :class:`EngineBase`;
both send each request's text and ending through a :class:`~kvtier.serve.output.RowOutput`.

No HTTP here (that is :mod:`kvtier.serve.app`): requests come in as :class:`GenRequest`, and each one's events go
to its ``sink`` callable, from the generation thread:

- ``("delta", content, reasoning, logprobs)``: new text of the row (``logprobs``: the token's
  :class:`~kvtier.sampling.TokenLogprobs` when the request asked for them, else None);
- ``("done", finish_reason, usage)``: the row is finished (``stop``, ``length``, ``timeout``, ``cancelled``);
- ``("error", status, message)``: it never ran (expired in the queue, shutdown) or generation failed.

Batching: requests that arrive while the model is busy wait; when it is free, the oldest waiting request and every
other one with the same cache and sampling settings (up to ``max_batch``) start together as one left-padded batch
through ``model.generate`` with the request's cache. A row that finishes (end of sequence, its own ``max_tokens``, a
stop string, its deadline, or a client that went away) is masked from then on — generate pads it — and the others
go on; the batch ends when every row has finished. Everything per step happens in one ``StoppingCriteria``
(``_Rows``), which sees each step's new tokens and returns the finished rows: no monkey-patching of generate.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..sampling import SamplingParams
from .metrics import Metrics
from .output import RowOutput, safe_sink
from .prefix import BLOCK_TOKENS, DEFAULT_HOST_BYTES, PrefixConfig

log = logging.getLogger(__name__)



class QueueFull(Exception):
    """The wait list holds ``max_queue`` requests (HTTP 429)."""


class ShuttingDown(Exception):
    """The engine no longer takes requests (HTTP 503)."""


class NeverFits(Exception):
    """The request could not run even alone under the device-KV budget (HTTP 400, before any stream starts)."""


# The continuous engine plans each step by tokens (kvtier.serve.scheduler): running rows decode first, then prompt
# chunks fill up to max_batched_tokens, so a decoding row never waits behind more than that many prompt tokens (a
# prompt longer than it is prefilled over several steps). Larger steps prefill faster and let a burst of arrivals
# start together (rows admitted early decode between the burst's chunks: with 32 x 256-token prompts arriving at
# once, 1024-token steps gave the early rows ~7 waits of a whole step each, 2048-token steps ~3, and the ITL p99
# of vLLM's client at 32 clients went with them: 658 ms at 1024 vs vLLM's 113 at its 2048, 2-core Xeon with AMX,
# 0.5B bf16, 2026-12-07); smaller steps bound a long prompt's stall of the decoding rows tighter. The default is
# vLLM's own for its API server on a CPU (and on GPUs below 70 GB): 2048. `kvtier serve` prints it at startup.
BATCHED_TOKENS = 2048


def default_batched_tokens(device: torch.device | str = "cpu") -> int:
    """``--max-batched-tokens`` when not given (see the note above): 2048 on every device for now (measured on a
    CPU only)."""
    return BATCHED_TOKENS


@dataclass
class EngineConfig:
    """How the engine batches and bounds work; validated on construction."""

    max_batch: int = 8
    max_queue: int = 64
    batch_wait_s: float = 0.02  # after the first arrival, how long to wait for companions before starting
    stats_every: int = 16  # decode steps between refreshes of the live KV metrics
    scheduler: str = "continuous"  # or "static": batches through model.generate, as before continuous batching
    device_kv_budget: int | None = None  # bytes of device K/V for all rows (None: CUDA -> a fraction, CPU -> no limit)
    device_kv_fraction: float = 0.9  # on CUDA without a budget: this share of the memory free after the weights
    host_kv_budget: int | None = None  # bytes of host K/V (T1/T2) for all rows (None: half the RAM free at start)
    on_pressure: str = "demote"  # "demote" | "queue" | "recompute" (see kvtier.serve.scheduler)
    # continuous: tokens one step carries, decoding rows' one token each first, then prompt chunks (a longer prompt
    # is prefilled over several steps); None: default_batched_tokens() for the model's device, at least max_batch.
    max_batched_tokens: int | None = None
    # replaced by max_batched_tokens (prompts are chunked now); given, it is refused with a message saying so
    prefill_tokens: int | None = None
    # Prepare the model's step (kvtier.step.prepare_step: packed linears, fused norms) on the engine's own thread as
    # it starts, None: the model as given.
    # Why there: oneDNN weights reordered on the loading thread and multiplied on another ran 1.5x slower (8 rows,
    # 0.5B bf16, 2-core AMX Xeon: 125 vs 82 ms a step; reordered on the thread that multiplies, as fast as on one).
    linear: str | None = None
    # continuous: step Llama-form models through kvtier.step.direct (the same ops without transformers' module
    # machinery, checked bit for bit against the model's forward at start); False: the model's own forward.
    direct_step: bool = True
    # what a request's logprobs are of: raw_logprobs (the model's logits, vLLM's default) or processed_logprobs (the
    # logits each token was drawn from: penalties, temperature, top_k / top_p / min_p; kvtier.sampling.logprobs)
    logprobs_mode: str = "raw_logprobs"
    # continuous: reuse the K/V of prompts' whole blocks across requests (kvtier.serve.prefix), kept in host memory up
    # to prefix_cache_host_bytes, keyed per API key and cache_salt; the static scheduler has none
    prefix_cache: bool = True
    prefix_cache_host_bytes: int = DEFAULT_HOST_BYTES
    prefix_block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        from ..sampling.logprobs import check_mode
        from .scheduler import PRESSURE_MODES

        check_mode(self.logprobs_mode)
        PrefixConfig(self.prefix_cache, self.prefix_cache_host_bytes, self.prefix_block_tokens)

        from ..step import linear_mode

        if self.linear is not None:
            linear_mode(self.linear)  # the one check of the names: "linear must be one of [...], got ..."
        if self.scheduler not in ("continuous", "static"):
            raise ValueError(f"scheduler (--scheduler) must be 'continuous' or 'static', got {self.scheduler!r}")
        if self.on_pressure not in PRESSURE_MODES:
            raise ValueError(f"on_pressure (--on-pressure) must be one of {', '.join(PRESSURE_MODES)}, got {self.on_pressure!r}")
        for name in ("device_kv_budget", "host_kv_budget"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be a number of bytes >= 1, got {v!r}")
        f = self.device_kv_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"device_kv_fraction (--device-kv-fraction) must be in (0, 1], got {f!r}")
        if self.scheduler == "static" and (self.device_kv_budget is not None or self.on_pressure != "demote"):
            raise ValueError("--device-kv-budget and --on-pressure need --scheduler continuous (the static scheduler "
                             "admits by count)")
        if self.prefill_tokens is not None:
            raise ValueError("prefill_tokens (--prefill-tokens) was replaced by max_batched_tokens "
                             "(--max-batched-tokens): the tokens of a whole step, decoding rows first, then prompt "
                             "chunks (a prompt longer than that is prefilled over several steps)")
        for name in ("max_batch", "max_queue", "stats_every", "max_batched_tokens"):
            v = getattr(self, name)
            if v is None and name == "max_batched_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, got {v!r}")
        if self.max_batched_tokens is not None and self.max_batched_tokens < self.max_batch:
            raise ValueError(f"max_batched_tokens (--max-batched-tokens) must be at least max_batch (--max-batch "
                             f"{self.max_batch}): every running row decodes one token a step; got "
                             f"{self.max_batched_tokens}")
        if isinstance(self.batch_wait_s, bool) or not isinstance(self.batch_wait_s, (int, float)) or not 0 <= self.batch_wait_s <= 10:
            raise ValueError(f"batch_wait_s (--batch-wait) must be a number of seconds in [0, 10], got {self.batch_wait_s!r}")

    def resolve_device_budget(self, model) -> int | None:
        """The device-KV budget in bytes: the one given; on CUDA ``device_kv_fraction`` of the memory free now
        (after the weights); on a CPU device none (any value given is honoured as if the memory were HBM)."""
        if self.device_kv_budget is not None:
            return self.device_kv_budget
        dev = getattr(model, "device", torch.device("cpu"))
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            return int(free * self.device_kv_fraction)
        return None

    def resolve_batched_tokens(self, model) -> int:
        """Tokens a step carries: the number given, else :func:`default_batched_tokens` for the model's device (at
        least ``max_batch``)."""
        if self.max_batched_tokens is not None:
            return self.max_batched_tokens
        return max(self.max_batch, default_batched_tokens(getattr(model, "device", torch.device("cpu"))))

    def resolve_host_budget(self) -> int | None:
        """The host-KV budget in bytes: the one given, else half the RAM available now (None if unknown)."""
        if self.host_kv_budget is not None:
            return self.host_kv_budget
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.5)
        except (ValueError, OSError, AttributeError):
            return None


@dataclass(eq=False)  # compared by identity: two equal-looking requests are still two requests
class GenRequest:
    """One request: prompt ids, limits, cache and sampling settings, and where its events go."""

    prompt_ids: list[int]
    max_tokens: int
    sink: Callable[[tuple], None]
    policy: str = "full"
    params: dict = field(default_factory=dict)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # sampling: the row's own generator (None: a fresh random seed)
    ignore_eos: bool = False  # decode through end-of-sequence tokens (they are not sent), up to max_tokens
    min_tokens: int = 0  # no end-of-sequence token is drawn before this many tokens (vLLM's min_tokens)
    logprobs: int | None = None  # each token's log-probability and this many likeliest alternatives (None: none)
    deadline: float = float("inf")  # time.monotonic() after which the request ends with "timeout"
    separate_reasoning: bool = True
    in_think: bool = False
    prefix_salt: bytes = b""  # the prefix cache's salt (kvtier.serve.prefix.salt_of: its API key and cache_salt)
    id: int = field(default_factory=itertools.count().__next__)
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)

    def sampling(self) -> SamplingParams:
        """Its sampling settings, checked (ValueError naming the field)."""
        return SamplingParams(float(self.temperature), float(self.top_p), int(self.top_k), float(self.min_p),
                              float(self.presence_penalty), float(self.frequency_penalty),
                              float(self.repetition_penalty))

    def batch_key(self) -> tuple:
        """Requests share a batch only if they share one cache object's settings and one sampler."""
        sp = self.sampling()
        return (self.policy, tuple(sorted((k, repr(v)) for k, v in self.params.items())),
                sp if not sp.greedy else SamplingParams(0.0), self.ignore_eos, self.min_tokens)

    def cancel(self) -> None:
        """The client went away: the row is masked at the next step, or the request leaves the wait list."""
        self.cancelled = True


def _kv_by_location(stats: dict) -> dict[tuple[str, str], int]:
    b = stats.get("bytes", {})
    return {("T0", "device"): int(b.get("T0", 0)), ("T1", "host"): int(b.get("T1", 0)),
            ("T2", "host"): int(b.get("T2", 0))}


class _Rows:
    """The batch's rows, stepped by generate: a ``StoppingCriteria`` (``(input_ids, scores) -> done (B,)``); each
    row's text and ending is its :class:`~kvtier.serve.output.RowOutput` (the continuous engine's rows use it too)."""

    def __init__(self, engine: "Engine", batch: list[GenRequest], cache, eos: set[int]):
        self.engine, self.batch, self.cache = engine, batch, cache
        self.outs = [RowOutput(r, engine.tokenizer, eos) for r in batch]
        self.steps = 0
        self.last = {"streamed": 0, "moved": 0, "retiers": 0}

    @property
    def done(self) -> list[bool]:
        return [o.done for o in self.outs]

    def __call__(self, input_ids: torch.Tensor, scores=None, **kw) -> torch.Tensor:
        new = input_ids[:, -1].tolist()  # the tokens go to the host anyway: they are streamed
        self.steps += 1
        now = time.monotonic()
        m = self.engine.metrics
        if self.steps == 1:
            for r in self.batch:
                m.observe_ttft(now - r.arrived)
        produced = 0
        for i, out in enumerate(self.outs):
            if out.done:
                continue
            produced += 1
            reason = out.push(new[i], now, self.engine.cancel_all)
            if reason is not None:
                self._finish(i, reason)
        m.add_tokens(produced)
        if self.steps % self.engine.cfg.stats_every == 0:
            self._update_metrics()
        return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)

    def _finish(self, i: int, reason: str) -> None:
        out = self.outs[i]
        if out.done:
            return
        r = self.batch[i]
        stats = self.cache.stats()
        usage = {
            **out.usage(),
            "kvtier": {
                "policy": r.policy,
                "params": dict(r.params),
                "sampling": r.sampling().as_dict(),
                "batch_size": len(self.batch),
                "tier_tokens": self.cache.row_tokens(i),
                "batch_peak_device_kv_bytes": stats.get("peak_device_kv_bytes"),  # the whole batch's, so far
                "streamed_bytes": stats["transfer"]["stream_h2d_bytes"] / len(self.batch),  # per row: batch / rows
                "moved_bytes": (stats["transfer"]["migration_h2d_bytes"] + stats["transfer"]["migration_d2h_bytes"])
                / len(self.batch),
                "reassignments": stats.get("retiers", 0),
                "seconds": time.monotonic() - r.arrived,
            },
        }
        self.engine.metrics.finished[reason] += 1
        self.engine._running -= 1
        out.finish(reason, usage)

    def _update_metrics(self, final: bool = False) -> None:
        s = self.cache.stats()
        m = self.engine.metrics
        m.kv_bytes = {} if final else _kv_by_location(s)
        tr = s["transfer"]
        now = {"streamed": tr["stream_h2d_bytes"], "moved": tr["migration_h2d_bytes"] + tr["migration_d2h_bytes"],
               "retiers": s.get("retiers", 0)}
        m.streamed_bytes += now["streamed"] - self.last["streamed"]
        m.moved_bytes += now["moved"] - self.last["moved"]
        m.reassignments += now["retiers"] - self.last["retiers"]
        self.last = now


class EngineBase:
    """What both engines share: the model, a wait list bounded by ``max_queue``, one generation thread, submit /
    cancel / shutdown, the metrics. The thread's loop is the engine's own (:class:`Engine`: static batches through
    generate; :class:`kvtier.serve.continuous.ContinuousEngine`: continuous batching); each request's output goes
    through a :class:`~kvtier.serve.output.RowOutput` in both."""

    # sampling fields a request may set to other than their inert value: temperature, top_p, top_k and min_p in both
    # engines; the penalties read each row's own history, which only the continuous engine keeps; logprobs come from
    # the continuous engine's own sampling step (generate's are not read)
    penalties = False
    logprobs = False

    def __init__(self, model, tokenizer, cfg: EngineConfig | None = None):
        from ..cache.sliding import layer_plan

        if layer_plan(model.config) is not None:
            # the device-KV budget counts the tiers' bytes, not a hybrid model's sliding windows: refuse rather than
            # overrun it
            raise ValueError("kvtier serve does not serve hybrid sliding/full models (Gemma 3) yet: its device-KV "
                             "budget does not count the sliding layers' windows. Use kvtier.make_cache with generate, "
                             "or kvtier eval, for this model")
        self.model, self.tokenizer = model, tokenizer
        self.cfg = cfg or EngineConfig()
        self.metrics = Metrics()
        self.waiting: deque[GenRequest] = deque()
        self._cv = threading.Condition()
        self._stop = False
        self.cancel_all = False
        self._running = 0
        self._thread: threading.Thread | None = None
        self.live_caches: "weakref.WeakSet[Any]" = weakref.WeakSet()  # a cache still alive after its batch is a leak
        eos = getattr(model.generation_config, "eos_token_id", None)
        self.eos = {int(x) for x in ([eos] if isinstance(eos, int) else (eos or []))}
        if tokenizer.eos_token_id is not None:
            self.eos.add(int(tokenizer.eos_token_id))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos or {0})
        self.budget = self.host_budget = None

    # ---- the server's side ---------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    # the wait list (the static engine's deque; the continuous engine's scheduler holds its own): under self._cv
    def _queue_add(self, req: GenRequest) -> None:
        self.waiting.append(req)

    def _queue_remove(self, req: GenRequest) -> bool:
        """Take ``req`` off the wait list; False if it is not on it (running, finished)."""
        try:
            self.waiting.remove(req)
            return True
        except ValueError:
            return False

    def _queue_list(self) -> list[GenRequest]:
        return list(self.waiting)

    @property
    def running(self) -> int:
        return self._running

    def start(self) -> "Engine":
        """Start the generation thread; returns once it has prepared the model (``cfg.linear``) and its step
        (:meth:`_prepared`: the continuous engine's check of its direct step)."""
        if self._thread is None:
            prepared = threading.Event()

            def run() -> None:
                try:
                    try:
                        if self.cfg.linear is not None:
                            from ..step import prepare_step

                            prepare_step(self.model, self.cfg.linear)
                    except Exception:
                        log.exception("preparing the model's step (packed linears, fused norms) failed; serving it "
                                      "as loaded")
                    try:
                        self._prepared()
                    except Exception:
                        log.exception("preparing the engine's step failed")
                finally:
                    prepared.set()
                self._loop()

            self._thread = threading.Thread(target=run, name="kvtier-engine", daemon=True)
            self._thread.start()
            prepared.wait()
        return self

    def _prepared(self) -> None:
        """On the engine's thread, after the model's step is prepared and before the first request: nothing here."""

    def submit(self, req: GenRequest) -> None:
        """Queue ``req``; raises :class:`QueueFull` beyond ``max_queue`` waiting, :class:`ShuttingDown` after
        :meth:`shutdown` began."""
        with self._cv:
            if self._stop:
                raise ShuttingDown("the server is shutting down")
            if self.queue_depth >= self.cfg.max_queue:
                raise QueueFull(f"{self.queue_depth} requests are waiting (--max-queue {self.cfg.max_queue})")
            self._queue_add(req)
            self._cv.notify()

    def cancel(self, req: GenRequest) -> None:
        """The client went away: a waiting request leaves the wait list now (its slot is free at once); a
        running row is masked at the next step."""
        req.cancel()
        with self._cv:
            self._queue_remove(req)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop taking requests, let the running batch and the wait list finish for up to ``grace_s``, then
        cancel what is left (waiting requests get an error event, running rows end ``cancelled``)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        t_end = time.monotonic() + grace_s
        while time.monotonic() < t_end and (self.queue_depth or self._running):
            time.sleep(0.05)
        self.cancel_all = True
        with self._cv:
            self._cv.notify_all()
        # the generation thread ends what is left (waiting requests get 503; a preempted one, which has streamed,
        # ends as a row, "cancelled"); without one, or if it does not, this thread does
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=30)
        if self.queue_depth:
            self._expire_waiting()

    def describe(self) -> str:
        """The startup line's account of how this engine schedules."""
        raise NotImplementedError

    def _expire_waiting(self) -> None:
        """Take cancelled and expired requests off the wait list (and all of them once shutdown cancels); each one
        not cancelled by its client gets its error event (504 timed out, 503 shutdown), unless
        :meth:`_ended_waiting` ends it otherwise."""
        now = time.monotonic()
        with self._cv:
            gone = [r for r in self._queue_list() if r.cancelled or now > r.deadline or self.cancel_all]
            for r in gone:
                self._queue_remove(r)
        for r in gone:
            if not self._ended_waiting(r, now) and not r.cancelled:
                safe_sink(r, ("error", 504 if now > r.deadline else 503, "the request timed out while waiting"
                              if now > r.deadline else "the server shut down before this request started"))

    def _ended_waiting(self, r: GenRequest, now: float) -> bool:
        """A request left the wait list cancelled or expired: True if the engine ended it itself (the continuous
        engine's preempted rows, which have streamed already)."""
        return False

    def _loop(self) -> None:
        """The generation thread's loop, after :meth:`_prepared`; returns when the engine stops."""
        raise NotImplementedError


class Engine(EngineBase):
    """The static engine: batches of up to ``max_batch`` requests with one cache and sampler through generate (see
    the module doc); ``--scheduler static``."""

    def describe(self) -> str:
        return f"scheduler static (batches of up to {self.cfg.max_batch} through generate)"

    # ---- the generation thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.waiting and not self._stop:
                    self._cv.wait()
                if not self.waiting:
                    return
            if len(self.waiting) < self.cfg.max_batch and self.cfg.batch_wait_s:
                time.sleep(self.cfg.batch_wait_s)  # let requests that arrive together start together
            batch = self._take()
            if batch:
                self._run(batch)

    def _take(self) -> list[GenRequest]:
        self._expire_waiting()
        with self._cv:
            keep = self.waiting
            if not keep:
                batch = []
            else:
                key = keep[0].batch_key()
                batch = [r for r in keep if r.batch_key() == key][: self.cfg.max_batch]
                ids = {r.id for r in batch}
                self.waiting = deque(r for r in keep if r.id not in ids)
            self._running += len(batch)
        return batch

    def _run(self, batch: list[GenRequest]) -> None:
        from transformers import StoppingCriteriaList

        import kvtier

        from ..compat import cache_kw
        from ..step.decode import decode_kw

        n = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, n - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[i, n - len(r.prompt_ids):] = 1
        dev = self.model.device
        rows = None
        try:
            cache = kvtier.make_cache(batch[0].policy, self.model, **batch[0].params)
            self.live_caches.add(cache)
            rows = _Rows(self, batch, cache, self.eos)
            gen: dict = dict(max_new_tokens=max(r.max_tokens for r in batch), pad_token_id=self.pad_id,
                             stopping_criteria=StoppingCriteriaList([rows]))
            gen.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            if batch[0].ignore_eos:  # generate's own end-of-sequence check would stop the rows (_Rows decides)
                gen["eos_token_id"] = None
            elif batch[0].min_tokens:  # transformers' own processor masks the end-of-sequence tokens until then
                gen["min_new_tokens"] = batch[0].min_tokens
                gen["eos_token_id"] = sorted(self.eos)
            if not batch[0].sampling().greedy:  # each row samples from its own seed: what it would draw alone
                import random

                from transformers import LogitsProcessorList

                from ..eval.sampling import RowSampler

                seeds = [r.seed if r.seed is not None else random.getrandbits(62) for r in batch]
                sp = batch[0].sampling()
                gen["logits_processor"] = LogitsProcessorList([RowSampler(seeds, sp.temperature, sp.top_p, dev,
                                                                          sp.top_k, sp.min_p)])
            self.metrics.batches += 1
            self.metrics.prompt_tokens += sum(len(r.prompt_ids) for r in batch)
            with torch.no_grad():
                self.model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **cache_kw(self.model, cache), **gen,
                                    **decode_kw())
            for i in range(len(batch)):  # generate stops at max_new_tokens: rows never marked are at their limit
                rows._finish(i, "length")
            rows._update_metrics(final=True)
        except Exception as e:  # a failed batch ends its rows with an error; the server goes on
            log.exception("generation failed for a batch of %d", len(batch))
            msg = f"generation failed: {type(e).__name__}: {e}"
            for i, r in enumerate(batch):
                if rows is None:
                    self._running -= 1
                    safe_sink(r, ("error", 500, msg))
                elif rows.outs[i].fail(500, msg):  # False: the row had ended already
                    self._running -= 1
            self.metrics.kv_bytes = {}
        finally:
            rows = cache = None  # noqa: F841  (drop the batch's KV before the next one is built)
            gc.collect()


