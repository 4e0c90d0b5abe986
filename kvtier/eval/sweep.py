"""Grid expansion for ``kvtier sweep``: policies x ratios -> evaluation configurations.

Each policy turns the shared axes into its own points (``Policy.grid``); the built-in ones:

- ``full`` runs once;
- ``tiered``: every hbm ratio x every eviction ratio (``quant_ratio`` fixed);
- ``evict``: every eviction ratio; ``quant``: every hbm ratio x eviction ratio;
- eviction baselines (family ``baseline``: ``h2o``, ``rkv``, ``snapkv_decode``, ``streaming_llm``, ``snapkv``), by
  ``compare``:

  - ``equal-eviction``: ``budget_ratio = 1 - eviction ratio`` (the same share of tokens destroyed);
  - ``equal-memory``: for every hbm ratio h, ``budget_ratio = h, budget_floor = tiered's recent_window`` — the
    device tokens the hierarchy keeps in T0 at h (``max(|prompt + recent window|, floor(h * N))``), which the
    baseline spends by its own score. Not for ``snapkv`` (its budget covers the prompt only);
  - every ``budget_tokens`` value: an absolute budget (the R-KV code's ``--kv_budget``).

Extra per-policy parameters come from ``policy_params`` (e.g. from a config file).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..policies import COMPARISONS, POLICIES, GridAxes, get_policy, of_family
from .runner import EvalConfig



def parse_compare(value) -> tuple[str, ...]:
    """``"equal-eviction"``, ``"equal-memory"``, ``"both"`` or a comma-separated / list of the first two."""
    items = value if isinstance(value, (list, tuple)) else [x.strip() for x in str(value).split(",") if x.strip()]
    out: list[str] = []
    for x in items:
        for y in (COMPARISONS if x == "both" else (x,)):
            if y not in COMPARISONS:
                raise ValueError(f"--compare must be equal-eviction, equal-memory or both (comma-separated), got {x!r}")
            if y not in out:
                out.append(y)
    if not out:
        raise ValueError("--compare needs at least one of equal-eviction, equal-memory")
    return tuple(out)


def expand_grid(model: str, benchmarks: list[str], policies: list[str], evict_ratios: list[float],
                hbm_ratios: list[float], quant_ratio: float = 0.0, policy_params: dict | None = None,
                compare=("equal-eviction",), budget_tokens=(), skipped: list[str] | None = None,
                **gen) -> list[EvalConfig]:
    """Every configuration of the grid, each validated (names and values) before anything runs.

    Tiered/quant points whose ratios sum over 1 are left out and described in ``skipped``; a value outside
    [0, 1] is an error, and so is a policy left with no point at all.
    """
    policy_params = policy_params or {}
    if not isinstance(policy_params, dict) or not all(isinstance(v, dict) for v in policy_params.values()):
        raise ValueError("policy_params must map a policy name to a mapping of its parameters")
    for pol in policy_params:
        get_policy(pol)
    compare = parse_compare(compare)
    for flag, xs in (("--evict-ratio", evict_ratios), ("--hbm-ratio", hbm_ratios), ("--quant-ratio", [quant_ratio])):
        for x in xs:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 <= x <= 1:
                raise ValueError(f"{flag} values must be numbers in [0, 1], got {x!r}")
    if not benchmarks or not policies:
        raise ValueError("a sweep needs at least one --benchmark and one --policy")
    for k in budget_tokens:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"--budget-tokens must be integers >= 1, got {k!r}")
    for pol in policies:
        get_policy(pol)
    hierarchy = [POLICIES[n] for n in of_family("hierarchy")]
    # equal memory floors a baseline at the device tokens the hierarchy keeps whatever its ratios
    floor = hierarchy[0].memory_floor(policy_params.get(hierarchy[0].name, {})) if hierarchy else None
    axes = GridAxes(evict_ratios=tuple(evict_ratios), hbm_ratios=tuple(hbm_ratios), quant_ratio=quant_ratio,
                    compare=compare, budget_tokens=tuple(budget_tokens), memory_floor=floor)
    cfgs = []
    for bench in benchmarks:
        for pol in policies:
            extra = dict(policy_params.get(pol, {}))
            grid, left_out = get_policy(pol).grid(axes)
            if skipped is not None:
                skipped += left_out
            if not grid:
                raise ValueError(f"policy {pol!r} has no grid point: every ratio combination is out of range "
                                 "(eviction 1 leaves nothing for the baselines; tiered needs hbm + evict + quant <= 1)")
            for params in grid:
                cfgs.append(EvalConfig(model=model, benchmark=bench, policy=pol, params={**extra, **params}, **gen))
    return cfgs


GLOBAL_KEYS = ("model", "data_dir", "batch_size", "device", "dtype")  # one model load, one batching for the run


def config_parts(file: dict, where: str = "--config") -> list[dict]:
    """The sub-grids of a sweep config: without ``parts``, the file itself; with ``parts`` (a list of mappings),
    each part is the file's top-level keys overridden by the part's own (``policy_params`` merged per policy).
    The run shares one model and batch size, so parts may not set those."""
    parts = file.get("parts")
    top = {k: v for k, v in file.items() if k != "parts"}
    if parts is None:
        return [top]
    if not isinstance(parts, list) or not parts or not all(isinstance(x, dict) for x in parts):
        raise ValueError(f"{where}: parts must be a non-empty list of objects (each a sub-grid's options)")
    out = []
    for i, part in enumerate(parts):
        bad = sorted(set(part) & set(GLOBAL_KEYS + ("parts",)))
        if bad:
            raise ValueError(f"{where}: parts[{i}] sets {bad}; those hold for the whole run (set them at the top level)")
        pp = {pol: dict(v) for pol, v in (top.get("policy_params") or {}).items()}
        for pol, v in (part.get("policy_params") or {}).items():
            if not isinstance(v, dict):
                raise ValueError(f"{where}: parts[{i}].policy_params.{pol} must be a mapping of parameters")
            pp[pol] = {**pp.get(pol, {}), **v}
        out.append({**top, **part, "policy_params": pp})
    return out


def load_config_file(path: str | Path) -> dict:
    """A sweep config (JSON or TOML) with the same keys as the CLI options, plus ``policy_params``."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ValueError("TOML sweep configs need Python >= 3.11; use a JSON file") from None
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except UnicodeDecodeError as e:
        raise ValueError(f"--config {p} is not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {p} line {e.lineno}: not valid JSON ({e.msg})") from None
    except Exception as e:  # tomllib.TOMLDecodeError
        if type(e).__name__ == "TOMLDecodeError":
            raise ValueError(f"--config {p}: not valid TOML ({e})") from None
        raise
    if not isinstance(data, dict):
        raise ValueError(f"--config {p} must hold an object of sweep options, got {type(data).__name__}")
    return data
