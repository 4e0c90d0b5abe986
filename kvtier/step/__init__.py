"""The decode step outside the attention: the model's own layers made fast on CPU (prepacked, fused linears, norms, MLPs).

The attention has its own kernels (:mod:`kvtier.attention`); this package owns the rest of the step, which on a
CPU is most of it. :func:`kvtier.load_model` applies :func:`prepare_step` by default (``linear="auto"``).
"""

from __future__ import annotations

from torch import nn

from .linear import LINEAR_MODES, FusedLinear, PackedLinear, linear_mode, linear_reference, pack_linears, packed_count, \
    packs_by_default, step_weight_bytes, expert_weights
from .malloc import keep_freed_memory
from .mlp import FusedMLP, fuse_mlps, fused_mlp_count, silu_mul_reference
from .norm import FusedRMSNorm, fuse_norms, fused_norm_count, rms_norm_reference


def prepare_step(model: nn.Module, mode: str | None = None) -> tuple[int, int, int]:
    """Make ``model``'s CPU step fast as ``mode`` says (:func:`linear_mode`; ``eager``: untouched, the stock step bit
    for bit): pack its linears, fuse its norms and its MLPs' SiLU x product. Returns (linears packed, norms fused,
    MLPs fused)."""
    return pack_linears(model, mode), fuse_norms(model, mode), fuse_mlps(model, mode)


__all__ = ["LINEAR_MODES", "FusedLinear", "FusedMLP", "FusedRMSNorm", "PackedLinear", "expert_weights", "fuse_mlps",
           "fuse_norms", "fused_mlp_count", "fused_norm_count", "keep_freed_memory", "linear_mode", "linear_reference",
           "pack_linears", "packed_count", "packs_by_default", "prepare_step", "rms_norm_reference",
           "silu_mul_reference", "step_weight_bytes"]
