"""``quant``: the seed paper's precision-sensitivity ablation.

The tiered cache with ``rest_tier="T2"``: protected tokens and the top ``hbm_ratio`` stay on the device in
full precision, the lowest ``evict_ratio`` are evicted, and everything else is stored as int8 (per token,
per kv-head scales) instead of going to T1.
"""

from __future__ import annotations

from ..cache import KVTierCache
from ..config import TierConfig
from .base import GridAxes, Policy, fits


class QuantPolicy(Policy):
    name = "quant"
    description = "kept tokens outside T0 stored as int8 instead of T1"
    family = "ablation"
    chunked_prefill = True

    @classmethod
    def grid(cls, axes: GridAxes) -> tuple[list[dict], list[str]]:
        pairs = [(h, e) for e in axes.evict_ratios for h in axes.hbm_ratios]
        return ([dict(hbm_ratio=h, evict_ratio=e) for h, e in pairs if fits(h, e)],
                [f"{cls.name} hbm {h} + evict {e}" for h, e in pairs if not fits(h, e)])

    @classmethod
    def build(
        cls,
        num_layers: int,
        hbm_ratio: float = 0.3,
        evict_ratio: float = 0.0,
        retier_interval: int = 64,
        sink_tokens: int = 4,
        recent_window: int = 128,
        protect_prompt: bool = True,
        attention: str = "split",
        t1_attention: str = "auto",
        kernel: str = "auto",
    ) -> KVTierCache:
        cfg = TierConfig(hbm_ratio, 0.0, evict_ratio, retier_interval, sink_tokens, recent_window, protect_prompt, rest_tier="T2")
        return KVTierCache(cfg, num_layers, retier=True, policy=cls.name, attention=attention, t1_attention=t1_attention,
                           kernel=kernel)
