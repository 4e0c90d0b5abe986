"""Bookkeeping shared by every layer of one tiered cache: lengths, validity, scores, the current layout, the T1 mode.

:class:`TierState` owns what is per cache rather than per layer: the logical positions and their validity, the
float64 score accumulators (device and host), the tier placement (``loc_tier``/``loc_idx``) and the layout built
from it, the transfer engine and host-attention worker, and the choice of how many rows stream their host tiers.
It decides; :class:`kvtier.cache.layer.TieredLayer` holds and moves K/V.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from ..attention import fused_cpu
from ..attention.host import HostAttention, stream_rows_for
from ..attention.merge import mask_bias, partial
from ..config import ATTENTION_MODES, T1_MODES, TierConfig, check_modes  # noqa: F401 (re-exported)
from ..tiers.layout import TAIL, Layout, build_layout, gather_rows
from ..tiers.planner import PAD, T0, T1, T2, T3, assign_tiers, limit_t0, protected_mask
from ..transfer import TransferEngine, memcpy_peak_gbps
from .base import check_update, prompt_validity

log = logging.getLogger(__name__)

_WORK_ALIGN = 256  # work-buffer capacity granularity: same length -> same strides -> same floats
_TAIL_GRANULE = 64  # tail columns are allocated in steps of min(this, retier_interval)

SCORE_DTYPE = torch.float64


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def tail_granule(retier_interval: int) -> int:
    """Columns a tiered tail grows by."""
    return min(_TAIL_GRANULE, retier_interval)


def tail_columns(retier_interval: int) -> int:
    """The most columns a tiered tail holds: the tokens between two reassignments, in whole granules."""
    return _roundup(retier_interval, tail_granule(retier_interval))


def full_columns(n: int) -> int:
    """Device columns of a ``full`` cache holding ``n`` tokens (its one region: whole work-aligned granules with a
    spare column, the strides the ordered path's work buffers have)."""
    return _roundup(n + 1, _WORK_ALIGN)


class TierState:
    """Bookkeeping shared by all layers of one cache: lengths, validity, scores, placement, attention mode.

    Positions are logical columns 0..n_total-1 of the batch (left padding included); each row's logical
    length N_b counts only its real positions.
    """

    def __init__(self, cfg: TierConfig, num_layers: int, retier: bool = True, policy: str = "tiered",
                 t1_on_device: bool = False, attention: str = "split", t1_attention: str = "auto",
                 host_threaded: bool | None = None, kernel: str = "auto") -> None:
        check_modes(policy, attention, t1_attention, t1_on_device, kernel)
        self.cfg = cfg
        self.num_layers = num_layers
        self.retier_enabled = retier
        self.policy = policy
        self.t1_on_device = t1_on_device
        self.attention = attention
        self.t1_attention = t1_attention
        self.host_threaded = host_threaded
        self.kernel = kernel
        self.fused = False  # this cache's split decode runs the fused CPU kernel (decided at the first update)
        self._kernel_ok = False  # the kernel could take its step (decided at the first update): rows_fused
        self.model_sinks = False  # the model has attention sinks (set by make_cache): SDPA cannot take full's step
        self.host: HostAttention | None = None
        self.bandwidth: dict[str, float] | None = None
        # rows that stream their host tiers, in place of the per-layout choice (tests and tuning; eager path only:
        # the fused CPU kernel attends every tier in place)
        self.fixed_stream_rows: int | None = None
        self.recorder = None  # a kvtier.tiers.tiermap.TierRecorder when make_cache(..., record_tiers=...) asked for one
        # memory pressure (a server's device-KV budget): at most this many T0 tokens per row, the rest of what the
        # planner would put there goes to T1 (exact); None: the ratios alone decide. Set by :meth:`limit_device`.
        self.t0_limit: int | None = None
        self.reset()

    def open_prompt(self, n: int) -> None:
        """Announce an ``n``-token prompt that arrives in chunks (chunked prefill): the updates that follow carry
        consecutive pieces of it until ``n`` tokens are in; each chunk attends the prompt so far (causal), no chunk
        adds to the scores, and the prompt is placed into tiers as a whole prefill places it, after its last chunk
        (and after every chunk while a device limit is set, so that the device never holds more than the limit
        beside one chunk). Decode steps follow as usual."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"open_prompt takes the prompt's length in tokens (an integer >= 1), got {n!r}")
        if self.n_total > 0:
            raise ValueError(f"open_prompt needs an empty cache; this one holds {self.n_total} positions (reset() it)")
        self.prompt_end = n

    @property
    def prefilling(self) -> bool:
        """An announced prompt (:meth:`open_prompt`) is not all in yet."""
        return self.prompt_end is not None and self.n_total < self.prompt_end

    def reset(self) -> None:
        if self.host is not None:
            self.host.close()
        if self.recorder is not None:
            self.recorder.reset()
        self.batch = None
        self.device = None
        self.n_heads = None
        self.head_dim = None
        self.dtype = None
        self.engine: TransferEngine | None = None
        self.host = None
        self.n_total = 0
        self.prompt_end: int | None = None  # open_prompt's announced length (chunked prefill), else None
        self.chunk: tuple[int, int, bool] | None = None  # this update's prompt piece: (start, tokens, last); None: decode
        self.place_pending = False  # a chunked prompt is placed at the next update (TieredLayer.attend)
        self.placed_version = -1  # the layout version of that placement: the layers' tails start again empty
        self.cap = 0
        self.valid = self.prompt = self.loc_tier = self.loc_idx = self.scores = self.valid_dev = None
        self.scores_host = None
        self.padded = False
        self.layout: Layout | None = None
        self.version = 0
        self.decode_steps = 0
        self.since_retier = 0
        self.retier_now = False  # a new device limit waits for the next update to take effect
        self.retiers = 0
        self.changed_total: dict[str, int] = {}
        self.stream_rows = 0  # rows [0, stream_rows) stream their T1/T2 to the device, the rest attend them on the host
        self.t1_modes: dict[str, int] = {}  # reassignments per chosen T1 mode
        self._meta: dict = {}
        self._meta_key = None
        self._tail_pos = self._tail_bias = None
        self._tail_key = None
        self._tail_filled = 0
        self.n_heads_q = None
        self._step = None
        self._step_key = None
        self._dest_key = None
        self._dest: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.layer_device_bytes = [0] * self.num_layers
        self.peak_device_tokens = 0  # resident real tokens (T0 + tail), host arithmetic
        self.peak_device_kv_bytes = 0
        self.peak_device_bytes = 0
        self._cuda_base = None
        self._seen_alloc = -1

    # ---- lifecycle ---------------------------------------------------------------------------
    def _init(self, k: torch.Tensor) -> None:
        B, H, _, D = k.shape
        self.batch, self.n_heads, self.head_dim, self.dtype, self.device = B, H, D, k.dtype, k.device
        self.stream_rows = B  # until a layout chooses: nothing is attended on the host
        self.engine = TransferEngine(k.device, n_slots=self.num_layers if self.t1_on_device else 1)
        self.host = HostAttention(k.device, self.num_layers, threaded=self.host_threaded, seam=self.engine.seam)
        blocker = self._kernel_blocker(k)
        self.fused = self._want_fused(k, blocker)
        self._kernel_ok = self.kernel != "eager" and self.attention == "split" and blocker is None
        self.layout = Layout.empty(B)
        self._cuda_base = self.engine.seam.memory_allocated(k.device)  # None where the device keeps no count
        self._grow(256)

    @property
    def rows_fused(self) -> bool:
        """Whether a RowsCache step may attend this cache's decode step in one fused-kernel call across rows
        (:mod:`kvtier.cache.rows`): a cache without scores (``full``, until it is demoted) whose kernel is possible
        and not refused (``kernel="eager"``), on a CPU where SDPA is the faster path for one cache or not."""
        return self._kernel_ok and not self.retier_enabled

    def _want_fused(self, k: torch.Tensor, why: str | None) -> bool:
        """The fused CPU kernel attends every region in one call where all of them are in CPU memory (a CPU
        device) and the host tiers are not on a worker thread; ``kernel="fused"`` insists, ``"eager"`` refuses.
        The full cache (one region, no scores) takes it under ``"auto"`` unless SDPA is the faster one on this CPU
        (:func:`kvtier.attention.fused_cpu.sdpa_is_faster`); its eager path is SDPA. ``why``: what
        :meth:`_kernel_blocker` says for ``k``."""
        if self.kernel == "eager" or self.attention != "split":
            return False
        if why is not None and self.kernel == "fused":
            raise ValueError(f"kernel='fused' is not possible for policy {self.policy!r}: {why}")
        if why is None and not self.retier_enabled and self.kernel == "auto":
            return self.model_sinks or not fused_cpu.sdpa_is_faster(k.dtype)
        return why is None

    def _kernel_blocker(self, k: torch.Tensor) -> str | None:
        """Why the fused CPU kernel cannot take this cache's step (None: it can)."""
        why = None
        if k.device.type != "cpu":
            why = f"the device is {k.device.type} (the fused kernel runs on CPU devices)"
        elif self.engine.asynchronous:
            why = "the device's copies are asynchronous (the fused kernel reads every region in place)"
        elif not fused_cpu.supports(k.dtype):
            why = f"the cache dtype is {k.dtype} (the fused kernel takes float32 and bfloat16)"
        elif self.host.threaded:
            why = "host_threaded=True runs the host tiers on a worker thread"
        elif not fused_cpu.available():
            why = "it could not be built (see the log)"
        return why

    def _grow(self, need: int) -> None:
        if need <= self.cap:
            return
        cap = max(need, 2 * self.cap, 256)
        B, old = self.batch, self.cap

        def grown(t, fill, dtype, device=None):
            out = torch.full((B, cap), fill, dtype=dtype, device=device)
            if t is not None:
                out[:, :old] = t[:, :old]
            return out

        self.valid = grown(self.valid, False, torch.bool)
        self.prompt = grown(self.prompt, False, torch.bool)
        self.loc_tier = grown(self.loc_tier, PAD, torch.int8)
        self.loc_idx = grown(self.loc_idx, 0, torch.long)
        self.valid_dev = grown(self.valid_dev, False, torch.bool, self.device)  # device mirror: no host sync per step
        # last column: trash, where weights of empty slots (exactly 0) land
        # float64 accumulators: a long chain adds ~steps x layers weights of ~1/N each to every score; in float32
        # the sum would lose the digits that rank close tokens (and depend on the summation order)
        scores = torch.zeros(B, cap + 1, dtype=SCORE_DTYPE, device=self.device)
        scores_host = torch.zeros(B, cap + 1, dtype=SCORE_DTYPE)
        if self.scores is not None:
            scores[:, :old] = self.scores[:, :old]
            scores_host[:, :old] = self.scores_host[:, :old]
        self.scores, self.scores_host = scores, scores_host
        self.host.scores = scores_host
        self.cap = cap
        self._meta_key = None  # trash column moved

    @property
    def inv_heads_layers(self) -> float:
        return 1.0 / (self.n_heads_q * self.num_layers)

    def begin_update(self, k: torch.Tensor) -> None:
        """Called by layer 0 with the new keys (B, H, q, D) before any layer stores them."""
        q = k.shape[2]
        check_update(self.batch, self.n_total, k, self.prompt_end)
        if self.batch is None:
            self._init(k)
        start = self.n_total
        end = self.prompt_end if self.prompt_end is not None else (q if start == 0 else 0)
        is_decode = start >= end
        self.chunk = None if is_decode else (start, q, start + q == end)
        placed = False
        if self.place_pending:  # the chunks so far, placed as a whole prefill places its prompt
            self.place_pending = False
            self.place_prefill()
            self.placed_version = self.version
            self.retier_now = False  # the placement took the device limit into account
            placed = True
        if is_decode:
            if placed:
                pass  # the prompt's placement is this update's reassignment (a whole prefill's, one step late)
            elif self.retier_enabled and (self.since_retier >= self.cfg.retier_interval or self.retier_now):
                self.retier()
            elif self.recorder is not None and not self.retier_enabled and self.recorder.due(self.decode_steps):
                self.recorder.note(self.decode_steps, self.codes())
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

    def chunk_attended(self, n_heads_q: int) -> None:
        """Layer 0 attended this update's piece of a chunked prompt (or a stored prefix was loaded in its place:
        :meth:`kvtier.cache.tiered.KVTierCache.load_prompt`). The prompt is placed after its last piece (and after
        each one while a device limit holds) at the next update, before any layer stores that update's tokens:
        here the later layers' pieces of this one are not stored yet."""
        self.n_heads_q = n_heads_q
        if self.retier_enabled and (self.chunk[2] or self.t0_limit is not None):
            self.place_pending = True

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
        self.padded = not bool(self.valid[:, :q].all())
        self._step_key = None

    def codes(self) -> torch.Tensor:
        """(B, n_total) int8: tier per logical position (the tail counts as T0), PAD for left padding."""
        n = self.n_total
        lt = self.loc_tier[:, :n].clone()
        lt[lt == TAIL] = T0
        lt[~self.valid[:, :n]] = PAD
        return lt

    # ---- device memory -----------------------------------------------------------------------
    def note_device(self, layer_idx: int | None = None, nbytes: int = 0) -> None:
        """Track the peak of real device buffers: KV (T0 + tail, all layers) and everything (+ staging, work)."""
        if layer_idx is not None:
            self.layer_device_bytes[layer_idx] = nbytes
        kv = sum(self.layer_device_bytes)
        self.peak_device_kv_bytes = max(self.peak_device_kv_bytes, kv)
        self.peak_device_bytes = max(self.peak_device_bytes, kv + self.engine.staging_bytes())
        self._seen_alloc = self.engine.allocations

    # ---- scores ------------------------------------------------------------------------------
    def combined_scores(self) -> torch.Tensor:
        """(B, cap + 1) float64 on the host: every position's cumulative score, wherever it accumulates
        (the device accumulator, or the host one for T1/T2 tokens attended on the host)."""
        s = self.scores.cpu()
        if self.host_attn:
            self.host.flush(self.inv_heads_layers)
            n = self.n_total
            on_host = (self.loc_tier[:, :n] == T1) | (self.loc_tier[:, :n] == T2)
            on_host[: self.stream_rows] = False  # those rows stream: their T1/T2 weights went to the device
            s[:, :n] = torch.where(on_host, self.scores_host[:, :n], s[:, :n])
        return s

    # ---- reassignment ------------------------------------------------------------------------
    def plan(self, scores: torch.Tensor | None = None, cfg: TierConfig | None = None) -> torch.Tensor:
        """Tier per position (B, n_total) for the current scores."""
        n = self.n_total
        cfg = cfg or self.cfg
        scores = self.combined_scores() if scores is None else scores
        valid = self.valid[:, :n]
        prot = protected_mask(valid, self.prompt[:, :n], cfg)
        evicted = self.loc_tier[:, :n] == T3
        tiers = assign_tiers(scores[:, :n], valid, prot, evicted, cfg)
        if self.t0_limit is not None:
            tiers = limit_t0(tiers, scores[:, :n], prot, torch.full((self.batch,), self.t0_limit, dtype=torch.long))
        return tiers

    def place_prefill(self) -> None:
        """The prompt's placement, right after prefill: T0 gets the protected set and the budget (scores are all 0
        yet, so the newest tokens win the ties), the rest goes to the host in full precision. Nothing is evicted or
        quantized before scores exist, so outputs are those of keeping the prompt on the device until the first
        reassignment (Proposition 1), while device memory already holds only the budget."""
        cfg = self.cfg
        cfg = dataclasses.replace(cfg, evict_ratio=0.0, quant_ratio=0.0,
                                  rest_tier="T1" if cfg.rest_tier == "T2" else cfg.rest_tier)
        tiers = self.plan(torch.zeros(self.batch, self.n_total), cfg)
        self._apply(tiers, None)

    def retier(self) -> None:
        self.retier_now = False
        combined = self.combined_scores()
        self._apply(self.plan(combined), combined)
        self.retiers += 1
        log.debug("retier %d at n=%d: %s", self.retiers, self.n_total, self.layout.changed)

    def _apply(self, tiers: torch.Tensor, combined: torch.Tensor | None) -> None:
        n = self.n_total
        was_host = self.host_attn
        self.layout = build_layout(tiers, self.valid[:, :n], self.loc_tier, self.loc_idx, self.layout,
                                   t0_max=self.t0_limit)
        self.version += 1
        if self.recorder is not None:
            self.recorder.note(self.decode_steps, tiers)
        self.since_retier = 0
        for key, v in self.layout.changed.items():
            self.changed_total[key] = self.changed_total.get(key, 0) + v
        self.stream_rows = self._choose_stream_rows()
        mode = self.t1_mode
        self.t1_modes[mode] = self.t1_modes.get(mode, 0) + 1
        if combined is not None and was_host:
            self.scores.copy_(combined.to(self.device))  # the host part comes home; tokens may change sides
        if combined is not None and self.host_attn:
            self.scores_host.copy_(combined)
        self.host.drop()

    def _host_bytes_per_layer(self) -> int:
        lay, H, D = self.layout, self.n_heads, self.head_dim
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return self.batch * H * (lay.tiers[T1].cap * D * 2 * elem + lay.tiers[T2].cap * (D + 4) * 2)

    @property
    def host_attn(self) -> bool:
        """Some rows of this layout attend their T1/T2 on the host."""
        return self.batch is not None and self.stream_rows < self.batch

    @property
    def t1_mode(self) -> str:
        """This layout's T1 mode: "stream", "host", or "both" (some rows each way)."""
        return "stream" if self.stream_rows >= self.batch else "host" if self.stream_rows == 0 else "both"

    def _choose_stream_rows(self) -> int:
        """How many rows (the first ones) stream their host tiers this layout; the others attend them on the host.
        ``auto``: on a CPU the host *is* the device, so attending in place beats a copy (0); on CUDA the split of the
        batch at which streaming and host attention, running side by side, finish together
        (:func:`kvtier.attention.host.stream_rows_for`), from bandwidths measured once."""
        B = self.batch
        if self.attention == "ordered" or self.t1_on_device or self.t1_attention == "stream":
            return B
        if self.fixed_stream_rows is not None and not self.fused:
            return max(0, min(B, int(self.fixed_stream_rows)))
        if self.t1_attention == "host" or not self.engine.asynchronous:
            return 0
        bw = self.measure_bandwidth()
        return stream_rows_for(B, self._host_bytes_per_layer() / B, bw["h2d_gbps"], bw["host_attention_gbps"],
                               bw["host_latency_s"])

    def measure_bandwidth(self) -> dict[str, float]:
        """Pinned H2D GB/s and host-attention GB/s (+ one round trip's latency), measured once per cache."""
        if self.bandwidth is None:
            self.bandwidth = measure_bandwidths(self.device, self.dtype, self.n_heads, self.head_dim)
        return self.bandwidth

    # ---- per-version metadata ----------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """Slot maps of this layout, on the device and (for host tiers) on the host: (B, cap) positions and
        (B, 1, 1, cap) additive masks per tier."""
        key = (self.version, self.cap)
        if self._meta_key == key:
            return self._meta
        lay, trash = self.layout, self.cap
        out: dict[str, Any] = {}
        for x in (T0, T1, T2):
            pos, occ = lay.tiers[x].slot_map(self.batch, trash)
            bias = mask_bias(occ)
            out[x] = (pos.to(self.device), bias.to(self.device))
            if x in (T1, T2):
                out[("host", x)] = (pos, bias)
        self._meta, self._meta_key = out, key
        return out

    def device_view(self, cap0: int, cap_t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device region (T0's ``cap0`` slots, then the tail's ``cap_t`` columns, one buffer): its (B, 1, 1, C)
        float32 additive mask (0 kept, -inf empty) and (B, C) long score positions, on the device. Rebuilt per
        layout; each step only opens its new tail column, in place."""
        key = (self.version, cap0, cap_t, self.cap)
        n_main = self.layout.n_main
        if self._tail_key != key:
            pos0, bias0 = self.meta()[T0]
            tail = n_main + torch.arange(cap_t, device=self.device)
            tail = torch.where(tail < self.cap, tail, self.cap).expand(self.batch, cap_t)
            self._tail_pos = torch.cat([pos0, tail], dim=1)
            closed = torch.full((self.batch, 1, 1, cap_t), float("-inf"), device=self.device)
            self._tail_bias = torch.cat([bias0, closed], dim=3)
            self._tail_filled = 0
            self._tail_key = key
        t = self.n_total - n_main
        if self._tail_filled < t:
            new = self.valid_dev[:, n_main + self._tail_filled : self.n_total]
            cols = self._tail_bias[:, 0, 0, cap0 + self._tail_filled : cap0 + t]
            cols.zero_().masked_fill_(~new, float("-inf"))
            self._tail_filled = t
        return self._tail_bias, self._tail_pos

    # ---- the ordered path's per-step view ----------------------------------------------------
    def step_view(self) -> dict[str, Any]:
        """Working-layout tensors for this step: K, capacity, mask (B,1,1,K), score positions (B,K), gathers."""
        key = (self.n_total, self.version)
        if self._step_key == key:
            return self._step
        lay = self.layout
        t = self.n_total - lay.n_main
        K = lay.k_main + t
        cap = _roundup(K + 1, _WORK_ALIGN)
        trash = self.cap
        work_valid = lay.work_valid.to(self.device)
        work_pos = torch.where(lay.work_pos >= 0, lay.work_pos, trash).to(self.device)
        valid = torch.cat([work_valid, self.valid_dev[:, lay.n_main : self.n_total]], dim=1)
        tail_pos = torch.arange(lay.n_main, self.n_total, device=self.device).expand(self.batch, t)
        pos = torch.cat([work_pos, tail_pos], dim=1)
        dev_width = self.layers[0].dev_k.shape[2]  # T0 slots + tail columns (the same in every layer)
        if self._dest_key != (self.version, cap, dev_width):
            self._dest = {x: tuple(i.to(self.device) for i in
                                   gather_rows(lay.tiers[x], self.n_heads, cap, dev_width if x == T0 else None))
                          for x in (T0, T1, T2)}
            self._dest_key = (self.version, cap, dev_width)
        self._step = {"K": K, "k_main": lay.k_main, "t": t, "cap": cap, "mask": valid.view(self.batch, 1, 1, K),
                      "score_pos": pos, "gather": self._dest}
        self._step_key = key
        return self._step


def measure_bandwidths(device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> dict[str, float]:
    """Pinned host->device GB/s, host attention GB/s over a 16 MiB-ish region, and a small host job's seconds."""
    n_tok = 4096
    k = torch.randn(1, heads, n_tok, head_dim).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(1, heads, 4, head_dim).to(dtype)
    valid = torch.ones(1, n_tok, dtype=torch.bool)
    nbytes = 2 * k.numel() * k.element_size()

    def best(fn, reps=3):
        out = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t)
        return out

    bias = mask_bias(valid)
    small_k, small_v = k[:, :, :16].contiguous(), v[:, :, :16].contiguous()
    host_s = best(lambda: partial(q, k, v, bias, 0.1, True))
    small = best(lambda: partial(q, small_k, small_v, bias[..., :16], 0.1, True))
    h2d_gbps = memcpy_peak_gbps(device, mib=16, reps=3)
    # on CUDA a host job adds a D2H and an H2D of a few KiB and the thread hand-off
    latency = small + (50e-6 if device.type == "cuda" else 0.0)
    return {"h2d_gbps": h2d_gbps, "host_attention_gbps": nbytes / host_s / 1e9, "host_latency_s": latency}
