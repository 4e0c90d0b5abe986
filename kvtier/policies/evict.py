"""``evict``: the seed paper's eviction-only ablation.

The same cumulative score, protected set, ``retier_interval`` and planner as ``tiered`` (this is the tiered
cache with ``rest_tier="T0"``): every kept token stays on the device, the lowest ``evict_ratio`` are
destroyed. With the same ``evict_ratio`` it evicts exactly the positions ``tiered`` evicts.
"""

from __future__ import annotations

from ..cache import KVTierCache
from ..config import TierConfig
from .base import GridAxes, Policy


class EvictPolicy(Policy):
    name = "evict"
    description = "cumulative-attention eviction only (kept tokens all on the device)"
    family = "ablation"
    chunked_prefill = True

    @classmethod
    def grid(cls, axes: GridAxes) -> tuple[list[dict], list[str]]:
        return [dict(evict_ratio=e) for e in axes.evict_ratios], []

    @classmethod
    def build(
        cls,
        num_layers: int,
        evict_ratio: float = 0.03,
        retier_interval: int = 64,
        sink_tokens: int = 4,
        recent_window: int = 128,
        protect_prompt: bool = True,
        attention: str = "split",
        kernel: str = "auto",
    ) -> KVTierCache:
        cfg = TierConfig(0.0, 0.0, evict_ratio, retier_interval, sink_tokens, recent_window, protect_prompt, rest_tier="T0")
        return KVTierCache(cfg, num_layers, retier=True, policy=cls.name, attention=attention, kernel=kernel)
