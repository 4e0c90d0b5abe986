"""``KVTierCache``: the transformers ``Cache`` of the tiered family (tiered, evict, quant, full): one shared
:class:`~kvtier.cache.state.TierState`, one :class:`~kvtier.cache.layer.TieredLayer` per layer."""

from __future__ import annotations

from typing import Any

import torch

from ..config import TierConfig
from ..tiers.layout import TAIL, grown_capacity
from ..tiers.planner import T0, T1, T2, T3
from ..tiers.quant import int8_bytes_per_token
from .base import ShapeGuardedCache
from .budget import BudgetView
from .layer import TieredLayer
from .state import _WORK_ALIGN, TierState, _roundup, full_columns, tail_columns, tail_granule
from .stats import cache_stats


class KVTierCache(ShapeGuardedCache):
    """A transformers ``Cache`` whose tokens live in four tiers; built by :func:`kvtier.make_cache`."""

    def __init__(self, cfg: TierConfig, num_layers: int, retier: bool = True, policy: str = "tiered",
                 t1_on_device: bool = False, attention: str = "split", t1_attention: str = "auto",
                 host_threaded: bool | None = None, kernel: str = "auto") -> None:
        self.state = TierState(cfg, num_layers, retier=retier, policy=policy, t1_on_device=t1_on_device,
                               attention=attention, t1_attention=t1_attention, host_threaded=host_threaded,
                               kernel=kernel)
        layers = [TieredLayer(self.state, i) for i in range(num_layers)]
        self.state.layers = layers
        super().__init__(layers=layers)
        self.config = cfg
        self.policy = policy

    def open_prompt(self, n: int) -> None:
        """Announce an ``n``-token prompt that the next updates bring in chunks (chunked prefill, as a serving
        engine runs it beside decoding rows): see :meth:`kvtier.cache.state.TierState.open_prompt`. The chunks give
        the logits a whole prefill gives up to the attention's rounding (bit for bit where the model's matmuls do
        not depend on the row count), the same zero scores and the same first tier placement."""
        if self.sliding_layers():
            raise ValueError("a hybrid sliding/full model's cache takes its prompt whole (its sliding layers attend "
                             "with the model's own mask)")
        self.state.open_prompt(n)

    def load_prompt(self, kv: torch.Tensor, n_heads_q: int, piece: int | None = None) -> None:
        """Put the first ``p`` tokens of an announced prompt (:meth:`open_prompt`, nothing in yet) from K/V computed
        before (a serving prefix cache): ``kv`` (L, 2, H, p, D), every layer's K and V in position order, as
        :meth:`prompt_kv` gives them. Each piece (``piece`` tokens; None: all ``p`` at once) is stored as a chunk
        of the prompt would be, without the model: the chunks that follow attend it, and the prompt is placed as
        a whole prefill places it. ``p`` must leave at least one token of the prompt to prefill (its logits).
        Scores: a prefill adds none, so a loaded prefix carries none either. Under a device limit pass the tail
        reserve as ``piece``: the device then holds at most the limit beside one piece, as with chunks."""
        st = self.state
        L, two, H, p, D = kv.shape if kv.dim() == 5 else (None,) * 5
        if L != len(self.layers) or two != 2:
            raise ValueError(f"kv must be (layers={len(self.layers)}, 2, H, p, D), got {tuple(kv.shape)}")
        if not st.prefilling or st.n_total != 0:
            raise ValueError("load_prompt needs an announced prompt (open_prompt) with nothing in yet")
        if not 1 <= p < st.prompt_end:
            raise ValueError(f"load_prompt takes 1 to {st.prompt_end - 1} tokens of the {st.prompt_end}-token prompt "
                             f"(at least one is left to prefill), got {p}")
        step = p if piece is None else int(piece)
        if step < 1:
            raise ValueError(f"piece must be >= 1 tokens, got {piece!r}")
        for s in range(0, p, step):
            e = min(p, s + step)
            for i, layer in enumerate(self.layers):
                layer.update(kv[i, 0, :, s:e].unsqueeze(0), kv[i, 1, :, s:e].unsqueeze(0))
            st.chunk_attended(n_heads_q)

    def prompt_kv(self, start: int, end: int) -> torch.Tensor:
        """(L, 2, H, end - start, D): every layer's K and V of positions ``[start, end)`` of this one-row cache, in
        position order (a copy), for :meth:`load_prompt` elsewhere. They must all be held exactly (T0, T1 or the
        tail): a position in T2 or destroyed is a ValueError."""
        st = self.state
        if st.batch != 1:
            raise ValueError(f"prompt_kv reads a one-row cache, this one has {st.batch} rows")
        out = None
        for i, layer in enumerate(self.layers):
            k, v = layer.positions_kv(start, end)
            if out is None:
                out = torch.empty((len(self.layers), 2, *k.shape[1:]), dtype=k.dtype, device=k.device)
            out[i, 0], out[i, 1] = k[0], v[0]
        return out

    @property
    def lossless(self) -> bool:
        """No token of this cache was ever quantized or destroyed: every K/V it computed attended exact K/V (up to
        rounding), so its positions are those a prefill of the same tokens gives."""
        return not any(n for key, n in self.state.changed_total.items() if key.endswith(("T2", "T3")))

    @property
    def chunked_prompts(self) -> bool:
        """Whether :meth:`open_prompt` is possible (not for a hybrid model's cache)."""
        return not self.sliding_layers()

    def reset(self) -> None:
        """Forget everything (for a new, unrelated prompt); the object stays usable."""
        for layer in self.layers:
            layer.reset()
        self.state.reset()

    def stats(self) -> dict[str, Any]:
        return cache_stats(self.state, self.state.layers, sliding=self.sliding_layers())

    def scores(self) -> torch.Tensor:
        """(B, N) float64 on the host: the cumulative score of every logical position (0 for padding)."""
        st = self.state
        if st.batch is None:
            return torch.zeros(0, 0)
        return st.combined_scores()[:, : st.n_total]

    def tier_map(self) -> torch.Tensor:
        """(B, N) int8 on the host: the tier of every logical position, 0-3 for T0-T3 (new tokens waiting for
        the next reassignment are on the device: 0), -1 for left padding. N = prompt + generated so far."""
        st = self.state
        if st.batch is None:
            return torch.zeros(0, 0, dtype=torch.int8)
        return st.codes()

    def tier_history(self):
        """The :class:`kvtier.tiers.tiermap.TierRecorder` of ``make_cache(..., record_tiers=True)``, else None."""
        return self.state.recorder

    def kept_mask(self) -> torch.Tensor:
        """(L, B, H_kv, N) bool on the host: True where the position's K/V is still held (any tier) in that layer
        and kv-head. The tiered family decides per position, so every layer and head agree."""
        st = self.state
        if st.batch is None:
            return torch.zeros(self.state.num_layers, 0, 0, 0, dtype=torch.bool)
        tm = self.tier_map()
        kept = (tm >= 0) & (tm != T3)
        return kept.view(1, st.batch, 1, -1).expand(st.num_layers, -1, st.n_heads, -1).clone()

    def row_tokens(self, row: int) -> dict[str, int]:
        """Tier token counts of one batch row (padding excluded)."""
        st = self.state
        if st.batch is None:
            return {"T0": 0, "T1": 0, "T2": 0, "T3": 0}
        n = st.n_total
        valid, lt = st.valid[row, :n], st.loc_tier[row, :n]
        count = lambda m: int((m & valid).sum())  # noqa: E731
        return {"T0": count((lt == T0) | (lt == TAIL)), "T1": count(lt == T1), "T2": count(lt == T2), "T3": count(lt == T3)}

    # ---- device memory under a budget (continuous batching) -----------------------------------------------
    @property
    def can_limit(self) -> bool:
        """This cache can move device tokens to T1 on demand (:meth:`limit_device`): every policy of the family
        whose rest goes to T1 (a ``full`` cache becomes a tiered cache with no eviction)."""
        return self.state.cfg.rest_tier == "T1"

    def limit_device(self, t0_tokens: int | None) -> None:
        """Keep at most ``t0_tokens`` tokens per row in T0 from the next update on (the coldest of the rest go to
        T1, exactly attended); None lifts the limit (tokens come back at the next regular reassignment).

        The device then holds at most ``t0_tokens`` + :meth:`tail_reserve` tokens per row. A ``full`` cache is
        turned into a tiered one with no eviction or quantization, which changes its output only by the split
        attention's rounding (Proposition 1)."""
        st = self.state
        if t0_tokens is not None:
            if isinstance(t0_tokens, bool) or not isinstance(t0_tokens, int) or t0_tokens < 0:
                raise ValueError(f"t0_tokens must be an integer >= 0 or None, got {t0_tokens!r}")
            if not self.can_limit:
                raise ValueError(f"policy {self.policy!r} keeps its rest in {st.cfg.rest_tier}, not T1: its device "
                                 "tokens cannot move to host memory without changing its output")
            if not st.retier_enabled:
                st.retier_enabled = True  # full -> tiered: the whole cache is its tail until the next update
                if st.batch is not None:
                    # the path a tiered cache takes (the fused kernel where it can run), not the one chosen for
                    # full: on a CPU where full keeps SDPA that would leave the eager split step, ~3x slower
                    st.fused = st._kernel_ok
        changed = t0_tokens != st.t0_limit
        st.t0_limit = t0_tokens
        if changed and t0_tokens is not None and st.n_total > 0:
            st.retier_now = True

    @property
    def device_limit(self) -> int | None:
        """The T0 limit :meth:`limit_device` set (None: none)."""
        return self.state.t0_limit

    def tail_reserve(self) -> int:
        """Device columns a row's tail can take between reassignments (tokens since the last one)."""
        return tail_columns(self.state.cfg.retier_interval)

    def _col_bytes(self) -> int:
        """Bytes of one device column (one token of one row) over all layers, K and V."""
        st = self.state
        elem = torch.empty(0, dtype=st.dtype).element_size()
        return st.num_layers * st.batch * st.n_heads * st.head_dim * 2 * elem

    def device_kv_bytes(self) -> int:
        """Device bytes of this cache's K/V buffers now (T0 + tail, all layers) plus its staging slots."""
        st = self.state
        if st.batch is None:
            return 0
        # The state notes each layer's buffer size at every (re)allocation: summing those is the buffers' own sizes
        # (tests/cache/test_device_limit.py) without reading 2 tensors a layer, which a serving step does per row.
        return (sum(st.layer_device_bytes) + st.engine.staging_bytes()
                + sum(s.device_bytes() for s in self.sliding_layers()))

    def device_kv_next(self, new_tokens: int = 1) -> int:
        """An upper bound on :meth:`device_kv_bytes` after the next update of ``new_tokens`` (a decode step's one
        token, or the next chunk of an announced prompt; a reassignment or the prompt's placement if one is due),
        from the allocation rules of :mod:`kvtier.cache.layer`."""
        st = self.state
        if st.batch is None:
            return 0
        layer = st.layers[0]
        cap0, cap_t = layer.cap0, layer.tail_k.shape[2]
        g = tail_granule(st.cfg.retier_interval)
        if st.place_pending and st.retier_enabled:  # a chunked prompt is placed, then the new tokens go to a new tail
            cap0 = st.t0_limit if st.t0_limit is not None else grown_capacity(max(cap0, st.n_total), cap0)
            cap_t = _roundup(new_tokens, g)
        elif st.prefilling:
            need = st.n_total + new_tokens - st.layout.n_main + (0 if st.retier_enabled else 1)
            if need > cap_t:
                cap_t = _roundup(need, g if st.retier_enabled else _WORK_ALIGN)
        elif st.retier_enabled and (st.since_retier >= st.cfg.retier_interval or st.retier_now):
            if st.t0_limit is not None:
                cap0, cap_t = st.t0_limit, min(cap_t, self.tail_reserve())
            else:
                cap0 = grown_capacity(max(cap0, st.n_total), cap0)
            cap_t = max(cap_t, g)
        else:
            need = st.n_total + 1 - st.layout.n_main + (0 if st.retier_enabled else 1)
            if need > cap_t:
                cap_t = _roundup(need, g if st.retier_enabled else _WORK_ALIGN)
        col = self._col_bytes()
        staging = st.engine.staging_bytes()
        streams = st.retier_enabled and (st.stream_rows > 0 or st.t1_on_device or st.t1_attention == "stream")
        if streams or st.attention == "ordered":  # (a full cache has no host tiers to stream)
            # host tiers streamed through staging slots (at most every token at its tier's capacity, one layer per
            # slot) and, on the ordered path, one layer's position-ordered work buffers of every kept token
            n = st.n_total + new_tokens
            slots = st.num_layers if st.t1_on_device else 1
            per_layer = slots * grown_capacity(n, 0) + (full_columns(n) if st.attention == "ordered" else 0)
            staging = max(staging, per_layer * col // st.num_layers)
        return (cap0 + cap_t) * col + staging

    def budget_view(self, new_tokens: int = 1) -> BudgetView:
        """What a serving scheduler needs to know of this one-row cache before its next update of ``new_tokens``
        (:class:`kvtier.cache.budget.BudgetView`): device bytes now and after it, host bytes now and after it (a
        limited row's tail goes to T1 at its reassignment, a chunked prompt's overflow at its placement), and how it
        can give device memory back."""
        st = self.state
        col = self._col_bytes() if st.batch is not None else 0
        host = self.host_kv_bytes()
        host_next = host
        if st.batch is not None and st.retier_enabled and st.t0_limit is not None:
            # at the limit's next reassignment or placement the tokens beyond it go to T1
            host_next += max(0, st.n_total - st.layout.n_main + (new_tokens if st.prefilling else 0)) * col
        return BudgetView(
            device_bytes=self.device_kv_bytes(), next_bytes=self.device_kv_next(new_tokens), host_bytes=host,
            host_next=host_next, col_bytes=col, reserve=self.tail_reserve(), can_limit=self.can_limit,
            t0_limit=st.t0_limit, tokens=st.n_total, device_tokens=self.row_tokens(0)["T0"] if st.batch else 0)

    def host_kv_bytes(self) -> int:
        """Host bytes of the T1 and T2 tokens (as :meth:`stats` counts them)."""
        st = self.state
        if st.batch is None or st.layout is None:
            return 0
        lay = st.layout
        return (lay.tiers[T1].count * self._col_bytes() // st.batch
                + lay.tiers[T2].count * int8_bytes_per_token(st.num_layers, st.n_heads, st.head_dim))
