"""kvtier's CPU kernels in one home: the build recipe (build.py), the CPU probe (cpu.py), the C++ sources with their shared AMX header (csrc/), the small row ops (rows.py); imported by attention/ and step/, importing neither."""

from .build import decode_module, step_module
from .cpu import cpu_amx, cpu_bf16_native, cpu_isa, cpuinfo
from .rows import append_rows, argmax_rows

__all__ = ["append_rows", "argmax_rows", "cpu_amx", "cpu_bf16_native", "cpu_isa", "cpuinfo", "decode_module",
           "step_module"]
