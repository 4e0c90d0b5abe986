"""The transformers ``Cache`` glue: shared tier state, the tiered layer's storage and migration, head-wise eviction caches, statistics."""

from .state import ATTENTION_MODES, T1_MODES
from .tiered import KVTierCache

__all__ = ["ATTENTION_MODES", "KVTierCache", "T1_MODES"]
