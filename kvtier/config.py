"""Typed, validated configuration for kvtier caches.

Budgets are fractions of each sequence's *logical* length N (prompt + generated, padding excluded):

- ``hbm_ratio``   -> T0 (device memory), at least the protected set;
- ``quant_ratio`` -> T2 (int8 on the host);
- ``evict_ratio`` -> T3 (destroyed);
- T1 (full precision on the host) takes the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Float ratios such as 0.29 * 100 land a hair under the integer; this keeps floor() honest.
_FLOOR_EPS = 1e-9


def budget(ratio: float, n: int) -> int:
    """floor(ratio * n), robust to binary floating point (0.29 * 100 -> 29, not 28)."""
    return int(math.floor(ratio * n + _FLOOR_EPS))


def _check_ratio(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 <= float(value) <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def _check_nonneg_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class TierConfig:
    """Parameters of the four-tier placement (the seed paper's hierarchy).

    Attributes:
        hbm_ratio: fraction of N kept in device memory (T0); the protected set always stays there.
        quant_ratio: fraction of N stored as int8 on the host (T2).
        evict_ratio: fraction of N destroyed (T3); the lowest-score tail.
        retier_interval: decode steps between reassignments (the paper's Δ).
        sink_tokens: first real tokens of each sequence that are always protected.
        recent_window: last tokens of each sequence that are always protected.
        protect_prompt: protect the whole prompt (the paper's default).
        rest_tier: the tier that takes what the ratios leave: "T1" (the hierarchy), "T0" (eviction-only
            ablation: everything kept stays on the device) or "T2" (precision ablation: the rest is int8).
    """

    hbm_ratio: float = 0.3
    quant_ratio: float = 0.0
    evict_ratio: float = 0.03
    retier_interval: int = 64
    sink_tokens: int = 4
    recent_window: int = 128
    protect_prompt: bool = True
    rest_tier: str = "T1"

    def __post_init__(self) -> None:
        if self.rest_tier not in ("T0", "T1", "T2"):
            raise ValueError(f"rest_tier must be 'T0', 'T1' or 'T2', got {self.rest_tier!r}")
        for name in ("hbm_ratio", "quant_ratio", "evict_ratio"):
            _check_ratio(name, getattr(self, name))
        total = self.hbm_ratio + self.quant_ratio + self.evict_ratio
        if total > 1.0 + 1e-9:
            raise ValueError(
                "hbm_ratio + quant_ratio + evict_ratio must be <= 1 (T1 takes the rest), "
                f"got {self.hbm_ratio} + {self.quant_ratio} + {self.evict_ratio} = {total:g}"
            )
        if isinstance(self.retier_interval, bool) or not isinstance(self.retier_interval, int) or self.retier_interval < 1:
            raise ValueError(f"retier_interval must be an integer >= 1, got {self.retier_interval!r}")
        _check_nonneg_int("sink_tokens", self.sink_tokens)
        _check_nonneg_int("recent_window", self.recent_window)
        if not isinstance(self.protect_prompt, bool):
            raise ValueError(f"protect_prompt must be True or False, got {self.protect_prompt!r}")
