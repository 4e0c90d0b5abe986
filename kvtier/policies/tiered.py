"""``tiered``: the seed paper's four-tier hierarchy (T0 HBM, T1 DRAM, T2 int8, T3 evicted).

Protected tokens (the prompt by default, ``sink_tokens`` first and ``recent_window`` last tokens) stay in T0.
Every ``retier_interval`` decode steps the rest are ranked by cumulative attention and split by the ratios.

``attention="split"`` (default) attends every tier where it lives and merges the partial softmaxes by log-sum-exp;
``attention="ordered"`` gathers the kept tokens in position order first (bit-identical across HBM ratios: the
reference). ``t1_attention`` says where T1 (and T2) are attended in split mode: ``"stream"`` copies them to the
device each step, ``"host"`` attends them on the host and sends back one small partial, ``"auto"`` picks per
reassignment from measured bandwidths (on a CPU-only machine: ``"host"``, i.e. in place).

``kernel`` chooses the split step's implementation: ``"auto"`` (default) runs the fused CPU kernel
(:mod:`kvtier.attention.fused_cpu`: every region in one call, scores included) when the cache lives on a CPU and the kernel
builds, else the eager partials of :mod:`kvtier.attention.merge`; ``"eager"`` always the latter; ``"fused"``
insists (an error where it cannot run).

``t1_on_device=True`` keeps a device copy of the host tiers between reassignments: T1/T2 then cross the bus
once per reassignment instead of every step, at the price of device memory (that of the full cache). Outputs
are unchanged; the benchmark shows the trade.
"""

from __future__ import annotations

from ..cache import KVTierCache
from ..config import TierConfig
from .base import GridAxes, Policy, fits


class TieredPolicy(Policy):
    name = "tiered"
    description = "T0 device / T1 host / T2 int8 host / T3 evicted, by cumulative attention"
    family = "hierarchy"
    chunked_prefill = True

    @classmethod
    def can_limit(cls, params: dict) -> bool:
        return True  # its rest lives in T1: demoting moves device tokens there, attended exactly

    @classmethod
    def grid(cls, axes: GridAxes) -> tuple[list[dict], list[str]]:
        """Every hbm ratio x every eviction ratio at the sweep's quant ratio, where the three fit."""
        q = axes.quant_ratio
        pairs = [(h, e) for e in axes.evict_ratios for h in axes.hbm_ratios]
        return ([dict(hbm_ratio=h, evict_ratio=e, quant_ratio=q) for h, e in pairs if fits(h, e, q)],
                [f"{cls.name} hbm {h} + evict {e} + quant {q}" for h, e in pairs if not fits(h, e, q)])

    @classmethod
    def memory_floor(cls, params: dict) -> int | None:
        """The device tokens kept on top of the prompt whatever the ratios (its recent window; sinks lie inside
        the prompt), or None when the prompt is not protected: what an equal-memory baseline is floored at."""
        p = {**cls.params(), **params}
        return int(p["recent_window"]) if p.get("protect_prompt", True) else None

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
        t1_on_device: bool = False,
        attention: str = "split",
        t1_attention: str = "auto",
        kernel: str = "auto",
    ) -> KVTierCache:
        cfg = TierConfig(hbm_ratio, quant_ratio, evict_ratio, retier_interval, sink_tokens, recent_window, protect_prompt)
        return KVTierCache(cfg, num_layers, retier=True, policy=cls.name, t1_on_device=t1_on_device,
                           attention=attention, t1_attention=t1_attention, kernel=kernel)
