"""What a policy is: a name, a family, its parameters with defaults and checks, a cache builder, and how it joins a sweep grid and a comparison."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

FAMILIES = ("reference", "hierarchy", "ablation", "baseline")
COMPARISONS = ("equal-eviction", "equal-memory")


@dataclass(frozen=True)
class GridAxes:
    """What a sweep varies, the same for every policy; each policy turns it into its own grid points.

    ``memory_floor``: the device tokens the hierarchy always keeps on top of the prompt (its recent window, or
    None when it does not protect the prompt); an equal-memory baseline gets the same floor.
    """

    evict_ratios: tuple[float, ...] = ()
    hbm_ratios: tuple[float, ...] = ()
    quant_ratio: float = 0.0
    compare: tuple[str, ...] = ("equal-eviction",)
    budget_tokens: tuple[int, ...] = ()
    memory_floor: int | None = None


def fits(*ratios: float) -> bool:
    """Tier ratios that leave T1 a share >= 0 (a hair of float slack)."""
    return sum(ratios) <= 1 + 1e-9


class Policy:
    """A named way to build a cache. Subclasses define ``name``, ``family``, ``build(num_layers, **params)`` and,
    to join sweeps, ``grid``; everything else has a default that reads ``build``'s signature."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    family: ClassVar[str] = "baseline"  # one of FAMILIES: how reports group and label it
    # its cache takes a prompt in chunks (KVTierCache.open_prompt): what a server's chunked prefill needs; a head-wise
    # baseline scores its whole prompt at prefill, so it takes the prompt whole
    chunked_prefill: ClassVar[bool] = False

    @classmethod
    def can_limit(cls, params: dict[str, Any]) -> bool:
        """Whether its cache can give device memory back without changing its output (T0 tokens moved to T1,
        attended exactly): what a server's device-KV budget may demote. Default: no."""
        return False

    @classmethod
    def params(cls) -> dict[str, Any]:
        """Accepted parameters and their defaults, read from ``build``'s signature."""
        sig = inspect.signature(cls.build)
        return {k: p.default for k, p in sig.parameters.items() if k not in ("cls", "num_layers")}

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        unknown = sorted(set(params) - set(cls.params()))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {unknown} for policy {cls.name!r}; it accepts {sorted(cls.params())}"
            )

    @classmethod
    def validate(cls, params: dict[str, Any]) -> dict[str, Any]:
        """Names *and* values of ``params`` checked without a model (a throwaway one-layer cache); returns the
        parameters with every default filled in."""
        cls.check_params(params)
        try:
            cls.build(1, **params)
        except TypeError as e:  # a value of the wrong kind that the policy's checks did not name
            raise ValueError(f"bad parameter for policy {cls.name!r}: {e}") from None
        return {**cls.params(), **params}

    @classmethod
    def accepted(cls, **given: Any) -> dict[str, Any]:
        """The subset of ``given`` (shared options such as ``hbm_ratio``) that this policy takes, Nones dropped."""
        names = cls.params()
        return {k: v for k, v in given.items() if k in names and v is not None}

    @classmethod
    def build(cls, num_layers: int, **params):  # pragma: no cover - abstract
        raise NotImplementedError

    # ---- sweeps and reports ------------------------------------------------------------------------------
    @classmethod
    def grid(cls, axes: GridAxes) -> tuple[list[dict[str, Any]], list[str]]:
        """The sweep's points for this policy, and descriptions of the points left out (ratios that do not fit).
        Default: the shared ratios this policy takes, one point per combination."""
        names = cls.params()
        evicts = axes.evict_ratios if "evict_ratio" in names else (None,)
        hbms = axes.hbm_ratios if "hbm_ratio" in names else (None,)
        points = []
        for e in evicts:
            for h in hbms:
                p = {k: v for k, v in (("hbm_ratio", h), ("evict_ratio", e)) if v is not None}
                points.append(p)
        return points, []

    @classmethod
    def comparison(cls, params: dict[str, Any], given: dict[str, Any] | None = None) -> str:
        """Which comparison a configuration belongs to, as a report labels it (default: its family)."""
        return cls.family

    @classmethod
    def eviction_ratio(cls, params: dict[str, Any]) -> float | None:
        """The share of tokens the configuration destroys, where a ratio sets it (None where a budget does)."""
        return float(params["evict_ratio"]) if params.get("evict_ratio") is not None else None


class EvictionBaseline(Policy):
    """A published eviction method with a token budget (``budget_ratio`` or ``budget_tokens``, ``budget_floor``).

    Sweeps compare it with the hierarchy at equal eviction (``budget_ratio = 1 - evict``), at equal memory
    (``budget_ratio = hbm``, floored at the hierarchy's protected window: the device tokens tiered keeps in T0) and
    at absolute budgets."""

    family: ClassVar[str] = "baseline"
    equal_memory: ClassVar[bool] = True  # False where the budget does not bound the device tokens (snapkv: prompt only)

    @classmethod
    def grid(cls, axes: GridAxes) -> tuple[list[dict[str, Any]], list[str]]:
        points: list[dict[str, Any]] = []
        if "equal-eviction" in axes.compare:
            points += [dict(budget_ratio=round(1.0 - e, 6)) for e in axes.evict_ratios if e < 1]
        if "equal-memory" in axes.compare and cls.equal_memory:
            points += [dict(budget_ratio=h, budget_floor=axes.memory_floor) for h in axes.hbm_ratios if h > 0]
        points += [dict(budget_tokens=k) for k in axes.budget_tokens]
        return points, []

    @classmethod
    def comparison(cls, params: dict[str, Any], given: dict[str, Any] | None = None) -> str:
        """``given``: the parameters as the run set them; the sweep's equal-memory points name ``budget_floor``
        even where it is None (the hierarchy's prompt unprotected: then the same budget as equal eviction at
        1 - hbm, labelled by what it was run for)."""
        if params.get("budget_floor") is not None or ("budget_floor" in (given or {})
                                                      and params.get("budget_ratio") is not None):
            return f"equal memory (hbm {params.get('budget_ratio')})"
        if params.get("budget_tokens") is not None:
            return f"fixed budget ({params['budget_tokens']} tokens)"
        if params.get("budget_ratio") is not None:
            return f"equal eviction ({round(1.0 - float(params['budget_ratio']), 6)})"
        return "–"

    @classmethod
    def eviction_ratio(cls, params: dict[str, Any]) -> float | None:
        """1 - budget for equal eviction and for equal memory without a floor; None for floored equal memory and
        absolute budgets, which no ratio sets."""
        if params.get("budget_floor") is not None:
            return None
        if params.get("budget_ratio") is not None:
            return round(1.0 - float(params["budget_ratio"]), 6)
        return None
