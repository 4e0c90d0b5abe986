"""``KVTierCache``: the transformers ``Cache`` of the tiered family (tiered, evict, quant, full): one shared
:class:`~kvtier.cache.state.TierState`, one :class:`~kvtier.cache.layer.TieredLayer` per layer."""

from __future__ import annotations

from typing import Any

import torch

from ..config import TierConfig
from ..tiers.layout import TAIL
from ..tiers.planner import T0, T1, T2, T3
from .base import ShapeGuardedCache
from .layer import TieredLayer
from .state import TierState
from .stats import cache_stats


class KVTierCache(ShapeGuardedCache):
    """A transformers ``Cache`` whose tokens live in four tiers; built by :func:`kvtier.make_cache`."""

    def __init__(self, cfg: TierConfig, num_layers: int, retier: bool = True, policy: str = "tiered",
                 t1_on_device: bool = False, attention: str = "split", t1_attention: str = "auto",
                 host_threaded: bool | None = None, kernel: str = "auto") -> None:
        self.state = TierState(cfg, num_layers, retier=retier, policy=policy, t1_on_device=t1_on_device,
                               attention=attention, t1_attention=t1_attention, host_threaded=host_threaded,
                               kernel=kernel)
        layers = [TieredLayer(self.state, i) for i in range(num_layers)]
        self.state.layers = layers
        super().__init__(layers=layers)
        self.config = cfg
        self.policy = policy

    def reset(self) -> None:
        """Forget everything (for a new, unrelated prompt); the object stays usable."""
        for layer in self.layers:
            layer.reset()
        self.state.reset()

    def stats(self) -> dict[str, Any]:
        return cache_stats(self.state, self.layers)

    def scores(self) -> torch.Tensor:
        """(B, N) float64 on the host: the cumulative score of every logical position (0 for padding)."""
        st = self.state
        if st.batch is None:
            return torch.zeros(0, 0)
        return st.combined_scores()[:, : st.n_total]

    def tier_map(self) -> torch.Tensor:
        """(B, N) int8 on the host: the tier of every logical position, 0-3 for T0-T3 (new tokens waiting for
        the next reassignment are on the device: 0), -1 for left padding. N = prompt + generated so far."""
        st = self.state
        if st.batch is None:
            return torch.zeros(0, 0, dtype=torch.int8)
        return st.codes()

    def tier_history(self):
        """The :class:`kvtier.tiers.tiermap.TierRecorder` of ``make_cache(..., record_tiers=True)``, else None."""
        return self.state.recorder

    def kept_mask(self) -> torch.Tensor:
        """(L, B, H_kv, N) bool on the host: True where the position's K/V is still held (any tier) in that layer
        and kv-head. The tiered family decides per position, so every layer and head agree."""
        st = self.state
        if st.batch is None:
            return torch.zeros(self.state.num_layers, 0, 0, 0, dtype=torch.bool)
        tm = self.tier_map()
        kept = (tm >= 0) & (tm != T3)
        return kept.view(1, st.batch, 1, -1).expand(st.num_layers, -1, st.n_heads, -1).clone()

    def row_tokens(self, row: int) -> dict[str, int]:
        """Tier token counts of one batch row (padding excluded)."""
        st = self.state
        if st.batch is None:
            return {"T0": 0, "T1": 0, "T2": 0, "T3": 0}
        n = st.n_total
        valid, lt = st.valid[row, :n], st.loc_tier[row, :n]
        count = lambda m: int((m & valid).sum())  # noqa: E731
        return {"T0": count((lt == T0) | (lt == TAIL)), "T1": count(lt == T1), "T2": count(lt == T2), "T3": count(lt == T3)}
