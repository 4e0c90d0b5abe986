"""glibc's malloc told to keep freed activation-sized blocks, so that a CPU prefill does not page-fault every layer.

Why: glibc serves an allocation above its mmap threshold (128 KiB, raised on its own up to 32 MiB) with fresh
pages from the kernel and gives them back on free. A prefill's activations are tens of MB (2,025 tokens of the
0.5B model: the MLP's gate/up product is 39 MB, its SiLU and product 20 MB each), allocated and freed in every
layer, so every layer touches ~100 MB of new pages; in a KVM guest each fault costs microseconds. Measured on a
2-core AMX Xeon guest, one packed step of 21 GSM8K prompts (2,025 tokens, bf16): 1877 ms with glibc's defaults,
1356 ms with the thresholds below (medians of 3, ``benchmarks/serve/ttft_burst.py --prefill-only``, results in
``benchmarks/results/ttft_burst_2026-12-04_xeon_amx/``). Decode steps allocate little and do not change.

What: :func:`keep_freed_memory` raises the mmap threshold to 256 MiB (blocks below it come from malloc's heaps and
are reused) and the trim threshold to 512 MiB (freed memory at a heap's top is kept up to that). The cost is that
the process keeps up to that much freed memory mapped; blocks above 256 MiB (large KV buffers) are still mapped
and unmapped as before. Numbers do not change: only where the bytes come from.

It is process-wide, so it runs only where kvtier owns the CPU step (:func:`kvtier.step.pack_linears` packs a
model: ``linear`` not ``eager``), once, and ``KVTIER_MALLOC=system`` leaves glibc's defaults alone. Elsewhere than
glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

from ..env import SWITCHES, choice

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20
MALLOC_MODES = SWITCHES["KVTIER_MALLOC"].choices  # keep, system

_applied: bool | None = None  # None: not tried yet; True/False: what the one try gave


def malloc_mode() -> str:
    """``$KVTIER_MALLOC``: ``keep`` (the default) or ``system``."""
    return choice("KVTIER_MALLOC")


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds (see the module doc) once per process; returns whether they are set.
    Does nothing with ``KVTIER_MALLOC=system`` or without glibc."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if malloc_mode() == "system" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
    if ok:
        log.info("glibc malloc keeps freed blocks below %d MiB (KVTIER_MALLOC=system to leave its defaults)",
                 MMAP_THRESHOLD >> 20)
    _applied = ok
    return ok
