"""``full``: every token kept in device memory, through the same attention path as the tiered cache.

It is the reference every other policy is compared with; with ``tiered`` at ``evict_ratio=0`` it gives
bit-identical outputs (Proposition 1).
"""

from __future__ import annotations

from ..cache import KVTierCache
from ..config import TierConfig
from .base import Policy


class FullPolicy(Policy):
    name = "full"
    description = "keep everything on the device (reference)"

    @classmethod
    def build(cls, num_layers: int) -> KVTierCache:
        cfg = TierConfig(hbm_ratio=1.0, quant_ratio=0.0, evict_ratio=0.0)
        return KVTierCache(cfg, num_layers, retier=False, policy=cls.name)
