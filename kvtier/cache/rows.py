"""``RowsCache``: one model step over many one-row kvtier caches of different lengths and policies (continuous batching).

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

**Packed steps** (``RowsCache(caches, lengths=[...])``): rows that bring different numbers of new tokens in one
forward — a running row its next token, a joining row its whole prompt (its cache still empty) — are laid end to
end in one sequence, ``input_ids`` (1, sum(lengths)) with ``position_ids`` (1, sum(lengths)) from
:meth:`RowsCache.positions`. The model's projections and MLP run once over all the tokens; each layer cuts the
sequence back into the rows' spans and hands span ``i`` to row ``i``'s own layer (``update`` then ``attend``): a
prefill span is that row's prefill (causal within itself), a one-token span its decode step. Pass
``logits_to_keep=`` :meth:`RowsCache.last_positions` to get one logit row per cache.
"""

from __future__ import annotations

import torch

from .base import KVTierLayer, ShapeGuardedCache


class RowsLayer(KVTierLayer):
    """Layer ``layer_idx`` of a batch of one-row caches: routes row ``i`` of each tensor to ``rows[i]``."""

    def __init__(self, rows: list[KVTierLayer], layer_idx: int, spans: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.layer_idx = layer_idx
        self.spans = spans  # packed step: row i's tokens are [start, start + n) of the one sequence; None: (B, 1)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the rows initialise themselves
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``/``value_states`` (B, H, 1, D): one new token per row; packed: (1, H, sum(lengths), D)."""
        if self.spans is not None:
            total = self.spans[-1][0] + self.spans[-1][1]
            if key_states.shape[0] != 1 or key_states.shape[2] != total:
                raise ValueError(f"a packed RowsCache step takes one sequence of {total} new tokens, got keys of "
                                 f"shape {tuple(key_states.shape)}")
            for row, (s, n) in zip(self.rows, self.spans):
                row.update(key_states[:, :, s : s + n], value_states[:, :, s : s + n])
            self.expose(kwargs, key_states)
            return key_states, value_states
        if key_states.shape[0] != len(self.rows) or key_states.shape[2] != 1:
            raise ValueError(f"a RowsCache step takes one new token for each of its {len(self.rows)} rows, got "
                             f"keys of shape {tuple(key_states.shape)}")
        for i, row in enumerate(self.rows):
            row.update(key_states[i : i + 1], value_states[i : i + 1])
        self.expose(kwargs, key_states)
        return key_states, value_states

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float):
        """``query`` (B, Hq, 1, D) -> (B, 1, Hq, D): each row attended by its own layer, as if alone; packed:
        (1, Hq, N, D) -> (1, N, Hq, D), span by span."""
        if self.spans is not None:
            outs = [row.attend(query[:, :, s : s + n], key[:, :, s : s + n], value[:, :, s : s + n], None, scaling)[0]
                    for row, (s, n) in zip(self.rows, self.spans)]
            return torch.cat(outs, dim=1), None
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
    """A step's cache over ``caches``: each a one-row kvtier cache of the same model.

    Without ``lengths``: a decode step, input (B, 1), every cache prefilled. With ``lengths`` (new tokens per
    row): a packed step, input (1, sum(lengths)); a row with more than one new token must have an empty cache (its
    prefill: a kvtier cache holds one generation, so a prompt cannot be continued in chunks).
    Built per step (cheap: it holds references); the rows' caches keep everything between steps."""

    def __init__(self, caches: list, lengths: list[int] | None = None) -> None:
        if not caches:
            raise ValueError("a RowsCache needs at least one row")
        if lengths is not None and len(lengths) != len(caches):
            raise ValueError(f"lengths must give one count per row ({len(caches)}), got {len(lengths)}")
        for i, c in enumerate(caches):
            st = c.state
            n = 1 if lengths is None else lengths[i]
            if st.batch not in (None, 1) or n < 1 or (n == 1 and st.n_total == 0 and lengths is None):
                raise ValueError("every row of a RowsCache is a prefilled cache of batch 1 (packed: or an empty one)")
            if n > 1 and st.n_total > 0:
                raise ValueError(f"row {i} brings {n} new tokens to a cache that holds {st.n_total}: only an empty "
                                 "cache takes more than one token (its prefill)")
        n_layers = len(caches[0].layers)
        if any(len(c.layers) != n_layers for c in caches):
            raise ValueError("the rows of a RowsCache must be caches of the same model (same layer count)")
        self.caches = caches
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.spans = None
        if self.lengths is not None:
            starts = [0]
            for n in self.lengths[:-1]:
                starts.append(starts[-1] + n)
            self.spans = list(zip(starts, self.lengths))
        super().__init__(layers=[RowsLayer([c.layers[i] for c in caches], i, self.spans) for i in range(n_layers)])

    def positions(self, device=None) -> torch.Tensor:
        """The step's ``position_ids``: (B, 1) long, each row's next logical position (its length so far); packed:
        (1, sum(lengths)), each span counting on from its row's length."""
        if self.lengths is None:
            return torch.tensor([[c.state.n_total] for c in self.caches], dtype=torch.long, device=device)
        pos = torch.cat([torch.arange(c.state.n_total, c.state.n_total + n) for c, n in zip(self.caches, self.lengths)])
        return pos.unsqueeze(0).to(device)

    def last_positions(self, device=None) -> torch.Tensor:
        """(B,) long: where each row's last new token sits in the packed sequence (``logits_to_keep``)."""
        if self.spans is None:
            raise ValueError("last_positions is for a packed step (RowsCache(..., lengths=...))")
        return torch.tensor([s + n - 1 for s, n in self.spans], dtype=torch.long, device=device)
