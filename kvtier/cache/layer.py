"""The transformers ``Cache`` glue: one :class:`TierState` of shared bookkeeping, one :class:`TieredLayer` per layer.

Data flow per layer:
    prefill   -> SDPA over the prompt; then (layer 0) a placement of the prompt into tiers, and each layer stores
                 its prompt K/V straight into T0 / T1, so device memory holds the T0 budget from the first step.
    update()  -> (layer 0) reassign tiers when due; (each layer) move the tokens whose tier changed, append the
                 new token to the device tail.
    attend()  -> ``attention="split"``: one partial softmax per region where it lives (T0 and the tail on the
                 device; T1 and deq(T2) streamed to the device or attended on the host, ``t1_attention``), merged
                 by log-sum-exp (:mod:`kvtier.attention.merge`); nothing is assembled.
                 ``attention="ordered"``: gather every kept token in position order into a reused work buffer and
                 take one softmax over it (bit-identical across HBM ratios: the reference).
                 Both add the merged attention weights to the cumulative scores.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import fused_cpu
from ..attention.host import HostAttention, HostRegion, host_tiers_partial, stream_rows_for
from ..attention.merge import Partial, add_weights, mask_bias, merge, ordered, partial
from ..config import TierConfig
from ..tiers.layout import TAIL, Layout, build_layout, gather_rows
from ..tiers.planner import PAD, T0, T1, T2, T3, assign_tiers, protected_mask
from ..tiers.quant import dequantize, int8_bytes_per_token, quantize
from ..transfer import TransferEngine, memcpy_peak_gbps
from .base import KVTierLayer, ShapeGuardedCache, check_update, prompt_validity

log = logging.getLogger(__name__)

_WORK_ALIGN = 256  # work-buffer capacity granularity: same length -> same strides -> same floats
_TAIL_GRANULE = 64  # tail columns are allocated in steps of min(this, retier_interval)

ATTENTION_MODES = ("split", "ordered")
SCORE_DTYPE = torch.float64
T1_MODES = ("auto", "stream", "host")


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def check_modes(policy: str, attention: str, t1_attention: str = "auto", t1_on_device: bool = False,
                kernel: str = "auto") -> None:
    """``ValueError`` naming the parameter when the attention settings are unknown or contradict each other."""
    if kernel not in fused_cpu.KERNEL_MODES:
        raise ValueError(f"kernel must be one of {list(fused_cpu.KERNEL_MODES)} for policy {policy!r}, got {kernel!r}")
    if kernel == "fused" and attention != "split":
        raise ValueError(f"kernel='fused' needs attention='split' for policy {policy!r} (the ordered path is the "
                         "reference and has no kernel)")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"attention must be one of {list(ATTENTION_MODES)} for policy {policy!r}, got {attention!r}")
    if t1_attention not in T1_MODES:
        raise ValueError(f"t1_attention must be one of {list(T1_MODES)} for policy {policy!r}, got {t1_attention!r}")
    if not isinstance(t1_on_device, bool):
        raise ValueError(f"t1_on_device must be True or False for policy {policy!r}, got {t1_on_device!r}")
    if attention == "ordered" and t1_attention == "host":
        raise ValueError(f"t1_attention='host' needs attention='split' for policy {policy!r}: the ordered path "
                         "attends every kept token in one softmax on the device")
    if t1_on_device and t1_attention == "host":
        raise ValueError(f"t1_on_device=True keeps T1 on the device; it contradicts t1_attention='host' for policy {policy!r}")


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
        self.host: HostAttention | None = None
        self.bandwidth: dict[str, float] | None = None
        # rows that stream their host tiers, in place of the per-layout choice (tests and tuning; eager path only:
        # the fused CPU kernel attends every tier in place)
        self.fixed_stream_rows: int | None = None
        self.recorder = None  # a kvtier.tiers.tiermap.TierRecorder when make_cache(..., record_tiers=...) asked for one
        self.reset()

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
        self.cap = 0
        self.valid = self.prompt = self.loc_tier = self.loc_idx = self.scores = self.valid_dev = None
        self.scores_host = None
        self.padded = False
        self.layout: Layout | None = None
        self.version = 0
        self.decode_steps = 0
        self.since_retier = 0
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
        self.host = HostAttention(k.device, self.num_layers, threaded=self.host_threaded)
        self.fused = self._want_fused(k)
        self.layout = Layout.empty(B)
        if k.device.type == "cuda":
            self._cuda_base = torch.cuda.memory_allocated(k.device)
        self._grow(256)

    def _want_fused(self, k: torch.Tensor) -> bool:
        """The fused CPU kernel attends every region in one call where all of them are in CPU memory (a CPU
        device) and the host tiers are not on a worker thread; ``kernel="fused"`` insists, ``"eager"`` refuses.
        The full cache (one region, no scores) takes it under ``"auto"`` unless SDPA is the faster one on this CPU
        (:func:`kvtier.attention.fused_cpu.sdpa_is_faster`); its eager path is SDPA."""
        if self.kernel == "eager" or self.attention != "split":
            return False
        why = None
        if k.device.type != "cpu":
            why = f"the device is {k.device.type} (the fused kernel runs on CPU devices)"
        elif not fused_cpu.supports(k.dtype):
            why = f"the cache dtype is {k.dtype} (the fused kernel takes float32 and bfloat16)"
        elif self.host.threaded:
            why = "host_threaded=True runs the host tiers on a worker thread"
        elif not fused_cpu.available():
            why = "it could not be built (see the log)"
        if why is not None and self.kernel == "fused":
            raise ValueError(f"kernel='fused' is not possible for policy {self.policy!r}: {why}")
        if why is None and not self.retier_enabled and self.kernel == "auto":
            return not fused_cpu.sdpa_is_faster(k.dtype)
        return why is None

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
        check_update(self.batch, self.n_total, k)
        if self.batch is None:
            self._init(k)
        is_decode = self.n_total > 0
        if is_decode:
            if self.retier_enabled and self.since_retier >= self.cfg.retier_interval:
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
        return assign_tiers(scores[:, :n], valid, prot, evicted, cfg)

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
        combined = self.combined_scores()
        self._apply(self.plan(combined), combined)
        self.retiers += 1
        log.debug("retier %d at n=%d: %s", self.retiers, self.n_total, self.layout.changed)

    def _apply(self, tiers: torch.Tensor, combined: torch.Tensor | None) -> None:
        n = self.n_total
        was_host = self.host_attn
        self.layout = build_layout(tiers, self.valid[:, :n], self.loc_tier, self.loc_idx, self.layout)
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
        if self.t1_attention == "host" or self.device.type != "cuda":
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
        self.is_initialized = False

    # ---- CacheLayerMixin ---------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        dev, dt = key_states.device, key_states.dtype
        eng = self.state.engine
        self.dev_k = torch.zeros(B, H, 0, D, dtype=dt, device=dev)
        self.dev_v = self.dev_k.clone()
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
        prefill = key_states.shape[2] == st.n_total
        if not prefill:
            if self.version != st.version:
                self._migrate()
            self._append(key_states, value_states)
        elif not st.retier_enabled:
            self._append(key_states, value_states)
        # else: a prompt is stored after its attention, straight into the tiers of the prefill placement
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
        nk = torch.zeros(B, H, cap0 + cap_t, D, dtype=self.dev_k.dtype, device=self.dev_k.device)
        nv = torch.zeros_like(nk)
        c = self.cap0
        nk[:, :, :c], nv[:, :, :c] = self.k0, self.v0
        if keep_tail:
            nk[:, :, cap0 : cap0 + keep_tail] = self.tail_k[:, :, :keep_tail]
            nv[:, :, cap0 : cap0 + keep_tail] = self.tail_v[:, :, :keep_tail]
        self.dev_k, self.dev_v, self.cap0 = nk, nv, cap0
        self._views()
        self.state.note_device(self.layer_idx, self._device_bytes())

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        st = self.state
        q = k.shape[2]
        end = st.n_total - st.layout.n_main
        start = end - q
        if st.retier_enabled:
            need, granule = end, min(_TAIL_GRANULE, st.cfg.retier_interval)
        else:
            # The full cache's tail is everything: it is read in place, with the strides (256-column granules and
            # one spare column) an assembled work buffer would have, so the ordered path stays bit-identical.
            need, granule = end + 1, _WORK_ALIGN
        if need > self.tail_k.shape[2]:
            self._alloc_device(self.cap0, _roundup(need, granule), keep_tail=start)
        self.tail_k[:, :, start:end] = k
        self.tail_v[:, :, start:end] = v

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

    def _migrate(self, tail: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Take this layer from its placement to the current layout; only tokens whose tier changed are moved
        (and only they cross host<->device). ``tail``: where the tail tokens are (the prompt's K/V at prefill)."""
        st, eng = self.state, self.state.engine
        lay = st.layout
        tail = tail or (self.tail_k, self.tail_v)
        dt, dev = self.dev_k.dtype, self.device
        # 1. read every moving token from where it is now, before any slot it frees is reused
        got = {x: [(mv, self._fetch(mv, tail)) for mv in lay.moves.get(x, [])] for x in (T0, T1, T2)}
        # 2. grow buffers whose tier outgrew them (the tail's tokens were read in 1: its columns start empty)
        if lay.tiers[T0].cap > self.cap0:
            self._alloc_device(lay.tiers[T0].cap, self.tail_k.shape[2], keep_tail=0)
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

    def _host_tensors(self, rows: slice = slice(None), tiers: tuple[int, ...] = (T1, T2)) -> dict[str, torch.Tensor]:
        """This layer's host ``tiers``, for ``rows`` (a leading-dimension slice: contiguous, so it copies as one block)."""
        lay = self.state.layout
        out = {}
        if T1 in tiers and lay.tiers[T1].width:
            out.update(k1=self.k1[rows], v1=self.v1[rows])
        if T2 in tiers and lay.tiers[T2].width:
            out.update(k2=self.k2[rows], v2=self.v2[rows], k2s=self.k2s[rows], v2s=self.v2s[rows])
        return out

    def _staged(self, rows: slice = slice(None), tiers: tuple[int, ...] = (T1, T2)) -> dict[str, torch.Tensor]:
        """Device copies of this layer's host ``tiers`` (``stream``) for ``rows``: from a prefetch, a per-layer
        persistent copy (``t1_on_device``, staged once per reassignment) or copied now."""
        st, eng = self.state, self.state.engine
        host = self._host_tensors(rows, tiers)
        if st.t1_on_device:
            return eng.take(self.layer_idx, (self.layer_idx, "v", st.version), host)
        return eng.take(0, (self.layer_idx, st.n_total), host)

    def _release(self) -> None:
        st = self.state
        if not st.t1_on_device:
            st.engine.release(0)
            self._prefetch_next()

    def _prefetch_next(self) -> None:
        """Start streaming the next layer's host tiers while this layer computes (async on CUDA)."""
        st = self.state
        nxt = self.layer_idx + 1
        layers = getattr(st, "layers", None)
        if not st.engine.is_cuda or st.stream_rows == 0 or layers is None or nxt >= len(layers):
            return
        other = layers[nxt]
        if other.version != st.version or not other.is_initialized:
            return  # its migration for this step has not run yet: it stages for itself
        host = other._host_tensors(slice(0, st.stream_rows))
        if host:
            st.engine.stage(0, (nxt, st.n_total), host)

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float) -> tuple[torch.Tensor, None]:
        """Attention of ``query`` (B, Hq, q, D) over this layer's kept tokens -> (B, q, Hq, D).

        ``key``/``value`` (B, H, q, D) are this step's new states (the whole prompt at prefill)."""
        st = self.state
        B, Hq, q, D = query.shape
        if self.layer_idx == 0:
            st.n_heads_q = Hq
            if q > 1:
                st.note_validity(attention_mask, q)
                if st.retier_enabled:
                    st.place_prefill()
        if q > 1:
            # Prefill of an empty cache: SDPA over the prompt, never building the (q x q) weights.
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None, scale=scaling,
                enable_gqa=True,
            )
            if st.retier_enabled:
                self._migrate(tail=(key, value))
            return out.transpose(1, 2).contiguous(), None
        if st.engine.allocations != st._seen_alloc:
            st.note_device()
        if self.layer_idx == 0:
            lay = st.layout
            # device tokens peak just before a reassignment: T0 + every row's tail (decode tokens are all real)
            st.peak_device_tokens = max(st.peak_device_tokens, lay.tiers[T0].count
                                        + int(st.valid[:, lay.n_main : st.n_total].sum()))
        if st.attention == "ordered":
            out = self._attend_ordered(query, scaling)
        elif not st.retier_enabled:
            out = self._attend_full(query, scaling)
        else:
            out = self._attend_split(query, scaling)
        return out.reshape(B, Hq, 1, D).transpose(1, 2), None

    def _attend_full(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Split mode without scores (the full cache): one region, read in place by the fused CPU kernel or SDPA.

        The query heads of one KV head attend as one group: ``query`` (B, Hq, 1, D) is viewed as (B, H_kv, Hq/H_kv,
        D) — Hq/H_kv "query positions" per KV head, nothing causal between them — rather than passing
        ``enable_gqa``, which on CPU falls off SDPA's fused kernel (2-3x slower at 2K-8K tokens, measured)."""
        st = self.state
        n = st.n_total
        B, Hq, _, D = query.shape
        H = self.tail_k.shape[1]
        if st.fused:
            # the whole buffer with its closed columns (-inf, never read) rather than a slice: the mask and
            # positions are rebuilt only when the buffer grows, and one column opens per step
            bias, pos = st.device_view(0, self.tail_k.shape[2])
            out = fused_cpu.attend(query.reshape(B, H, Hq // H, D), [self.dev_k], [self.dev_v], [bias], [pos], None,
                                   0.0, scaling)
            return out.reshape(B, Hq, 1, D)
        mask = st.valid_dev[:, :n].view(st.batch, 1, 1, n) if st.padded else None
        out = F.scaled_dot_product_attention(query.reshape(B, H, Hq // H, D), self.tail_k[:, :, :n], self.tail_v[:, :, :n],
                                             attn_mask=mask, scale=scaling)
        return out.reshape(B, Hq, 1, D)

    def _attend_split(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Each region attended where it lives, merged by log-sum-exp; scores from the merged weights."""
        st = self.state
        lay = st.layout
        B, Hq, _, D = query.shape
        H = self.dev_k.shape[1]
        qg = query.reshape(B, H, Hq // H, D).contiguous()
        keep = True  # retier-enabled caches always score
        meta = st.meta()
        inv = st.inv_heads_layers
        host_tiers = [x for x in (T1, T2) if lay.tiers[x].count]
        if st.fused:
            return self._attend_fused(qg, host_tiers, meta, scaling, inv).to(query.dtype)
        # rows [0, r) stream their host tiers to the device, rows [r, B) attend them on the host ("both" when
        # 0 < r < B): each row's host tiers give one partial either way, and the two row blocks make one
        r = st.stream_rows
        on_host, streamed = slice(r, B), slice(0, r)
        job = None
        if host_tiers and r < B:
            job = st.host.submit(self.layer_idx, qg[on_host], self._host_regions(host_tiers, meta, True, on_host),
                                 scaling, keep, inv, row0=r)
        # T0 and the tail are one contiguous device buffer, attended whole (empty slots and columns masked)
        bias, dpos = st.device_view(self.cap0, self.tail_k.shape[2])
        parts = [partial(qg, self.dev_k, self.dev_v, bias, scaling, keep)]
        host_state = stream_state = None
        if host_tiers:
            pieces = []
            if r > 0:
                regions = self._host_regions(host_tiers, meta, False, streamed)
                sp, sparts, cs = host_tiers_partial(qg[streamed], regions, scaling, keep, query.dtype)
                stream_state = (sparts, cs, [x.pos for x in regions])
                self._release()
                pieces.append(sp)
            if job is not None:
                hp, host_state = st.host.result(job)
                pieces.append(hp)
            parts.append(pieces[0] if len(pieces) == 1 else
                         Partial(*(torch.cat([getattr(p, a) for p in pieces]) for a in ("o", "m", "l"))))
        out, fs = merge(parts)
        add_weights(st.scores, dpos, parts[0].e, fs[0], inv)
        if host_tiers:
            f_host = fs[-1]
            if stream_state is not None:
                for p, c, ps in zip(*stream_state):
                    add_weights(st.scores[streamed], ps, p.e, c * f_host[streamed], inv)
            if job is not None:
                st.host.post(self.layer_idx, host_state, f_host[on_host])
        return out.to(query.dtype)

    def _attend_fused(self, qg: torch.Tensor, host_tiers: list[int], meta: dict, scaling: float, inv: float
                      ) -> torch.Tensor:
        """The same step as the eager split path in one kernel call (CPU): T0 and the tail, then T1 and deq T2
        (host buffers or their staged copies), one softmax, scores added to the accumulator each region's tokens
        belong to (the host one for host-attended tiers). Returns (B, H, g, D) float32."""
        st = self.state
        bias, dpos = st.device_view(self.cap0, self.tail_k.shape[2])
        ks, vs, biases, poss, scores = [self.dev_k], [self.dev_v], [bias], [dpos], [st.scores]
        staged = [False]
        on_host = st.host_attn
        # streaming T1: the kernel stages it itself, block by block (see fused_cpu.attend); int8 T2 is staged
        # whole and dequantised on the device as on the eager path
        kernel_stages = T1 in host_tiers and not on_host and not st.t1_on_device
        if host_tiers:
            for x, r in zip(host_tiers, self._host_regions(host_tiers, meta, on_host, in_place=kernel_stages)):
                k, v = r.kv(qg.dtype)
                ks.append(k), vs.append(v), biases.append(r.bias), poss.append(r.pos)
                scores.append(st.scores_host if on_host else st.scores)
                staged.append(kernel_stages and x == T1)
            if on_host:
                st.host.jobs += 1
        out = fused_cpu.attend(qg, ks, vs, biases, poss, scores, inv, scaling, staged)
        if kernel_stages:
            t1 = self._host_tensors(tiers=(T1,))
            B, H, cap, D = self.k1.shape
            # staging this stream needs: one (row, kv-head) block per worker thread (the kernel's buffers are the
            # process's, shared by every cache, so their total is not this cache's)
            block = cap * D * self.k1.element_size()
            st.engine.count_streamed(sum(t.numel() * t.element_size() for t in t1.values()),
                                     fused_cpu.take_staging_seconds(), min(torch.get_num_threads(), B * H) * block)
        if host_tiers and not on_host and (T2 in host_tiers or not kernel_stages):
            self._release()
        return out

    def _host_regions(self, tiers: list[int], meta: dict, on_host: bool, rows: slice = slice(None),
                      in_place: bool = False) -> list[HostRegion]:
        """One region per tier in ``tiers``: host buffers (``on_host``) or their device copies, scored into the host
        or the device accumulator accordingly. ``in_place``: streamed, but T1 is read from host memory by a
        consumer that stages it itself (the fused CPU kernel); only T2 is copied here."""
        if on_host:
            src = self._host_tensors(rows)
        elif in_place:
            src = {**self._host_tensors(rows, (T1,)), **(self._staged(rows, (T2,)) if T2 in tiers else {})}
        else:
            src = self._staged(rows)
        out = []
        for x in tiers:
            pos, bias = meta[("host", x)] if on_host else meta[x]
            pos, bias = pos[rows], bias[rows]
            if x == T1:
                out.append(HostRegion(src["k1"], src["v1"], bias, pos))
            else:
                out.append(HostRegion(src["k2"], src["v2"], bias, pos, src["k2s"], src["v2s"]))
        return out

    def _attend_ordered(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The reference: every kept token gathered in position order, one softmax (bit-identical across HBM ratios)."""
        st = self.state
        B, Hq, _, D = query.shape
        k, v = self.assemble()
        H = k.shape[1]
        sv = st.step_view()
        out, p = ordered(query.reshape(B, H, Hq // H, D), k, v, sv["mask"], scaling)
        if st.retier_enabled:
            # s_i += mean over layers of mean over all query heads of the attention weight on i.
            w = p.sum(dim=(1, 2)) * st.inv_heads_layers
            st.scores.scatter_add_(1, sv["score_pos"], w.to(SCORE_DTYPE))
        return out

    def assemble(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept K and V of this layer in position order: two (B, H, K, D) views of the engine's work buffers."""
        st = self.state
        sv = st.step_view()
        K = sv["K"]
        if sv["k_main"] == 0 and self.tail_k.shape[2] == sv["cap"]:
            return self.tail_k[:, :, :K], self.tail_v[:, :, :K]  # nothing to assemble
        B, H, D = st.batch, self.dev_k.shape[1], self.dev_k.shape[3]
        wk, wv = st.engine.work_buffers((B, H, sv["cap"], D), self.dev_k.dtype)
        fk, fv = wk.view(-1, D), wv.view(-1, D)
        gather = sv["gather"]
        if st.layout.tiers[T0].count:
            src, dst = gather[T0]  # rows of the whole device buffer (T0 slots, then the tail)
            fk.index_copy_(0, dst, self.dev_k.reshape(-1, D).index_select(0, src))
            fv.index_copy_(0, dst, self.dev_v.reshape(-1, D).index_select(0, src))
        if self._host_tensors():
            dv = self._staged()
            if "k1" in dv and st.layout.tiers[T1].count:
                src, dst = gather[T1]
                fk.index_copy_(0, dst, dv["k1"].reshape(-1, D).index_select(0, src))
                fv.index_copy_(0, dst, dv["v1"].reshape(-1, D).index_select(0, src))
            if "k2" in dv and st.layout.tiers[T2].count:
                src, dst = gather[T2]
                fk.index_copy_(0, dst, dequantize(dv["k2"], dv["k2s"], wk.dtype).reshape(-1, D).index_select(0, src))
                fv.index_copy_(0, dst, dequantize(dv["v2"], dv["v2s"], wv.dtype).reshape(-1, D).index_select(0, src))
            self._release()
        km = sv["k_main"]
        wk[:, :, km:K].copy_(self.tail_k[:, :, : sv["t"]])
        wv[:, :, km:K].copy_(self.tail_v[:, :, : sv["t"]])
        return wk[:, :, :K], wv[:, :, :K]


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

    def reset(self) -> None:
        """Forget everything (for a new, unrelated prompt); the object stays usable."""
        for layer in self.layers:
            layer.reset()
        self.state.reset()

    def stats(self) -> dict[str, Any]:
        return cache_stats(self.state, self.layers)

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
    dev_alloc = sum(layer._device_bytes() for layer in layers if layer.is_initialized)
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
        "attention": st.attention,
        "kernel": {"requested": st.kernel, "current": ("fused" if st.fused else "eager")
                   if st.attention == "split" else None},
        "t1_attention": {"requested": st.t1_attention, "current": st.t1_mode if tokens["T1"] + tokens["T2"] else None,
                         "stream_rows": st.stream_rows, "reassignments": dict(st.t1_modes),
                         "host_jobs": st.host.jobs, "bandwidth": st.bandwidth},
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
        # resident real tokens at their peak (T0 + tail, summed over rows; comparable across policies) ...
        "peak_device_tokens": st.peak_device_tokens,
        # ... and the real buffers (capacity, all layers): T0 + tail; and with staging and work buffers
        "peak_device_kv_bytes": st.peak_device_kv_bytes,
        "peak_device_bytes": st.peak_device_bytes,
        "cuda_max_allocated_delta_bytes": (torch.cuda.max_memory_allocated(st.device) - st._cuda_base)
        if st._cuda_base is not None else None,
    }
