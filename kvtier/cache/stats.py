"""What a tiered cache reports (``KVTierCache.stats()``): tokens and bytes per tier, transfers, peaks, the T1 mode."""

from __future__ import annotations

from typing import Any

import torch

from ..tiers.planner import T0, T1, T2, T3
from ..tiers.quant import int8_bytes_per_token
from .state import TierState


def sliding_stats(sliding: list) -> dict[str, Any] | None:
    """A hybrid model's sliding layers: how many, their window, the device bytes their windows hold now (not in the
    tiers' counts and bytes, which are the full-attention layers'); None without any."""
    if not sliding:
        return None
    return {"layers": len(sliding), "window": sliding[0].window, "device_bytes": sum(s.device_bytes() for s in sliding)}


def cache_stats(st: TierState, layers, sliding: list | None = None) -> dict[str, Any]:
    """Token counts, bytes and transfer counters, summed over the batch (padding excluded); ``layers``: the policy's
    (full-attention) layers, ``sliding``: a hybrid model's sliding-window layers."""
    empty = {
        "tokens": {"T0": 0, "T1": 0, "T2": 0, "T3": 0},
        "bytes": {"T0": 0, "T1": 0, "T2": 0},
        "transfer": {"h2d_bytes": 0, "d2h_bytes": 0, "seconds": 0.0, "stream_h2d_bytes": 0, "migration_h2d_bytes": 0, "migration_d2h_bytes": 0},
        "retiers": 0,
    }
    if st.batch is None:
        return {**empty, "policy": st.policy, "decode_steps": 0, "logical_tokens": 0, "sliding": sliding_stats(sliding)}
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
        "cuda_max_allocated_delta_bytes": (st.engine.seam.max_memory_allocated(st.device) - st._cuda_base)
        if st._cuda_base is not None else None,
        "sliding": sliding_stats(sliding),
    }
