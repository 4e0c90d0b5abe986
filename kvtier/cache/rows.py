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

**Rows served together.** A row whose decode step is one call of the fused CPU kernel — ``full`` (one region, no
scores) and the tiered family on the kernel's path (T0 + tail, T1 and T2 attended in place, scores folded) — has
its new token written and its attention done together with the other such rows: one
:func:`~kvtier.kernels.rows.append_rows` and one :func:`~kvtier.attention.fused_cpu.attend_rows` call per
layer, the same floats and scores as each row through the kernel alone, without 2-4 dispatches and a kernel call
per row and layer (32 ``full`` rows at 512 tokens, bf16, 2-core Xeon with AMX: 145 -> 115 ms a step,
``benchmarks/decode/step_profile.py --layout rows``). On a CPU where one ``full`` cache alone takes SDPA instead (bf16 on
AMX, :func:`~kvtier.attention.fused_cpu.sdpa_is_faster`), its rows in a RowsCache step take the kernel: the same
tokens up to that rounding. Baseline rows (their own scoring), streamed host tiers, the ordered path and
``kernel="eager"`` rows go through their own layers as before.
"""

from __future__ import annotations

import torch

from ..attention import fused_cpu
from ..kernels.rows import append_rows
from .base import KVTierLayer, ShapeGuardedCache


def _plain_call(row: KVTierLayer, region: tuple) -> tuple:
    """A plain full decode row's kernel call at a layer after the first: layer 0's mask and positions (``region``),
    this layer's K/V buffers, no scores (:func:`~kvtier.attention.fused_cpu.attend_rows`' per-row arguments)."""
    return [row.dev_k], [row.dev_v], region[0], region[1], None, 0.0


class RowsLayer(KVTierLayer):
    """Layer ``layer_idx`` of a batch of one-row caches: routes row ``i`` of each tensor to ``rows[i]``."""

    def __init__(self, rows: list[KVTierLayer], layer_idx: int, spans: list[tuple[int, int]] | None = None,
                 lane: dict | None = None) -> None:
        super().__init__()
        self.rows = rows
        self.layer_idx = layer_idx
        self.spans = spans  # packed step: row i's tokens are [start, start + n) of the one sequence; None: (B, 1)
        # What layer 0 found for this step, shared by the step's layers: "cols" (row i's tail column, or None) and
        # "regions" (row i's bias and positions, or None) for each *plain full decode* row: a ``full`` row
        # (``rows_fused``: no scores, no reassignment) decoding in place, its tail not reallocated this step. Such a
        # row's later layers need none of its per-row bookkeeping (every layer of a cache holds the same columns and
        # the mask and positions are the cache's, not the layer's): they take the same column and region, with
        # their own buffers (32 rows x 24 layers: 768 -> 32 calls of each a step; ~1.5 ms of a ~85 ms step). When
        # every row is one ("all_cols", "all_regions"), a later layer builds its kernel calls in one comprehension
        # each, without the per-row branches (32 rows, 0.5B bf16, per layer: update 117 -> 94 us, attend 736 ->
        # 692). A hybrid model's sliding layers keep their own path.
        self.lane = lane if lane is not None else {}
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the rows initialise themselves
        pass

    def _row_spans(self) -> list[tuple[int, int]]:
        """(start, new tokens) per row: the packed spans, or row ``i`` of a (B, ..., 1, D) decode step."""
        return self.spans if self.spans is not None else [(i, 1) for i in range(len(self.rows))]

    def _piece(self, t: torch.Tensor, i: int, s: int, n: int) -> torch.Tensor:
        """Row ``i``'s part of a step tensor (B, H, 1, D) or packed (1, H, N, D) (its span ``s``, ``n``)."""
        return t[:, :, s : s + n] if self.spans is not None else t[i : i + 1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``key_states``/``value_states`` (B, H, 1, D): one new token per row; packed: (1, H, sum(lengths), D).
        The decode tokens of rows that :meth:`attend` serves in one kernel call are written in one call too
        (:meth:`~kvtier.cache.layer.TieredLayer.fused_slot`); every other row's by its own ``update``."""
        packed = self.spans is not None
        if packed:
            total = self.spans[-1][0] + self.spans[-1][1]
            if key_states.shape[0] != 1 or key_states.shape[2] != total:
                raise ValueError(f"a packed RowsCache step takes one sequence of {total} new tokens, got keys of "
                                 f"shape {tuple(key_states.shape)}")
        elif key_states.shape[0] != len(self.rows) or key_states.shape[2] != 1:
            raise ValueError(f"a RowsCache step takes one new token for each of its {len(self.rows)} rows, got "
                             f"keys of shape {tuple(key_states.shape)}")
        first = self.layer_idx == 0
        lane = [None] * len(self.rows) if first else self.lane.get("cols")
        if not first and self.lane.get("all_cols"):
            # every row a plain full decode row: no per-row branches (~90 us a layer at 32 rows in Python)
            rows = self.rows
            self._append(key_states, value_states, self.lane["idx"], [r.tail_k for r in rows],
                         [r.tail_v for r in rows], lane)
            self.expose(kwargs, key_states)
            return key_states, value_states
        idx, dks, dvs, cols = [], [], [], []
        for i, (row, (s, n)) in enumerate(zip(self.rows, self._row_spans())):
            col = None if first or lane is None or row.is_sliding else lane[i]
            if col is not None:  # a plain full decode row (see __init__): layer 0 did its bookkeeping
                slot = row.tail_k, row.tail_v, col
            elif first and n == 1:
                # (baseline rows have neither: their slot is None)
                tail, version = getattr(row, "tail_k", None), getattr(row, "version", None)
                slot = row.fused_slot(self._piece(key_states, i, s, n))
                if slot is not None and row.state.rows_fused and slot[0] is tail and row.version == version:
                    lane[i] = slot[2]  # the same buffer, not migrated: the later layers' are as they were too
            else:
                slot = row.fused_slot(None) if n == 1 else None
            if slot is None:
                row.update(self._piece(key_states, i, s, n), self._piece(value_states, i, s, n))
            else:
                idx.append(s)
                dks.append(slot[0])
                dvs.append(slot[1])
                cols.append(slot[2])
        if idx:
            self._append(key_states, value_states, idx, dks, dvs, cols)
        if first:
            self.lane["cols"] = lane
            self.lane["all_cols"] = all(c is not None for c in lane)  # (a RowsCache has no sliding layers)
            self.lane["idx"] = [s for s, _ in self._row_spans()]
        self.expose(kwargs, key_states)
        return key_states, value_states

    def _append(self, key_states, value_states, idx: list[int], dks: list, dvs: list, cols: list[int]) -> None:
        """Write row ``i``'s new token (step position ``idx[i]``) into column ``cols[i]`` of ``dks[i]``/``dvs[i]``."""
        # (H, M, D): M new tokens, row i's at idx[i]
        k, v = (key_states[0], value_states[0]) if self.spans is not None else \
            (key_states[:, :, 0].transpose(0, 1), value_states[:, :, 0].transpose(0, 1))
        if k.dtype != dks[0].dtype:
            k, v = k.to(dks[0].dtype), v.to(dks[0].dtype)
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            k, v = k.contiguous(), v.contiguous()
        append_rows(k, v, idx, dks, dvs, cols)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float, sinks: torch.Tensor | None = None):
        """``query`` (B, Hq, 1, D) -> (B, 1, Hq, D): each row attended by its own layer, as if alone; packed:
        (1, Hq, N, D) -> (1, N, Hq, D), span by span. The decode steps of rows whose step is one fused-kernel call
        (``full``, and tiered rows on the kernel's path; :meth:`~kvtier.cache.layer.TieredLayer.fused_region`) go
        to the kernel in one call across rows, the same floats and scores as each alone through the kernel."""
        packed = self.spans is not None
        spans = self._row_spans()
        Hq, D = query.shape[1], query.shape[3]
        together, calls = [], []
        first = self.layer_idx == 0
        cols = self.lane.get("cols")
        lane = [None] * len(self.rows) if first else self.lane.get("regions")
        if not first and self.lane.get("all_regions"):  # every row a plain full decode row: no per-row branches
            together = range(len(self.rows))
            calls = [_plain_call(row, region) for row, region in zip(self.rows, lane)]
        else:
            for i, (row, (_, n)) in enumerate(zip(self.rows, spans)):
                region = None if first or lane is None or row.is_sliding else lane[i]
                if region is not None:  # a plain full decode row: layer 0's mask and positions, this layer's buffers
                    call = _plain_call(row, region)
                else:
                    call = row.fused_region(Hq, query.dtype) if n == 1 else None
                    if first and call is not None and cols is not None and cols[i] is not None:
                        lane[i] = call[2], call[3]
                if call is not None:
                    together.append(i)
                    calls.append(call)
        if first:
            self.lane["regions"] = lane
            self.lane["all_regions"] = all(r is not None for r in lane)  # (a RowsCache has no sliding layers)
        done = {}
        if together:
            R, H = len(together), calls[0][0][0].shape[1]
            if R == len(self.rows):  # every row decodes through the kernel: the queries in order, no gather
                q = query[0].transpose(0, 1) if packed else query[:, :, 0]
            else:
                at = torch.tensor([spans[i][0] for i in together], device=query.device)
                q = query[0].index_select(1, at).transpose(0, 1) if packed else query[:, :, 0].index_select(0, at)
            o = fused_cpu.attend_rows(q.reshape(R, H, Hq // H, D), calls, scaling, sinks).view(R, 1, Hq, D)
            if R == len(self.rows):
                return (o.view(1, R, Hq, D) if packed else o), None
            done = {i: o[j : j + 1] for j, i in enumerate(together)}  # (1, 1, Hq, D) each
        outs = []
        for i, (row, (s, n)) in enumerate(zip(self.rows, spans)):
            if i in done:
                outs.append(done[i])
            else:
                outs.append(row.attend(self._piece(query, i, s, n), self._piece(key, i, s, n),
                                       self._piece(value, i, s, n), None, scaling, sinks=sinks)[0])
        return torch.cat(outs, dim=1 if packed else 0), None

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
    prefill) or an announced prompt with room for them (``open_prompt``: the next chunk of a chunked prefill).
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
            if n > 1 and st.n_total > 0 and not (getattr(st, "prefilling", False) and st.n_total + n <= st.prompt_end):
                raise ValueError(f"row {i} brings {n} new tokens to a cache that holds {st.n_total}: only an empty "
                                 "cache (its prefill) or one whose announced prompt has room for them (open_prompt: "
                                 "the next chunk) takes more than one token")
        n_layers = len(caches[0].layers)
        if any(len(c.layers) != n_layers for c in caches):
            raise ValueError("the rows of a RowsCache must be caches of the same model (same layer count)")
        if any(layer.is_sliding for layer in caches[0].layers):
            # A sliding layer's attention is transformers' own over the step's packed keys and mask, which a batch
            # of rows at different lengths does not have; refused here rather than deep inside the first forward.
            raise ValueError("a RowsCache does not take a hybrid sliding/full model's caches (Gemma 3, gpt-oss): "
                             "their sliding layers attend with the model's own mask; decode such a model with "
                             "kvtier.make_cache and generate")
        self.caches = caches
        self.lengths = None if lengths is None else [int(n) for n in lengths]
        self.spans = None
        if self.lengths is not None:
            starts = [0]
            for n in self.lengths[:-1]:
                starts.append(starts[-1] + n)
            self.spans = list(zip(starts, self.lengths))
        lane: dict = {}  # shared by the step's layers (RowsLayer.lane)
        super().__init__(layers=[RowsLayer([c.layers[i] for c in caches], i, self.spans, lane)
                                 for i in range(n_layers)])

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
