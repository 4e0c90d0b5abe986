"""Grid expansion for ``kvtier sweep``: policies x ratios -> evaluation configurations.

- ``full`` runs once;
- ``tiered``: every hbm ratio x every eviction ratio (``quant_ratio`` fixed);
- ``evict``: every eviction ratio; ``quant``: every hbm ratio x eviction ratio;
- eviction baselines (``h2o``, ``rkv``, ``streaming_llm``): ``budget_ratio = 1 - eviction ratio``.
Extra per-policy parameters come from ``policy_params`` (e.g. from a config file).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..policies import get_policy
from .runner import EvalConfig


def expand_grid(model: str, benchmarks: list[str], policies: list[str], evict_ratios: list[float],
                hbm_ratios: list[float], quant_ratio: float = 0.0, policy_params: dict | None = None,
                **gen) -> list[EvalConfig]:
    policy_params = policy_params or {}
    cfgs = []
    for pol in policies:
        get_policy(pol)
    for bench in benchmarks:
        for pol in policies:
            extra = dict(policy_params.get(pol, {}))
            grid: list[dict] = []
            if pol == "full":
                grid = [{}]
            elif pol == "tiered":
                grid = [dict(hbm_ratio=h, evict_ratio=e, quant_ratio=quant_ratio) for e in evict_ratios for h in hbm_ratios
                        if h + e + quant_ratio <= 1 + 1e-9]
            elif pol == "evict":
                grid = [dict(evict_ratio=e) for e in evict_ratios]
            elif pol == "quant":
                grid = [dict(hbm_ratio=h, evict_ratio=e) for e in evict_ratios for h in hbm_ratios if h + e <= 1 + 1e-9]
            else:
                grid = [dict(budget_ratio=round(1.0 - e, 6)) for e in evict_ratios if e < 1]
            for params in grid:
                cfgs.append(EvalConfig(model=model, benchmark=bench, policy=pol, params={**extra, **params}, **gen))
    return cfgs


def load_config_file(path: str | Path) -> dict:
    """A sweep config (JSON or TOML) with the same keys as the CLI options, plus ``policy_params``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {p} does not exist")
    if p.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError("TOML sweep configs need Python >= 3.11; use a JSON file") from None

        return tomllib.loads(p.read_text())
    return json.loads(p.read_text())
