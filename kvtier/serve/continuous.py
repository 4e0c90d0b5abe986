"""The continuous-batching engine: its own decode loop over rows, each with its own cache; every step carries the running rows' next tokens and prompt chunks up to a token budget, under a device-KV budget.

Per loop iteration (one generation thread owns the model): schedule -> one forward over the plan -> postprocess.
1. the wait list loses requests that were cancelled or expired (error events, as in the static engine);
2. :class:`kvtier.serve.scheduler.Scheduler` plans the step from numbers alone: each running row's memory as its
   cache reports it (:meth:`~kvtier.cache.tiered.KVTierCache.budget_view`) and each waiting request's needs give the
   memory decision — T0 limits (demotion to T1, exact; or growth back), preemptions (the row's cache is dropped and
   its request goes back to the head of the wait list with what it generated, to be recomputed: nothing it already
   sent is sent again), rejections (HTTP 400 naming ``--device-kv-budget``) and admissions; then the token plan:
   every row past its prompt decodes one token, then the prompts still prefilling (oldest first) and the admitted
   requests' prompts take chunks of what is left of ``max_batched_tokens`` (``--max-batched-tokens``; by default
   per device: :func:`~kvtier.serve.engine.default_batched_tokens`). A prompt longer than that is prefilled over
   several steps in its own cache (:meth:`~kvtier.cache.tiered.KVTierCache.open_prompt`), so a decoding row never
   waits behind more than one step's budget of prompt tokens;
3. one forward over the plan (a packed :class:`kvtier.cache.rows.RowsCache`): a decoding row brings its next
   token, a prefilling row its chunk, laid end to end in one sequence; each row's attention runs through its own
   cache, exactly as if it ran alone; a row whose prompt is complete draws its next token from its own settings
   and seed (a row still prefilling draws nothing);
4. rows that finished (end of sequence, ``max_tokens``, a stop string, deadline, a client that left) free their
   slot and their bytes at once; the device bytes of all rows are summed from the caches and checked against the
   budget after every step (``kvtier_device_kv_peak_bytes``; a breach is counted and logged). What each step
   carried is kept in :attr:`ContinuousEngine.step_log` (the last 4096 steps).

Events go to each request's ``sink`` exactly as from :class:`kvtier.serve.engine.Engine` (the static engine).
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections import deque

import torch

from ..attention.fused_cpu import argmax_rows
from ..cache.base import model_shape
from ..cache.state import full_columns, tail_columns
from ..config import TierConfig
from ..step.decode import step_for
from ..step.direct import rows_logits
from ..tiers.layout import grown_capacity
from .engine import EngineBase, GenRequest, NeverFits
from .output import RowOutput, safe_sink
from .scheduler import Plan, PromptNeed, RowNeed, Scheduler, WaitNeed

log = logging.getLogger(__name__)


class _Row:
    """One running request: its cache, its text state, its sampler and what it generated."""

    def __init__(self, req: GenRequest, tokenizer, eos: set[int]) -> None:
        self.req = req
        self.cache = None
        self.out = RowOutput(req, tokenizer, eos)  # its text, stop strings and ending (as the static engine's rows)
        self.generated: list[int] = []  # every token drawn (an end-of-sequence token included)
        self.sampler = None
        if req.temperature > 0:
            from ..eval.sampling import RowSampler

            seed = req.seed if req.seed is not None else random.getrandbits(62)
            self.sampler = RowSampler([seed], req.temperature, req.top_p)
        self.preemptions = 0
        self.recomputed = 0
        self.demoted = 0
        self.waited = 0.0
        self.queued_at = req.arrived
        self.first_token = False
        self.peak_device = 0
        self.left: list[int] = []  # prompt tokens (and, after a preemption, generated ones) not yet prefilled
        self.chunkable = True  # its cache takes the prompt in chunks (else whole, in one step)

    @property
    def done(self) -> bool:
        return self.out.done


class ContinuousEngine(EngineBase):
    """Continuous batching over one-row caches, admitted under ``cfg.device_kv_budget`` (see the module doc)."""

    def __init__(self, model, tokenizer, cfg=None):
        super().__init__(model, tokenizer, cfg)
        self.rows: list[_Row] = []
        self._resumed: dict[int, _Row] = {}  # request id -> its row, while a preempted request waits
        self._loop_hook = None
        self.budget = self.cfg.resolve_device_budget(model)
        self.host_budget = self.cfg.resolve_host_budget()
        self.max_batched_tokens = self.cfg.resolve_batched_tokens(model)
        self.scheduler = Scheduler(self.budget, self.host_budget, self.cfg.on_pressure, self.cfg.max_batch,
                                   self.max_batched_tokens)
        # what each step carried: {"step", "decode": [request ids], "chunks": [(request id, tokens)], "ms"}
        self.step_log: deque[dict] = deque(maxlen=4096)
        m = self.metrics
        m.device_kv_budget = self.budget
        layers, heads, head_dim = model_shape(model.config)
        elem = torch.empty(0, dtype=model.dtype).element_size()
        self.col_bytes = layers * heads * head_dim * 2 * elem  # one token, all layers, K and V
        self._direct = None  # kvtier.step.direct's step, once checked (start()), else the model's forward

    def _prepared(self) -> None:
        if self.cfg.direct_step:
            self._direct = step_for(self.model)

    @property
    def running(self) -> int:
        return self._running

    def describe(self) -> str:
        b = "no device-KV budget" if self.budget is None else f"device-KV budget {self.budget / 2**20:.1f} MiB"
        h = "" if self.host_budget is None else f", host-KV budget {self.host_budget / 2**30:.1f} GiB"
        step = "direct step" if self._direct is not None else "the model's forward"
        return (f"scheduler continuous (up to {self.cfg.max_batch} rows, {self.max_batched_tokens} tokens a step, "
                f"prompts chunked, "
                f"{step}), {b}{h}, on pressure: {self.cfg.on_pressure}")

    # ---- the generation thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.waiting and not self.rows and not self._stop:
                    self._cv.wait()
                if not self.waiting and not self.rows:
                    return
            try:
                hook, self._loop_hook = self._loop_hook, None
                if hook is not None:  # tests: run something on this thread, between two steps
                    hook()
                self._expire_waiting()
                plan = self._schedule()
                if plan is not None and plan.tokens.tokens:
                    self._step(plan)
                elif self.waiting and not (plan and plan.tokens.joined):
                    time.sleep(0.01)  # nothing fits and nothing runs: requests are being rejected or expire
            except Exception as e:  # a failed step ends its rows with an error; the server goes on
                log.exception("a continuous step failed")
                for row in list(self.rows):
                    self._fail(row, e)
            if not self.rows and not self.waiting:
                gc.collect()  # idle: the released caches' objects go too (live caches back to 0)

    def _ended_waiting(self, r: GenRequest, now: float) -> bool:
        row = self._resumed.pop(r.id, None)
        if row is None:
            return False
        # a preempted request (still counted running): it has streamed, so it ends as a row
        self.rows.append(row)
        self._finish(row, "cancelled" if r.cancelled or self.cancel_all else "timeout")
        return True

    # ---- scheduling ---------------------------------------------------------------------------------
    def _row_need(self, row: _Row) -> RowNeed:
        """The row's memory as its cache reports it before its next update (its chunk, or one decode token)."""
        n = self._next_chunk(row)
        v = row.cache.budget_view(n)
        n_max = len(row.req.prompt_ids) + row.req.max_tokens
        return RowNeed(key=row.req.id, next_bytes=v.next_bytes, col_bytes=self.col_bytes, reserve=v.reserve,
                       can_limit=v.can_limit, generated=len(row.generated), arrived=row.req.arrived,
                       host_bytes=v.host_bytes, host_next=v.host_next, t0_limit=v.t0_limit, tokens=v.tokens,
                       peak_bytes=self._peak_bytes(n_max, row.req.policy), device_tokens=v.device_tokens)

    def _next_chunk(self, row: _Row) -> int:
        """Tokens the row brings to its next step: one to decode, else (at most) its next prompt chunk."""
        if not row.left:
            return 1
        if not row.chunkable:
            return len(row.left)
        limited = getattr(row.cache, "device_limit", None) is not None  # (a head-wise baseline's cache has none)
        cap = self._reserve(row.req) if limited else self.max_batched_tokens
        return min(len(row.left), cap)

    def _reserve(self, req: GenRequest) -> int:
        return tail_columns(int(req.params.get("retier_interval", TierConfig.retier_interval)))

    def _peak_bytes(self, n: int, policy: str | None = None) -> int:
        """Device bytes of a row of ``n`` tokens all on the device under its own policy: a ``full`` row's one buffer
        (``full_columns``), any other row's T0 at its grown capacity beside a whole tail (the larger of the two when
        the policy is not known). A ``full`` row reserved at the tiered size took 8% more than its buffers (seven
        rows where the budget held eight)."""
        full = full_columns(n)
        tiered = grown_capacity(n, 0) + tail_columns(TierConfig.retier_interval)
        if policy is not None:
            from ..policies import POLICIES

            return (full if getattr(POLICIES[policy], "family", "") == "reference" else tiered) * self.col_bytes
        return max(full, tiered) * self.col_bytes

    def _wait_need(self, req: GenRequest) -> WaitNeed:
        from ..policies import POLICIES

        n = self._tokens(req)
        cls = POLICIES[req.policy]
        can_limit = getattr(cls, "family", "") in ("reference", "hierarchy") and req.params.get("rest_tier", "T1") == "T1"
        reserve = self._reserve(req)
        return WaitNeed(key=req.id, start_bytes=self._peak_bytes(n + 1, req.policy), min_bytes=reserve * self.col_bytes,
                        peak_bytes=self._peak_bytes(len(req.prompt_ids) + req.max_tokens, req.policy),
                        col_bytes=self.col_bytes, reserve=reserve, can_limit=can_limit, tokens=n)

    def _chunkable(self, req: GenRequest) -> bool:
        """Whether the request's cache takes its prompt in chunks: the tiered family (a head-wise baseline scores
        its whole prompt at prefill)."""
        from ..policies import POLICIES

        return getattr(POLICIES[req.policy], "family", "") in ("reference", "hierarchy", "ablation")

    def _tokens(self, req: GenRequest) -> int:
        """Tokens a waiting request prefills when it starts: its prompt, and after a preemption what it generated."""
        return len(req.prompt_ids) + (len(self._resumed[req.id].generated) if req.id in self._resumed else 0)

    def _never_fits(self, r: GenRequest, need: WaitNeed) -> str:
        """Why ``r`` cannot run even alone under the budget (the 400's message)."""
        mode = self.cfg.on_pressure
        what = "its prompt + max_tokens" if mode == "queue" else "its prompt" if mode == "recompute" or not \
            need.can_limit else f"its device tail ({need.reserve} tokens)"
        return (f"--device-kv-budget is {self.budget} bytes, and this request needs at least {need.least(mode)} "
                f"bytes of device KV for {what} ({len(r.prompt_ids)} prompt tokens, --on-pressure {mode}); raise "
                "--device-kv-budget or send a shorter request")

    def submit(self, req: GenRequest) -> None:
        """Queue ``req``, after refusing one that could not run even alone under the budget (:class:`NeverFits`:
        a 400 before a streamed response starts, rather than an error event inside it)."""
        if self.budget is not None:
            need = self._wait_need(req)
            if need.least(self.cfg.on_pressure) > self.budget:
                raise NeverFits(self._never_fits(req, need))
        super().submit(req)

    def _schedule(self) -> Plan | None:
        """Plan the step (:class:`~kvtier.serve.scheduler.Scheduler`) and apply its memory decision and
        admissions; returns the plan (None when nothing runs or waits)."""
        with self._cv:
            waiting = list(self.waiting)
        if not waiting and not self.rows:
            return None
        if self.budget is None:
            # only the row count decides: the rows' byte needs (~40 us a row) are not gathered
            rows = [RowNeed(key=r.req.id, next_bytes=0, col_bytes=0, reserve=0, can_limit=False, generated=0,
                            arrived=0.0) for r in self.rows]
            needs = [WaitNeed(key=r.id, start_bytes=0, min_bytes=0, peak_bytes=0, col_bytes=0, reserve=0,
                              can_limit=False) for r in waiting]
        else:
            rows = [self._row_need(r) for r in self.rows]
            needs = [self._wait_need(r) for r in waiting]
        decoding = [r.req.id for r in self.rows if not r.left]
        prefilling = [PromptNeed(r.req.id, len(r.left), r.chunkable) for r in self.rows if r.left]
        prompts = {r.id: PromptNeed(r.id, self._tokens(r), self._chunkable(r)) for r in waiting}
        plan = self.scheduler.plan(rows, needs, decoding, prefilling, prompts)
        d = plan.memory
        by_id = {r.req.id: r for r in self.rows}
        for key in d.preempt:
            self._preempt(by_id[key])
        for key, t0 in d.limits.items():
            row = by_id.get(key)
            if row is None or row.done:
                continue
            row.cache.limit_device(t0)
        reqs = {r.id: r for r in waiting}
        for key in d.reject:
            r = reqs[key]
            with self._cv:
                self._remove_waiting(r)
            self._resumed.pop(r.id, None)
            safe_sink(r, ("error", 400, self._never_fits(r, self._wait_need(r))))
        limits = dict(d.admit)
        for key in plan.tokens.joined:
            r = reqs[key]
            with self._cv:
                if not self._remove_waiting(r):
                    continue  # cancelled meanwhile: its chunk is dropped from the step below
            self._start(r, limits.get(key))
        return plan

    def _remove_waiting(self, r: GenRequest) -> bool:
        try:
            self.waiting.remove(r)
            return True
        except ValueError:
            return False

    # ---- rows ---------------------------------------------------------------------------------------
    def _start(self, req: GenRequest, t0: int | None) -> None:
        """Give ``req`` a row and a new empty cache; the next step prefills it (its prompt and, after a preemption,
        what it generated) beside the running rows and draws its next token."""
        import kvtier

        row = self._resumed.pop(req.id, None)
        resumed = row is not None
        if row is None:
            row = _Row(req, self.tokenizer, self.eos)
            self._running += 1
        row.waited += time.monotonic() - row.queued_at
        self.rows.append(row)
        try:
            cache = kvtier.make_cache(req.policy, self.model, **req.params)
            if t0 is not None:
                cache.limit_device(t0)
            self.live_caches.add(cache)
            row.cache = cache
            row.left = list(req.prompt_ids) + row.generated
            row.chunkable = self._chunkable(req) and getattr(cache, "chunked_prompts", False)
            if row.chunkable:
                cache.open_prompt(len(row.left))
            if resumed:
                row.recomputed += len(row.left)
                self.metrics.recomputed_tokens += len(row.left)
            self.metrics.prompt_tokens += len(req.prompt_ids) if not resumed else 0
        except Exception as e:
            log.exception("could not start request %d", req.id)
            self._fail(row, e)

    def _step(self, plan: Plan) -> None:
        """One forward over the plan: each decoding row's next token and each prompt chunk, packed end to end in
        one sequence (:class:`kvtier.cache.rows.RowsCache` with ``lengths``); every row whose prompt is complete
        draws its next token."""
        by_id = {r.req.id: r for r in self.rows}
        rows, seqs = [], []
        for key in plan.tokens.decode:
            row = by_id.get(key)
            if row is not None and not row.done and row.cache is not None:
                rows.append(row)
                seqs.append([row.generated[-1]])
        chunks = []
        for key, n in plan.tokens.chunks:
            row = by_id.get(key)
            if row is not None and not row.done and row.cache is not None:
                rows.append(row)
                seqs.append(row.left[:n])
                chunks.append((key, n))
        if not rows:
            return
        t0 = time.perf_counter()
        # (B, V) in the model's dtype: through the direct step where it was checked, else the model's forward
        logits = rows_logits(self.model, self._direct, [r.cache for r in rows], seqs)[0]
        ready = []  # (index, row) of rows that draw a token: decoding rows and prompts now complete
        for i, (row, seq) in enumerate(zip(rows, seqs)):
            if row.left:
                row.left = row.left[len(seq):]
            if not row.left:
                ready.append((i, row))
        self._note_device()
        # Greedy rows: one pass over the batch's logits in the model's dtype, each row's first maximum as float32
        # argmax finds it (bf16 -> float32 is exact), without the float32 copy of every row: at 32 rows of a 152K
        # vocabulary in bf16, float() + argmax took ~4 ms a step, torch.max ~1.9, argmax_rows ~0.4 (2-core Xeon).
        greedy = argmax_rows(logits).tolist() if any(r.sampler is None for _, r in ready) else None
        produced = 0
        for i, row in ready:
            if not row.done:
                produced += 1
                self._accept(row, logits[i : i + 1], None if greedy is None else greedy[i])
        now = time.monotonic()
        for row in rows:  # a row still prefilling ends here if its client left or its time ran out
            if row.left and not row.done:
                if row.req.cancelled or self.cancel_all:
                    self._finish(row, "cancelled")
                elif now > row.req.deadline:
                    self._finish(row, "timeout")
        self.metrics.add_tokens(produced)
        self.metrics.steps += 1
        ms = 1e3 * (time.perf_counter() - t0)
        self.step_log.append({"step": self.metrics.steps, "decode": [k for k in plan.tokens.decode if k in by_id],
                              "chunks": chunks, "ms": ms})
        if log.isEnabledFor(logging.DEBUG):  # KVTIER_LOG=debug: what each step held and took
            # (rows in the step, of them carrying a prompt chunk, the chunks' tokens: benchmarks/serve_steps.py)
            log.debug("step %d: %d rows, %d joining with %d prompt tokens, %.1f ms", self.metrics.steps, len(rows),
                      len(chunks), sum(n for _, n in chunks), ms)

    def _accept(self, row: _Row, logits: torch.Tensor, greedy: int | None = None) -> None:
        """Draw the row's next token from ``logits`` (1, V) (``greedy``: its first maximum, if taken already) and
        stream it; finish the row if it is done. Sampling runs on float32 logits."""
        if len(row.generated) < row.req.min_tokens and self.eos and not row.req.ignore_eos:
            # min_tokens: the end-of-sequence tokens cannot be drawn yet (their logits masked, as vLLM does)
            logits = logits.float().clone()
            logits[:, sorted(self.eos)] = float("-inf")
            greedy = None
        if row.sampler is None:
            tok = int(logits.float().argmax(dim=-1)) if greedy is None else greedy
        else:
            tok = int(row.sampler(None, logits.float()).argmax(dim=-1))
        row.generated.append(tok)
        now = time.monotonic()
        if not row.first_token:
            row.first_token = True
            self.metrics.observe_ttft(now - row.req.arrived)
        reason = row.out.push(tok, now, self.cancel_all)
        if reason is not None:
            self._finish(row, reason)

    def _usage(self, row: _Row) -> dict:
        r, c = row.req, row.cache
        st = c.stats() if c is not None else {"transfer": {}}
        tr = st.get("transfer", {})
        return {
            **row.out.usage(),
            "kvtier": {
                "policy": r.policy,
                "params": dict(r.params),
                "scheduler": "continuous",
                "batch_size": len(self.rows),  # rows running when it finished
                "tier_tokens": c.row_tokens(0) if c is not None else None,
                "peak_device_kv_bytes": st.get("peak_device_kv_bytes"),
                "streamed_bytes": tr.get("stream_h2d_bytes", 0),
                "moved_bytes": tr.get("migration_h2d_bytes", 0) + tr.get("migration_d2h_bytes", 0),
                "reassignments": st.get("retiers", 0),
                # token-columns moved from the device to T1 (its dropped caches' and this one's)
                "demoted_tokens": row.demoted + (st.get("changed_tokens", {}).get("T0->T1", 0) if c is not None else 0),
                "preemptions": row.preemptions,
                "recomputed_tokens": row.recomputed,
                "waiting_seconds": round(row.waited, 6),
                "seconds": time.monotonic() - r.arrived,
            },
        }

    def _finish(self, row: _Row, reason: str) -> None:
        if row.done:
            return
        usage = self._usage(row)
        self.metrics.finished[reason] += 1
        self._release(row)
        row.out.finish(reason, usage)

    def _fail(self, row: _Row, e: Exception) -> None:
        if row.done:
            return
        self._release(row)
        row.out.fail(500, f"generation failed: {type(e).__name__}: {e}")

    def _release(self, row: _Row) -> None:
        """The row's slot and bytes are free now (its cache's buffers dropped, not left to the collector)."""
        if row in self.rows:
            self.rows.remove(row)
            self._running -= 1
        self._drop_cache(row)

    def _drop_cache(self, row: _Row) -> None:
        """Count the row's cache's moves, free its buffers at once, and account the device again."""
        if row.cache is not None:
            self._count_moves(row)
            row.cache.reset()
            row.cache = None
        self._note_device()

    def _count_moves(self, row: _Row) -> None:
        st = row.cache.stats()
        # every token-column moved between the device and T1, at admission, limit changes and reassignments alike
        changed = st.get("changed_tokens", {})
        row.demoted += changed.get("T0->T1", 0)
        self.metrics.demoted_tokens += changed.get("T0->T1", 0)
        self.metrics.promoted_tokens += changed.get("T1->T0", 0)
        self.metrics.reassignments += st.get("retiers", 0)
        tr = st.get("transfer", {})
        self.metrics.streamed_bytes += tr.get("stream_h2d_bytes", 0)
        self.metrics.moved_bytes += tr.get("migration_h2d_bytes", 0) + tr.get("migration_d2h_bytes", 0)

    def _preempt(self, row: _Row) -> None:
        """Drop the row's cache; its request waits at the head of the queue and is recomputed (prompt + what it
        generated) when it fits again. The client sees only a pause."""
        self.metrics.preemptions += 1
        row.preemptions += 1
        if row in self.rows:
            self.rows.remove(row)  # still counted running: it has streamed, and it resumes
        row.queued_at = time.monotonic()
        self._resumed[row.req.id] = row
        with self._cv:
            self.waiting.appendleft(row.req)
        self._drop_cache(row)

    def _note_device(self) -> None:
        """Sum the running rows' device K/V from their caches; check it against the budget (every step)."""
        m = self.metrics
        total = sum(r.cache.device_kv_bytes() for r in self.rows if r.cache is not None)
        host = sum(r.cache.host_kv_bytes() for r in self.rows if r.cache is not None)
        m.device_kv_bytes_now = total
        m.device_kv_peak = max(m.device_kv_peak, total)
        m.host_kv_bytes_now = host
        m.host_kv_peak = max(m.host_kv_peak, host)
        m.kv_bytes = {("T0", "device"): total, ("T1", "host"): host, ("T2", "host"): 0} if self.rows else {}
        if self.budget is not None and total > self.budget:
            m.budget_violations += 1
            log.error("device KV %d bytes over the budget of %d", total, self.budget)

    def cancel(self, req: GenRequest) -> None:
        """As :meth:`Engine.cancel`; a preempted request (it has streamed already) stays listed until the
        generation thread ends it ``cancelled``, so that its row's slot is counted back."""
        if req.id in self._resumed:
            req.cancel()
            with self._cv:
                self._cv.notify()
            return
        super().cancel(req)

    def shutdown(self, grace_s: float = 10.0) -> None:
        super().shutdown(grace_s)
        with self._cv:
            self._cv.notify_all()


__all__ = ["ContinuousEngine"]
