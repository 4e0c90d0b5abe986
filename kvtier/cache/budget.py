"""What a one-row cache tells a serving scheduler about its memory: :class:`BudgetView`, plain numbers, no tensors."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetView:
    """One cache's memory before its next update (``cache.budget_view(new_tokens)``); bytes are K/V of all layers.

    ``device_bytes``/``next_bytes``: device K/V now and an upper bound after the update; ``host_bytes``/``host_next``:
    T1/T2 now and a bound after it; ``col_bytes``: one token on the device; ``reserve``: the tail columns a limited
    row holds between reassignments; ``can_limit``: device tokens can move to T1 without changing the output (the
    policy's rest tier is T1); ``t0_limit``: the limit set now (None: none); ``tokens``: positions held;
    ``device_tokens``: of them on the device (T0 and the tail)."""

    device_bytes: int
    next_bytes: int
    host_bytes: int
    host_next: int
    col_bytes: int
    reserve: int
    can_limit: bool
    t0_limit: int | None
    tokens: int
    device_tokens: int
