"""Where each kept token lives, and the moves that take the cache from one placement to the next.

Pure index bookkeeping on the CPU, shared by all layers (the score, hence the placement, is shared):
a :class:`Layout` lists the tokens of each tier in (row, position) order with their *slot* in the tier's
(B, H, cap, D) buffers (stable while the token stays in the tier) and their *working column*, the index in the
position-ordered K/V that the ordered attention gathers. Because the ordered path lays kept tokens out in position
order, which tier a token sits in cannot change a single float of its output; the split path attends each
tier's slots in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .planner import PAD, T0, T1, T2, T3

TAIL = 4  # new tokens since the last reassignment: device resident (counted as T0)
STORED_TIERS = (T0, T1, T2)


def grown_capacity(width: int, cap: int) -> int:
    """Slots to allocate for a tier that must hold ``width`` slots and has ``cap``: unchanged while it fits, else
    1/8 + 32 slots of headroom (rounded to 16), so that buffers are resized once every several reassignments and
    O(log N) times in a chain, while T0's device memory stays within ~1/8 of its budget."""
    if width <= cap:
        return cap
    return (width + width // 8 + 32 + 15) // 16 * 16


@dataclass
class TierTokens:
    """The tokens of one tier, in (row, position) order.

    A tier's buffers are (B, H, cap, D): token i sits at row ``b[i]``, slot ``slot[i]``. Slots are stable: a token
    that stays in its tier keeps its slot across reassignments, so only tokens that change tier are written.
    ``width`` is the number of slot columns in use (max over rows), ``cap`` the allocated columns.
    """

    b: torch.Tensor  # (M,) long
    pos: torch.Tensor  # (M,) long
    col: torch.Tensor  # (M,) long, working column (position order, for the ordered path)
    slot: torch.Tensor  # (M,) long, column in the tier's (B, H, cap, D) buffers
    width: int = 0
    cap: int = 0

    @property
    def count(self) -> int:
        return int(self.b.numel())

    def slot_map(self, batch: int, trash: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, cap) long position held by each slot (``trash`` where empty) and (B, cap) bool occupied.

        Over the whole capacity: attention reads the buffers unsliced, since a matmul over a column slice of a
        (B, H, cap, D) buffer copies it first on some backends."""
        pos = torch.full((batch, self.cap), trash, dtype=torch.long)
        occ = torch.zeros(batch, self.cap, dtype=torch.bool)
        pos[self.b, self.slot] = self.pos
        occ[self.b, self.slot] = True
        return pos, occ


@dataclass
class Move:
    """Tokens going from source tier ``src_tier`` into one target tier.

    ``src``: (m,) slot in the source tier (or tail column); ``dst``: (m,) slot in the target; ``b``: (m,) row.
    """

    src_tier: int
    src: torch.Tensor
    dst: torch.Tensor
    b: torch.Tensor
    _on: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device, name: str) -> torch.Tensor:
        """``src``/``dst``/``b`` on ``device``, copied once for all layers."""
        key = (str(device), name)
        if key not in self._on:
            self._on[key] = getattr(self, name).to(device)
        return self._on[key]


@dataclass
class Layout:
    """Placement of the positions before ``n_main``; positions from ``n_main`` on sit in the tail."""

    n_main: int
    k_main: int  # working columns used by the main part (max over rows of kept positions, padding included)
    tiers: dict[int, TierTokens]
    work_pos: torch.Tensor  # (B, k_main) long, position in each working column, -1 where a row has none
    work_valid: torch.Tensor  # (B, k_main) bool, column holds a real (non-padding) token
    moves: dict[int, list[Move]] = field(default_factory=dict)  # target tier -> moves (from the previous layout)
    changed: dict[str, int] = field(default_factory=dict)  # "T0->T1": tokens (T0 includes the tail)

    @classmethod
    def empty(cls, batch: int) -> "Layout":
        z = torch.zeros(0, dtype=torch.long)
        return cls(
            n_main=0,
            k_main=0,
            tiers={t: TierTokens(z, z, z, z) for t in STORED_TIERS},
            work_pos=torch.zeros(batch, 0, dtype=torch.long),
            work_valid=torch.zeros(batch, 0, dtype=torch.bool),
        )


def _stable_slots(new_x: torch.Tensor, stay: torch.Tensor, old_slot: torch.Tensor) -> torch.Tensor:
    """(B, N) long slot of every token of a tier: stayers keep theirs, entrants take the lowest free slots.
    A caller that shrinks the tier counts a stayer beyond the new width as an entrant (it is relocated)."""
    slot = torch.full(new_x.shape, -1, dtype=torch.long)
    slot[stay] = old_slot[stay]
    enter = new_x & ~stay
    for r in torch.nonzero(enter.any(1)).flatten().tolist():
        es = torch.nonzero(enter[r]).flatten()
        held = slot[r][stay[r]]
        width = max(int(held.max()) + 1 if held.numel() else 0, held.numel() + es.numel())
        occ = torch.zeros(width, dtype=torch.bool)
        occ[held] = True
        slot[r, es] = torch.nonzero(~occ).flatten()[: es.numel()]
    return slot


def build_layout(tiers: torch.Tensor, valid: torch.Tensor, loc_tier: torch.Tensor, loc_idx: torch.Tensor,
                 old: Layout, t0_max: int | None = None) -> Layout:
    """New layout from a tier assignment, with the moves from the current locations.

    Args:
        tiers: (B, N) int8 new tier per position (PAD for padding).
        valid: (B, N) bool real positions.
        loc_tier: (B, N) int8 current tier (TAIL for positions >= ``old.n_main``), updated in place.
        loc_idx: (B, N) long current slot (tail column for TAIL), updated in place.
        old: the current layout (its capacities carry over).
        t0_max: T0's capacity may not exceed this many slots (a device limit; every row's T0 count must fit):
            T0 then shrinks to it, and its tokens in slots beyond it are relocated below it (T0 -> T0 moves).
    """
    B, N = tiers.shape
    kept = tiers != T3  # padding keeps its column (masked) so the working layout matches the full cache
    col = torch.cumsum(kept.long(), dim=1) - 1
    k_main = int(kept.sum(1).max()) if N else 0
    bb, pp = torch.nonzero(kept, as_tuple=True)
    work_pos = torch.full((B, k_main), -1, dtype=torch.long)
    work_valid = torch.zeros(B, k_main, dtype=torch.bool)
    work_pos[bb, col[bb, pp]] = pp
    work_valid[bb, col[bb, pp]] = valid[bb, pp]

    old_t, old_i = loc_tier[:, :N], loc_idx[:, :N]
    by_tier, moves = {}, {}
    for x in STORED_TIERS:
        new_x = tiers == x
        stay = new_x & (old_t == x)
        limit = t0_max if x == T0 else None
        if limit is not None:
            if bool((new_x.sum(1) > limit).any()):
                raise ValueError(f"a row has more T0 tokens than the device limit of {limit} slots")
            stay = stay & (old_i < limit)
        slot = _stable_slots(new_x, stay, old_i)
        bx, px = torch.nonzero(new_x, as_tuple=True)
        sx = slot[bx, px]
        width = int(sx.max()) + 1 if sx.numel() else 0
        cap = grown_capacity(width, old.tiers[x].cap)
        by_tier[x] = TierTokens(bx, px, col[bx, px], sx, width, cap if limit is None else min(cap, limit))
        moves[x] = []
        for y in (T0, TAIL, T1, T2):
            moving = new_x & (old_t == y)
            if y == x:  # relocated below a shrunk capacity
                moving = moving & ~stay
            mb, mp = torch.nonzero(moving, as_tuple=True)
            if mb.numel():
                moves[x].append(Move(y, old_i[mb, mp], slot[mb, mp], mb))

    names = {T0: "T0", TAIL: "T0", T1: "T1", T2: "T2", T3: "T3"}
    changed: dict[str, int] = {}
    for a in (T0, TAIL, T1, T2, T3):
        for c in (T0, T1, T2, T3):
            if names[a] == names[c]:
                continue
            n = int(((old_t == a) & (tiers == c) & valid).sum())
            if n:
                key = f"{names[a]}->{names[c]}"
                changed[key] = changed.get(key, 0) + n

    loc_tier[:, :N] = tiers
    for tok in by_tier.values():
        loc_idx[tok.b, tok.pos] = tok.slot
    return Layout(N, k_main, by_tier, work_pos, work_valid, moves, changed)


def gather_rows(tok: TierTokens, n_heads: int, work_cap: int, stride: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat row indices to copy a tier's tokens into a position-ordered (B, H, work_cap, D) buffer.

    Returns (src, dst), each (H*M,) long: row ``(b*H + h)*stride + slot`` of the tier's buffer viewed as
    (B*H*stride, D) goes to row ``(b*H + h)*work_cap + col`` of the work buffer. ``stride``: the buffer's columns
    (default the tier's capacity; T0 shares its buffer with the tail's columns).
    """
    h = torch.arange(n_heads).unsqueeze(1)  # (H, 1)
    bh = tok.b.unsqueeze(0) * n_heads + h
    stride = tok.cap if stride is None else stride
    return (bh * stride + tok.slot.unsqueeze(0)).reshape(-1), (bh * work_cap + tok.col.unsqueeze(0)).reshape(-1)


__all__ = ["Layout", "Move", "TierTokens", "TAIL", "PAD", "build_layout", "gather_rows", "grown_capacity"]
