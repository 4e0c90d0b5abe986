"""``RowsCache``: one decode step over many one-row kvtier caches of different lengths and policies (continuous batching).

Continuous batching gives every request its own cache (batch 1, no padding: a row joins the running batch after
its own prefill and leaves it the step it finishes). One decode step of the model then runs over a batch of rows
whose caches differ in length, policy and tier layout. :class:`RowsCache` is the transformers ``Cache`` handed to
that step: its layer ``l`` passes row ``i``'s new K/V (1, H, 1, D) to row ``i``'s own layer ``l``, and its
attention attends each row through that row's layer — the very calls the row would see decoding alone, so each row's
attention is the same floats at any batch size (only the model's batched matmuls can round differently; see
``tests/serve/test_continuous.py``).

The rows' positions differ, so the caller passes ``position_ids`` (B, 1) = each row's logical length
(:meth:`RowsCache.positions`); the mask transformers builds is not needed (one query per row, no padding) and is
ignored.
"""

from __future__ import annotations

import torch

from .base import KVTierLayer, ShapeGuardedCache


class RowsLayer(KVTierLayer):
    """Layer ``layer_idx`` of a batch of one-row caches: routes row ``i`` of each tensor to ``rows[i]``."""

    def __init__(self, rows: list[KVTierLayer], layer_idx: int) -> None:
        super().__init__()
        self.rows = rows
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the rows initialise themselves
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``/``value_states`` (B, H, 1, D): one new token per row."""
        if key_states.shape[0] != len(self.rows) or key_states.shape[2] != 1:
            raise ValueError(f"a RowsCache step takes one new token for each of its {len(self.rows)} rows, got "
                             f"keys of shape {tuple(key_states.shape)}")
        for i, row in enumerate(self.rows):
            row.update(key_states[i : i + 1], value_states[i : i + 1])
        self.expose(kwargs, key_states)
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float):
        """``query`` (B, Hq, 1, D) -> (B, 1, Hq, D): each row attended by its own layer, as if alone."""
        outs = [row.attend(query[i : i + 1], key[i : i + 1], value[i : i + 1], None, scaling)[0]
                for i, row in enumerate(self.rows)]
        return torch.cat(outs, dim=0), None

    def check_model(self, module, key: torch.Tensor) -> None:  # each row was checked at its own prefill
        pass

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return max(row.get_seq_length() for row in self.rows)


class RowsCache(ShapeGuardedCache):
    """A decode step's cache over ``caches``: each a prefilled one-row kvtier cache of the same model.

    Built per step (cheap: it holds references); the rows' caches keep everything between steps."""

    def __init__(self, caches: list) -> None:
        if not caches:
            raise ValueError("a RowsCache needs at least one row")
        for c in caches:
            st = c.state
            if st.batch != 1 or st.n_total == 0:
                raise ValueError("every row of a RowsCache is a prefilled cache of batch 1")
        n_layers = len(caches[0].layers)
        if any(len(c.layers) != n_layers for c in caches):
            raise ValueError("the rows of a RowsCache must be caches of the same model (same layer count)")
        self.caches = caches
        super().__init__(layers=[RowsLayer([c.layers[i] for c in caches], i) for i in range(n_layers)])

    def positions(self, device=None) -> torch.Tensor:
        """(B, 1) long: each row's next logical position (its length so far), the step's ``position_ids``."""
        return torch.tensor([[c.state.n_total] for c in self.caches], dtype=torch.long, device=device)
