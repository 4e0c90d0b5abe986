"""Load a script of ``benchmarks/`` as a module, for the tests of its functions (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def benchmark_script(name: str):
    """``benchmarks/<subject>/<name>.py`` (``name`` may name its folder too: ``peer/run``) imported afresh as a
    module."""
    found = [p for p in (ROOT / "benchmarks").rglob(f"{name}.py") if "results" not in p.parts]
    if len(found) != 1:
        raise LookupError(f"benchmarks/**/{name}.py: found {len(found)} scripts, expected one")
    spec = importlib.util.spec_from_file_location(Path(name).name, found[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
