"""One layer of the tiered cache: its K/V storage in T0 / tail (device), T1 and int8 T2 (host), and migration.

Data flow per layer:
    prefill   -> SDPA over the prompt; then (layer 0) a placement of the prompt into tiers, and each layer stores
                 its prompt K/V straight into T0 / T1, so device memory holds the T0 budget from the first step.
    update()  -> (layer 0) reassign tiers when due; (each layer) move the tokens whose tier changed, append the
                 new token to the device tail.
    attend()  -> the decode step itself lives with the decode math (:mod:`kvtier.attention.tiered`): split
                 (one partial per region where it lives, merged by log-sum-exp), the full cache's one region, or
                 the ordered reference; each adds the merged attention weights to the cumulative scores.
"""

from __future__ import annotations

import torch

from ..attention import tiered
from ..attention.merge import chunk_attention, prompt_attention
from ..tiers.layout import TAIL
from ..tiers.planner import T0, T1, T2
from ..tiers.quant import dequantize, quantize
from .base import KVTierLayer
from .state import _WORK_ALIGN, TierState, _roundup, tail_columns, tail_granule


def _whole(chunk: tuple[int, int, bool]) -> bool:
    """A prompt that came in one update (``TierState.chunk`` of its first and last piece)."""
    return chunk[0] == 0 and chunk[2]


class TieredLayer(KVTierLayer):
    """One layer's K/V split across T0 (device), T1 (host, full precision), T2 (host, int8) and a device tail.

    Tier buffers are (B, H, cap, D) with stable slots (see :class:`kvtier.tiers.layout.TierTokens`); T1 and T2 live in
    (pinned, on CUDA) host memory. The tail (B, H, cap_t, D) holds the tokens since the last reassignment.
    """

    def __init__(self, state: TierState, layer_idx: int) -> None:
        super().__init__()
        self.state = state
        self.layer_idx = layer_idx
        self._clear()

    def _clear(self) -> None:
        self.version = 0
        self.dev_k = self.dev_v = None  # (B, H, cap0 + cap_t, D) device: T0's slots, then the tail's columns
        self.cap0 = 0
        self.k0 = self.v0 = None  # (B, H, cap0, D) views of dev_k / dev_v
        self.k1 = self.v1 = None  # (B, H, cap1, D) host
        self.k2 = self.v2 = None  # (B, H, cap2, D) int8 host
        self.k2s = self.v2s = None  # (B, H, cap2, 1) float32 host
        self.tail_k = self.tail_v = None  # (B, H, cap_t, D) views of dev_k / dev_v
        self.kernel_memo = None  # the fused kernel's arguments, kept between steps (attention.tiered.kernel_regions)
        self.is_initialized = False

    # ---- CacheLayerMixin ---------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        eng = self.state.engine
        self.dev_k = eng.seam.device_empty((B, H, 0, D), dt, dev)
        self.dev_v = eng.seam.device_empty((B, H, 0, D), dt, dev)
        self._views()
        self.k1 = eng.host_zeros((B, H, 0, D), dt)
        self.v1 = eng.host_zeros((B, H, 0, D), dt)
        self.k2 = eng.host_zeros((B, H, 0, D), torch.int8)
        self.v2 = eng.host_zeros((B, H, 0, D), torch.int8)
        self.k2s = eng.host_zeros((B, H, 0, 1), torch.float32)
        self.v2s = eng.host_zeros((B, H, 0, 1), torch.float32)
        self.device = dev
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        st = self.state
        if self.layer_idx == 0:
            st.begin_update(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        ch = st.chunk
        if ch is None or not _whole(ch):  # a decode step, or a piece of a chunked prompt (into the tail)
            if self.version != st.version:
                self._migrate()
            self._append(key_states, value_states)
        elif not st.retier_enabled:
            self._append(key_states, value_states)
        # else: a whole prompt is stored after its attention, straight into the tiers of the prefill placement
        self.expose(kwargs, key_states)
        return key_states, value_states

    # ---- storage -----------------------------------------------------------------------------
    def _device_bytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.dev_k, self.dev_v))

    def _views(self) -> None:
        c = self.cap0
        self.k0, self.v0 = self.dev_k[:, :, :c], self.dev_v[:, :, :c]
        self.tail_k, self.tail_v = self.dev_k[:, :, c:], self.dev_v[:, :, c:]

    def _alloc_device(self, cap0: int, cap_t: int, keep_tail: int) -> None:
        """Reallocate the device buffer as ``cap0`` T0 slots + ``cap_t`` tail columns, keeping T0's slots and the
        tail's first ``keep_tail`` columns. One buffer, so that split attention reads T0 and the tail as one
        region (one matmul pair per layer instead of two)."""
        B, H, _, D = self.dev_k.shape
        # device memory through the engine's seam (the simulated device keeps its own pool); zeroed: empty
        # columns are masked, but 0 * NaN would still poison the output
        seam = self.state.engine.seam
        nk = seam.device_empty((B, H, cap0 + cap_t, D), self.dev_k.dtype, self.dev_k.device).zero_()
        nv = seam.device_empty((B, H, cap0 + cap_t, D), self.dev_k.dtype, self.dev_k.device).zero_()
        c = min(self.cap0, cap0)  # a device limit can shrink T0: its tokens beyond cap0 were relocated first
        nk[:, :, :c], nv[:, :, :c] = self.k0[:, :, :c], self.v0[:, :, :c]
        if keep_tail:
            nk[:, :, cap0 : cap0 + keep_tail] = self.tail_k[:, :, :keep_tail]
            nv[:, :, cap0 : cap0 + keep_tail] = self.tail_v[:, :, :keep_tail]
        self.dev_k, self.dev_v, self.cap0 = nk, nv, cap0
        self._views()
        self.state.note_device(self.layer_idx, self._device_bytes())

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        start = self._room(k.shape[2])
        self.tail_k[:, :, start : start + k.shape[2]] = k
        self.tail_v[:, :, start : start + k.shape[2]] = v

    def _room(self, q: int) -> int:
        """Make the tail hold the step's ``q`` new tokens (counted in ``n_total`` already): their first column."""
        st = self.state
        end = st.n_total - st.layout.n_main
        start = end - q
        if st.retier_enabled:
            need, granule = end, tail_granule(st.cfg.retier_interval)
        else:
            # The full cache's tail is everything: it is read in place, with the strides (256-column granules and
            # one spare column) an assembled work buffer would have, so the ordered path stays bit-identical.
            need, granule = end + 1, _WORK_ALIGN
        if need > self.tail_k.shape[2]:
            self._alloc_device(self.cap0, _roundup(need, granule), keep_tail=start)
        return start

    def _fetch(self, mv, tail: tuple[torch.Tensor, torch.Tensor]):
        """Values of the moving tokens from their current place: (m, H, D) pairs, (int8, scale) pairs for T2."""
        if mv.src_tier == TAIL:
            b, c = mv.on(self.device, "b"), mv.on(self.device, "src")
            return tail[0][b, :, c], tail[1][b, :, c]
        if mv.src_tier == T0:
            b, i = mv.on(self.device, "b"), mv.on(self.device, "src")
            return self.k0[b, :, i], self.v0[b, :, i]
        if mv.src_tier == T1:
            return self.k1[mv.b, :, mv.src], self.v1[mv.b, :, mv.src]
        return ((self.k2[mv.b, :, mv.src], self.k2s[mv.b, :, mv.src]),
                (self.v2[mv.b, :, mv.src], self.v2s[mv.b, :, mv.src]))

    def _resized(self, names: tuple[str, ...], cap: int, host: bool) -> None:
        """Grow this layer's tier buffers to ``cap`` slots, keeping their content (stable slots)."""
        eng = self.state.engine
        for name in names:
            old = getattr(self, name)
            if old.shape[2] >= cap:
                continue
            shape = (*old.shape[:2], cap, old.shape[3])
            new = eng.host_zeros(shape, old.dtype) if host else torch.zeros(shape, dtype=old.dtype, device=old.device)
            new[:, :, : old.shape[2]] = old
            setattr(self, name, new)

    def _migrate(self, tail: tuple[torch.Tensor, torch.Tensor] | None = None, fresh_tail: bool = False) -> None:
        """Take this layer from its placement to the current layout; only tokens whose tier changed are moved
        (and only they cross host<->device). ``tail``: where the tail tokens are (the prompt's K/V at prefill).
        ``fresh_tail``: the tail's columns all moved (a chunked prompt placed): it starts again empty, as after a
        whole prefill."""
        st, eng = self.state, self.state.engine
        lay = st.layout
        # a chunked prompt's placement moves every tail column: its tail starts again empty (ahead of the next line)
        fresh_tail = fresh_tail or (tail is None and st.version == st.placed_version)
        tail = tail or (self.tail_k, self.tail_v)
        dt, dev = self.dev_k.dtype, self.device
        # 1. read every moving token from where it is now, before any slot it frees is reused
        got = {x: [(mv, self._fetch(mv, tail)) for mv in lay.moves.get(x, [])] for x in (T0, T1, T2)}
        # 2. resize buffers whose tier outgrew them, or that a device limit shrinks (the tail's tokens were read in
        # 1: its columns start empty; a full cache turned tiered under memory pressure gives back its long tail)
        cap_t = 0 if fresh_tail else min(self.tail_k.shape[2], tail_columns(st.cfg.retier_interval))
        if fresh_tail:
            self._alloc_device(lay.tiers[T0].cap, 0, keep_tail=0)
        elif lay.tiers[T0].cap > self.cap0 or (st.t0_limit is not None and (lay.tiers[T0].cap < self.cap0
                                                                             or cap_t < self.tail_k.shape[2])):
            self._alloc_device(lay.tiers[T0].cap, cap_t if st.t0_limit is not None else self.tail_k.shape[2],
                               keep_tail=0)
        self._resized(("k1", "v1"), lay.tiers[T1].cap, host=True)
        self._resized(("k2", "v2", "k2s", "v2s"), lay.tiers[T2].cap, host=True)
        # 3. write them into their new slots
        for mv, (a, b) in got[T0]:
            if mv.src_tier == T1:
                a, b = eng.to_device(a), eng.to_device(b)
            elif mv.src_tier == T2:
                a = dequantize(eng.to_device(a[0]), eng.to_device(a[1]), dt)
                b = dequantize(eng.to_device(b[0]), eng.to_device(b[1]), dt)
            r, d = mv.on(dev, "b"), mv.on(dev, "dst")
            self.k0[r, :, d], self.v0[r, :, d] = a, b
        for mv, (a, b) in got[T1]:
            if mv.src_tier in (T0, TAIL):
                a, b = eng.to_host(a), eng.to_host(b)
            elif mv.src_tier == T2:
                a, b = dequantize(*a, dt), dequantize(*b, dt)
            self.k1[mv.b, :, mv.dst], self.v1[mv.b, :, mv.dst] = a, b
        for mv, (a, b) in got[T2]:
            if mv.src_tier in (T0, TAIL):
                # Quantize where the data is, so only int8 and scales cross the bus.
                a, b = quantize(a), quantize(b)
                a = (eng.to_host(a[0]), eng.to_host(a[1]))
                b = (eng.to_host(b[0]), eng.to_host(b[1]))
            elif mv.src_tier == T1:
                a, b = quantize(a), quantize(b)
            self.k2[mv.b, :, mv.dst], self.k2s[mv.b, :, mv.dst] = a
            self.v2[mv.b, :, mv.dst], self.v2s[mv.b, :, mv.dst] = b
        self.version = st.version
        st.note_device(self.layer_idx, self._device_bytes())

    def host_tensors(self, rows: slice = slice(None), tiers: tuple[int, ...] = (T1, T2)) -> dict[str, torch.Tensor]:
        """This layer's host ``tiers``, for ``rows`` (a leading-dimension slice: contiguous, so it copies as one block)."""
        lay = self.state.layout
        out = {}
        if T1 in tiers and lay.tiers[T1].width:
            out.update(k1=self.k1[rows], v1=self.v1[rows])
        if T2 in tiers and lay.tiers[T2].width:
            out.update(k2=self.k2[rows], v2=self.v2[rows], k2s=self.k2s[rows], v2s=self.v2s[rows])
        return out

    def staged(self, rows: slice = slice(None), tiers: tuple[int, ...] = (T1, T2)) -> dict[str, torch.Tensor]:
        """Device copies of this layer's host ``tiers`` (``stream``) for ``rows``: from a prefetch, a per-layer
        persistent copy (``t1_on_device``, staged once per reassignment) or copied now."""
        st, eng = self.state, self.state.engine
        host = self.host_tensors(rows, tiers)
        if st.t1_on_device:
            return eng.take(self.layer_idx, (self.layer_idx, "v", st.version), host)
        return eng.take(0, (self.layer_idx, st.n_total), host)

    def release_staged(self) -> None:
        st = self.state
        if not st.t1_on_device:
            st.engine.release(0)
            self._prefetch_next()

    def _prefetch_next(self) -> None:
        """Start streaming the next layer's host tiers while this layer computes (async on CUDA)."""
        st = self.state
        nxt = self.layer_idx + 1
        layers = getattr(st, "layers", None)
        if not st.engine.asynchronous or st.stream_rows == 0 or layers is None or nxt >= len(layers):
            return
        other = layers[nxt]
        if other.version != st.version or not other.is_initialized:
            return  # its migration for this step has not run yet: it stages for itself
        host = other.host_tensors(slice(0, st.stream_rows))
        if host:
            st.engine.stage(0, (nxt, st.n_total), host)

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float,
               sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """Attention of ``query`` (B, Hq, q, D) over this layer's kept tokens -> (B, q, Hq, D).

        ``key``/``value`` (B, H, q, D) are this step's new states (the whole prompt at prefill). ``sinks`` (Hq,):
        the model's sink logit per query head (gpt-oss), or None: they join each softmax (one more partial in the
        merge, one more logit in the fused kernel; SDPA has none, so the prefill takes ``merge.prompt_attention``'s
        eager math)."""
        st = self.state
        B, Hq, q, D = query.shape
        # a prefill brings the cache's first tokens (update() has counted them): a one-token prompt is one too; a
        # chunked prompt (open_prompt) brings them piece by piece
        ch = st.chunk
        if ch is not None:
            whole = _whole(ch)
            if self.layer_idx == 0:
                if whole:
                    st.n_heads_q = Hq
                    st.note_validity(attention_mask, q)
                    if st.retier_enabled:
                        st.place_prefill()
                else:
                    st.chunk_attended(Hq)
            if whole:
                out = prompt_attention(query, key, value, attention_mask, scaling, sinks)
                if st.retier_enabled:
                    self._migrate(tail=(key, value))
            else:  # this chunk's queries over the prompt so far, in position order (kept whole: nothing evicted yet)
                if st.layout.n_main == 0:
                    keys, values = self.tail_k[:, :, : st.n_total], self.tail_v[:, :, : st.n_total]
                else:
                    keys, values = self._prompt_so_far()
                out = chunk_attention(query, keys, values, scaling, sinks)
            return out.transpose(1, 2).contiguous(), None
        self._decode_bookkeeping()
        if st.attention == "ordered":
            out = tiered.attend_ordered(self, query, scaling, sinks)
        elif not st.retier_enabled:
            out = tiered.attend_full(self, query, scaling, sinks)
        else:
            out = tiered.attend_split(self, query, scaling, sinks)
        return out.reshape(B, Hq, 1, D).transpose(1, 2), None

    def _prompt_so_far(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, n, D) K and V of a chunked prompt's ``n`` tokens so far in position order, after a placement put
        some in T0 and T1 (a prompt's placement evicts and quantizes nothing): a transient copy, as a whole
        prefill's K/V are, so that the device holds no more than its limit between chunks."""
        return self.positions_kv(0, self.state.n_total)

    def positions_kv(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, H, end - start, D) K and V of positions ``[start, end)`` in position order, gathered from T0, T1 and
        the tail (a transient copy on the device). Every one of them must be held exactly: a position in T2
        (int8) or destroyed (T3) is a ValueError."""
        st = self.state
        lay, n = st.layout, st.n_total
        if not 0 <= start <= end <= n:
            raise ValueError(f"positions [{start}, {end}) are not within the {n} this cache holds")
        B, H, _, D = self.dev_k.shape
        m = lay.n_main
        k = torch.empty(B, H, end - start, D, dtype=self.dev_k.dtype, device=self.device)
        v = torch.empty_like(k)
        covered = 0
        for x, (bk, bv) in ((T0, (self.k0, self.v0)), (T1, (self.k1, self.v1))):
            t = lay.tiers[x]
            if not t.count:
                continue
            if start == 0 and end >= m:
                b, pos, slot = t.b, t.pos, t.slot  # (a whole prompt so far: every token of the tier)
            else:
                sel = (t.pos >= start) & (t.pos < end)
                b, pos, slot = t.b[sel], t.pos[sel], t.slot[sel]
            covered += int(pos.numel())
            if pos.numel():
                bd, pd = b.to(self.device), (pos - start).to(self.device)
                k[bd, :, pd] = bk[b, :, slot].to(self.device)
                v[bd, :, pd] = bv[b, :, slot].to(self.device)
        main = int(st.valid[:, start : max(start, min(end, m))].sum())  # (a batch's left padding is in no tier)
        if covered != main:
            raise ValueError(f"positions [{start}, {end}) are not all held exactly: some are in T2 (int8) or "
                             "destroyed (T3)")
        a = max(start, m)
        if end > a:
            k[:, :, a - start :], v[:, :, a - start :] = self.tail_k[:, :, a - m : end - m], self.tail_v[:, :, a - m : end - m]
        return k, v

    def _decode_bookkeeping(self) -> None:
        """What a decode step notes before it attends: device allocations, and (layer 0) the device tokens' peak."""
        st = self.state
        if st.engine.allocations != st._seen_alloc:
            st.note_device()
        if self.layer_idx == 0:
            lay = st.layout
            # device tokens peak just before a reassignment: T0 + every row's tail (decode tokens are all real)
            st.peak_device_tokens = max(st.peak_device_tokens, lay.tiers[T0].count
                                        + int(st.valid[:, lay.n_main : st.n_total].sum()))

    def fused_slot(self, key_states: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """A RowsCache step's :meth:`update` without the copy: the bookkeeping (``key_states`` (1, H, 1, D), the
        row's new keys, needed by layer 0 only) and room for the token; returns ``(tail_k, tail_v, column)`` for the
        caller to write the token into (one call for all rows: :func:`kvtier.kernels.rows.append_rows`), or
        None (no kernel here, or not a one-row decode step): then :meth:`update` it."""
        st = self.state
        if not st._kernel_ok or st.batch != 1 or st.n_total == 0 or not self.is_initialized or st.prefilling:
            return None
        if self.layer_idx == 0:
            st.begin_update(key_states)
        if self.version != st.version:
            self._migrate()
        col = self._room(1)  # first: it may reallocate the buffer
        return self.tail_k, self.tail_v, col

    def fused_region(self, n_heads_q: int, dtype: torch.dtype) -> tuple | None:
        """This decode step as one row of a fused-kernel call across rows (:mod:`kvtier.cache.rows`), after the
        bookkeeping :meth:`attend` does: the kernel's arguments for it
        (:func:`kvtier.attention.tiered.rows_call`), or None (the eager or ordered path, streamed host tiers, a
        prefill): then :meth:`attend` it. Called after :meth:`update` has added the step's token."""
        st = self.state
        if st.batch != 1 or st.n_total <= 1 or st.chunk is not None:
            return None
        if self.layer_idx == 0:
            st.n_heads_q = n_heads_q
        call = tiered.rows_call(self, dtype)
        if call is not None:
            self._decode_bookkeeping()
        return call

    def assemble(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept K and V of this layer in position order (the ordered path's work buffers; see
        :func:`kvtier.attention.tiered.assemble`)."""
        return tiered.assemble(self)
