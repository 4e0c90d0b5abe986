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


def _cpu_has(probes: tuple[str, ...], flags: tuple[str, ...]) -> bool:
    """Whether any of torch's CPU probes ``probes`` (``torch.cpu._is_*_supported``, where this build has them) says
    yes; on builds without them (or where they fail), whether any of ``flags`` is in ``/proc/cpuinfo``'s flags."""
    known = [p for p in (getattr(torch.cpu, n, None) for n in probes) if callable(p)]
    if known:
        try:
            return any(bool(p()) for p in known)
        except RuntimeError:
            pass
    have = (cpuinfo("flags", "Features") or "").split()  # older builds without the probes: the kernel's own flags
    return any(f in have for f in flags)


def cpu_bf16_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX-BF16 or AVX512-BF16). Without it PyTorch converts bf16
    to fp32 inside every matmul, and fp32 is the faster choice (measured: see the README's dtype rule)."""
    return _cpu_has(("_is_amx_tile_supported", "_is_avx512_bf16_supported"), ("amx_bf16", "avx512_bf16"))


def cpu_amx() -> bool:
    """Whether this CPU has AMX tiles (Sapphire Rapids and later): bf16 matmuls of many rows at the same rate from
    hundreds to thousands of rows, which is what the serving prefill's step size rests on."""
    return _cpu_has(("_is_amx_tile_supported",), ("amx_tile",))


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
