"""What the CPU reader says from /proc/cpuinfo: the ISA names and the CPU name records and benchmarks carry."""

from __future__ import annotations

import pytest
import torch

from kvtier.step import cpu


@pytest.fixture(autouse=True)
def _fresh_read():
    """The reader keeps the file's lines for the process: each test reads its own fake, and later tests the real one."""
    cpu._cpuinfo_lines.cache_clear()
    yield
    cpu._cpuinfo_lines.cache_clear()


def _fake_cpuinfo(monkeypatch, tmp_path, text: str | None):
    info = tmp_path / "cpuinfo"
    if text is not None:
        info.write_text(text)
    real = cpu.Path
    monkeypatch.setattr(cpu, "Path", lambda p, *a: info if str(p) == "/proc/cpuinfo" else real(p, *a))
    return info


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


def test_the_file_is_read_once_per_process(monkeypatch, tmp_path):
    info = _fake_cpuinfo(monkeypatch, tmp_path, "model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2\n")
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
