"""Where each kept token lives, and the moves that take the cache from one placement to the next.

Pure index bookkeeping on the CPU, shared by all layers (the score, hence the placement, is shared):
a :class:`Layout` lists the tokens of each tier in (row, position) order and the *working column* of each,
i.e. its index in the position-ordered K/V that attention sees. Because kept tokens are always laid out
in position order, which tier a token sits in cannot change a single float of the attention output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .planner import PAD, T0, T1, T2, T3

TAIL = 4  # new tokens since the last reassignment: device resident (counted as T0)
STORED_TIERS = (T0, T1, T2)


@dataclass
class TierTokens:
    """The tokens of one tier, in (row, position) order; index j is the token's slot in the tier's buffers."""

    b: torch.Tensor  # (M,) long
    pos: torch.Tensor  # (M,) long
    col: torch.Tensor  # (M,) long, working column

    @property
    def count(self) -> int:
        return int(self.b.numel())


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
            tiers={t: TierTokens(z, z, z) for t in STORED_TIERS},
            work_pos=torch.zeros(batch, 0, dtype=torch.long),
            work_valid=torch.zeros(batch, 0, dtype=torch.bool),
        )


def build_layout(tiers: torch.Tensor, valid: torch.Tensor, loc_tier: torch.Tensor, loc_idx: torch.Tensor, n_main_old: int) -> Layout:
    """New layout from a tier assignment, with the moves from the current locations.

    Args:
        tiers: (B, N) int8 new tier per position (PAD for padding).
        valid: (B, N) bool real positions.
        loc_tier: (B, N) int8 current tier (TAIL for positions >= ``n_main_old``), updated in place.
        loc_idx: (B, N) long current slot (tail column for TAIL), updated in place.
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

    by_tier, moves = {}, {}
    for x in STORED_TIERS:
        bx, px = torch.nonzero(tiers == x, as_tuple=True)
        by_tier[x] = TierTokens(bx, px, col[bx, px])
        old_t, old_i = loc_tier[bx, px], loc_idx[bx, px]
        j = torch.arange(bx.numel())
        moves[x] = [
            Move(y, old_i[sel], j[sel], bx[sel])
            for y in (T0, TAIL, T1, T2)
            if (sel := old_t == y).any()
        ]

    names = {T0: "T0", TAIL: "T0", T1: "T1", T2: "T2", T3: "T3"}
    changed: dict[str, int] = {}
    old = loc_tier[:, :N]
    for a in (T0, TAIL, T1, T2, T3):
        for c in (T0, T1, T2, T3):
            if names[a] == names[c]:
                continue
            n = int(((old == a) & (tiers == c) & valid).sum())
            if n:
                key = f"{names[a]}->{names[c]}"
                changed[key] = changed.get(key, 0) + n

    loc_tier[:, :N] = tiers
    for x, tok in by_tier.items():
        loc_idx[tok.b, tok.pos] = torch.arange(tok.count)
    return Layout(N, k_main, by_tier, work_pos, work_valid, moves, changed)


def dest_rows(tok: TierTokens, n_heads: int, cap: int) -> torch.Tensor:
    """Flat row indices into a (B, H, cap, D) buffer viewed as (B*H*cap, D), in (H, M) source order.

    Returns (H*M,) long: for source row h*M + j, ``(b_j*H + h)*cap + col_j``.
    """
    h = torch.arange(n_heads).unsqueeze(1)  # (H, 1)
    return ((tok.b.unsqueeze(0) * n_heads + h) * cap + tok.col.unsqueeze(0)).reshape(-1)


__all__ = ["Layout", "Move", "TierTokens", "TAIL", "PAD", "build_layout", "dest_rows"]
