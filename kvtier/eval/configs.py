"""What a record says about its configuration: parameters with defaults, the comparison it belongs to, its eviction ratio and device memory."""

from __future__ import annotations

import json
from collections import defaultdict

from ..policies import get_policy

_GEN_KEYS = ("benchmark", "model", "max_new_tokens", "temperature", "top_p", "seed")
_IDENTITY_KEYS = ("model_fingerprint", "dtype", "device")


def device_tokens(r: dict) -> float:
    """Device KV tokens of one sequence at its batch's peak (``peak_device_tokens`` / batch size); records written
    before the peak was recorded give the end state (T0)."""
    peak = r.get("peak_device_tokens")
    if peak is not None and r.get("batch_size"):
        return peak / r["batch_size"]
    return r["tier_tokens"]["T0"]


def device_kv_bytes(r: dict) -> float:
    """Device KV bytes of one sequence at its batch's peak: :func:`device_tokens` x the model's KV bytes per token
    (from the record's own tier bytes). Compares policies by what they keep resident, not by how each cache
    sizes its buffers."""
    t = r["tier_tokens"]["T0"]
    return device_tokens(r) * (r["tier_bytes"]["T0"] / t if t else 0.0)


def comparison_base(r: dict) -> tuple:
    """What a configuration is compared within: benchmark, model (and weights, dtype, device), generation."""
    ki = r.get("key_inputs") or {}
    return tuple(r.get(k) for k in _GEN_KEYS) + tuple(json.dumps(ki.get(k)) for k in _IDENTITY_KEYS)


def full_params(r: dict) -> dict:
    """The configuration's parameters with defaults filled in (older records: as given, defaults added here)."""
    ki = r.get("key_inputs") or {}
    if isinstance(ki.get("params"), dict):
        return ki["params"]
    try:
        return {**get_policy(r["policy"]).params(), **(r.get("params") or {})}
    except (ValueError, KeyError):
        return dict(r.get("params") or {})


def differing_fields(records: list[dict]) -> dict[str, list]:
    """Key inputs that differ between configurations of one report (what sets the rows apart)."""
    values: dict[str, set] = defaultdict(set)
    for r in records:
        for k, v in (r.get("key_inputs") or {}).items():
            if k != "params":
                values[k].add(json.dumps(v, sort_keys=True))
    return {k: sorted(json.loads(v) for v in vs) for k, vs in values.items() if len(vs) > 1}


def eviction_ratio(policy: str, params: dict) -> float | None:
    """The configured eviction ratio of a configuration (:meth:`kvtier.policies.Policy.eviction_ratio`; None for
    a policy this installation does not know)."""
    try:
        return get_policy(policy).eviction_ratio(params)
    except ValueError:
        return None


def comparison(policy: str, params: dict, given: dict | None = None) -> str:
    """Which comparison a configuration belongs to (how its budget was set), as its policy labels it
    (:meth:`kvtier.policies.Policy.comparison`); ``given``: the parameters as the run set them."""
    try:
        return get_policy(policy).comparison(params, given)
    except ValueError:
        return "–"


def family(policy: str) -> str | None:
    try:
        return get_policy(policy).family
    except ValueError:
        return None


_SHOWN = ("hbm_ratio", "evict_ratio", "budget_ratio", "budget_floor", "budget_tokens")  # columns of their own


def settings(given: dict) -> str:
    """The parameters a configuration set beyond the ratio and budget columns (``protect_prompt=False``,
    ``attention=ordered``, ...): what tells two rows with the same ratios apart."""
    return ", ".join(f"{k}={v}" for k, v in sorted(given.items())
                     if k not in _SHOWN and v is not None and not (k == "quant_ratio" and v == 0))
