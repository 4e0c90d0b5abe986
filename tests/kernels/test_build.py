"""The kernels' build recipe: the -march target checked and in the build's name, every header it compiles in its cache key, one compile reused by another checkout, a killed build's lock taken over."""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.kernels import build as kbuild


def test_the_kernel_target_is_checked_and_names_the_build(monkeypatch):
    monkeypatch.delenv("KVTIER_KERNEL_MARCH", raising=False)
    assert kbuild.march() == "native" and "-march=native" in kbuild.flags()
    native = kbuild.build_name()
    monkeypatch.setenv("KVTIER_KERNEL_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in kbuild.flags() and kbuild.build_name() != native
    for bad in ("native -O0", "-march=native", "x86;ls"):
        monkeypatch.setenv("KVTIER_KERNEL_MARCH", bad)
        with pytest.raises(ValueError, match="KVTIER_KERNEL_MARCH must be a gcc -march= target"):
            kbuild.build_name()


_TINY = """#include <torch/extension.h>
torch::Tensor twice(torch::Tensor x) { return x * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


@pytest.mark.heavy
def test_a_build_is_compiled_once_and_reused_from_another_checkout(tmp_path, caplog):
    """The build compiles its directory's copy of the source: the same source from another path (another clone)
    loads the build without compiling again; only a compile is announced."""
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "build"
    for d in (a, b, out):
        d.mkdir()
    (a / "tiny.cpp").write_text(_TINY)
    name = f"kvtier_test_tiny_{abs(hash(str(tmp_path))) % 10**8}"
    with caplog.at_level("WARNING", logger="kvtier.kernels.build"):
        mod = kbuild.build(name, a / "tiny.cpp", out)
    assert torch.equal(mod.twice(torch.ones(3)), torch.full((3,), 2.0))
    assert any("compiling the CPU kernels of tiny.cpp" in r.getMessage() for r in caplog.records)
    so = out / f"{name}.so"
    built = so.stat().st_mtime_ns
    (b / "tiny.cpp").write_text(_TINY)  # another checkout: a new path and a newer mtime, the same text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtier.kernels.build"):
        kbuild.build(name, b / "tiny.cpp", out)
    assert not caplog.records and so.stat().st_mtime_ns == built


def test_the_cache_key_covers_the_headers_a_build_compiles(tmp_path):
    """A header beside the source is part of the build's name: change its text (or add one) and the name, so the
    build directory and the build, are new (the build compiles the directory's own copies of source and headers);
    both real sources build with the shared AMX header."""
    assert [h.name for h in kbuild.headers(kbuild.DECODE_SRC)] == ["kvtier_amx.h"]
    assert kbuild.headers(kbuild.STEP_SRC) == kbuild.headers(kbuild.DECODE_SRC)
    (tmp_path / "k.cpp").write_text(_TINY.replace("#include <torch/extension.h>", '#include <torch/extension.h>\n#include "k.h"'))
    (tmp_path / "k.h").write_text("#pragma once\n// one\n")
    first = kbuild.build_name(tmp_path / "k.cpp", "kvtier_test")
    assert kbuild.build_name(tmp_path / "k.cpp", "kvtier_test") == first
    (tmp_path / "k.h").write_text("#pragma once\n// two\n")
    second = kbuild.build_name(tmp_path / "k.cpp", "kvtier_test")
    (tmp_path / "other.h").write_text("#pragma once\n")
    assert len({first, second, kbuild.build_name(tmp_path / "k.cpp", "kvtier_test")}) == 3


_LOAD_DECODE = ("import logging, sys; logging.basicConfig(level=logging.WARNING, stream=sys.stderr)\n"
                "from kvtier.kernels import build as b\n"
                "n = b.build_name(); b.build(n, b.DECODE_SRC, b.build_dir(n)); print('loaded')")


@pytest.mark.skipif(kbuild.decode_module() is None, reason="no compiler: the kernels cannot be built here")
def test_a_lock_a_killed_build_left_is_taken_over_and_a_live_build_is_waited_for():
    """A torch build ``lock`` left in the directory (what a build killed mid-way leaves) is removed by the next
    build, which loads at once instead of waiting forever; a build while another process holds the directory waits,
    says for whom, and goes on once it is released."""
    import subprocess
    import sys
    import threading
    import time

    directory = kbuild.build_dir(kbuild.build_name())
    (directory / "lock").touch()
    run = subprocess.run([sys.executable, "-c", _LOAD_DECODE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "loaded" in run.stdout, run.stderr
    assert "the build lock a killed build left behind" in run.stderr and not (directory / "lock").exists()

    lines: list[str] = []
    with kbuild.builder(directory):  # this process is building: another waits for it
        proc = subprocess.Popen([sys.executable, "-c", _LOAD_DECODE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        deadline = time.time() + 120
        while time.time() < deadline and not any("waiting for the kernel build" in x for x in lines):
            time.sleep(0.1)
        assert proc.poll() is None, lines  # still waiting: it did not go past the lock
    assert proc.wait(timeout=300) == 0 and proc.stdout.read().strip() == "loaded", lines
    reader.join(timeout=10)
    assert any(f"waiting for the kernel build in progress in {directory} (PID {os.getpid()})" in x for x in lines), lines
