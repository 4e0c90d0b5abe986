"""The docs cannot drift from the code: generated reference blocks are current, every kvtier name they mention
imports, the README's Python example runs, and the module paths that moved still import."""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

from kvtier._moved import MOVED
from kvtier.cli.reference import BLOCKS, begin, splice

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_NAMES = {"kvtier.policy"}  # the request body's "kvtier" object and its fields (docs/SERVING.md)


@pytest.mark.parametrize("doc", ["CLI.md", "POLICIES.md", "GUIDE.md"])
def test_generated_reference_blocks_are_current(doc):
    text = (ROOT / "docs" / doc).read_text(encoding="utf-8")
    assert any(begin(name) in text for name in BLOCKS)
    assert splice(text) == text, f"docs/{doc} is stale: run `python -m kvtier.cli.reference`"


def test_every_kvtier_name_in_the_docs_resolves():
    names = sorted({m for d in DOCS for m in re.findall(r"\bkvtier(?:\.[A-Za-z_]\w*)+", d.read_text(encoding="utf-8"))}
                   - NOT_NAMES)
    assert "kvtier.make_cache" in names and len(names) > 8
    for name in names:
        parts = name.split(".")
        obj, i = None, len(parts)
        while i > 0:  # the longest importable prefix, then attributes
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    obj = importlib.import_module(".".join(parts[:i]))
                break
            except ModuleNotFoundError:
                i -= 1
        for attr in parts[i:]:
            assert hasattr(obj, attr), f"{name}: {'.'.join(parts[:i])} has no {attr!r}"
            obj = getattr(obj, attr)


def test_public_surface():
    import kvtier
    import kvtier.eval

    for name in ("make_cache", "load_model", "POLICIES", "get_policy", "prepare_model", "KVTierCache", "TierConfig",
                 "decode"):
        assert hasattr(kvtier, name) and name in kvtier.__all__
    assert callable(kvtier.eval.grade) and callable(kvtier.eval.extract_boxed)
    from kvtier.attention import prepare_model  # the old kvtier.attention module's names, from the package now
    from kvtier.cache import ATTENTION_MODES, T1_MODES, KVTierCache, TierState, TieredLayer, cache_stats  # noqa: F401
    from kvtier.eval.runner import validate_policy  # noqa: F401  (documented there before policies owned it)

    assert prepare_model is kvtier.prepare_model


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_module_paths_still_import_with_a_warning(old):
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(MOVED[old])):
        mod = importlib.import_module(old)
    assert mod is importlib.import_module(MOVED[old])


def test_the_readme_python_example_runs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    code = text.split("## In Python", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert len(code.strip().splitlines()) <= 10
    # the same lines on a tiny random model: no download, a few tokens
    code = code.replace('"deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"', '"random:tiny-qwen2", dtype="fp32", device="cpu"')
    code = code.replace("max_new_tokens=2048", "max_new_tokens=8")
    from kvtier.compat import cache_arg

    ns: dict = {}
    if cache_arg(importlib.import_module("kvtier").load_model("random:tiny-qwen2", device="cpu")[0]) != "cache":
        code = code.replace("cache=cache", "past_key_values=cache")  # transformers < 5.24 (test-compat's oldest)
    exec(compile(code, "README.md", "exec"), ns)
    assert sum(ns["cache"].stats()["tokens"].values()) > 0 and ns["tiers"].shape[0] == 1
    # custom_generate=kvtier.decode built the model's direct step, and it passed its check against the forward
    assert ns["model"].__dict__["_kvtier_direct"][1] is not None


def test_benchmarks_are_indexed_and_the_docs_paths_exist():
    """benchmarks/README.md lists every script of benchmarks/ by its path there (a newcomer finds each one); every
    `benchmarks/...` path the README and docs/ name exists (a `*` in one is a glob; one at a commit is git's)."""
    index = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.relative_to(ROOT / "benchmarks").as_posix() for p in (ROOT / "benchmarks").rglob("*")
                     if p.suffix in (".py", ".sh") and not {"results", "__pycache__"} & set(p.parts))
    assert len(scripts) > 20
    unlisted = [s for s in scripts if f"`{s}`" not in index]
    assert not unlisted, f"benchmarks/README.md does not list {unlisted}"
    missing = []
    for doc in DOCS + [ROOT / "benchmarks" / "README.md"]:
        # a path at a commit (`git show <sha>:benchmarks/...`) is git's to find, not the tree's
        for path in set(re.findall(r"(?<![:\w/])benchmarks/[A-Za-z0-9_./*<>-]*[A-Za-z0-9_*]", doc.read_text(encoding="utf-8"))):
            if "<" in path:  # a pattern a command fills in (results/peer_<date>...)
                continue
            if not list(ROOT.glob(path)) and not (ROOT / path).exists():
                missing.append(f"{doc.name}: {path}")
    assert not missing, missing
