"""Load a script of ``benchmarks/`` as a module, for the tests of its functions (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def benchmark_script(name: str):
    """``benchmarks/<name>.py`` imported afresh as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
