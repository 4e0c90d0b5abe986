"""What the tiered decode paths read of a layer (:class:`TieredBuffers`): its buffers, its state and three host-tier calls; the cache's ``TieredLayer`` is one, and this package need not import it."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class TieredBuffers(Protocol):
    """One layer's K/V as :mod:`kvtier.attention.tiered` reads it (:class:`kvtier.cache.layer.TieredLayer` owns and
    fills these; nothing in ``attention/`` allocates K/V).

    ``dev_k`` / ``dev_v`` (B, H, cap0 + cap_t, D) on the device: T0's slots then the tail's columns; ``tail_k`` /
    ``tail_v`` (B, H, cap_t, D) views of their tail; ``k1`` / ``v1`` (B, H, cap1, D) host; ``k2`` / ``v2`` (B, H,
    cap2, D) int8 host with ``k2s`` / ``v2s`` (B, H, cap2, 1) scales. ``state`` is the cache's shared
    :class:`kvtier.cache.state.TierState` (typed loosely here: ``cache/`` imports ``attention/``, not the other way)."""

    state: Any
    layer_idx: int
    cap0: int
    dev_k: torch.Tensor
    dev_v: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    k1: torch.Tensor | None
    v1: torch.Tensor | None
    k2: torch.Tensor | None
    v2: torch.Tensor | None
    kernel_memo: Any  # the fused kernel's arguments kept between steps (tiered.kernel_regions); None: rebuild

    def host_tensors(self, rows: slice = ..., tiers: tuple[int, ...] = ...) -> dict[str, torch.Tensor]:
        """The layer's host ``tiers`` for ``rows`` (a leading-dimension slice), by name (k1, v1, k2, v2, k2s, v2s)."""
        ...

    def staged(self, rows: slice = ..., tiers: tuple[int, ...] = ...) -> dict[str, torch.Tensor]:
        """Device copies of :meth:`host_tensors` (prefetched, kept, or copied now)."""
        ...

    def release_staged(self) -> None:
        """The staged copies are read: free their slot and start the next layer's prefetch."""
        ...
