"""Eviction caches that choose tokens per (layer, kv-head): the published baselines (H2O, R-KV, StreamingLLM,
SnapKV and its decode-time variant).

Bookkeeping (:class:`HeadwiseState`, budgets, limits) is shared by all layers; each :class:`HeadwiseLayer` holds
its K/V on the device as (B, H, S, D) with the position of every slot, so different heads may keep different
positions while the tensors stay rectangular (every head of a row keeps the same number of tokens).
A policy plugs in a :class:`Scorer`: what to observe after attention, when to compress, its must-keep set and
its score.

Budgets: exactly one of ``budget_ratio`` (fraction of each row's logical length, floor, at least 1) or
``budget_tokens`` (a fixed count), optionally raised by ``budget_floor`` (equal-memory comparisons). A row keeps
``max(budget, |forced|)``: the forced set (must-keep + protected prompt) always, the rest by score. Left padding
is never kept over a real token: invalid slots rank last.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..attention.merge import ordered, prompt_attention
from ..config import EvictionBudget  # noqa: F401 (its documented home was here)
from .base import KVTierLayer, ShapeGuardedCache, check_update, prompt_validity
from .budget import BudgetView
from .stats import sliding_stats


class Scorer:
    """Policy hooks.

    A compression keeps, per (row, kv-head), every *forced* slot — the policy's must-keep set (``must_keep``:
    the first ``sinks`` real tokens and the ``recent`` newest, at least the newest token) plus the prompt when it
    is protected — and spends what remains of the budget on the highest ``scores``. When the forced set alone
    exceeds the budget, all of it is kept and nothing else.
    """

    name = "scorer"
    slot_fields: tuple[str, ...] = ()  # per-slot (B, H, cap) float32 tensors the layer keeps aligned with K/V

    def after_prefill(self, layer: "HeadwiseLayer", query: torch.Tensor, scaling: float) -> None:
        pass

    def after_decode(self, layer: "HeadwiseLayer", query: torch.Tensor, probs: torch.Tensor, scaling: float) -> None:
        pass

    def should_compress(self, layer: "HeadwiseLayer", counts: torch.Tensor, limits: torch.Tensor) -> bool:
        """Whether to compress now; ``limits`` (B,) is what each row may keep (budget, raised to the forced set)."""
        return bool((counts > limits).any())

    def must_keep(self, state: "HeadwiseState", budgets: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(sinks, recent): the first ``sinks`` real positions and the ``recent[b]`` (B,) newest positions of each
        row are kept whatever their score. ``recent`` is at least 1 (the newest token)."""
        return 0, torch.ones_like(budgets)

    def scores(self, layer: "HeadwiseLayer", budgets: torch.Tensor, scaling: float) -> torch.Tensor:
        """(B, H, S) float: the policy's keep score per slot, higher = keep (forced slots are kept anyway)."""
        raise NotImplementedError

    def budgets(self, state: "HeadwiseState") -> torch.Tensor:
        """(B,) tokens each row may keep; by default the budget applies to the whole logical length."""
        return state.budget.per_row(state.n_real, state.n_prompt)


def forced_count(n_total: int, n_real: torch.Tensor, prompt_end: int | None, sinks: int, recent: torch.Tensor) -> torch.Tensor:
    """(B,) size of the forced set per row, by interval arithmetic on the host (no device wait).

    Real positions of a row are [pad, n_total) with pad = n_total - n_real (left padding). The forced set is
    [pad, max(pad + sinks, prompt_end)) (sinks, and the protected prompt ``[pad, prompt_end)`` when given) united
    with the ``recent`` newest positions [n_total - recent, n_total).
    """
    pad = n_total - n_real
    head_end = torch.clamp(pad + sinks, max=n_total)
    if prompt_end is not None:
        head_end = torch.maximum(head_end, torch.full_like(pad, prompt_end))
    head = head_end - pad
    rec_start = torch.clamp(n_total - recent, min=0)
    rec_start = torch.maximum(rec_start, pad)
    rec = n_total - rec_start
    overlap = torch.clamp(head_end - rec_start, min=0)
    return head + rec - overlap


class HeadwiseState:
    """Shared bookkeeping: lengths, validity (left padding), prompt positions, budgets."""

    def __init__(self, scorer: Scorer, budget: EvictionBudget, num_layers: int, protect_prompt: bool, policy: str):
        self.scorer = scorer
        self.budget = budget
        self.num_layers = num_layers
        self.protect_prompt = protect_prompt
        self.policy = policy
        self.recorder = None  # a kvtier.tiers.tiermap.TierRecorder when make_cache(..., record_tiers=...) asked for one
        self.reset()

    def reset(self) -> None:
        if self.recorder is not None:
            self.recorder.reset()
        self.batch = None
        self.device = None
        self.n_total = 0
        self.cap = 0
        self.valid = None  # (B, cap + 1) bool on the device; the last column (for empty slots) is False
        self.prompt = None  # (B, cap + 1) bool on the device
        self.decode_steps = 0
        self.compressions = 0
        self.peak_tokens = 0
        self.peak_alloc = 0
        self.dtype = None
        self.n_heads = self.head_dim = None
        # Host-side counts, kept by arithmetic so that a decode step never waits for the device.
        self.n_real: torch.Tensor | None = None  # (B,) real positions per row
        self.n_prompt: torch.Tensor | None = None  # (B,) real prompt positions per row
        self.prompt_end = 0  # padded prompt length: the prompt is positions [pad, prompt_end)
        self.last_budgets: torch.Tensor | None = None  # (B,) the policy's budget at the last step
        self.last_limits: torch.Tensor | None = None  # (B,) budget raised to the forced set at the last step

    def begin_update(self, k: torch.Tensor) -> None:
        q = k.shape[2]
        check_update(self.batch, self.n_total, k)
        if self.batch is None:
            self.batch, self.device, self.dtype = k.shape[0], k.device, k.dtype
            self.n_heads, self.head_dim = k.shape[1], k.shape[3]
        if self.n_total > 0:
            self.decode_steps += 1
        need = self.n_total + q
        if need > self.cap:
            cap = max(need, 2 * self.cap, 256)
            valid = torch.zeros(self.batch, cap + 1, dtype=torch.bool, device=self.device)
            prompt = torch.zeros_like(valid)
            if self.valid is not None:
                valid[:, : self.cap] = self.valid[:, : self.cap]
                prompt[:, : self.cap] = self.prompt[:, : self.cap]
            self.valid, self.prompt, self.cap = valid, prompt, cap
        self.valid[:, self.n_total : need] = True
        if self.n_total == 0:
            self.prompt[:, :need] = True
            self.prompt_end = need
            self.n_real = torch.full((self.batch,), q, dtype=torch.long)
            self.n_prompt = self.n_real.clone()
        else:
            self.n_real += q
        self.n_total = need

    def note_validity(self, attention_mask: torch.Tensor | None, q: int) -> None:
        """Padding of the prompt, from the mask's diagonal (only the prompt holds padding)."""
        diag = prompt_validity(attention_mask, q) if self.n_total == q else None
        if diag is None:
            return
        self.valid[:, :q] = diag.to(self.device)
        self.prompt[:, :q] &= self.valid[:, :q]
        self.n_real = diag.sum(-1).cpu().long()  # one wait, at prefill
        self.n_prompt = self.n_real.clone()

    def kept_mask(self) -> torch.Tensor:
        """(L, B, H_kv, N) bool on the host (see :meth:`HeadwiseCache.kept_mask`)."""
        if self.batch is None:
            return torch.zeros(self.num_layers, 0, 0, 0, dtype=torch.bool)
        out = torch.zeros(self.num_layers, self.batch, self.n_heads, self.n_total + 1, dtype=torch.bool)
        for i, layer in enumerate(self.layers):
            pos = layer.pos[:, :, : layer.S].cpu()
            ok = layer.slot_valid().cpu()
            idx = torch.where(ok, pos, torch.full_like(pos, self.n_total))  # dropped slots land in the spare column
            out[i].scatter_(-1, idx, True)
        return out[..., : self.n_total]

    def share_map(self) -> torch.Tensor:
        """(B, N) int8 on the host: percent of (layer, kv-head) pairs holding each position, -1 for padding."""
        if self.batch is None:
            return torch.zeros(0, 0, dtype=torch.int8)
        from ..tiers.tiermap import share_row

        return share_row(self.kept_mask(), self.valid[:, : self.n_total])

    def record(self) -> None:
        """After the last layer of a step: the share map, when due."""
        rec = self.recorder
        if rec is not None and rec.due(self.decode_steps):
            rec.note(self.decode_steps, self.share_map())

    def budgets(self) -> torch.Tensor:
        """(B,) long per-row budgets (the scorer decides what the budget covers)."""
        return self.scorer.budgets(self)

    def must_keep(self, budgets: torch.Tensor) -> tuple[int, torch.Tensor]:
        sinks, recent = self.scorer.must_keep(self, budgets)
        return int(sinks), torch.clamp(recent.long(), min=1)

    def limits(self, budgets: torch.Tensor) -> torch.Tensor:
        """(B,) what each row may keep: its budget, raised to the forced set (protected prompt + must-keep)."""
        sinks, recent = self.must_keep(budgets)
        forced = forced_count(self.n_total, self.n_real, self.prompt_end if self.protect_prompt else None, sinks, recent)
        return torch.minimum(torch.maximum(budgets, forced), self.n_real)


class HeadwiseLayer(KVTierLayer):
    """One layer: K/V (B, H, cap, D) on the device, slot positions (B, H, cap) (-1 = empty), S slots used."""

    def __init__(self, state: HeadwiseState, layer_idx: int):
        super().__init__()
        self.state = state
        self.layer_idx = layer_idx
        self._clear()

    def _clear(self) -> None:
        self.k = self.v = self.pos = None
        self.slots: dict[str, torch.Tensor] = {}
        self.aux: dict[str, Any] = {}
        self.S = 0
        self.counts: torch.Tensor | None = None  # (B,) kept real tokens per row, tracked on the host
        self.is_initialized = False

    def lazy_initialization(self, key_states, value_states) -> None:
        B, H, _, D = key_states.shape
        self.k = torch.zeros(B, H, 0, D, dtype=key_states.dtype, device=key_states.device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((B, H, 0), -1, dtype=torch.long, device=key_states.device)
        for name in self.state.scorer.slot_fields:
            self.slots[name] = torch.zeros(B, H, 0, dtype=torch.float32, device=key_states.device)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        st = self.state
        if self.layer_idx == 0:
            st.begin_update(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self.S + q > self.k.shape[2]:
            self._resize(max(self.S + q, 2 * self.k.shape[2], 64))
        self.k[:, :, self.S : self.S + q] = key_states
        self.v[:, :, self.S : self.S + q] = value_states
        self.pos[:, :, self.S : self.S + q] = torch.arange(st.n_total - q, st.n_total, device=self.device)
        for t in self.slots.values():
            t[:, :, self.S : self.S + q] = 0
        self.S += q
        self.expose(kwargs, key_states)
        return key_states, value_states

    def _resize(self, cap: int) -> None:
        def grow(t, fill):
            out = torch.full((*t.shape[:2], cap, *t.shape[3:]), fill, dtype=t.dtype, device=t.device)
            out[:, :, : self.S] = t[:, :, : self.S]
            return out

        self.k, self.v, self.pos = grow(self.k, 0), grow(self.v, 0), grow(self.pos, -1)
        self.slots = {n: grow(t, 0) for n, t in self.slots.items()}
        st = self.state
        st.peak_alloc = max(st.peak_alloc, sum(x.numel() * x.element_size() for layer in st.layers
                                               if layer.is_initialized for x in (layer.k, layer.v)))

    # ---- views -------------------------------------------------------------------------------
    def slot_valid(self) -> torch.Tensor:
        """(B, H, S) bool: slot holds a real, kept token."""
        return self._gather_state(self.state.valid)

    def kept_counts(self) -> torch.Tensor:
        """(B,) real tokens kept per row (the same for every head), read from the device (reference for tests)."""
        return self.slot_valid()[:, 0].sum(-1).cpu()

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
               scaling: float, sinks: torch.Tensor | None = None):
        st = self.state
        B, Hq, q, D = query.shape
        if self.layer_idx == 0:
            st.note_validity(attention_mask, q)
        k, v = self.k[:, :, : self.S], self.v[:, :, : self.S]
        prefill = q == st.n_total  # the cache's first tokens (a one-token prompt included)
        if prefill:
            out = prompt_attention(query, k, v, attention_mask, scaling, sinks)
            st.scorer.after_prefill(self, query, scaling)
        else:
            H = k.shape[1]
            # one softmax over this kv-head's kept slots; p (B, H, g, S) float32 feeds the scorer
            out, p = ordered(query.reshape(B, H, Hq // H, D), k, v, self.slot_valid().unsqueeze(2), scaling, sinks)
            out = out.reshape(B, Hq, 1, D)
            st.scorer.after_decode(self, query, p, scaling)
        # Every row gained its q new real tokens (the prompt: its real length), and compression keeps exactly
        # min(kept, budget) per row, so the counts follow by arithmetic.
        self.counts = st.n_real.clone() if prefill or self.counts is None else self.counts + q
        budgets = st.budgets()
        limits = st.limits(budgets)
        if self.layer_idx == 0:
            st.peak_tokens = max(st.peak_tokens, int(self.counts.sum()))
            st.last_budgets, st.last_limits = budgets, limits
        if st.scorer.should_compress(self, self.counts, limits):
            self.compress(budgets, limits, scaling)
            self.counts = torch.minimum(self.counts, limits)
        if self.layer_idx == st.num_layers - 1:
            st.record()
        return out.transpose(1, 2).contiguous(), None

    def _gather_state(self, table: torch.Tensor) -> torch.Tensor:
        """(B, H, S) bool: ``table`` (B, cap + 1) read at each slot's position (empty slots read False)."""
        st = self.state
        p = self.pos[:, :, : self.S]
        idx = torch.where(p >= 0, p, st.cap).reshape(st.batch, -1)
        return torch.gather(table, 1, idx).view_as(p)

    def protected(self) -> torch.Tensor:
        """(B, H, S) bool: slots kept regardless of score (the prompt, when ``protect_prompt``)."""
        if not self.state.protect_prompt:
            return torch.zeros(self.pos[:, :, : self.S].shape, dtype=torch.bool, device=self.device)
        return self._gather_state(self.state.prompt)

    def forced(self, budgets: torch.Tensor) -> torch.Tensor:
        """(B, H, S) bool: real slots kept whatever their score — the policy's sinks and recent tokens, and
        the prompt when protected."""
        st = self.state
        sinks, recent = st.must_keep(budgets)
        pos = self.pos[:, :, : self.S]
        pad = (st.n_total - st.n_real).to(self.device).view(-1, 1, 1)
        keep = pos >= (st.n_total - recent.to(self.device).view(-1, 1, 1))
        if sinks > 0:
            keep |= (pos - pad) < sinks
        return (keep | self.protected()) & self.slot_valid()

    def compress(self, budgets: torch.Tensor, limits: torch.Tensor, scaling: float) -> None:
        """Keep, per (row, head), the forced slots and then the highest scores up to ``limits[b]`` real tokens,
        in position order. Equal scores: the newer token wins."""
        st = self.state
        score = torch.nan_to_num(st.scorer.scores(self, budgets, scaling).float(), nan=-math.inf, posinf=math.inf)
        # The forced slots rank above every score (+inf), so the remaining budget goes to the best scores;
        # their number is the same in every head (positional sets), so no head can crowd another's out.
        prio = torch.where(self.forced(budgets), torch.full_like(score, math.inf), score.clamp(max=torch.finfo(torch.float32).max))
        valid = self.slot_valid()
        prio = torch.where(valid, prio, torch.full_like(prio, -math.inf))
        keep_n = min(int(limits.max()), self.S)
        # Slots are in position order, so a stable sort of the reversed slots breaks score ties towards the
        # newer token (as the tiered planner does) instead of leaving them to topk's unspecified order.
        order = torch.sort(prio.flip(-1), dim=-1, descending=True, stable=True).indices[..., :keep_n]
        top = self.S - 1 - order  # (B, H, keep_n), best first
        rank_ok = torch.arange(keep_n, device=self.device).view(1, 1, -1) < limits.to(self.device).view(-1, 1, 1)
        kept_valid = torch.gather(valid, 2, top) & rank_ok
        pos = torch.gather(self.pos[:, :, : self.S], 2, top)
        pos = torch.where(kept_valid, pos, torch.full_like(pos, -1))
        # Position order (empty slots last) so that attention over an uncompressed cache equals the full one.
        order = torch.argsort(torch.where(pos >= 0, pos, torch.full_like(pos, 1 << 62)), dim=-1, stable=True)
        idx = torch.gather(top, 2, order)
        pos = torch.gather(pos, 2, order)
        D = self.k.shape[-1]
        gidx = idx.unsqueeze(-1).expand(-1, -1, -1, D)
        k = torch.gather(self.k[:, :, : self.S], 2, gidx)
        v = torch.gather(self.v[:, :, : self.S], 2, gidx)
        self.k[:, :, :keep_n], self.v[:, :, :keep_n] = k, v
        self.pos[:, :, :keep_n] = pos
        self.pos[:, :, keep_n : self.S] = -1
        for name, t in self.slots.items():
            t[:, :, :keep_n] = torch.gather(t[:, :, : self.S], 2, idx)
        self.S = keep_n
        if self.layer_idx == 0:
            st.compressions += 1


class HeadwiseCache(ShapeGuardedCache):
    """A transformers ``Cache`` for per-head eviction policies."""

    def __init__(self, scorer: Scorer, budget: EvictionBudget, num_layers: int, protect_prompt: bool, policy: str):
        self.state = HeadwiseState(scorer, budget, num_layers, protect_prompt, policy)
        layers = [HeadwiseLayer(self.state, i) for i in range(num_layers)]
        self.state.layers = layers
        super().__init__(layers=layers)
        self.policy = policy

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.state.reset()

    def stats(self) -> dict[str, Any]:
        st = self.state
        zero_t = {"h2d_bytes": 0, "d2h_bytes": 0, "seconds": 0.0, "stream_h2d_bytes": 0,
                  "migration_h2d_bytes": 0, "migration_d2h_bytes": 0}
        if st.batch is None:
            return {"policy": st.policy, "tokens": {"T0": 0, "T1": 0, "T2": 0, "T3": 0},
                    "bytes": {"T0": 0, "T1": 0, "T2": 0}, "transfer": zero_t, "retiers": 0,
                    "logical_tokens": 0, "decode_steps": 0}
        logical = int(st.n_real.sum())
        kept = int(self.state.layers[0].counts.sum())
        elem = torch.empty(0, dtype=st.dtype).element_size()
        bpt = st.num_layers * st.n_heads * st.head_dim * 2 * elem
        tokens = {"T0": kept, "T1": 0, "T2": 0, "T3": logical - kept}
        dev_alloc = self.device_kv_bytes()
        return {
            "policy": st.policy,
            "tokens": tokens,
            "bytes": {"T0": kept * bpt, "T1": 0, "T2": 0},
            "bytes_per_token": {"T0": bpt, "T1": bpt, "T2": 0},
            "allocated_bytes": {"device": dev_alloc, "host": 0, "staging": 0},
            "effective_ratios": {k: (v / logical if logical else 0.0) for k, v in tokens.items()},
            "logical_tokens": logical,
            "transfer": zero_t,
            "retiers": st.compressions,
            "decode_steps": st.decode_steps,
            "peak_device_tokens": st.peak_tokens,
            "peak_device_kv_bytes": st.peak_alloc,  # the real buffers (capacity doubles as it grows)
            "sliding": sliding_stats(self.sliding_layers()),
            # what the policy's budget allowed vs what was kept: the forced set (protected prompt + the
            # policy's own sinks/window/newest) can exceed the budget, and then all of it is kept
            "budget": {
                "tokens": int(st.last_budgets.sum()) if st.last_budgets is not None else 0,
                "limit_tokens": int(st.last_limits.sum()) if st.last_limits is not None else 0,
                "rows_over_budget": int((st.last_limits > st.last_budgets).sum()) if st.last_limits is not None else 0,
            },
        }

    def kept_mask(self) -> torch.Tensor:
        """(L, B, H_kv, N) bool on the host: True where the position's K/V is still held in that layer and
        kv-head. N = prompt + generated so far (padding included, never kept)."""
        return self.state.kept_mask()

    def share_map(self) -> torch.Tensor:
        """(B, N) int8 on the host: percent of (layer, kv-head) pairs still holding each position, -1 for padding
        (the per-head counterpart of ``KVTierCache.tier_map``)."""
        return self.state.share_map()

    def tier_history(self):
        """The :class:`kvtier.tiers.tiermap.TierRecorder` of ``make_cache(..., record_tiers=True)``, else None."""
        return self.state.recorder

    def row_budget(self, row: int) -> int | None:
        """What row ``row`` was allowed to keep at the last step: its budget, raised to its forced set."""
        st = self.state
        return None if st.last_limits is None else int(st.last_limits[row])

    def row_tokens(self, row: int) -> dict[str, int]:
        st = self.state
        if st.batch is None:
            return {"T0": 0, "T1": 0, "T2": 0, "T3": 0}
        kept = int(self.state.layers[0].counts[row])
        return {"T0": kept, "T1": 0, "T2": 0, "T3": int(st.n_real[row]) - kept}

    # ---- device memory under a budget (continuous batching) -----------------------------------------------
    can_limit = False  # what a head-wise policy keeps is on the device: it cannot give memory back to the host

    def device_kv_bytes(self) -> int:
        """Device bytes of this cache's K/V buffers now (all layers)."""
        return sum(x.numel() * x.element_size() for layer in self.state.layers if layer.is_initialized
                   for x in (layer.k, layer.v)) + sum(s.device_bytes() for s in self.sliding_layers())

    def device_kv_next(self) -> int:
        """An upper bound on :meth:`device_kv_bytes` after one more decode step (buffers double as they fill)."""
        layer = self.state.layers[0]
        if not layer.is_initialized:
            return 0
        cap = layer.k.shape[2]
        new_cap = cap if layer.S + 1 <= cap else max(layer.S + 1, 2 * cap, 64)
        return self.device_kv_bytes() // cap * new_cap if cap else 0

    def host_kv_bytes(self) -> int:
        return 0

    def budget_view(self, new_tokens: int = 1) -> BudgetView:
        """As :meth:`kvtier.cache.tiered.KVTierCache.budget_view`: a head-wise baseline holds everything on the
        device and cannot give any of it to host memory (its evictions are its own)."""
        st = self.state
        return BudgetView(device_bytes=self.device_kv_bytes(), next_bytes=self.device_kv_next(), host_bytes=0,
                          host_next=0, col_bytes=0, reserve=0, can_limit=False, t0_limit=None,
                          tokens=st.n_total, device_tokens=st.n_total)
