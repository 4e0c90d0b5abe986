"""What every kvtier cache layer shares: one generation per cache, logical lengths, and how attention finds it."""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin


def check_update(batch: int | None, n_total: int, keys: torch.Tensor) -> None:
    """Refuse a different batch or a second prompt: a kvtier cache holds one generation (``cache.reset()``)."""
    if batch is not None and keys.shape[0] != batch:
        raise ValueError(
            f"this kvtier cache holds a batch of {batch}, got {keys.shape[0]} rows; "
            "call cache.reset() or make a new cache with kvtier.make_cache() for a new batch"
        )
    if n_total > 0 and keys.shape[2] > 1:
        raise ValueError(
            "a kvtier cache holds one generation: it got a new prompt after "
            f"{n_total} positions; call cache.reset() or make a new cache for an unrelated prompt"
        )


def prompt_validity(attention_mask: torch.Tensor | None, q: int) -> torch.Tensor | None:
    """(B, q) bool: which prompt positions are real, read from the mask's diagonal (a padding query's own
    column is masked). None when there is no 4-D mask (no padding)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    i = torch.arange(q, device=attention_mask.device)
    diag = attention_mask[:, 0, i, i]
    return diag if diag.dtype == torch.bool else diag == 0  # additive float masks are 0 where attended


def check_number(policy: str, name: str, value, lo: float, hi: float | None = None, integer: bool = False) -> None:
    """``ValueError`` naming the parameter, the policy and the allowed range."""
    kind = int if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kind) and value >= lo and (hi is None or value <= hi)
    if not ok:
        what = "an integer" if integer else "a number"
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {what} {rng} for policy {policy!r}, got {value!r}")


class KVTierLayer(CacheLayerMixin):
    """Base of kvtier's cache layers. Subclasses keep ``self.state`` (shared bookkeeping with ``n_total``)."""

    is_sliding = False

    def expose(self, update_kwargs: dict) -> None:
        """Hand this layer to the registered attention.

        transformers passes the attention kwargs to ``cache.update(..., kwargs=kwargs)`` and then unpacks the same
        dict into the attention function: the ``"kvtier"`` attention finds its layer there.
        """
        attn_kwargs = update_kwargs.get("kwargs")
        if isinstance(attn_kwargs, dict):
            attn_kwargs["kvtier_layer"] = self

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.state.n_total + query_length, 0  # logical length: masks and RoPE stay true

    def get_seq_length(self) -> int:
        return self.state.n_total

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("kvtier caches do not support beam search (reorder_cache); use greedy or sampling")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("kvtier caches do not support num_return_sequences > 1 with a shared prompt cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("kvtier caches do not support batch selection")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvtier caches do not support crop (assisted decoding)")
