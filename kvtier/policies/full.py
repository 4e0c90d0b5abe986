"""``full``: every token kept in device memory, through the same attention path as the tiered cache.

It is the reference every other policy is compared with; with ``attention="ordered"`` on both, ``tiered`` at
``evict_ratio=0`` gives bit-identical outputs (Proposition 1). In the default split mode it has one region and no
scores to keep: it is read in place, by the fused CPU kernel (:mod:`kvtier.attention.fused_cpu`, without its score update) on
a CPU where that is the faster path, else by torch's SDPA (``kernel="eager"`` always SDPA, ``"fused"`` insists on
the kernel; see :func:`kvtier.attention.fused_cpu.sdpa_is_faster`).
"""

from __future__ import annotations

from ..cache import KVTierCache
from ..config import TierConfig
from .base import GridAxes, Policy


class FullPolicy(Policy):
    name = "full"
    description = "keep everything on the device (reference)"
    family = "reference"
    chunked_prefill = True

    @classmethod
    def can_limit(cls, params: dict) -> bool:
        return True  # a limited full cache becomes a tiered one with no eviction (Proposition 1)

    @classmethod
    def grid(cls, axes: GridAxes) -> tuple[list[dict], list[str]]:
        return [{}], []  # nothing to vary: it runs once

    @classmethod
    def eviction_ratio(cls, params: dict) -> float:
        return 0.0

    @classmethod
    def build(cls, num_layers: int, attention: str = "split", kernel: str = "auto") -> KVTierCache:
        cfg = TierConfig(hbm_ratio=1.0, quant_ratio=0.0, evict_ratio=0.0)
        return KVTierCache(cfg, num_layers, retier=False, policy=cls.name, attention=attention, kernel=kernel)
