"""The decode step outside the attention: the model's own layers made fast on CPU (prepacked, fused linears).

The attention has its own kernels (:mod:`kvtier.attention`); this package owns the rest of the step, which on a
CPU is most of it. :func:`kvtier.load_model` applies :func:`pack_linears` by default (``linear="auto"``).
"""

from .linear import LINEAR_MODES, FusedLinear, PackedLinear, linear_mode, linear_reference, pack_linears, packed_count, \
    packs_by_default, step_weight_bytes, expert_weights
from .malloc import keep_freed_memory

__all__ = ["LINEAR_MODES", "FusedLinear", "PackedLinear", "linear_mode", "linear_reference", "pack_linears", "packed_count",
           "packs_by_default", "step_weight_bytes", "expert_weights", "keep_freed_memory"]
