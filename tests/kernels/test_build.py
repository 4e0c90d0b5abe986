"""The kernels' build recipe: the -march target checked and in the build's name, every header it compiles in its cache key, one compile reused by another checkout."""

from __future__ import annotations

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
