"""``tiered``: the seed paper's four-tier hierarchy (T0 HBM, T1 DRAM, T2 int8, T3 evicted).

Protected tokens (the prompt by default, ``sink_tokens`` first and ``recent_window`` last tokens) stay in T0.
Every ``retier_interval`` decode steps the rest are ranked by cumulative attention and split by the ratios.
"""

from __future__ import annotations

from ..cache import KVTierCache
from ..config import TierConfig
from .base import Policy


class TieredPolicy(Policy):
    name = "tiered"
    description = "T0 device / T1 host / T2 int8 host / T3 evicted, by cumulative attention"

    @classmethod
    def build(
        cls,
        num_layers: int,
        hbm_ratio: float = 0.3,
        quant_ratio: float = 0.0,
        evict_ratio: float = 0.03,
        retier_interval: int = 64,
        sink_tokens: int = 4,
        recent_window: int = 128,
        protect_prompt: bool = True,
    ) -> KVTierCache:
        cfg = TierConfig(hbm_ratio, quant_ratio, evict_ratio, retier_interval, sink_tokens, recent_window, protect_prompt)
        return KVTierCache(cfg, num_layers, retier=True, policy=cls.name)
