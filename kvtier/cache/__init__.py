"""The transformers ``Cache`` glue: shared tier state, the tiered layer's storage and migration, head-wise eviction caches, statistics."""

from .layer import TieredLayer
from .state import ATTENTION_MODES, T1_MODES, TierState, check_modes
from .stats import cache_stats
from .tiered import KVTierCache

__all__ = ["ATTENTION_MODES", "KVTierCache", "T1_MODES", "TierState", "TieredLayer", "cache_stats", "check_modes"]
