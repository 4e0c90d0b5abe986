"""The scheduler's plan from numbers alone (no model, no tensors): the token budget, decoding rows first, prompt
chunks that continue over steps, and the memory decisions (demote / queue / recompute, a host budget that forces a
preemption) in the same plan."""

from __future__ import annotations

import pytest

from kvtier.serve.scheduler import PromptNeed, RowNeed, Scheduler, WaitNeed, plan_tokens

COL = 100  # bytes a token


def _row(key, tokens, *, limit=None, generated=10, host=0, host_next=None, can_limit=True, arrived=0.0):
    return RowNeed(key=key, next_bytes=(tokens + 1) * COL, col_bytes=COL, reserve=8, can_limit=can_limit,
                   generated=generated, arrived=arrived, host_bytes=host,
                   host_next=host if host_next is None else host_next, t0_limit=limit, tokens=tokens,
                   device_tokens=tokens, peak_bytes=(tokens + 50) * COL)


def _wait(key, tokens, can_limit=True):
    return WaitNeed(key=key, start_bytes=(tokens + 1) * COL, min_bytes=8 * COL, peak_bytes=(tokens + 50) * COL,
                    col_bytes=COL, reserve=8, can_limit=can_limit, tokens=tokens)


def test_decoding_rows_go_first_then_prefilling_rows_then_joining_prompts():
    p = plan_tokens([1, 2, 3], [PromptNeed(4, 500)], [PromptNeed(5, 40), PromptNeed(6, 40)], 256)
    assert p.decode == [1, 2, 3]
    assert p.chunks == [(4, 253)]  # the prefilling row takes all that is left: nobody joins this step
    assert p.joined == [] and p.tokens == 256


def test_a_long_prompt_continues_over_steps_within_the_budget():
    left, steps = 3000, 0
    while left:
        p = plan_tokens([1, 2], [PromptNeed(9, left)], [], 256)
        assert p.tokens <= 256 and p.decode == [1, 2]
        left -= p.chunks[0][1]
        steps += 1
    assert steps == -(-3000 // 254)


def test_joining_prompts_share_what_is_left_in_order():
    p = plan_tokens([1], [], [PromptNeed(5, 100), PromptNeed(6, 100), PromptNeed(7, 100)], 256)
    assert p.chunks == [(5, 100), (6, 100), (7, 55)] and p.joined == [5, 6, 7]
    p = plan_tokens(list(range(256)), [], [PromptNeed(5, 10)], 256)  # no room: the join waits
    assert p.chunks == [] and p.joined == []


def test_a_prompt_that_cannot_be_chunked_goes_whole_alone_or_waits():
    p = plan_tokens([1], [], [PromptNeed(5, 600, chunkable=False)], 256)
    assert p.chunks == [(5, 600)]  # alone among the step's prompts: the one case a step exceeds the budget
    p = plan_tokens([1], [], [PromptNeed(4, 50), PromptNeed(5, 600, chunkable=False), PromptNeed(6, 10)], 256)
    assert p.chunks == [(4, 50)] and p.joined == [4]  # it waits for a step of its own; the one behind it too


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="max_batched_tokens must be an integer >= 1"):
        plan_tokens([], [], [], 0)
    with pytest.raises(ValueError, match="mode must be one of"):
        Scheduler(None, None, "evict", 8, 256)


def test_without_a_budget_rows_count_and_tokens_decide():
    s = Scheduler(None, None, "demote", 3, 256)
    rows = [_row(1, 50), _row(2, 50)]
    p = s.plan(rows, [_wait(5, 300), _wait(6, 10)], [1, 2], [], {5: PromptNeed(5, 300), 6: PromptNeed(6, 10)})
    assert p.memory.admit == [(5, None)]  # one slot left
    assert p.tokens.chunks == [(5, 254)] and p.tokens.joined == [5]


def test_demote_limits_running_rows_so_a_request_starts():
    s = Scheduler(1000 * COL, None, "demote", 8, 256)
    rows = [_row(1, 480), _row(2, 480)]
    p = s.plan(rows, [_wait(5, 100)], [1, 2], [], {5: PromptNeed(5, 100)})
    assert p.memory.limits and not p.memory.preempt
    assert p.tokens.decode == [1, 2]


def test_queue_admits_only_at_peak_and_never_demotes():
    s = Scheduler(1000 * COL, None, "queue", 8, 256)
    rows = [_row(1, 400)]
    p = s.plan(rows, [_wait(5, 600)], [1], [], {5: PromptNeed(5, 600)})
    assert p.memory.admit == [] and not p.memory.limits
    p = s.plan(rows, [_wait(5, 100)], [1], [], {5: PromptNeed(5, 100)})
    assert p.memory.admit == [(5, None)] and p.tokens.joined == [5]


def test_recompute_preempts_the_newest_and_its_tokens_leave_the_plan():
    s = Scheduler(900 * COL, None, "recompute", 8, 256)
    rows = [_row(1, 500, arrived=1.0), _row(2, 500, arrived=2.0)]
    p = s.plan(rows, [], [1], [PromptNeed(2, 40)], {})
    assert p.memory.preempt == [2]
    assert p.tokens.decode == [1] and p.tokens.chunks == []


def test_a_full_host_budget_forces_a_preemption():
    s = Scheduler(10_000 * COL, 100 * COL, "demote", 8, 256)
    rows = [_row(1, 50, host=60 * COL, host_next=80 * COL, generated=5),
            _row(2, 50, host=30 * COL, host_next=40 * COL, generated=20)]
    p = s.plan(rows, [], [1, 2], [], {})
    assert p.memory.preempt == [1]  # the one with the fewest generated tokens
    assert p.tokens.decode == [2]


def test_a_prompt_under_a_t0_limit_takes_chunks_of_its_tail_reserve():
    """A prefilling row with a T0 limit, and a request admitted at a limit, prefill at most their tail reserve a
    step: the device then holds the limit beside one reserve, the bytes the decision counted."""
    s = Scheduler(550 * COL, None, "demote", 8, 256)  # no room for the limit to grow back
    rows = [_row(1, 300, limit=100), _row(2, 200)]
    p = s.plan(rows, [], [2], [PromptNeed(1, 700)], {})
    assert 1 not in p.memory.limits
    assert p.tokens.chunks == [(1, 8)]  # its reserve (8 columns here), not the 255 tokens left in the step
    roomy = Scheduler(2000 * COL, None, "demote", 8, 256).plan(rows, [], [2], [PromptNeed(1, 700)], {})
    assert roomy.memory.limits == {1: None} and roomy.tokens.chunks == [(1, 255)]  # lifted: full chunks again
    s = Scheduler(1000 * COL, None, "demote", 8, 256)
    rows = [_row(1, 480), _row(2, 480)]
    p = s.plan(rows, [_wait(5, 600)], [1, 2], [], {5: PromptNeed(5, 600)})
    if p.memory.admit and p.memory.admit[0][1] is not None:  # admitted at a limit
        assert p.tokens.chunks == [(5, 8)]
    unlimited = Scheduler(None, None, "demote", 8, 256).plan([_row(1, 300, limit=None)], [], [], [PromptNeed(1, 700)], {})
    assert unlimited.tokens.chunks == [(1, 256)]


def _needs(s, rows_tokens):
    """Row needs for the scheduler's running rows (``rows_tokens``: key -> tokens held) and wait needs for its
    wait list, as an engine would report them."""
    rows = [_row(k, rows_tokens.get(k, 10), generated=s.seqs[k].generated, arrived=float(k)) for k in s.running]
    return rows, [_wait(k, s.seqs[k].tokens) for k in s.waiting]


def test_the_scheduler_owns_the_wait_list_and_the_running_rows():
    """Requests move between the scheduler's own lists: they join in order as slots and tokens allow, their prompt
    chunks are counted off step by step, they decode once their prompt is in, and they leave when they end."""
    s = Scheduler(None, None, "demote", 2, 256)
    for key, prompt in ((1, 600), (2, 10), (3, 5)):
        s.add(key, prompt)
    with pytest.raises(ValueError, match="known already"):
        s.add(1, 5)
    p = s.schedule([], [])
    assert p.tokens.chunks == [(1, 256)] and p.tokens.joined == [1]  # 2 could join (a slot) but no tokens are left
    assert s.running == [1] and list(s.waiting) == [2, 3] and s.seqs[1].left == 344
    p = s.schedule([], [])
    assert p.tokens.chunks == [(1, 256)] and s.seqs[1].left == 88  # the running prompt goes first
    p = s.schedule([], [])
    assert p.tokens.chunks == [(1, 88), (2, 10)] and p.tokens.joined == [2]  # one slot was left: 3 waits
    assert s.running == [1, 2] and list(s.waiting) == [3] and not s.prefilling(1)
    s.advanced(1)
    s.advanced(2)
    p = s.schedule([], [])
    assert p.tokens.decode == [1, 2] and p.tokens.chunks == []
    assert s.remove(1) and not s.remove(1)  # 1 finished: 3 takes its slot
    p = s.schedule([], [])
    assert p.tokens.decode == [2] and p.tokens.joined == [3] and s.running == [2, 3]
    assert s.remove(3) is True and s.running == [2] and not s.waiting
    assert s.next_tokens(2, limited=False, reserve=8) == 1


def test_a_preempted_row_waits_first_and_prefills_what_it_generated():
    s = Scheduler(900 * COL, None, "recompute", 8, 256)
    s.add(1, 200)
    s.add(2, 200)
    s.schedule(*_needs(s, {}))
    s.schedule(*_needs(s, {}))  # both prompts are in (2 x 200 < 256 + 256)
    assert s.running == [1, 2] and not s.prefilling(1) and not s.prefilling(2)
    for _ in range(30):
        s.advanced(1)
        s.advanced(2)
    s.add(3, 50)
    p = s.schedule(*_needs(s, {1: 450, 2: 450}))  # the next step does not fit: the newest (2) is preempted
    assert p.memory.preempt == [2] and s.running == [1] and list(s.waiting) == [2, 3]
    assert s.seqs[2].tokens == 230 and s.seqs[2].preemptions == 1 and s.is_waiting(2)
    p = s.schedule(*_needs(s, {1: 300}))  # room again: it starts first, with its prompt and its 30 tokens
    assert p.tokens.joined[0] == 2 and (2, 230) in p.tokens.chunks
    s.add(4, 10)
    with pytest.raises(ValueError, match="waiting needs must follow"):
        s.schedule(_needs(s, {})[0], [])  # under a budget, every waiting request's numbers are needed
    with pytest.raises(ValueError, match="row needs must cover"):
        s.schedule([], _needs(s, {})[1])


def test_a_request_that_can_never_fit_leaves_the_wait_list():
    s = Scheduler(100 * COL, None, "queue", 8, 256)
    s.add(7, 500)
    p = s.schedule([], [_wait(7, 500)])
    assert p.memory.reject == [7] and not s.seqs and not s.waiting
