"""The continuous engine's scheduler: it holds the wait list and the running rows (request keys and token counts) and plans each step — which rows decode, which prompt chunks prefill under a token budget, which waiting requests join, which rows give device memory back (demote), which are preempted — arithmetic on token and byte counts; no tensors here.

:class:`Scheduler` owns the state (:attr:`~Scheduler.waiting`, :attr:`~Scheduler.running` and one :class:`Seq` a
request: its prompt, what it generated, what it has left to prefill) and moves requests between its lists:
:meth:`~Scheduler.add` on arrival, :meth:`~Scheduler.schedule` each step (the plan, applied to its own lists:
admitted requests start, preempted ones go back to the head of the wait list, prompt chunks are counted off),
:meth:`~Scheduler.advanced` for each drawn token, :meth:`~Scheduler.remove` when a request ends. Each step's
:class:`Plan` is the memory decision (:func:`decide`) and the token plan (:func:`plan_tokens`): every running row
that is past its prompt decodes one token first, then prompt chunks of the rows still prefilling (oldest first) and
of the requests that join fill what is left of ``max_batched_tokens``. A prompt longer than what is left is
prefilled over several steps, its partial K/V kept in its own cache. The engine owns the tensors: it reports each
row's memory from its cache, runs the step and says which tokens were drawn.

Each running row reports what it will hold after the next step (:class:`RowNeed`); each waiting request what it
needs to start (:class:`WaitNeed`). :func:`decide` returns T0 limits (tokens) for rows that must shrink or may grow,
rows to preempt, requests to admit (with a T0 limit when they start at reduced device share) and requests that can
never fit (HTTP 400). The engine applies the decision and checks the budget from the caches' own accounting.

Modes (``--on-pressure``):
- ``demote`` (default): lower running rows' device share (their coldest T0 tokens go to T1: exact) down to each
  row's minimum (its tail between reassignments), so that new requests start now; only when every row is at its
  minimum do arrivals wait; only when the host budget is exhausted too is a row preempted (fewest generated first).
- ``queue``: admit a request only when its peak (prompt + ``max_tokens``, all on the device) fits beside the
  running rows' peaks; never demote, never preempt.
- ``recompute``: the field's policy: admit on current use; when the running rows' next step does not fit, preempt
  the newest request and recompute it later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

PRESSURE_MODES = ("demote", "queue", "recompute")


@dataclass
class RowNeed:
    """A running row, as the scheduler sees it (bytes are device K/V unless named host)."""

    key: int
    next_bytes: int  # bound after the next step, as things stand
    col_bytes: int  # one token, all layers, K and V
    reserve: int  # tail columns between reassignments (a limited row holds at most limit + reserve tokens)
    can_limit: bool
    generated: int
    arrived: float
    host_bytes: int = 0  # T1/T2 now
    host_next: int = 0  # bound on T1/T2 after the next step
    t0_limit: int | None = None
    tokens: int = 0  # logical length
    device_tokens: int = 0  # on the device now (T0 + tail)
    peak_bytes: int = 0  # queue mode: what the row holds at its longest

    @property
    def min_bytes(self) -> int:
        return self.reserve * self.col_bytes if self.can_limit else self.next_bytes


@dataclass
class WaitNeed:
    """A waiting request: device bytes to start it whole, to start it at its minimum, and at its peak."""

    key: int
    start_bytes: int
    min_bytes: int
    peak_bytes: int
    col_bytes: int
    reserve: int
    can_limit: bool
    tokens: int = 0  # to prefill (prompt, and what it generated before a preemption)

    def least(self, mode: str) -> int:
        """The fewest device bytes it can start with under ``mode`` (over the budget: it can never run)."""
        return self.peak_bytes if mode == "queue" else self.min_bytes if mode == "demote" else self.start_bytes


@dataclass
class Decision:
    admit: list[tuple[int, int | None]] = field(default_factory=list)  # (waiting key, T0 limit or None)
    limits: dict[int, int | None] = field(default_factory=dict)  # running key -> new T0 limit (None: lifted)
    preempt: list[int] = field(default_factory=list)
    reject: list[int] = field(default_factory=list)  # waiting keys that can never fit the budget
    demoted_bytes: int = 0


def _limit_for(target: int, col: int, reserve: int) -> int:
    """T0 tokens that keep a limited row within ``target`` device bytes."""
    return max(0, target // col - reserve)


def admit_by_count(running: int, waiting: list[int], max_rows: int) -> Decision:
    """Without a device budget: the oldest ``waiting`` keys, as many as the ``max_rows`` slots beside ``running``
    rows allow. No bytes are read, so the caller need not gather them."""
    return Decision(admit=[(key, None) for key in waiting[: max(max_rows - running, 0)]])


def decide(rows: list[RowNeed], waiting: list[WaitNeed], budget: int | None, host_budget: int | None,
           mode: str, max_rows: int) -> Decision:
    """What to do before the next step (see the module docstring)."""
    if mode not in PRESSURE_MODES:
        raise ValueError(f"mode must be one of {PRESSURE_MODES}, got {mode!r}")
    if budget is None:
        return admit_by_count(len(rows), [w.key for w in waiting], max_rows)
    d = Decision()
    use = {r.key: (r.peak_bytes if mode == "queue" else r.next_bytes) for r in rows}
    alive = {r.key: r for r in rows}
    host = sum(r.host_next for r in rows)
    starting = 0  # device bytes of the requests admitted so far

    def total() -> int:
        return sum(use[k] for k in alive) + starting

    def slack(r: RowNeed) -> int:
        return use[r.key] - r.min_bytes if mode == "demote" and r.can_limit else 0

    def demote(amount: int) -> int:
        """Free ``amount`` device bytes from the rows with the most above their minimum; host budget allowing."""
        nonlocal host
        freed = 0
        for r in sorted(alive.values(), key=slack, reverse=True):
            if freed >= amount or slack(r) <= 0:
                break
            t0 = _limit_for(use[r.key] - min(slack(r), amount - freed), r.col_bytes, r.reserve)
            new = (t0 + r.reserve) * r.col_bytes
            moved = max(0, r.device_tokens - t0) * r.col_bytes  # what lands in T1
            if host_budget is not None and host + moved > host_budget:
                continue  # the host cannot take it: this row keeps its share
            freed += use[r.key] - new
            host += moved
            d.demoted_bytes += use[r.key] - new
            use[r.key] = new
            d.limits[r.key] = t0
        return freed

    def preempt(victim: RowNeed) -> None:
        nonlocal host
        d.preempt.append(victim.key)
        d.limits.pop(victim.key, None)
        host -= victim.host_next
        del alive[victim.key]

    # 1. the running rows' next step fits the device (demote, then preempt) and the host
    if total() > budget:
        if mode == "demote":
            demote(total() - budget)
        while total() > budget and alive:
            pick = (min(alive.values(), key=lambda r: (r.generated, -r.arrived)) if mode == "demote"
                    else max(alive.values(), key=lambda r: r.arrived))  # recompute: the newest request
            preempt(pick)
    while host_budget is not None and host > host_budget:
        holders = [r for r in alive.values() if r.host_next > 0]  # preempting a row that holds none frees none
        if not holders:
            break
        preempt(min(holders, key=lambda r: (r.generated, -r.arrived)))
    if d.preempt or d.limits:
        # preempted requests wait at the head of the queue, and demoted rows hold their bytes until the next
        # step's reassignment: nothing new starts before that step
        return d
    # 2. admissions, oldest first; a request that does not fit waits, and so do the ones behind it
    for w in waiting:
        if len(alive) + len(d.admit) >= max_rows:
            break
        if w.least(mode) > budget:
            d.reject.append(w.key)
            continue
        want = w.peak_bytes if mode == "queue" else w.start_bytes
        if total() + want > budget and mode == "demote":
            if demote(total() + want - budget):
                break  # demoted rows give their bytes back during the next step: the request starts after it
        free = budget - total()
        if want <= free:
            d.admit.append((w.key, None))
            starting += want
        elif mode == "demote" and w.can_limit and w.min_bytes <= free:
            t0 = _limit_for(free, w.col_bytes, w.reserve)
            moved = max(0, w.tokens - t0) * w.col_bytes  # starts with this much in T1
            if host_budget is not None and host + moved > host_budget:
                break
            d.admit.append((w.key, t0))
            host += moved
            starting += (t0 + w.reserve) * w.col_bytes
        else:
            break
    # 3. no one waits: limited rows grow back into the free budget (at their next regular reassignment)
    if mode == "demote" and not waiting:
        limited = [r for r in alive.values() if d.limits.get(r.key, r.t0_limit) is not None]
        free = budget - total()
        if limited and free > budget // 4:
            share = (free - budget // 8) // len(limited)
            for r in limited:
                cur = d.limits.get(r.key, r.t0_limit)
                grown = cur + share // r.col_bytes
                d.limits[r.key] = None if grown >= r.tokens + r.reserve else grown
    return d


@dataclass
class PromptNeed:
    """A prompt with tokens still to prefill: a running row's (it started) or a request admitted this step."""

    key: int
    left: int  # prompt tokens not yet prefilled (and, after a preemption, what the row had generated)
    chunkable: bool = True  # False: its cache takes the prompt whole (a head-wise baseline, a hybrid model)
    max_chunk: int | None = None  # a row under a T0 limit: at most its tail reserve a step (limit + reserve fit)


@dataclass
class TokenPlan:
    decode: list[int] = field(default_factory=list)  # keys of rows decoding one token, in the order given
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (key, prompt tokens this step), in order
    joined: list[int] = field(default_factory=list)  # keys of the admitted requests that start this step

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def tokens(self) -> int:
        return len(self.decode) + self.prompt_tokens


def plan_tokens(decoding: list[int], prefilling: list[PromptNeed], joining: list[PromptNeed],
                max_batched_tokens: int) -> TokenPlan:
    """The step's tokens: every decoding row's one token first; then the prefilling rows' next chunks (in order:
    oldest first), then the joining requests' first chunks, while ``max_batched_tokens`` has room. A prompt that does
    not fit gets what is left (it goes on next step); one that cannot be chunked goes whole, alone among the prompts
    of its step, when it does not fit (the one case a step carries more than the budget: a head-wise baseline's
    prefill scores its whole prompt). A joining request that gets nothing waits, and so do the ones behind it."""
    if isinstance(max_batched_tokens, bool) or not isinstance(max_batched_tokens, int) or max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be an integer >= 1, got {max_batched_tokens!r}")
    plan = TokenPlan(decode=list(decoding))
    room = max_batched_tokens - len(plan.decode)
    for joins, needs in ((False, prefilling), (True, joining)):
        for p in needs:
            if p.left < 1:
                raise ValueError(f"request {p.key}: a prompt with nothing left to prefill is not prefilling")
            if p.chunkable:
                n = min(p.left, room, p.max_chunk if p.max_chunk is not None else room)
            else:
                n = p.left if p.left <= room or not plan.chunks else 0
            if n <= 0:
                if joins:
                    return plan
                continue  # a running prompt waits for the next step; the others behind it may still fit
            plan.chunks.append((p.key, n))
            room -= n
            if joins:
                plan.joined.append(p.key)
    return plan


@dataclass
class Plan:
    """One step: the memory decision (applied first) and the tokens that go into the step's one forward."""

    memory: Decision
    tokens: TokenPlan


@dataclass
class Seq:
    """One request as the scheduler keeps it: token counts only."""

    key: int
    prompt: int  # prompt tokens
    chunkable: bool = True  # False: its cache takes the prompt whole (a head-wise baseline)
    generated: int = 0  # tokens drawn so far (a preempted request prefills them again, after its prompt)
    left: int = 0  # while running: tokens still to prefill (0: it decodes)
    preemptions: int = 0
    cached: int = 0  # while waiting: leading tokens of what it prefills that the prefix cache holds (not computed)

    @property
    def tokens(self) -> int:
        """Tokens it prefills when it (re)starts: its prompt and what it generated before a preemption."""
        return self.prompt + self.generated


class Scheduler:
    """Holds the wait list and the running rows and plans each step from numbers alone (see the module doc); the
    engine runs the step and reports back (:meth:`advanced`, :meth:`remove`). Not thread-safe: the engine calls it
    under its own lock."""

    def __init__(self, budget: int | None, host_budget: int | None, mode: str, max_rows: int,
                 max_batched_tokens: int) -> None:
        if mode not in PRESSURE_MODES:
            raise ValueError(f"mode must be one of {PRESSURE_MODES}, got {mode!r}")
        if isinstance(max_batched_tokens, bool) or not isinstance(max_batched_tokens, int) or max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be an integer >= 1, got {max_batched_tokens!r}")
        self.budget, self.host_budget, self.mode = budget, host_budget, mode
        self.max_rows, self.max_batched_tokens = max_rows, max_batched_tokens
        self.waiting: deque[int] = deque()  # keys, in the order they start (preempted requests at the head)
        self.running: list[int] = []  # keys, in the order they started
        self.seqs: dict[int, Seq] = {}

    # ---- the state ----------------------------------------------------------------------------------
    def add(self, key: int, prompt: int, chunkable: bool = True) -> None:
        """A new request waits at the end of the wait list."""
        if key in self.seqs:
            raise ValueError(f"request {key} is known already")
        if prompt < 1:
            raise ValueError(f"request {key}: a prompt needs at least one token, got {prompt}")
        self.seqs[key] = Seq(key, prompt, chunkable)
        self.waiting.append(key)

    def remove(self, key: int) -> bool:
        """The request ended (finished, cancelled, expired, failed, rejected): it leaves whichever list holds it.
        False if it was not there."""
        if self.seqs.pop(key, None) is None:
            return False
        if key in self.running:
            self.running.remove(key)
        else:
            self.waiting.remove(key)
        return True

    def advanced(self, key: int, tokens: int = 1) -> None:
        """The running row drew ``tokens`` more (a preempted request prefills them again when it resumes)."""
        self.seqs[key].generated += tokens

    def preempt(self, key: int) -> None:
        """A running row gives its place back: its request goes to the head of the wait list, to prefill its prompt
        and what it generated when it starts again."""
        seq = self.seqs[key]
        self.running.remove(key)
        seq.left, seq.preemptions, seq.cached = 0, seq.preemptions + 1, 0
        self.waiting.appendleft(key)

    def set_cached(self, key: int, tokens: int) -> None:
        """A waiting request's leading ``tokens`` come from the prefix cache when it starts: only the rest is
        prefilled (its memory is counted whole, as it ends in its cache all the same)."""
        seq = self.seqs[key]
        if key in self.running:
            raise ValueError(f"request {key} is running: its prefix is settled")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < seq.tokens:
            raise ValueError(f"request {key}: cached tokens must be in [0, {seq.tokens}), got {tokens!r}")
        seq.cached = tokens

    def is_waiting(self, key: int) -> bool:
        return key in self.seqs and key not in self.running

    def prefilling(self, key: int) -> bool:
        """A running row with prompt tokens still to prefill (it draws nothing yet)."""
        return self.seqs[key].left > 0

    def next_tokens(self, key: int, limited: bool, reserve: int) -> int:
        """Tokens the running row brings to its next step, at most: one to decode, else its next prompt chunk (the
        whole prompt if its cache takes no chunks; at most its tail ``reserve`` under a T0 limit)."""
        seq = self.seqs[key]
        if not seq.left:
            return 1
        if not seq.chunkable:
            return seq.left
        return min(seq.left, max(1, reserve) if limited else self.max_batched_tokens)

    def schedule(self, rows: list[RowNeed], waiting: list[WaitNeed]) -> Plan:
        """Plan the next step and apply it to the lists: ``rows`` are the running rows' memory as their caches
        report it (any order; ignored without a budget), ``waiting`` the waiting requests' needs (only read with a
        budget: without one, pass ``[]``). Preempted rows go back to the head of the wait list (to prefill their
        prompt and what they generated); rejected requests leave; the requests that join start running; every
        prompt chunk of the plan is counted as prefilled (the engine runs it next)."""
        if self.budget is None:
            waiting = [WaitNeed(key=k, start_bytes=0, min_bytes=0, peak_bytes=0, col_bytes=0, reserve=0,
                                can_limit=False) for k in self.waiting]
        elif [w.key for w in waiting] != list(self.waiting):
            raise ValueError("waiting needs must follow the wait list's order, one each")
        if self.budget is not None and sorted(r.key for r in rows) != sorted(self.running):
            raise ValueError("row needs must cover the running rows, one each")
        decoding = [k for k in self.running if not self.seqs[k].left]
        prefilling = [PromptNeed(k, self.seqs[k].left, self.seqs[k].chunkable) for k in self.running
                      if self.seqs[k].left]
        prompts = {k: PromptNeed(k, self.seqs[k].tokens - self.seqs[k].cached, self.seqs[k].chunkable)
                   for k in self.waiting}
        rows = rows if self.budget is not None else [
            RowNeed(key=k, next_bytes=0, col_bytes=0, reserve=0, can_limit=False, generated=0, arrived=0.0)
            for k in self.running]
        plan = self.plan(rows, waiting, decoding, prefilling, prompts)
        for key in reversed(plan.memory.preempt):  # they keep their order, ahead of the requests that waited
            self.preempt(key)
        for key in plan.memory.reject:
            self.remove(key)
        for key in plan.tokens.joined:
            self.waiting.remove(key)
            self.running.append(key)
            self.seqs[key].left = self.seqs[key].tokens - self.seqs[key].cached
        for key, n in plan.tokens.chunks:
            self.seqs[key].left -= n
        return plan

    def plan(self, rows: list[RowNeed], waiting: list[WaitNeed], decoding: list[int], prefilling: list[PromptNeed],
             prompts: dict[int, PromptNeed]) -> Plan:
        """The plan alone, from the numbers given (:meth:`schedule` gives its own lists' and applies it). ``rows``: every running row's memory (ignored without a budget: then only counts decide); ``waiting``:
        the wait list in order; ``decoding``: running rows past their prompt; ``prefilling``: running rows with
        prompt left, oldest first; ``prompts``: each waiting key's prompt need, should it join."""
        if self.budget is None:
            memory = admit_by_count(len(rows), [w.key for w in waiting], self.max_rows)
        else:
            memory = decide(rows, waiting, self.budget, self.host_budget, self.mode, self.max_rows)
        gone = set(memory.preempt)
        # a prompt prefilled under a T0 limit (set now or before) takes chunks of at most its tail reserve: the
        # device then holds its limit beside one reserve, the bytes the decision counted for it
        by_key = {r.key: r for r in rows}
        limits = {k: r.t0_limit for k, r in by_key.items()} | memory.limits  # as they stand after the decision
        limited = {k for k, t in limits.items() if t is not None}
        reserves = {w.key: w.reserve for w in waiting}

        def capped(p: PromptNeed, limit: bool, reserve: int) -> PromptNeed:
            return PromptNeed(p.key, p.left, p.chunkable, max(1, reserve)) if limit and p.chunkable else p

        running = [capped(p, p.key in limited, by_key[p.key].reserve if p.key in by_key else 0)
                   for p in prefilling if p.key not in gone]
        joining = [capped(prompts[k], t0 is not None, reserves.get(k, 0)) for k, t0 in memory.admit]
        tokens = plan_tokens([k for k in decoding if k not in gone], running, joining, self.max_batched_tokens)
        return Plan(memory=memory, tokens=tokens)
