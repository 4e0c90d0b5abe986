"""The one registry of cache policies: the CLI, evaluation and benchmarks look names up here only."""

from __future__ import annotations

from .base import Policy
from .full import FullPolicy
from .tiered import TieredPolicy

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (FullPolicy, TieredPolicy)}


def get_policy(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]


__all__ = ["POLICIES", "Policy", "get_policy"]
