"""Eviction caches that choose tokens per (layer, kv-head): the published baselines (H2O, R-KV, StreamingLLM).

Bookkeeping (:class:`HeadwiseState`, budgets) is shared by all layers; each :class:`HeadwiseLayer` holds its
K/V on the device as (B, H, S, D) with the position of every slot, so different heads may keep different
positions while the tensors stay rectangular (every head of a row keeps the same number of tokens).
A policy plugs in a :class:`Scorer`: what to observe after attention, when to compress and what to keep.

Budgets: exactly one of ``budget_ratio`` (fraction of each row's logical length, floor, at least 1) or
``budget_tokens`` (a fixed count). Left padding is never kept over a real token: invalid slots rank last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache

from .config import budget as floor_budget
from .layer_base import KVTierLayer, check_update, prompt_validity


@dataclass(frozen=True)
class EvictionBudget:
    """How many tokens a row may keep: ``budget_ratio`` of its logical length, or ``budget_tokens``."""

    budget_ratio: float | None = None
    budget_tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.budget_ratio is None) == (self.budget_tokens is None):
            raise ValueError("give exactly one of budget_ratio (in (0, 1]) or budget_tokens (an integer >= 1)")
        if self.budget_ratio is not None:
            r = self.budget_ratio
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 < r <= 1.0):
                raise ValueError(f"budget_ratio must be a number in (0, 1], got {r!r}")
        if self.budget_tokens is not None:
            t = self.budget_tokens
            if isinstance(t, bool) or not isinstance(t, int) or t < 1:
                raise ValueError(f"budget_tokens must be an integer >= 1, got {t!r}")

    def per_row(self, n_real: torch.Tensor) -> torch.Tensor:
        """(B,) long budgets for rows of (B,) real lengths."""
        if self.budget_tokens is not None:
            return torch.clamp(n_real, max=self.budget_tokens)
        return torch.tensor([max(1, floor_budget(self.budget_ratio, int(n))) for n in n_real.tolist()], dtype=torch.long)


class Scorer:
    """Policy hooks. ``priority`` returns (B, H, S) float, higher = keep; +inf forces a keep."""

    name = "scorer"
    slot_fields: tuple[str, ...] = ()  # per-slot (B, H, cap) float32 tensors the layer keeps aligned with K/V

    def after_prefill(self, layer: "HeadwiseLayer", query: torch.Tensor, scaling: float) -> None:
        pass

    def after_decode(self, layer: "HeadwiseLayer", query: torch.Tensor, probs: torch.Tensor, scaling: float) -> None:
        pass

    def should_compress(self, layer: "HeadwiseLayer", counts: torch.Tensor, budgets: torch.Tensor) -> bool:
        return bool((counts > budgets).any())

    def priority(self, layer: "HeadwiseLayer", budgets: torch.Tensor, scaling: float) -> torch.Tensor:
        raise NotImplementedError

    def budgets(self, state: "HeadwiseState") -> torch.Tensor:
        """(B,) tokens each row may keep; by default the budget applies to the whole logical length."""
        return state.budget.per_row(state.n_real)


class HeadwiseState:
    """Shared bookkeeping: lengths, validity (left padding), prompt positions, budgets."""

    def __init__(self, scorer: Scorer, budget: EvictionBudget, num_layers: int, protect_prompt: bool, policy: str):
        self.scorer = scorer
        self.budget = budget
        self.num_layers = num_layers
        self.protect_prompt = protect_prompt
        self.policy = policy
        self.reset()

    def reset(self) -> None:
        self.batch = None
        self.device = None
        self.n_total = 0
        self.cap = 0
        self.valid = None  # (B, cap + 1) bool on the device; the last column (for empty slots) is False
        self.prompt = None  # (B, cap + 1) bool on the device
        self.decode_steps = 0
        self.compressions = 0
        self.peak_tokens = 0
        self.dtype = None
        self.n_heads = self.head_dim = None
        # Host-side counts, kept by arithmetic so that a decode step never waits for the device.
        self.n_real: torch.Tensor | None = None  # (B,) real positions per row
        self.n_prompt: torch.Tensor | None = None  # (B,) real prompt positions per row

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

    def budgets(self) -> torch.Tensor:
        """(B,) long per-row budgets (the scorer decides what the budget covers)."""
        return self.scorer.budgets(self)


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
        self.expose(kwargs)
        return key_states, value_states

    def _resize(self, cap: int) -> None:
        def grow(t, fill):
            out = torch.full((*t.shape[:2], cap, *t.shape[3:]), fill, dtype=t.dtype, device=t.device)
            out[:, :, : self.S] = t[:, :, : self.S]
            return out

        self.k, self.v, self.pos = grow(self.k, 0), grow(self.v, 0), grow(self.pos, -1)
        self.slots = {n: grow(t, 0) for n, t in self.slots.items()}

    # ---- views -------------------------------------------------------------------------------
    def slot_valid(self) -> torch.Tensor:
        """(B, H, S) bool: slot holds a real, kept token."""
        st = self.state
        p = self.pos[:, :, : self.S]
        idx = torch.where(p >= 0, p, st.cap).reshape(st.batch, -1)
        return torch.gather(st.valid, 1, idx).view_as(p)

    def kept_counts(self) -> torch.Tensor:
        """(B,) real tokens kept per row (the same for every head), read from the device (reference for tests)."""
        return self.slot_valid()[:, 0].sum(-1).cpu()

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float):
        st = self.state
        B, Hq, q, D = query.shape
        if self.layer_idx == 0:
            st.note_validity(attention_mask, q)
        k, v = self.k[:, :, : self.S], self.v[:, :, : self.S]
        if q > 1:
            out = F.scaled_dot_product_attention(
                query, k, v, attn_mask=attention_mask, is_causal=attention_mask is None, scale=scaling, enable_gqa=True
            )
            st.scorer.after_prefill(self, query, scaling)
        else:
            H = k.shape[1]
            g = Hq // H
            s = torch.matmul(query.reshape(B, H, g, D), k.transpose(-1, -2)) * scaling  # (B, H, g, S)
            s = s.masked_fill(~self.slot_valid().unsqueeze(2), float("-inf"))
            p = torch.softmax(s, dim=-1, dtype=torch.float32)
            out = torch.matmul(p.to(v.dtype), v).reshape(B, Hq, 1, D)
            st.scorer.after_decode(self, query, p, scaling)
        # Every row gained its q new real tokens (the prompt: its real length), and compression keeps exactly
        # min(kept, budget) per row, so the counts follow by arithmetic.
        self.counts = st.n_real.clone() if q > 1 or self.counts is None else self.counts + q
        budgets = self.effective_budgets()
        if self.layer_idx == 0:
            st.peak_tokens = max(st.peak_tokens, int(self.counts.sum()))
        if st.scorer.should_compress(self, self.counts, budgets):
            self.compress(budgets, scaling)
            self.counts = torch.minimum(self.counts, budgets)
        return out.transpose(1, 2).contiguous(), None

    def protected(self) -> torch.Tensor:
        """(B, H, S) bool: slots kept regardless of score (the prompt, when ``protect_prompt``)."""
        st = self.state
        if not st.protect_prompt:
            return torch.zeros(self.pos[:, :, : self.S].shape, dtype=torch.bool, device=self.device)
        p = self.pos[:, :, : self.S]
        idx = torch.where(p >= 0, p, st.cap).reshape(st.batch, -1)
        return torch.gather(st.prompt, 1, idx).view_as(p)

    def effective_budgets(self) -> torch.Tensor:
        """Per-row budgets, raised to the protected count when the prompt is protected."""
        b = self.state.budgets()
        if self.state.protect_prompt:
            b = torch.maximum(b, self.state.n_prompt)
        return b

    def compress(self, budgets: torch.Tensor, scaling: float) -> None:
        """Keep the ``budgets[b]`` highest-priority real tokens per (row, head), in position order."""
        st = self.state
        prio = st.scorer.priority(self, budgets, scaling).float()
        prio = torch.where(self.protected(), torch.full_like(prio, math.inf), prio)
        valid = self.slot_valid()
        prio = torch.where(valid, prio, torch.full_like(prio, -math.inf))
        keep_n = min(int(budgets.max()), self.S)
        top = torch.topk(prio, keep_n, dim=-1, sorted=True).indices  # (B, H, keep_n), best first
        rank_ok = torch.arange(keep_n, device=self.device).view(1, 1, -1) < budgets.to(self.device).view(-1, 1, 1)
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


class HeadwiseCache(Cache):
    """A transformers ``Cache`` for per-head eviction policies."""

    def __init__(self, scorer: Scorer, budget: EvictionBudget, num_layers: int, protect_prompt: bool, policy: str):
        self.state = HeadwiseState(scorer, budget, num_layers, protect_prompt, policy)
        layers = [HeadwiseLayer(self.state, i) for i in range(num_layers)]
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
        kept = int(self.layers[0].counts.sum())
        elem = torch.empty(0, dtype=st.dtype).element_size()
        bpt = st.num_layers * st.n_heads * st.head_dim * 2 * elem
        tokens = {"T0": kept, "T1": 0, "T2": 0, "T3": logical - kept}
        dev_alloc = sum(x.numel() * x.element_size() for layer in self.layers if layer.is_initialized for x in (layer.k, layer.v))
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
            "peak_device_kv_bytes": st.peak_tokens * bpt,
        }

    def row_tokens(self, row: int) -> dict[str, int]:
        st = self.state
        if st.batch is None:
            return {"T0": 0, "T1": 0, "T2": 0, "T3": 0}
        kept = int(self.layers[0].counts[row])
        return {"T0": kept, "T1": 0, "T2": 0, "T3": int(st.n_real[row]) - kept}
