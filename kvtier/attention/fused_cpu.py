"""The fused CPU decode kernel's Python side (``kvtier/kernels/csrc/fused_decode_cpu.cpp``, built by :mod:`kvtier.kernels.build`): one call per layer and step.

On a CPU the split decode step is ~50 small eager ops per layer (partials, log-sum-exp merge, weight folds),
and their dispatch, not the arithmetic, is what puts ``tiered`` behind ``full`` (0.47 ms vs SDPA's 0.14 ms
per layer at 2K tokens with T1 in use, measured). The kernel attends every region as one softmax (float32 statistics) and adds
the merged weights to the score accumulators in the same call; :mod:`kvtier.attention.merge` stays the
reference it is tested against (and the path on CUDA, and wherever the kernel cannot be built). Where and how it
is built (once per machine, CPU kind and torch; ``KVTIER_KERNEL=eager`` never builds it): :mod:`kvtier.kernels.build`.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..config import KERNEL_MODES  # noqa: F401 (the kernel switch, checked in config; exported here)
from ..kernels.build import cpu_signature
from ..kernels.build import decode_module as _module
from ..kernels.rows import append_rows, argmax_rows  # noqa: F401 (the row ops live in kvtier.kernels.rows)

log = logging.getLogger(__name__)


def available() -> bool:
    """Whether the kernel is built (building it now if needed)."""
    return _module() is not None


def bf16_dots() -> bool:
    """Whether this build dots bfloat16 keys with AVX512-BF16 instructions (when the query is bf16-exact, as it
    is in a bf16 model) instead of widening them to float32: same products, float32 sums in another order."""
    mod = _module()
    return bool(mod is not None and mod.bf16_dots())


def amx_dots() -> bool:
    """Whether this build takes bfloat16 logits through AMX tiles (AMX-BF16 at build time, the tile state granted
    by the OS, not switched off by :func:`use_amx`): 16 keys x every query head of a group per tile product, K read in
    place. Same products as the VDPBF16PS path (bf16 pairs are exact in float32), float32 sums in the tile's order."""
    mod = _module()
    return bool(mod is not None and mod.amx_dots())


@contextlib.contextmanager
def use_amx(on: bool):
    """Within the block, AMX logits on or off for every thread (off: the VDPBF16PS path, the AMX path's reference
    in tests and A/B timings); restored to on afterwards."""
    mod = _module()
    if mod is None:
        yield
        return
    mod.set_amx(bool(on))
    try:
        yield
    finally:
        mod.set_amx(True)


def sdpa_is_faster(dtype: torch.dtype) -> bool:
    """Whether ``kernel="auto"`` leaves the ``full`` cache's step (one region, no scores) on torch's SDPA: bfloat16
    on CPUs with AMX tiles when this build cannot take its logits through them (:func:`amx_dots`), where oneDNN's
    SDPA multiplies on AMX and the two are about even (an Intel Xeon with AMX-BF16, one layer without scores,
    512-8192 tokens x batch 1 and 4: 0.96-1.06x SDPA's time, ``benchmarks/results/cpu_xeon_amx_2026-12-02/``).
    With AMX logits and prefetched K/V the kernel is the faster one there too (same machine, 2026-12-04:
    0.73-0.74x SDPA's time at 2048-8192 tokens x batch 1 and 4, even at 1 x 512; ``benchmarks/kernels/kernel_micro.py``,
    ``benchmarks/results/kernel_amx_prefetch_2026-12-04_xeon_amx/``), as it is elsewhere
    (AMD EPYC with AVX512-BF16: 0.69-0.84x in bfloat16; float32 everywhere). A rule by ISA and build, not a timing
    at start, so that one machine always runs one path (a reference policy's floats must not depend on load)."""
    return dtype == torch.bfloat16 and "amx_bf16" in cpu_signature().split() and not amx_dots()


def supports(dtype: torch.dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16)


def attend(qg: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], biases: list[torch.Tensor],
           poss: list[torch.Tensor], scores: list[torch.Tensor] | None, score_scale: float, scaling: float,
           staged: list[bool] | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of ``qg`` over the union of the regions, and (optionally) the score update.

    Args:
        qg: (B, H, g, D) queries grouped by kv-head: float32 or bfloat16 are read as they are (widened per head
            inside the kernel), any other float dtype is converted to float32 first.
        ks, vs: per region (B, H, C_r, D), float32 or bfloat16, last dim contiguous (strided views are fine).
        biases: per region (B, 1, 1, C_r) float32, 0 on kept columns and -inf elsewhere (masked columns are
            never read).
        poss: per region (B, C_r) int64 score positions.
        scores: per region the (B, N + 1) float64 accumulator its weights go to (regions may share one), or None.
        score_scale: factor on each weight (1 / (layers * query heads): the mean over layers and heads).
        staged: per region, whether it is streamed (``t1_attention="stream"``): each (b, h) block of its K, then
            of its V, is copied chunk by chunk (:func:`staged_rows` rows) into a staging buffer of the worker
            thread and read from there, the next chunk prefetched meanwhile, so the device-side copy is one chunk
            per thread rather than the layer's whole tier (:func:`take_staging_seconds`,
            :func:`staging_buffer_bytes`). Same floats as reading it in place.
        sinks: (H * g,) the model's sink logit per query head (gpt-oss), or None: it joins each softmax's
            maximum and denominator and brings no value (the eager path's ``merge.sink_partial``).
    Returns:
        (B, H, g, D) in ``qg``'s dtype (float32 for other dtypes), the normalised attention output: float32
        statistics and sums, a bfloat16 output rounded once (as ``.to(torch.bfloat16)`` would).
    """
    mod = _module()
    if mod is None:
        raise RuntimeError("the fused CPU decode kernel is not available (see the log for why)")
    if qg.dtype not in (torch.float32, torch.bfloat16):
        qg = qg.to(torch.float32)
    return mod.fused_decode(qg.contiguous(), ks, vs, biases, poss, scores or [],
                            float(score_scale), float(scaling), list(staged or []), _sinks(sinks))


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor:
    return _NO_SINKS if sinks is None else sinks.detach().to(torch.float32).contiguous()


_NO_SINKS = torch.empty(0)


def attend_rows(qg: torch.Tensor, calls: list[tuple], scaling: float, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Many one-row caches in one call (a continuous-batching step): row ``i`` does what :func:`attend` does for it
    alone with ``calls[i]``.

    Args:
        qg: (R, H, g, D) queries grouped by kv-head, float32 or bfloat16 (other float dtypes: converted).
        calls: per row ``(ks, vs, biases, poss, scores, score_scale)``, :func:`attend`'s arguments for that row
            (batch 1: K/V (1, H, C_r, D), one dtype for every row; ``scores`` None or one accumulator per region).
            No region is staged (streamed tiers are attended by :func:`attend`, which times the staging per call).
        sinks: (H * g,) the layer's sink logits (one model layer: the same for every row), or None.
    Returns:
        (R, H, g, D) in ``qg``'s dtype: row ``i`` bit for bit what :func:`attend` gives it alone, and each row's
        scores added in the same order; one parallel loop over every (row, kv-head) pair.
    """
    mod = _module()
    if mod is None:
        raise RuntimeError("the fused CPU decode kernel is not available (see the log for why)")
    if qg.dtype not in (torch.float32, torch.bfloat16):
        qg = qg.to(torch.float32)
    ks, vs, biases, poss, scores, scales = zip(*calls)
    return mod.fused_decode_rows(qg.contiguous(), list(ks), list(vs), list(biases), list(poss),
                                 [s or [] for s in scores], [float(x) for x in scales], float(scaling),
                                 _sinks(sinks))


def take_staging_seconds() -> float:
    """Seconds the kernel's workers spent copying staged blocks in the calls this thread made since its last take,
    divided by the threads that share the work (the copies run side by side, one block per worker at a time): the
    streaming time. Kept per calling thread, so caches decoding in different threads each take their own."""
    mod = _module()
    return 0.0 if mod is None else mod.take_staging_ns() / 1e9 / max(1, torch.get_num_threads())


def staged_rows(head_dim: int, dtype: torch.dtype) -> int:
    """Rows of a staged (b, h) block the kernel copies at a time for K/V of ``head_dim`` and ``dtype`` (~8 KiB,
    whole value tiles): a worker's staging buffer holds at most this many rows."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the fused CPU kernel is not available on this machine")
    return int(mod.staged_rows(head_dim, torch.empty(0, dtype=dtype).element_size()))


def staging_buffer_bytes() -> int:
    """Bytes held by the workers' staging buffers (each grows to the largest chunk it has staged)."""
    mod = _module()
    return 0 if mod is None else int(mod.staging_buffer_bytes())


__all__ = ["KERNEL_MODES", "attend", "attend_rows", "available", "amx_dots", "bf16_dots", "sdpa_is_faster",
           "staged_rows", "staging_buffer_bytes", "use_amx", "supports", "take_staging_seconds"]
