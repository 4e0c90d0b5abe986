"""The one registry of cache policies: the CLI, evaluation and benchmarks look names up here only."""

from __future__ import annotations

from .base import Policy
from .evict import EvictPolicy
from .full import FullPolicy
from .h2o import H2OPolicy
from .quant import QuantPolicy
from .rkv import RKVPolicy
from .snapkv import SnapKVPolicy
from .snapkv_decode import SnapKVDecodePolicy
from .streaming_llm import StreamingLLMPolicy
from .tiered import TieredPolicy

POLICIES: dict[str, type[Policy]] = {
    p.name: p
    for p in (FullPolicy, TieredPolicy, EvictPolicy, QuantPolicy, StreamingLLMPolicy, H2OPolicy, RKVPolicy, SnapKVPolicy,
              SnapKVDecodePolicy)
}


def get_policy(name: str) -> type[Policy]:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]


__all__ = ["POLICIES", "Policy", "get_policy"]
