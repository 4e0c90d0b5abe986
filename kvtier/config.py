"""Typed, validated configuration for kvtier caches, and every value check a policy's parameters go through.

Budgets are fractions of each sequence's *logical* length N (prompt + generated, padding excluded):

- ``hbm_ratio``   -> T0 (device memory), at least the protected set;
- ``quant_ratio`` -> T2 (int8 on the host);
- ``evict_ratio`` -> T3 (destroyed);
- T1 (full precision on the host) takes the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ATTENTION_MODES = ("split", "ordered")  # split: each tier where it lives; ordered: the bit-exact reference
T1_MODES = ("auto", "stream", "host")  # where T1/T2 are attended in split mode
KERNEL_MODES = ("auto", "fused", "eager")  # the split step's implementation (kvtier.attention.fused_cpu)

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


@dataclass(frozen=True)
class EvictionBudget:
    """How many tokens a row may keep: ``budget_ratio`` of its logical length, or ``budget_tokens``.

    ``budget_floor`` (equal-memory comparisons): when set, a row's budget is at least its prompt plus its
    ``budget_floor`` newest generated tokens. The tiered planner keeps ``max(|protected|, floor(hbm_ratio * N))``
    tokens in T0 with protected = prompt + sinks + the last ``recent_window`` tokens, so
    ``budget_ratio=hbm_ratio, budget_floor=recent_window`` gives a baseline exactly that many device tokens.
    """

    budget_ratio: float | None = None
    budget_tokens: int | None = None
    budget_floor: int | None = None

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
        f = self.budget_floor
        if f is not None and (isinstance(f, bool) or not isinstance(f, int) or f < 0):
            raise ValueError(f"budget_floor must be None or an integer >= 0 (generated tokens on top of the prompt), got {f!r}")

    def per_row(self, n_real: torch.Tensor, n_prompt: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) long budgets for rows of (B,) real lengths (``n_prompt`` (B,): real prompt lengths, for the floor)."""
        if self.budget_tokens is not None:
            b = torch.clamp(n_real, max=self.budget_tokens)
        else:
            b = torch.tensor([max(1, budget(self.budget_ratio, int(n))) for n in n_real.tolist()], dtype=torch.long)
        if self.budget_floor is not None and n_prompt is not None:
            b = torch.maximum(b, n_prompt + torch.clamp(n_real - n_prompt, max=self.budget_floor))
        return b


def check_number(policy: str, name: str, value, lo: float, hi: float | None = None, integer: bool = False) -> None:
    """``ValueError`` naming the parameter, the policy and the allowed range."""
    kind = int if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kind) and value >= lo and (hi is None or value <= hi)
    if not ok:
        what = "an integer" if integer else "a number"
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {what} {rng} for policy {policy!r}, got {value!r}")


def check_modes(policy: str, attention: str, t1_attention: str = "auto", t1_on_device: bool = False,
                kernel: str = "auto") -> None:
    """``ValueError`` naming the parameter when the attention settings are unknown or contradict each other."""
    if kernel not in KERNEL_MODES:
        raise ValueError(f"kernel must be one of {list(KERNEL_MODES)} for policy {policy!r}, got {kernel!r}")
    if kernel == "fused" and attention != "split":
        raise ValueError(f"kernel='fused' needs attention='split' for policy {policy!r} (the ordered path is the "
                         "reference and has no kernel)")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {list(ATTENTION_MODES)} for policy {policy!r}, got {attention!r}")
    if t1_attention not in T1_MODES:
        raise ValueError(f"t1_attention must be one of {list(T1_MODES)} for policy {policy!r}, got {t1_attention!r}")
    if not isinstance(t1_on_device, bool):
        raise ValueError(f"t1_on_device must be True or False for policy {policy!r}, got {t1_on_device!r}")
    if attention == "ordered" and t1_attention == "host":
        raise ValueError(f"t1_attention='host' needs attention='split' for policy {policy!r}: the ordered path "
                         "attends every kept token in one softmax on the device")
    if t1_on_device and t1_attention == "host":
        raise ValueError(f"t1_on_device=True keeps T1 on the device; it contradicts t1_attention='host' for policy {policy!r}")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(name: str, text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` or a plain number of bytes -> bytes (>= 1); a clear error otherwise."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name} must be a size in bytes, like 536870912, 512MiB or 2GiB, got {text!r}")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {text!r}")
    return n
