"""What the CPU reader says from /proc/cpuinfo: the ISA names and the CPU name records and benchmarks carry."""

from __future__ import annotations

import torch

from kvtier.kernels import cpu


def test_cpuinfo_reads_the_first_matching_line(fake_cpuinfo):
    fake_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 9R14\n"
                 "flags\t\t: fpu avx2 avx512f avx512_bf16\nprocessor\t: 1\n"
                 "model name\t: something else\n")
    assert cpu.cpuinfo("model name") == "AMD EPYC 9R14"
    assert cpu.cpuinfo("Features", "flags") == "fpu avx2 avx512f avx512_bf16"
    assert cpu.cpuinfo("no such key") is None
    assert cpu.cpu_name() == "AMD EPYC 9R14"
    assert cpu.cpu_isa() == "avx2 avx512f avx512_bf16"
    assert cpu.machine("cpu") == f"AMD EPYC 9R14 (avx2 avx512f avx512_bf16), {torch.get_num_threads()} threads"


def test_cpuinfo_without_the_file_falls_back_to_the_platform(fake_cpuinfo):
    import platform

    fake_cpuinfo(None)  # no such file: an OSError inside, never raised
    assert cpu.cpuinfo("flags") is None
    assert cpu.cpu_name() == (platform.processor() or platform.machine())
    assert cpu.cpu_isa() == platform.machine()


def test_a_cpu_without_avx2_says_so(fake_cpuinfo):
    fake_cpuinfo("model name\t: Intel Xeon\nflags\t\t: fpu sse sse2\n")
    assert cpu.cpu_isa() == "no avx2"


def test_the_file_is_read_once_per_process(fake_cpuinfo, monkeypatch):
    info = fake_cpuinfo("model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2\n")
    reads = []
    real_read = type(info).read_text
    monkeypatch.setattr(type(info), "read_text", lambda self, *a, **k: reads.append(self) or real_read(self, *a, **k))
    for _ in range(3):
        assert cpu.cpu_name() == "AMD EPYC 9R14" and cpu.cpu_isa() == "avx2"
    assert len(reads) == 1


def test_cpu_amx_reads_the_probe_or_the_flags(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert cpu.cpu_amx() is True
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert cpu.cpu_amx() is False
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.setattr(cpu, "cpuinfo", lambda *keys: "fpu avx512f amx_bf16 amx_tile")
    assert cpu.cpu_amx() is True
    monkeypatch.setattr(cpu, "cpuinfo", lambda *keys: "fpu avx2 avx512f avx512_bf16")
    assert cpu.cpu_amx() is False
