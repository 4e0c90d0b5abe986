"""What the CPU reader says from /proc/cpuinfo: the ISA names and the CPU name records and benchmarks carry."""

from __future__ import annotations

import torch

from kvtier.step import cpu


def _fake_cpuinfo(monkeypatch, tmp_path, text: str | None):
    info = tmp_path / "cpuinfo"
    if text is not None:
        info.write_text(text)
    real = cpu.Path
    monkeypatch.setattr(cpu, "Path", lambda p, *a: info if str(p) == "/proc/cpuinfo" else real(p, *a))


def test_cpuinfo_reads_the_first_matching_line(monkeypatch, tmp_path):
    _fake_cpuinfo(monkeypatch, tmp_path, "processor\t: 0\nmodel name\t: AMD EPYC 9R14\n"
                                         "flags\t\t: fpu avx2 avx512f avx512_bf16\nprocessor\t: 1\n"
                                         "model name\t: something else\n")
    assert cpu.cpuinfo("model name") == "AMD EPYC 9R14"
    assert cpu.cpuinfo("Features", "flags") == "fpu avx2 avx512f avx512_bf16"
    assert cpu.cpuinfo("no such key") is None
    assert cpu.cpu_name() == "AMD EPYC 9R14"
    assert cpu.cpu_isa() == "avx2 avx512f avx512_bf16"
    assert cpu.machine("cpu") == f"AMD EPYC 9R14 (avx2 avx512f avx512_bf16), {torch.get_num_threads()} threads"


def test_cpuinfo_without_the_file_falls_back_to_the_platform(monkeypatch, tmp_path):
    import platform

    _fake_cpuinfo(monkeypatch, tmp_path, None)  # no such file: an OSError inside, never raised
    assert cpu.cpuinfo("flags") is None
    assert cpu.cpu_name() == (platform.processor() or platform.machine())
    assert cpu.cpu_isa() == platform.machine()


def test_a_cpu_without_avx2_says_so(monkeypatch, tmp_path):
    _fake_cpuinfo(monkeypatch, tmp_path, "model name\t: Intel Xeon\nflags\t\t: fpu sse sse2\n")
    assert cpu.cpu_isa() == "no avx2"
