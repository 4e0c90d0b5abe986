"""The continuous-batching engine: its own decode loop over rows, each with its own cache; every step carries the running rows' next tokens and prompt chunks up to a token budget, under a device-KV budget.

Per loop iteration (one generation thread owns the model): schedule -> one forward over the plan -> postprocess.
1. the wait list loses requests that were cancelled or expired (error events, as in the static engine);
2. :class:`kvtier.serve.scheduler.Scheduler`, which holds the wait list and the running rows (request keys and
   token counts; the engine keeps each request's objects — its cache, its output — by key), plans the step from
   numbers alone and applies the plan to its lists: each running row's memory as its
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

from ..kernels.rows import argmax_rows
from ..cache.base import model_shape
from ..cache.state import full_columns, tail_columns
from ..config import TierConfig
from ..sampling import sample_rows_logprobs
from ..step.decode import step_for
from ..step.direct import rows_logits
from ..tiers.layout import grown_capacity
from .engine import EngineBase, GenRequest, NeverFits
from .output import RowOutput, safe_sink
from .prefix import PrefixStore, block_keys
from .scheduler import Plan, RowNeed, Scheduler, WaitNeed

log = logging.getLogger(__name__)


class _Row:
    """One running request: its cache, its text state, its sampling settings and generator, and what it generated."""

    def __init__(self, req: GenRequest, tokenizer, eos: set[int]) -> None:
        self.req = req
        self.cache = None
        self.out = RowOutput(req, tokenizer, eos)  # its text, stop strings and ending (as the static engine's rows)
        self.generated: list[int] = []  # every token drawn (an end-of-sequence token included)
        self.params = req.sampling()
        self.gen = None  # its own generator: what it draws does not depend on the rows beside it
        if not self.params.greedy:
            self.gen = torch.Generator()
            self.gen.manual_seed((req.seed if req.seed is not None else random.getrandbits(62)) % (2**63))
        self.preemptions = 0  # (the usage block's; the scheduler counts its own)
        self.recomputed = 0
        self.demoted = 0
        self.waited = 0.0
        self.queued_at = req.arrived
        self.first_token = False
        self.peak_device = 0
        self.prefill: list[int] = []  # what its cache is prefilled with since it (re)started: prompt + generated
        self.prefilled = 0  # of them, in its cache so far (the scheduler says how many each step)
        self.cached = 0  # of them, taken from the prefix cache when it (last) started

    @property
    def done(self) -> bool:
        return self.out.done


class ContinuousEngine(EngineBase):
    """Continuous batching over one-row caches, admitted under ``cfg.device_kv_budget`` (see the module doc)."""

    penalties = True
    logprobs = True

    def __init__(self, model, tokenizer, cfg=None):
        super().__init__(model, tokenizer, cfg)
        self._rows: dict[int, _Row] = {}  # request id -> its row: running, or preempted and waiting to resume
        self._reqs: dict[int, GenRequest] = {}  # request id -> the request, while the scheduler holds it
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
        # the prefix cache (kvtier.serve.prefix): whole prompt blocks' K/V in host memory, None when off
        self.prefix = PrefixStore(self.cfg.prefix_cache_host_bytes, self.cfg.prefix_block_tokens) \
            if self.cfg.prefix_cache else None
        # request id -> the block keys of its sequence (prompt, then what it generated) so far: each block hashed once
        self._keys: dict[int, list[bytes]] = {}
        self.n_heads_q = int(model.config.num_attention_heads)

    def _prepared(self) -> None:
        if self.cfg.direct_step:
            self._direct = step_for(self.model)

    @property
    def running(self) -> int:
        return self._running

    @property
    def rows(self) -> list[_Row]:
        """The running rows, in the order they started (the scheduler's running list)."""
        return [self._rows[k] for k in self.scheduler.running if k in self._rows]

    # the wait list is the scheduler's (EngineBase calls these under self._cv)
    @property
    def queue_depth(self) -> int:
        return len(self.scheduler.waiting)

    def _queue_add(self, req: GenRequest) -> None:
        self.scheduler.add(req.id, len(req.prompt_ids), self._chunkable(req))
        self._reqs[req.id] = req

    def _queue_remove(self, req: GenRequest) -> bool:
        if not self.scheduler.is_waiting(req.id) or req.id in self._rows:
            return False  # running, finished, or preempted (it has streamed: the generation thread ends it)
        self.scheduler.remove(req.id)
        del self._reqs[req.id]
        return True

    def _queue_list(self) -> list[GenRequest]:
        return [self._reqs[k] for k in self.scheduler.waiting]

    def describe(self) -> str:
        b = "no device-KV budget" if self.budget is None else f"device-KV budget {self.budget / 2**20:.1f} MiB"
        h = "" if self.host_budget is None else f", host-KV budget {self.host_budget / 2**30:.1f} GiB"
        step = "direct step" if self._direct is not None else "the model's forward"
        p = "no prefix cache" if self.prefix is None else \
            f"prefix cache {self.prefix.host_bytes / 2**30:.2g} GiB host, {self.prefix.block}-token blocks"
        return (f"scheduler continuous (up to {self.cfg.max_batch} rows, {self.max_batched_tokens} tokens a step, "
                f"prompts chunked, "
                f"{step}), {b}{h}, on pressure: {self.cfg.on_pressure}, {p}")

    # ---- the generation thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.scheduler.seqs and not self._stop:
                    self._cv.wait()
                if not self.scheduler.seqs:
                    return
            try:
                hook, self._loop_hook = self._loop_hook, None
                if hook is not None:  # tests: run something on this thread, between two steps
                    hook()
                self._expire_waiting()
                plan = self._schedule()
                if plan is not None and plan.tokens.tokens:
                    self._step(plan)
                elif self.queue_depth and not (plan and plan.tokens.joined):
                    time.sleep(0.01)  # nothing fits and nothing runs: requests are being rejected or expire
            except Exception as e:  # a failed step ends its rows with an error; the server goes on
                log.exception("a continuous step failed")
                for row in list(self.rows):
                    self._fail(row, e)
                with self._cv:  # requests the scheduler started before the failure, before they had a row
                    orphans = [k for k in self.scheduler.running if k not in self._rows]
                    for key in orphans:
                        self.scheduler.remove(key)
                    orphaned = [self._reqs.pop(k) for k in orphans if k in self._reqs]
                for r in orphaned:
                    safe_sink(r, ("error", 500, f"generation failed: {type(e).__name__}: {e}"))
            if not self.scheduler.seqs:
                gc.collect()  # idle: the released caches' objects go too (live caches back to 0)

    def _ended_waiting(self, r: GenRequest, now: float) -> bool:
        self._reqs.pop(r.id, None)
        self._keys.pop(r.id, None)
        row = self._rows.get(r.id)
        if row is None:
            return False
        # a preempted request (still counted running): it has streamed, so it ends as a row
        self._finish(row, "cancelled" if r.cancelled or self.cancel_all else "timeout")
        return True

    # ---- scheduling ---------------------------------------------------------------------------------
    def _row_need(self, row: _Row) -> RowNeed:
        """The row's memory as its cache reports it before its next update (its chunk, or one decode token)."""
        limited = getattr(row.cache, "device_limit", None) is not None  # (a head-wise baseline's cache has none)
        n = self.scheduler.next_tokens(row.req.id, limited, self._reserve(row.req))
        v = row.cache.budget_view(n)
        n_max = len(row.req.prompt_ids) + row.req.max_tokens
        return RowNeed(key=row.req.id, next_bytes=v.next_bytes, col_bytes=self.col_bytes, reserve=v.reserve,
                       can_limit=v.can_limit, generated=len(row.generated), arrived=row.req.arrived,
                       host_bytes=v.host_bytes, host_next=v.host_next, t0_limit=v.t0_limit, tokens=v.tokens,
                       peak_bytes=self._peak_bytes(n_max, row.req.policy), device_tokens=v.device_tokens)

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
        can_limit = POLICIES[req.policy].can_limit(req.params)  # (a running row's cache says it itself)
        reserve = self._reserve(req)
        return WaitNeed(key=req.id, start_bytes=self._peak_bytes(n + 1, req.policy), min_bytes=reserve * self.col_bytes,
                        peak_bytes=self._peak_bytes(len(req.prompt_ids) + req.max_tokens, req.policy),
                        col_bytes=self.col_bytes, reserve=reserve, can_limit=can_limit, tokens=n)

    # ---- the prefix cache ------------------------------------------------------------------------------
    def _block_keys(self, req: GenRequest, n: int) -> list[bytes]:
        """The prefix cache's keys of the whole blocks among the first ``n`` tokens of ``req``'s sequence (its
        prompt, then what it generated; ``req``'s salt): every token list the engine stores or looks up is a start
        of that one sequence, so its keys are hashed once, a chain continued as the sequence grows."""
        keys = self._keys.setdefault(req.id, [])
        B = self.prefix.block
        start, stop = len(keys) * B, n // B * B
        if stop > start:
            row = self._rows.get(req.id)
            p, gen = req.prompt_ids, (row.generated if row is not None else [])
            tokens = list(p[start:stop]) + gen[max(0, start - len(p)) : max(0, stop - len(p))]
            keys += block_keys(tokens, keys[-1] if keys else req.prefix_salt, B)
        return keys[: n // B]

    def _match(self, waiting: list[GenRequest]) -> None:
        """Tell the scheduler how many leading tokens of each waiting request the prefix cache holds (only the
        rest is prefilled when it starts, this step or a later one: looked up again each step). Under the
        engine's lock; pure lookups."""
        for r in waiting:  # (all of them: which join is the scheduler's to say; a lookup stops at its first miss)
            if not self._chunkable(r):
                continue
            n = self.scheduler.seqs[r.id].tokens  # (its prompt, and what it generated before a preemption)
            self.scheduler.set_cached(r.id, self.prefix.match(self._block_keys(r, n), n))

    def _load_prefix(self, row: _Row, cached: int, t0: int | None) -> None:
        """Copy the first ``cached`` tokens' K/V from the prefix cache into the row's new cache (the lookup the
        scheduler planned with); count the lookup. Under a T0 limit, in pieces of the tail reserve."""
        kv = self.prefix.take(self._block_keys(row.req, len(row.prefill)), cached, len(row.prefill))
        row.cached = cached
        if kv is None:
            return
        piece = self._reserve(row.req) if t0 is not None else None
        row.cache.load_prompt(kv.to(self.model.device), self.n_heads_q, piece=piece)
        row.prefilled = cached

    def _remember(self, row: _Row, n: int) -> None:
        """Store the whole blocks among the first ``n`` tokens of the row's sequence (its cache holds them, from its
        start) that the prefix cache lacks, copied out of the row's cache."""
        keys = self._block_keys(row.req, n)
        first = self.prefix.missing(keys)
        if first == len(keys):
            return
        B = self.prefix.block
        try:
            kv = row.cache.prompt_kv(first * B, len(keys) * B)
        except ValueError:  # a position no longer held exactly: nothing is stored
            log.debug("request %d: its blocks from %d are not held exactly; not stored", row.req.id, first)
            return
        except Exception:  # the store is a saving, never a reason for a request to fail
            log.exception("request %d: its blocks could not be stored in the prefix cache", row.req.id)
            return
        self.prefix.put(keys, first, kv)

    def _chunkable(self, req: GenRequest) -> bool:
        """Whether the request's cache takes its prompt in chunks, as its policy says (the tiered family; a
        head-wise baseline scores its whole prompt at prefill; the server refuses hybrid models)."""
        from ..policies import POLICIES

        return POLICIES[req.policy].chunked_prefill

    def _tokens(self, req: GenRequest) -> int:
        """Tokens a waiting request prefills when it starts: its prompt, and after a preemption what it generated."""
        seq = self.scheduler.seqs.get(req.id)
        return seq.tokens if seq is not None else len(req.prompt_ids)

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
        """Plan the step (:meth:`Scheduler.schedule <kvtier.serve.scheduler.Scheduler.schedule>`, which applies it
        to its lists) and carry out what it decided: T0 limits, preemptions, rejections, the requests that start;
        returns the plan (None when nothing runs or waits)."""
        with self._cv:  # submit and cancel change the scheduler's lists from other threads
            if not self.scheduler.seqs:
                return None
            waiting = self._queue_list()
            if self.prefix is not None:
                self._match(waiting)
            if self.budget is None:
                rows, needs = [], []  # only the counts decide: the rows' byte needs (~40 us a row) are not gathered
            else:
                rows = [self._row_need(r) for r in self.rows]
                needs = [self._wait_need(r) for r in waiting]
            plan = self.scheduler.schedule(rows, needs)
            for key in plan.memory.reject:
                self._reqs.pop(key, None)
                self._keys.pop(key, None)
        d = plan.memory
        for key in d.preempt:
            self._preempted(self._rows[key])
        for key, t0 in d.limits.items():
            row = self._rows.get(key)
            if row is None or row.done or row.cache is None:
                continue
            row.cache.limit_device(t0)
        reqs = {r.id: r for r in waiting}
        need_of = {w.key: w for w in needs}
        for key in d.reject:
            r = reqs[key]
            msg = self._never_fits(r, need_of[key])
            row = self._rows.get(key)
            if row is not None:  # preempted, and now longer than the budget allows: it has streamed, it ends here
                self._release(row)
                row.out.fail(400, msg)
            else:
                safe_sink(r, ("error", 400, msg))
        limits = dict(d.admit)
        for key in plan.tokens.joined:
            self._start(reqs[key], limits.get(key))
        return plan

    # ---- rows ---------------------------------------------------------------------------------------
    def _start(self, req: GenRequest, t0: int | None) -> None:
        """Give ``req`` a row (its own, kept while it was preempted) and a new empty cache; the step prefills it
        (its prompt and, after a preemption, what it generated) in the chunks the scheduler plans."""
        import kvtier

        row = self._rows.get(req.id)
        resumed = row is not None
        if row is None:
            row = self._rows[req.id] = _Row(req, self.tokenizer, self.eos)
            self._running += 1
        with self._cv:
            self._reqs.pop(req.id, None)
        row.waited += time.monotonic() - row.queued_at
        try:
            cache = kvtier.make_cache(req.policy, self.model, **req.params)
            if t0 is not None:
                cache.limit_device(t0)
            self.live_caches.add(cache)
            row.cache = cache
            row.prefill, row.prefilled, row.cached = list(req.prompt_ids) + row.generated, 0, 0
            seq = self.scheduler.seqs[req.id]
            if seq.chunkable:
                cache.open_prompt(len(row.prefill))
                if self.prefix is not None:
                    self._load_prefix(row, seq.cached, t0)
            if resumed:  # (what the prefix cache gave is not computed again)
                row.recomputed += len(row.prefill) - row.cached
                self.metrics.recomputed_tokens += len(row.prefill) - row.cached
            self.metrics.prompt_tokens += len(req.prompt_ids) if not resumed else 0
        except Exception as e:
            log.exception("could not start request %d", req.id)
            self._fail(row, e)

    def _step(self, plan: Plan) -> None:
        """One forward over the plan: each decoding row's next token and each prompt chunk, packed end to end in
        one sequence (:class:`kvtier.cache.rows.RowsCache` with ``lengths``); every row whose prompt is complete
        draws its next token."""
        rows, seqs, chunks, decoded = [], [], [], []
        for key in plan.tokens.decode:
            row = self._rows.get(key)
            if row is not None and not row.done and row.cache is not None:
                rows.append(row)
                seqs.append([row.generated[-1]])
                decoded.append(key)
        for key, n in plan.tokens.chunks:
            row = self._rows.get(key)
            if row is not None and not row.done and row.cache is not None:
                rows.append(row)
                seqs.append(row.prefill[row.prefilled : row.prefilled + n])
                row.prefilled += n
                chunks.append((key, n))
        if not rows:
            return
        t0 = time.perf_counter()
        # (B, V) in the model's dtype: through the direct step where it was checked, else the model's forward
        logits = rows_logits(self.model, self._direct, [r.cache for r in rows], seqs)[0]
        # rows that draw a token: decoding rows and prompts now complete (the scheduler counted the chunks off)
        ready = [(i, row) for i, row in enumerate(rows) if row.prefilled >= len(row.prefill)]
        self._note_device()
        if self.prefix is not None:
            # the whole blocks of each prompt so far, for the requests that start next (with a prompt longer than a
            # step, a request admitted while the first is still prefilling reuses what it has computed)
            for key, _ in chunks:
                row = self._rows.get(key)
                if row is not None and row.cache is not None and self._chunkable(row.req):
                    self._remember(row, row.prefilled)
        produced = 0
        if ready:
            toks, lps = self._draw(logits if len(ready) == len(rows) else logits[[i for i, _ in ready]],
                                   [row for _, row in ready])
            for (_, row), tok, lp in zip(ready, toks, lps):
                if not row.done:
                    produced += 1
                    self._accept(row, tok, lp)
        now = time.monotonic()
        for row in rows:  # a row still prefilling ends here if its client left or its time ran out
            if row.prefilled < len(row.prefill) and not row.done:
                if row.req.cancelled or self.cancel_all:
                    self._finish(row, "cancelled")
                elif now > row.req.deadline:
                    self._finish(row, "timeout")
        self.metrics.add_tokens(produced)
        self.metrics.steps += 1
        ms = 1e3 * (time.perf_counter() - t0)
        self.step_log.append({"step": self.metrics.steps, "decode": decoded,
                              "chunks": chunks, "ms": ms})
        if log.isEnabledFor(logging.DEBUG):  # KVTIER_LOG=debug: what each step held and took
            # (rows in the step, of them carrying a prompt chunk, the chunks' tokens: benchmarks/serve/serve_steps.py)
            log.debug("step %d: %d rows, %d joining with %d prompt tokens, %.1f ms", self.metrics.steps, len(rows),
                      len(chunks), sum(n for _, n in chunks), ms)

    def _draw(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[list[int], list]:
        """Every row's next token from its logits (R, V) in one sampling step
        (:func:`kvtier.sampling.sample_rows_logprobs`): each row's own settings, generator and history;
        ``min_tokens`` bans the end-of-sequence tokens until then (as vLLM does); the log-probabilities of the rows
        that asked (``cfg.logprobs_mode``), else None. Greedy rows take one pass over the batch's logits in the
        model's dtype (``argmax_rows``: at 32 rows of a 152K vocabulary in bf16, float() + argmax took ~4 ms a step,
        argmax_rows ~0.4, 2-core Xeon)."""
        eos = sorted(self.eos)
        banned = [eos if eos and len(r.generated) < r.req.min_tokens and not r.req.ignore_eos else None for r in rows]
        history = [(r.req.prompt_ids, r.generated) if r.params.penalised else ((), ()) for r in rows]
        want = [r.req.logprobs for r in rows]
        return sample_rows_logprobs(logits, [r.params for r in rows], [r.gen for r in rows], history, banned,
                                    greedy_pick=argmax_rows,
                                    logprobs=want if any(k is not None for k in want) else None,
                                    mode=self.cfg.logprobs_mode)

    def _accept(self, row: _Row, tok: int, logprobs=None) -> None:
        """Stream the row's drawn token ``tok`` (with its log-probabilities, if the request asked); finish the row
        if it is done."""
        row.generated.append(tok)
        with self._cv:
            self.scheduler.advanced(row.req.id)
        now = time.monotonic()
        if not row.first_token:
            row.first_token = True
            self.metrics.observe_ttft(now - row.req.arrived)
        reason = row.out.push(tok, now, self.cancel_all, logprobs)
        if reason is not None:
            self._finish(row, reason)

    def _usage(self, row: _Row) -> dict:
        r, c = row.req, row.cache
        st = c.stats() if c is not None else {"transfer": {}}
        tr = st.get("transfer", {})
        return {
            **row.out.usage(),
            "prompt_tokens_details": {"cached_tokens": row.cached},  # OpenAI's: prompt tokens not computed again
            "kvtier": {
                "policy": r.policy,
                "params": dict(r.params),
                "sampling": row.params.as_dict(),  # what it was drawn with (the request's fields, else the defaults)
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
                "cached_prompt_tokens": row.cached,  # from the prefix cache, when it (last) started
                "waiting_seconds": round(row.waited, 6),
                "seconds": time.monotonic() - r.arrived,
            },
        }

    def _finish(self, row: _Row, reason: str) -> None:
        if row.done:
            return
        c = row.cache
        if self.prefix is not None and reason in ("stop", "length") and c is not None and self._chunkable(row.req) \
                and c.lossless:
            # prompt and answer, for a chat's next turn (a cache that quantized or destroyed tokens computed the
            # later ones from inexact K/V: it gave its prompt's blocks when the prompt was in)
            self._remember(row, c.state.n_total)
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
        key = row.req.id
        if self._rows.get(key) is row:
            del self._rows[key]
            self._running -= 1
        with self._cv:
            self.scheduler.remove(key)
            self._reqs.pop(key, None)
        self._keys.pop(key, None)
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
        """Preempt a running row outside a plan (tests): the scheduler puts it back at the head of its wait list,
        then as :meth:`_preempted`."""
        with self._cv:
            self.scheduler.preempt(row.req.id)
        self._preempted(row)

    def _preempted(self, row: _Row) -> None:
        """The scheduler put the row's request back at the head of its wait list: drop the row's cache; the request
        is recomputed (prompt + what it generated) when it fits again, its row kept (it has streamed, and it is
        still counted running). The client sees only a pause."""
        self.metrics.preemptions += 1
        row.preemptions += 1
        row.queued_at = time.monotonic()
        with self._cv:
            self._reqs[row.req.id] = row.req
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
        with self._cv:
            preempted = req.id in self._rows and self.scheduler.is_waiting(req.id)
        if preempted:
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
