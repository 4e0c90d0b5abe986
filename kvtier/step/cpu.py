"""What this CPU offers the decode step: native bf16 matmuls (the dtype and packing rules) and its vector ISA."""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=1)
def _cpuinfo_lines() -> tuple[str, ...]:
    """``/proc/cpuinfo``'s lines, read once per process (on a many-core host the file is hundreds of KB, and the
    CPU does not change under a running process); empty where there is no such file."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def cpuinfo(*keys: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line starting with one of ``keys`` (stripped), or None where there
    is no such line or no such file (one reader for the ISA probes, the names records carry and the kernel's build key)."""
    for line in _cpuinfo_lines():
        if line.startswith(keys):
            return line.split(":", 1)[1].strip()
    return None


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX-BF16 or AVX512-BF16). Without it PyTorch converts bf16
    to fp32 inside every matmul, and fp32 is the faster choice (measured: see the README's dtype rule)."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    known = [p for p in probes if callable(p)]
    if known:
        try:
            return any(bool(p()) for p in known)
        except RuntimeError:
            pass
    flags = (cpuinfo("flags", "Features") or "").split()  # older builds without the probes: the kernel's own flags
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_amx() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later): bf16 matmuls of many rows at the same rate from
    hundreds to thousands of rows, which is what the serving prefill's step size rests on."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    if callable(probe):
        try:
            return bool(probe())
        except RuntimeError:
            pass
    return "amx_tile" in (cpuinfo("flags", "Features") or "").split()


def cpu_isa() -> str:
    """The vector extensions a benchmark record names to say which CPU kind it ran on (AVX2-only, AVX512-BF16, AMX)."""
    line = cpuinfo("flags", "Features")
    if line is None:
        return platform.machine()
    flags = line.split()
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "no avx2"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform string."""
    return cpuinfo("model name") or platform.processor() or platform.machine()


def machine(device: torch.device | str = "cpu") -> str:
    """One line naming what a measurement or a record ran on, e.g. ``AMD EPYC (avx2 avx512f avx512_bf16), 2 threads``
    or a GPU's name: bf16 results round differently on AMX, AVX512-BF16 and AVX2-only CPUs, so records say which."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({cpu_isa()}), {torch.get_num_threads()} threads"
