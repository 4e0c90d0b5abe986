"""The transformers compatibility layer (kvtier/compat.py): the installed release is in the tested range, the
cache reaches the model under the name its forward takes, and the registered attention really runs (a fallback
to plain SDPA would leave every score at zero)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers
from conftest import prompt_ids
from transformers import DynamicCache

import kvtier
from kvtier import compat


def _v(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", s)[:3])


def test_installed_transformers_is_in_the_stated_range():
    assert _v(compat.OLDEST) <= _v(transformers.__version__) <= _v(compat.NEWEST)
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    lo, hi = re.search(r'"transformers>=([\d.]+),<([\d.]+)"', pyproject).groups()
    assert _v(lo) == _v(compat.OLDEST)[:2] and _v(compat.NEWEST) < _v(hi)


def test_cache_argument_name_is_the_forward_s(qwen2):
    import inspect

    params = inspect.signature(type(qwen2).forward).parameters
    assert compat.cache_arg(qwen2) in params
    assert compat.cache_arg(qwen2) == ("cache" if "cache" in params else "past_key_values")


def test_a_short_generate_goes_through_kvtier_attention(qwen2):
    ids = prompt_ids(2, 12, seed=4)
    ref = qwen2.generate(ids, attention_mask=torch.ones_like(ids), **compat.cache_kw(qwen2, DynamicCache(config=qwen2.config)),
                         max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
    for policy, params in (("full", {}), ("tiered", {"hbm_ratio": 0.3, "evict_ratio": 0.0, "retier_interval": 8, "recent_window": 4, "protect_prompt": False,
                                                      "attention": "ordered"})):
        cache = kvtier.make_cache(policy, qwen2, **params)
        out = qwen2.generate(ids, attention_mask=torch.ones_like(ids), **compat.cache_kw(qwen2, cache),
                             max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.equal(out, ref), policy
        assert cache.stats()["decode_steps"] == 19
        if policy == "tiered":
            assert cache.stats()["tokens"]["T1"] > 0 and float(cache.scores().sum()) > 0  # kvtier's attention ran
    h2o = kvtier.make_cache("h2o", qwen2, budget_ratio=0.5)
    qwen2.generate(ids, attention_mask=torch.ones_like(ids), **compat.cache_kw(qwen2, h2o), max_new_tokens=20,
                   do_sample=False, pad_token_id=0)
    assert h2o.stats()["tokens"]["T3"] > 0  # the per-head cache compressed: its attention ran


def test_hand_over_is_tied_to_the_key_tensor():
    a, b = torch.zeros(1), torch.zeros(1)
    compat.hand_over("layer", a)
    assert compat.take_over(b) is None  # another tensor: never another cache's layer
    assert compat.take_over(a) is None  # and the hand-over is gone after one look
    compat.hand_over("layer", a)
    assert compat.take_over(a) == "layer"


def test_the_source_needs_no_python_newer_than_3_10():
    """pyproject says Python 3.10 - 3.12; only 3.11 runs here, so the 3.10 floor is checked statically (vermin:
    every stdlib module, function and syntax the code uses). tomllib (3.11) is the one exception, imported behind an
    ImportError guard that names the alternative (a JSON config)."""
    import subprocess
    import sys

    import pytest

    pytest.importorskip("vermin")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips", "--violations", "-t=3.10-", "--eval-annotations",
                          "--exclude", "tomllib", "kvtier", "tests", "benchmarks"], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    sweep = (root / "kvtier" / "eval" / "sweep.py").read_text()
    assert re.search(r"try:\n\s+import tomllib\n\s+except ImportError:", sweep)
