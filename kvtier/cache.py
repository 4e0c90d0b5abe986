"""The transformers ``Cache`` glue: one :class:`TierState` of shared bookkeeping, one :class:`TieredLayer` per layer.

Data flow per decode step and layer:
    update()  -> (layer 0) reassign tiers when due; (each layer) migrate changed tokens, append the new token
    attend()  -> assemble T0 | stream(T1) | deq(T2) | tail in position order into a reused work buffer,
                 exact softmax attention over it, add the attention weights to the cumulative scores.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F

from .config import TierConfig
from .layer_base import KVTierLayer, ShapeGuardedCache, check_update, prompt_validity
from .layout import TAIL, Layout, build_layout, dest_rows
from .planner import PAD, T0, T1, T2, T3, assign_tiers, protected_mask
from .quant import dequantize, int8_bytes_per_token, quantize
from .transfer import TransferEngine

log = logging.getLogger(__name__)

_WORK_ALIGN = 256  # work-buffer capacity granularity: same length -> same strides -> same floats


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class TierState:
    """Bookkeeping shared by all layers of one cache: lengths, validity, scores, placement.

    Positions are logical columns 0..n_total-1 of the batch (left padding included); each row's logical
    length N_b counts only its real positions.
    """

    def __init__(self, cfg: TierConfig, num_layers: int, retier: bool = True, policy: str = "tiered",
                 t1_on_device: bool = False) -> None:
        self.cfg = cfg
        self.num_layers = num_layers
        self.retier_enabled = retier
        self.policy = policy
        self.t1_on_device = t1_on_device
        self.reset()

    def reset(self) -> None:
        self.batch = None
        self.device = None
        self.n_heads = None
        self.head_dim = None
        self.dtype = None
        self.engine: TransferEngine | None = None
        self.n_total = 0
        self.cap = 0
        self.valid = self.prompt = self.loc_tier = self.loc_idx = self.scores = self.valid_dev = None
        self._lay_dev_key = None
        self._lay_dev = None
        self.layout: Layout | None = None
        self.version = 0
        self.decode_steps = 0
        self.since_retier = 0
        self.retiers = 0
        self.changed_total: dict[str, int] = {}
        self.peak_device_tokens = 0
        self._step = None
        self._step_key = None
        self._dest_key = None
        self._dest: dict[int, torch.Tensor] = {}

    # ---- lifecycle ---------------------------------------------------------------------------
    def _init(self, k: torch.Tensor) -> None:
        B, H, _, D = k.shape
        self.batch, self.n_heads, self.head_dim, self.dtype, self.device = B, H, D, k.dtype, k.device
        self.engine = TransferEngine(k.device)
        self.layout = Layout.empty(B)
        self._grow(256)

    def _grow(self, need: int) -> None:
        if need <= self.cap:
            return
        cap = max(need, 2 * self.cap, 256)
        B, old = self.batch, self.cap

        def grown(t, fill, dtype):
            out = torch.full((B, cap), fill, dtype=dtype)
            if t is not None:
                out[:, :old] = t[:, :old]
            return out

        self.valid = grown(self.valid, False, torch.bool)
        self.prompt = grown(self.prompt, False, torch.bool)
        self.loc_tier = grown(self.loc_tier, PAD, torch.int8)
        self.loc_idx = grown(self.loc_idx, 0, torch.long)
        scores = torch.zeros(B, cap + 1, dtype=torch.float32, device=self.device)  # last column: trash
        valid_dev = torch.zeros(B, cap, dtype=torch.bool, device=self.device)  # device mirror: no host sync per step
        if self.scores is not None:
            scores[:, :old] = self.scores[:, :old]
            valid_dev[:, :old] = self.valid_dev[:, :old]
        self.scores, self.valid_dev = scores, valid_dev
        self.cap = cap

    def begin_update(self, k: torch.Tensor) -> None:
        """Called by layer 0 with the new keys (B, H, q, D) before any layer stores them."""
        q = k.shape[2]
        check_update(self.batch, self.n_total, k)
        if self.batch is None:
            self._init(k)
        is_decode = self.n_total > 0
        if is_decode:
            if self.retier_enabled and self.since_retier >= self.cfg.retier_interval:
                self.retier()
            self.since_retier += 1
            self.decode_steps += 1
        self._grow(self.n_total + q)
        start = self.n_total
        self.n_total += q
        self.valid[:, start : self.n_total] = True  # refined by note_validity once the prompt's mask is seen
        self.valid_dev[:, start : self.n_total] = True
        self.loc_tier[:, start : self.n_total] = TAIL
        self.loc_idx[:, start : self.n_total] = torch.arange(start - self.layout.n_main, self.n_total - self.layout.n_main)
        if not is_decode:
            self.prompt[:, start : self.n_total] = True

    def note_device_tokens(self) -> None:
        """Track the peak of device-resident real tokens (T0 + tail): it peaks just before a reassignment."""
        lay = self.layout
        n = lay.tiers[T0].count + int(self.valid[:, lay.n_main : self.n_total].sum())
        self.peak_device_tokens = max(self.peak_device_tokens, n)

    def note_validity(self, attention_mask: torch.Tensor | None, q: int) -> None:
        """Read which of the prompt's positions are padding from the mask's diagonal (B, 1, q, kv).

        Only the prompt can hold padding (``generate`` appends real tokens), so decode steps skip this and never
        wait for the device.
        """
        diag = prompt_validity(attention_mask, q) if self.n_total == q else None
        if diag is None:
            return
        self.valid_dev[:, :q] = diag.to(self.device)
        self.valid[:, :q] = diag.cpu()
        self._step_key = None

    # ---- reassignment ------------------------------------------------------------------------
    def plan(self) -> torch.Tensor:
        """Tier per position (B, n_total) for the current scores."""
        n = self.n_total
        valid = self.valid[:, :n]
        prot = protected_mask(valid, self.prompt[:, :n], self.cfg)
        evicted = self.loc_tier[:, :n] == T3
        return assign_tiers(self.scores[:, :n].cpu(), valid, prot, evicted, self.cfg)

    def retier(self) -> None:
        tiers = self.plan()
        n = self.n_total
        self.layout = build_layout(tiers, self.valid[:, :n], self.loc_tier, self.loc_idx, self.layout.n_main)
        self.version += 1
        self.retiers += 1
        self.since_retier = 0
        for key, v in self.layout.changed.items():
            self.changed_total[key] = self.changed_total.get(key, 0) + v
        log.debug("retier %d at n=%d: %s", self.retiers, n, self.layout.changed)

    # ---- per-step views shared by all layers -------------------------------------------------
    def step_view(self) -> dict[str, Any]:
        """Working-layout tensors for this step: K, capacity, mask (B,1,1,K), score positions (B,K), dest rows."""
        key = (self.n_total, self.version)
        if self._step_key == key:
            return self._step
        lay = self.layout
        t = self.n_total - lay.n_main
        K = lay.k_main + t
        cap = _roundup(K + 1, _WORK_ALIGN)
        if self._lay_dev_key != (self.version, self.cap):
            trash = self.cap  # the scores' last column: weights of empty columns (exactly 0) land there
            self._lay_dev = (
                lay.work_valid.to(self.device),
                torch.where(lay.work_pos >= 0, lay.work_pos, trash).to(self.device),
            )
            self._lay_dev_key = (self.version, self.cap)
        work_valid, work_pos = self._lay_dev
        valid = torch.cat([work_valid, self.valid_dev[:, lay.n_main : self.n_total]], dim=1)
        tail_pos = torch.arange(lay.n_main, self.n_total, device=self.device).expand(self.batch, t)
        pos = torch.cat([work_pos, tail_pos], dim=1)
        if self._dest_key != (self.version, cap):
            self._dest = {x: dest_rows(lay.tiers[x], self.n_heads, cap).to(self.device) for x in (T0, T1, T2)}
            self._dest_key = (self.version, cap)
        self._step = {
            "K": K,
            "k_main": lay.k_main,
            "t": t,
            "cap": cap,
            "mask": valid.view(self.batch, 1, 1, K),
            "score_pos": pos,
            "dest": self._dest,
        }
        self._step_key = key
        return self._step


class TieredLayer(KVTierLayer):
    """One layer's K/V split across T0 (device), T1 (host, full precision), T2 (host, int8) and a device tail.

    Tier buffers are (H, M_tier, D): the tier's tokens of all rows, in (row, position) order, so a tier
    holds exactly its tokens and T1 streams as one contiguous copy.
    """

    def __init__(self, state: TierState, layer_idx: int) -> None:
        super().__init__()
        self.state = state
        self.layer_idx = layer_idx
        self._clear()

    def _clear(self) -> None:
        self.version = 0
        self.k0 = self.v0 = None  # (H, M0, D) device
        self.k1 = self.v1 = None  # (H, M1, D) host
        self.k2 = self.v2 = None  # (H, M2, D) int8 host
        self.k2s = self.v2s = None  # (H, M2, 1) float32 host
        self.tail_k = self.tail_v = None  # (B, H, cap, D) device
        self.mirror_k = self.mirror_v = None  # (B, H, cap, D) device, with t1_on_device
        self.mirror_version = -1
        self.mirror_len = 0
        self.is_initialized = False

    # ---- CacheLayerMixin ---------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        eng = self.state.engine
        self.k0 = torch.zeros(H, 0, D, dtype=dt, device=dev)
        self.v0 = self.k0.clone()
        self.k1 = eng.host_empty((H, 0, D), dt)
        self.v1 = eng.host_empty((H, 0, D), dt)
        self.k2 = torch.zeros(H, 0, D, dtype=torch.int8)
        self.v2 = self.k2.clone()
        self.k2s = torch.zeros(H, 0, 1, dtype=torch.float32)
        self.v2s = self.k2s.clone()
        self.tail_k = torch.zeros(B, H, 0, D, dtype=dt, device=dev)
        self.tail_v = self.tail_k.clone()
        self.device = dev
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        st = self.state
        if self.layer_idx == 0:
            st.begin_update(key_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.version != st.version:
            self._migrate()
        self._append(key_states, value_states)
        self.expose(kwargs)
        return key_states, value_states

    # ---- storage -----------------------------------------------------------------------------
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        st = self.state
        q = k.shape[2]
        end = st.n_total - st.layout.n_main
        start = end - q
        if end + 1 > self.tail_k.shape[2]:
            # Same granularity as the work buffer: with nothing in the main tiers (the full policy, or before the
            # first reassignment) attention reads the tail in place, with the strides an assembled buffer would have.
            cap = _roundup(end + 1, _WORK_ALIGN)
            B, H, _, D = self.tail_k.shape
            nk = torch.zeros(B, H, cap, D, dtype=k.dtype, device=k.device)
            nv = torch.zeros_like(nk)
            nk[:, :, :start] = self.tail_k[:, :, :start]
            nv[:, :, :start] = self.tail_v[:, :, :start]
            self.tail_k, self.tail_v = nk, nv
        self.tail_k[:, :, start:end] = k
        self.tail_v[:, :, start:end] = v

    def _fetch(self, move, src_tier):
        """Values of the moving tokens from their current place: (H, m, D) pairs, plus scales for T2."""
        if src_tier == TAIL:
            b, c = move.on(self.device, "b"), move.on(self.device, "src")
            return self.tail_k[b, :, c].transpose(0, 1), self.tail_v[b, :, c].transpose(0, 1)
        if src_tier == T0:
            i = move.on(self.device, "src")
            return self.k0[:, i], self.v0[:, i]
        if src_tier == T1:
            return self.k1[:, move.src], self.v1[:, move.src]
        return (self.k2[:, move.src], self.k2s[:, move.src]), (self.v2[:, move.src], self.v2s[:, move.src])

    def _migrate(self) -> None:
        """Take this layer from its placement to the current layout; only tier changes cross host<->device."""
        st, eng = self.state, self.state.engine
        lay = st.layout
        H, D, dt, dev = self.k0.shape[0], self.k0.shape[2], self.k0.dtype, self.device
        # T0 (device, full precision)
        m0 = lay.tiers[T0].count
        k0, v0 = torch.zeros(H, m0, D, dtype=dt, device=dev), torch.zeros(H, m0, D, dtype=dt, device=dev)
        # T1 (host, full precision)
        m1 = lay.tiers[T1].count
        k1, v1 = eng.host_empty((H, m1, D), dt), eng.host_empty((H, m1, D), dt)
        # T2 (host, int8 + scales)
        m2 = lay.tiers[T2].count
        k2, v2 = torch.empty(H, m2, D, dtype=torch.int8), torch.empty(H, m2, D, dtype=torch.int8)
        k2s, v2s = torch.empty(H, m2, 1), torch.empty(H, m2, 1)

        for mv in lay.moves.get(T0, []):
            a, b = self._fetch(mv, mv.src_tier)
            if mv.src_tier == T1:
                a, b = eng.to_device(a), eng.to_device(b)
            elif mv.src_tier == T2:
                a = dequantize(eng.to_device(a[0]), eng.to_device(a[1]), dt)
                b = dequantize(eng.to_device(b[0]), eng.to_device(b[1]), dt)
            d = mv.on(dev, "dst")
            k0[:, d], v0[:, d] = a, b
        for mv in lay.moves.get(T1, []):
            a, b = self._fetch(mv, mv.src_tier)
            if mv.src_tier in (T0, TAIL):
                a, b = eng.to_host(a), eng.to_host(b)
            elif mv.src_tier == T2:
                a, b = dequantize(*a, dt), dequantize(*b, dt)
            k1[:, mv.dst], v1[:, mv.dst] = a, b
        for mv in lay.moves.get(T2, []):
            a, b = self._fetch(mv, mv.src_tier)
            if mv.src_tier in (T0, TAIL):
                # Quantize where the data is, so only int8 and scales cross the bus.
                a, b = quantize(a), quantize(b)
                a = (eng.to_host(a[0]), eng.to_host(a[1]))
                b = (eng.to_host(b[0]), eng.to_host(b[1]))
            elif mv.src_tier == T1:
                a, b = quantize(a), quantize(b)
            k2[:, mv.dst], k2s[:, mv.dst] = a
            v2[:, mv.dst], v2s[:, mv.dst] = b
        self.k0, self.v0, self.k1, self.v1 = k0, v0, k1, v1
        self.k2, self.v2, self.k2s, self.v2s = k2, v2, k2s, v2s
        self.version = st.version

    # ---- attention ---------------------------------------------------------------------------
    def _host_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        if self.k1.shape[1]:
            out.update(k1=self.k1, v1=self.v1)
        if self.k2.shape[1]:
            out.update(k2=self.k2, v2=self.v2, k2s=self.k2s, v2s=self.v2s)
        return out

    def assemble(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept K and V of this layer in position order: two (B, H, K, D) views of the engine's work buffers
        (or of this layer's device mirror with ``t1_on_device``)."""
        st = self.state
        sv = st.step_view()
        K = sv["K"]
        if sv["k_main"] == 0 and self.tail_k.shape[2] == sv["cap"]:
            return self.tail_k[:, :, :K], self.tail_v[:, :, :K]  # nothing to assemble
        if st.t1_on_device:
            return self._assemble_mirror(sv)
        B, H, D = st.batch, self.k0.shape[0], self.k0.shape[2]
        wk, wv = st.engine.work_buffers((B, H, sv["cap"], D), self.k0.dtype)
        self._fill(wk, wv, sv)
        self._prefetch_next()
        return wk[:, :, :K], wv[:, :, :K]

    def _fill(self, wk: torch.Tensor, wv: torch.Tensor, sv: dict) -> None:
        """Write every kept token of this layer into (B, H, cap, D) buffers at its working column."""
        st, eng = self.state, self.state.engine
        D = self.k0.shape[2]
        fk, fv = wk.view(-1, D), wv.view(-1, D)
        dest = sv["dest"]
        if self.k0.shape[1]:
            fk.index_copy_(0, dest[T0], self.k0.reshape(-1, D))
            fv.index_copy_(0, dest[T0], self.v0.reshape(-1, D))
        host = self._host_tensors()
        if host:
            slot = self.layer_idx % len(eng.slots)
            dv = eng.take(slot, (self.layer_idx, st.n_total), host)
            if "k1" in dv:
                fk.index_copy_(0, dest[T1], dv["k1"].reshape(-1, D))
                fv.index_copy_(0, dest[T1], dv["v1"].reshape(-1, D))
            if "k2" in dv:
                fk.index_copy_(0, dest[T2], dequantize(dv["k2"], dv["k2s"], wk.dtype).reshape(-1, D))
                fv.index_copy_(0, dest[T2], dequantize(dv["v2"], dv["v2s"], wv.dtype).reshape(-1, D))
            eng.release(slot)
        km, K = sv["k_main"], sv["K"]
        wk[:, :, km:K].copy_(self.tail_k[:, :, : sv["t"]])
        wv[:, :, km:K].copy_(self.tail_v[:, :, : sv["t"]])

    def _assemble_mirror(self, sv: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``t1_on_device``: the assembled K/V stay on the device until the next reassignment, so each step only
        appends the new token; host tiers cross the bus once per reassignment instead of every step. Device memory
        is then that of the full cache (the trade this option makes)."""
        st = self.state
        K, cap = sv["K"], sv["cap"]
        B, H, D = st.batch, self.k0.shape[0], self.k0.shape[2]
        if self.mirror_k is None or self.mirror_version != st.version:
            self.mirror_k = torch.zeros(B, H, cap, D, dtype=self.k0.dtype, device=self.device)
            self.mirror_v = torch.zeros_like(self.mirror_k)
            self._fill(self.mirror_k, self.mirror_v, sv)
            self.mirror_version = st.version
        else:
            n = self.mirror_len
            if self.mirror_k.shape[2] != cap:  # same 256-column granules as the work buffer: same strides
                mk = torch.zeros(B, H, cap, D, dtype=self.k0.dtype, device=self.device)
                mv = torch.zeros_like(mk)
                mk[:, :, :n], mv[:, :, :n] = self.mirror_k[:, :, :n], self.mirror_v[:, :, :n]
                self.mirror_k, self.mirror_v = mk, mv
            t0 = n - sv["k_main"]
            self.mirror_k[:, :, n:K].copy_(self.tail_k[:, :, t0 : sv["t"]])
            self.mirror_v[:, :, n:K].copy_(self.tail_v[:, :, t0 : sv["t"]])
        self.mirror_len = K
        return self.mirror_k[:, :, :K], self.mirror_v[:, :, :K]

    def _prefetch_next(self) -> None:
        """Start streaming the next layer's host tiers while this layer computes (async on CUDA)."""
        st = self.state
        nxt = self.layer_idx + 1
        layers = getattr(st, "layers", None)
        if not st.engine.is_cuda or st.t1_on_device or layers is None or nxt >= len(layers):
            return
        other = layers[nxt]
        if other.version != st.version or not other.is_initialized:
            return  # its migration for this step has not run yet: it stages for itself
        host = other._host_tensors()
        if host:
            st.engine.stage(nxt % len(st.engine.slots), (nxt, st.n_total), host)

    def attend(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, None]:
        """Exact attention of ``query`` (B, Hq, q, D) over this layer's kept tokens -> (B, q, Hq, D)."""
        st = self.state
        B, Hq, q, D = query.shape
        if self.layer_idx == 0:
            st.note_validity(attention_mask, q)
            st.note_device_tokens()
        if q > 1:
            # Prefill of an empty cache: the tail is the whole sequence; SDPA never builds the (q x q) weights.
            t = st.n_total
            k, v = self.tail_k[:, :, :t], self.tail_v[:, :, :t]
            out = F.scaled_dot_product_attention(
                query, k, v, attn_mask=attention_mask, is_causal=attention_mask is None, scale=scaling, enable_gqa=True
            )
            return out.transpose(1, 2).contiguous(), None
        k, v = self.assemble()
        H = k.shape[1]
        g = Hq // H
        mask = st.step_view()["mask"]
        qg = query.reshape(B, H, g, D)
        s = torch.matmul(qg, k.transpose(-1, -2)) * scaling  # (B, H, g, K)
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
        out = torch.matmul(p.to(v.dtype), v)  # (B, H, g, D)
        if st.retier_enabled:
            # s_i += mean over layers of mean over all query heads of the attention weight on i.
            w = p.sum(dim=(1, 2)) * (1.0 / (Hq * st.num_layers))
            st.scores.scatter_add_(1, st.step_view()["score_pos"], w)
        return out.reshape(B, Hq, 1, D).transpose(1, 2), None


class KVTierCache(ShapeGuardedCache):
    """A transformers ``Cache`` whose tokens live in four tiers; built by :func:`kvtier.make_cache`."""

    def __init__(self, cfg: TierConfig, num_layers: int, retier: bool = True, policy: str = "tiered",
                 t1_on_device: bool = False) -> None:
        self.state = TierState(cfg, num_layers, retier=retier, policy=policy, t1_on_device=t1_on_device)
        layers = [TieredLayer(self.state, i) for i in range(num_layers)]
        self.state.layers = layers
        super().__init__(layers=layers)
        self.config = cfg
        self.policy = policy

    def reset(self) -> None:
        """Forget everything (for a new, unrelated prompt); the object stays usable."""
        for layer in self.layers:
            layer.reset()
        self.state.reset()

    def stats(self) -> dict[str, Any]:
        return cache_stats(self.state, self.layers)

    def tier_map(self) -> torch.Tensor:
        """(B, N) int8 on the host: the tier of every logical position, 0-3 for T0-T3 (new tokens waiting for
        the next reassignment are on the device: 0), -1 for left padding. N = prompt + generated so far."""
        st = self.state
        if st.batch is None:
            return torch.zeros(0, 0, dtype=torch.int8)
        n = st.n_total
        lt = st.loc_tier[:, :n].clone()
        lt[lt == TAIL] = T0
        lt[~st.valid[:, :n]] = PAD
        return lt

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


def cache_stats(st: TierState, layers) -> dict[str, Any]:
    """Token counts, bytes and transfer counters, summed over the batch (padding excluded)."""
    empty = {
        "tokens": {"T0": 0, "T1": 0, "T2": 0, "T3": 0},
        "bytes": {"T0": 0, "T1": 0, "T2": 0},
        "transfer": {"h2d_bytes": 0, "d2h_bytes": 0, "seconds": 0.0, "stream_h2d_bytes": 0, "migration_h2d_bytes": 0, "migration_d2h_bytes": 0},
        "retiers": 0,
    }
    if st.batch is None:
        return {**empty, "policy": st.policy, "decode_steps": 0, "logical_tokens": 0}
    lay = st.layout
    n = st.n_total
    valid = st.valid[:, :n]
    tail_real = int(valid[:, lay.n_main :].sum())
    tokens = {
        "T0": lay.tiers[T0].count + tail_real,
        "T1": lay.tiers[T1].count,
        "T2": lay.tiers[T2].count,
        "T3": int((st.loc_tier[:, :n] == T3).sum()),
    }
    L, H, D = st.num_layers, st.n_heads, st.head_dim
    elem = torch.empty(0, dtype=st.dtype).element_size()
    bpt_fp = L * H * D * 2 * elem  # K and V, all layers
    bpt_q = int8_bytes_per_token(L, H, D)
    logical = int(valid.sum())
    st.engine.resolve_timings()
    c = st.engine.counters
    dev_alloc = sum(
        (x.numel() * x.element_size())
        for layer in layers
        if layer.is_initialized
        for x in (layer.k0, layer.v0, layer.tail_k, layer.tail_v, layer.mirror_k, layer.mirror_v)
        if x is not None
    )
    host_alloc = sum(
        (x.numel() * x.element_size())
        for layer in layers
        if layer.is_initialized
        for x in (layer.k1, layer.v1, layer.k2, layer.v2, layer.k2s, layer.v2s)
    )
    return {
        "policy": st.policy,
        "tokens": tokens,
        "bytes": {"T0": tokens["T0"] * bpt_fp, "T1": tokens["T1"] * bpt_fp, "T2": tokens["T2"] * bpt_q},
        "bytes_per_token": {"T0": bpt_fp, "T1": bpt_fp, "T2": bpt_q},
        "allocated_bytes": {"device": dev_alloc, "host": host_alloc, "staging": st.engine.staging_bytes()},
        "t1_on_device": st.t1_on_device,
        "effective_ratios": {k: (v / logical if logical else 0.0) for k, v in tokens.items()},
        "logical_tokens": logical,
        "transfer": {
            "h2d_bytes": c.h2d_bytes,
            "d2h_bytes": c.d2h_bytes,
            "seconds": c.seconds,
            "stream_h2d_bytes": c.stream_h2d_bytes,
            "migration_h2d_bytes": c.migration_h2d_bytes,
            "migration_d2h_bytes": c.migration_d2h_bytes,
        },
        "retiers": st.retiers,
        "decode_steps": st.decode_steps,
        "changed_tokens": dict(st.changed_total),
        "peak_device_kv_bytes": st.peak_device_tokens * bpt_fp,
    }
