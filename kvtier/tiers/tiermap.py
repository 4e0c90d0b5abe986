"""Where every token lived: opt-in recording of placements over time, and per-token tier maps for display.

``make_cache(..., record_tiers=True)`` attaches a :class:`TierRecorder` to the cache: one int8 row per
reassignment (the tiered family) or per ``every`` decode steps (caches that never reassign, and the per-head
baselines), so its memory is bounded by ``rows x positions`` bytes. ``record_tiers=callable`` calls
``callable(step, row)`` instead and keeps nothing. Off (the default), no recorder exists and nothing is
recorded or allocated.

Row codes, per logical position (B, N) int8:
- ``kind == "tiers"`` (the tiered family): 0-3 for T0-T3, -1 for left padding.
- ``kind == "share"`` (per-head policies, whose layers and kv-heads each keep their own positions): the
  percentage 0-100 of (layer, kv-head) pairs that still hold the position, -1 for left padding.

:class:`TokenTiers` is one sequence's map (prompt + completion, left padding dropped): final codes, scores,
protected marks, and the recorded history, all JSON-able; the HTML and PNG renderers (:mod:`kvtier.tools.viz`)
read only this. Records store the compact form (:func:`compact`): one character per token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

TIERS, SHARE = "tiers", "share"
NOT_CACHED = -2  # a token sampled last: never fed back, so never in the cache
NOT_YET = -3  # history rows: a token not generated yet at that step
TIER_NAMES = ("T0", "T1", "T2", "T3")
DEFAULT_EVERY = 64  # the paper's reassignment interval; used by caches that do not reassign


class TierRecorder:
    """Placement rows over decode steps: ``steps[i]`` is the decode step of ``rows[i]`` (B, N_i) int8."""

    def __init__(self, kind: str, every: int = DEFAULT_EVERY, callback: Callable[[int, torch.Tensor], None] | None = None):
        if kind not in (TIERS, SHARE):
            raise ValueError(f"kind must be {TIERS!r} or {SHARE!r}, got {kind!r}")
        self.kind = kind
        self.every = every
        self.callback = callback
        self.steps: list[int] = []
        self.rows: list[torch.Tensor] = []

    def note(self, step: int, row: torch.Tensor) -> None:
        row = row.to(device="cpu", dtype=torch.int8)
        if self.callback is not None:
            self.callback(step, row)
            return
        if self.steps and self.steps[-1] == step:  # a second placement at one step replaces the first
            self.rows[-1] = row.clone()
            return
        self.steps.append(step)
        self.rows.append(row.clone())

    def due(self, step: int) -> bool:
        """Periodic recording (caches that never reassign): at prefill and every ``every`` decode steps."""
        return step % self.every == 0

    def nbytes(self) -> int:
        return sum(r.numel() for r in self.rows)

    def reset(self) -> None:
        self.steps, self.rows = [], []


def check_record_tiers(record_tiers: Any) -> None:
    if isinstance(record_tiers, bool) or record_tiers is None or callable(record_tiers):
        return
    raise ValueError(f"record_tiers must be True, False or a callable(step, row), got {record_tiers!r}")


def attach_recorder(cache, record_tiers: Any) -> None:
    """Give ``cache`` a recorder when asked (``True`` or a callback); otherwise leave it without one."""
    check_record_tiers(record_tiers)
    if not record_tiers:
        return
    kind = TIERS if hasattr(cache, "tier_map") else SHARE  # per-head caches keep positions per (layer, head)
    cb = record_tiers if callable(record_tiers) else None
    cache.state.recorder = TierRecorder(kind, callback=cb)


def share_row(kept: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(L, B, H, N) bool kept + (B, N) bool valid -> (B, N) int8 percent of (layer, head) pairs holding each position."""
    pct = torch.round(kept.float().mean(dim=(0, 2)) * 100).to(torch.int8)
    return torch.where(valid.cpu(), pct, torch.full_like(pct, -1))


def cache_codes(cache) -> tuple[str, torch.Tensor]:
    """The cache's current placement as a recorder row: (kind, (B, N) int8)."""
    if hasattr(cache, "tier_map"):
        return TIERS, cache.tier_map()
    return SHARE, cache.share_map()


def protected_positions(cache) -> torch.Tensor | None:
    """(B, N) bool positions the cache keeps whatever their score (tiered family), or None."""
    st = cache.state
    if not hasattr(cache, "tier_map") or st.batch is None:
        return None
    from .planner import protected_mask

    n = st.n_total
    return protected_mask(st.valid[:, :n], st.prompt[:, :n], st.cfg)


@dataclass
class TokenTiers:
    """One sequence's tier map: ``tokens[i]`` (text) with its final ``codes[i]`` (see the module doc; ``-2``
    for a token never cached), cumulative ``scores[i]`` (tiered family), ``protected[i]``, and the recorded
    ``history``: ``history[j][i]`` the code of token i at decode step ``history_steps[j]`` (``NOT_YET``: not yet
    generated)."""

    kind: str
    tokens: list[str]
    n_prompt: int
    codes: list[int]
    scores: list[float] | None = None
    protected: list[bool] | None = None
    history_steps: list[int] = field(default_factory=list)
    history: list[list[int]] = field(default_factory=list)
    title: str = ""

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.codes) != n:
            raise ValueError(f"codes has {len(self.codes)} entries for {n} tokens")
        for name in ("scores", "protected"):
            x = getattr(self, name)
            if x is not None and len(x) != n:
                raise ValueError(f"{name} has {len(x)} entries for {n} tokens")
        if len(self.history) != len(self.history_steps):
            raise ValueError("history and history_steps differ in length")

    def transitions(self, i: int) -> list[tuple[int, int]]:
        """(step, code) each time token i's recorded code changed (its first recorded code included)."""
        out: list[tuple[int, int]] = []
        for step, row in zip(self.history_steps, self.history):
            c = row[i]
            if c == NOT_YET:
                continue
            if not out or out[-1][1] != c:
                out.append((step, c))
        return out

    def counts(self) -> dict[str, int]:
        return tier_counts(self.codes) if self.kind == TIERS else {}


def tier_counts(codes: list[int]) -> dict[str, int]:
    """Tokens per tier among tier codes (never-cached tokens not counted)."""
    return {name: sum(c == t for c in codes) for t, name in enumerate(TIER_NAMES)}


def token_pieces(tok, ids: list[int], text: str | None = None, skip_special: bool = True) -> list[str]:
    """The text of each token such that ``"".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special)``.

    Decoding tokens one by one splits multi-byte characters; then each token gets what its prefix adds to the
    text (a character split over tokens goes to the token that completes it). Quadratic, so only for the rare
    sequences that need it."""
    text = tok.decode(ids, skip_special_tokens=skip_special) if text is None else text
    pieces = [tok.decode([i], skip_special_tokens=skip_special) for i in ids]
    if "".join(pieces) == text:
        return pieces
    out, emitted = [], 0
    for j in range(len(ids)):
        if j == len(ids) - 1:
            upto = len(text)
        else:
            cur = tok.decode(ids[: j + 1], skip_special_tokens=skip_special).rstrip("\ufffd")  # an unfinished character
            upto = next((k for k, (a, b) in enumerate(zip(cur, text)) if a != b), min(len(cur), len(text)))
        upto = max(upto, emitted)
        out.append(text[emitted:upto])
        emitted = upto
    return out


def sequence_map(cache, row: int, pad: int, n_tokens: int, pieces: list[str], n_prompt: int, title: str = "",
                 details: bool = True, codes: tuple[str, torch.Tensor] | None = None) -> TokenTiers:
    """The map of batch row ``row``: its ``n_tokens`` real positions start at logical column ``pad``
    (left padding); ``pieces`` are their texts, the first ``n_prompt`` the prompt's. ``details=False`` leaves
    out scores, protected marks and history (what records keep); ``codes`` reuses one :func:`cache_codes`
    for every row of a batch."""
    kind, codes = cache_codes(cache) if codes is None else codes
    n_cached = codes.shape[1] if codes.numel() else 0
    stop = min(pad + n_tokens, n_cached)
    final = codes[row, pad:stop].tolist() + [NOT_CACHED] * (pad + n_tokens - stop)
    scores = prot = None
    if details and kind == TIERS and n_cached:
        s = cache.scores()[row, pad:stop].tolist()
        scores = s + [0.0] * (pad + n_tokens - stop)
        p = protected_positions(cache)[row, pad:stop].tolist()
        prot = p + [False] * (pad + n_tokens - stop)
    rec = getattr(cache.state, "recorder", None) if details else None
    steps, hist = [], []
    if rec is not None:
        for step, r in zip(rec.steps, rec.rows):
            got = r[row, pad : min(pad + n_tokens, r.shape[1])].tolist()
            hist.append(got + [NOT_YET] * (n_tokens - len(got)))
            steps.append(step)
    return TokenTiers(kind, list(pieces), n_prompt, final, scores, prot, steps, hist, title)


# ---- the compact form kept in eval records ---------------------------------------------------------------
def encode_codes(kind: str, codes: list[int]) -> str:
    """One character per token: tiers '0'-'3'; share 'a' (0%) .. 'k' (100%) in tenths; '.' not cached."""
    if kind == TIERS:
        return "".join("." if c < 0 else str(c) for c in codes)
    return "".join("." if c < 0 else chr(ord("a") + round(c / 10)) for c in codes)


def decode_codes(kind: str, s: str) -> list[int]:
    if kind == TIERS:
        return [NOT_CACHED if ch == "." else int(ch) for ch in s]
    return [NOT_CACHED if ch == "." else 10 * (ord(ch) - ord("a")) for ch in s]


def compact(m: TokenTiers, n_prompt_tokens: int) -> dict:
    """What an eval record keeps: the final codes of the prompt and of the completion, and where each completion
    token ends in the completion text (the report colors the text by these)."""
    ends, acc = [], 0
    for piece in m.tokens[n_prompt_tokens:]:
        acc += len(piece)
        ends.append(acc)
    return {"kind": m.kind, "prompt": encode_codes(m.kind, m.codes[:n_prompt_tokens]),
            "completion": encode_codes(m.kind, m.codes[n_prompt_tokens:]), "ends": ends}


def from_compact(d: dict, completion: str) -> TokenTiers:
    """A completion-only map rebuilt from a record's compact form and its completion text."""
    kind = d["kind"]
    codes = decode_codes(kind, d["completion"])
    ends = d["ends"]
    starts = [0] + ends[:-1]
    pieces = [completion[a:b] for a, b in zip(starts, ends)]
    return TokenTiers(kind, pieces, 0, codes)
