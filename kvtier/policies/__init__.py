"""The one registry of cache policies: the CLI, evaluation, reports, the server and benchmarks look names up here only.

Adding a policy is one file in this folder and one line in ``_BUILTIN`` (or :func:`register` from outside): its
class says its family, its parameters and their checks, and how it joins a sweep grid and a comparison.
"""

from __future__ import annotations

from .base import COMPARISONS, FAMILIES, EvictionBaseline, GridAxes, Policy
from .evict import EvictPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .quant import QuantPolicy
from .rkv import RKVPolicy
from .snapkv import SnapKVPolicy
from .snapkv_decode import SnapKVDecodePolicy
from .streaming_llm import StreamingLLMPolicy
from .tiered import TieredPolicy

_BUILTIN = (FullPolicy, TieredPolicy, EvictPolicy, QuantPolicy, StreamingLLMPolicy, H2OPolicy, RKVPolicy, SnapKVPolicy,
            SnapKVDecodePolicy)

POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Add a policy class to the registry (usable as a decorator); its name must be new and its family known."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"a policy needs a non-empty string name, got {name!r}")
    if name in POLICIES and POLICIES[name] is not cls:
        raise ValueError(f"policy {name!r} is already registered")
    if cls.family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)} for policy {name!r}, got {cls.family!r}")
    POLICIES[name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove a policy added by :func:`register` (tests)."""
    POLICIES.pop(name, None)


for _cls in _BUILTIN:
    register(_cls)


def get_policy(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]


def validate_policy(policy: str, params: dict) -> dict:
    """Names *and* values of a policy's parameters, checked without a model; returns them with defaults filled in."""
    return get_policy(policy).validate(params)


def of_family(family: str) -> list[str]:
    """The registered policies of one family, by name."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}")
    return sorted(n for n, p in POLICIES.items() if p.family == family)


def equal_memory_baselines() -> list[str]:
    """The baselines whose budget bounds their device tokens, so that they can be run at the hierarchy's memory."""
    return [n for n in of_family("baseline") if getattr(POLICIES[n], "equal_memory", False)]


__all__ = ["COMPARISONS", "FAMILIES", "POLICIES", "EvictionBaseline", "GridAxes", "Policy", "equal_memory_baselines",
           "get_policy", "of_family", "register", "unregister", "validate_policy"]
