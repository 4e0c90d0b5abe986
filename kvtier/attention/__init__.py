"""The decode math: partial softmaxes and their log-sum-exp merge (merge), the host-side worker (host), the fused CPU kernel (fused_cpu + csrc/), the tiered layer's decode paths (tiered), and the hook into transformers (registration)."""

from .registration import check_supported, kvtier_attention, num_cache_layers, prepare_model

__all__ = ["check_supported", "kvtier_attention", "num_cache_layers", "prepare_model"]
