"""Sliding-window layers of hybrid models (Gemma 3): each keeps its last ``window`` tokens on the device, untiered.

A hybrid model alternates sliding-window attention layers with full-attention ones (``config.layer_types``). A
reasoning chain lives in the full layers; a sliding layer already forgets all but its window, so there is nothing
to tier. :func:`interleave` builds the cache the model sees: the policy's cache over the full-attention layers
(its layers, state, scores, tiers, stats — the policy is unchanged, it just has fewer layers), with a
:class:`SlidingLayer` at every sliding position. The tier planner's scores therefore come from the full layers
only (the mean over full layers and heads).

A sliding layer stores what transformers' own sliding-window cache layer stores (the last ``window - 1`` positions,
left padding included, the mask hiding it) and attends with transformers' SDPA: the same masks, the same floats.
"""

from __future__ import annotations

import torch

from .base import KVTierLayer


class SlidingLayer(KVTierLayer):
    """One sliding-window layer: K/V (B, H, <= window - 1, D) on the device, the positions before dropped."""

    is_sliding = True

    def __init__(self, window: int) -> None:
        super().__init__()
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1, got {window!r}")
        self.window = window
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.seen = 0  # positions this layer has been given (prompt + generated, padding included)
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the step's K/V (B, H, q, D); returns what attends now (the kept window + the new tokens) and keeps
        the last ``window - 1`` positions for the next step."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[2]
        k = torch.cat([self.keys, key_states], dim=2)
        v = torch.cat([self.values, value_states], dim=2)
        keep = self.window - 1
        self.keys, self.values = k[:, :, -keep:] if keep else k[:, :, :0], v[:, :, -keep:] if keep else v[:, :, :0]
        self.expose(kwargs, k)
        return k, v

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(kv length, kv offset) of the next step's mask: the kept positions plus the new ones, starting at the
        first kept absolute position."""
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        kept = min(self.seen, self.window - 1)
        return kept + q, self.seen - kept

    def get_seq_length(self) -> int:
        return self.seen

    def device_bytes(self) -> int:
        """Bytes of the kept window (K and V, all rows and heads)."""
        if not self.is_initialized:
            return 0
        return 2 * self.keys.numel() * self.keys.element_size()

    def check_model(self, module, key: torch.Tensor) -> None:  # the full layers check the model's shapes
        return None


def layer_plan(config) -> tuple[list[str], int] | None:
    """(layer types, sliding window) of a hybrid model's config, or None when every layer attends in full."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = list(getattr(c, "layer_types", None) or [])
    if not any(t == "sliding_attention" for t in types):
        return None
    return types, int(c.sliding_window)


def interleave(cache, layer_types: list[str], window: int):
    """Make ``cache`` (built over the ``full_attention`` layers only) the cache of the whole hybrid model: its
    ``layers`` become one per model layer, the policy's own layers at the full positions, a :class:`SlidingLayer`
    at each sliding one. The policy's layers keep their own indices (0 .. full layers - 1); returns ``cache``."""
    own = list(cache.layers)
    full = sum(t != "sliding_attention" for t in layer_types)
    if full != len(own):
        raise ValueError(f"the cache has {len(own)} layers for {full} full-attention layers")
    it = iter(own)
    cache.layers = [SlidingLayer(window) if t == "sliding_attention" else next(it) for t in layer_types]
    cache.state.model_layers = len(layer_types)
    return cache


__all__ = ["SlidingLayer", "interleave", "layer_plan"]
