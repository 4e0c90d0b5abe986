"""glibc's thresholds for the CPU step (kvtier.step.malloc): set once where kvtier packs a model, never with KVTIER_MALLOC=system."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

PROBE = """
import torch
from kvtier.models import random_model
from kvtier.step import malloc, pack_linears
print("before", malloc._applied)
m = random_model("tiny-qwen2", seed=0)
n = pack_linears(m, "{mode}")
print("packed", n > 0, "applied", malloc._applied, "again", malloc.keep_freed_memory())
"""


def _run(mode: str, env_mode: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_MALLOC"}
    if env_mode is not None:
        env["KVTIER_MALLOC"] = env_mode
    out = subprocess.run([sys.executable, "-c", PROBE.format(mode=mode)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.heavy
@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt: Linux with glibc only")
def test_set_when_kvtier_packs_and_only_then():
    from kvtier.step.linear import packable

    import torch

    if not packable(torch.float32):
        pytest.skip("this torch build has no oneDNN: nothing is packed")
    assert "before None" in _run("packed", None)
    assert "packed True applied True again True" in _run("packed", None)
    assert "packed True applied False again False" in _run("packed", "system")  # the switch
    assert "applied None" in _run("eager", None)  # eager: the process is left as it was


def test_bad_mode_is_one_clear_error(monkeypatch):
    from kvtier.step import malloc

    monkeypatch.setenv("KVTIER_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match=r"KVTIER_MALLOC must be one of keep \| system, got 'jemalloc'"):
        malloc.malloc_mode()
