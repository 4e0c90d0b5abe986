from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Deterministic property tests: the same examples on every run and in CI (no example database either).
settings.register_profile("kvtier", derandomize=True, database=None)
settings.load_profile("kvtier")

import kvtier
from kvtier.compat import cache_kw
from kvtier.models import random_model

REPO = Path(__file__).resolve().parents[1]  # the checkout (tests/ lies one level below it)

# Under pytest-xdist (`make test` runs two workers) each worker takes its share of the cores, and so do the servers
# and tools its tests start: two workers each threading over every core would oversubscribe them (4-10x slower).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


def _find_data_dir() -> Path:
    """The shared benchmark data (never copied into the repo): $KVTIER_DATA_DIR, else a `shared/data` beside
    the checkout or any folder above it."""
    env = os.environ.get("KVTIER_DATA_DIR")
    if env:
        return Path(env)
    repo = REPO
    # beside the checkout or above it; last, this workplace's shared folder (CI clones elsewhere)
    for cand in [p / "shared" / "data" for p in repo.parents] + [Path("/work/shared/data")]:
        if (cand / "gsm8k" / "test.jsonl").is_file():
            return cand
    return repo.parent / "shared" / "data"


DATA_DIR = _find_data_dir()


def _embedded_installed() -> bool:
    from kvtier.models import ModelLoadError, embedded_parts

    try:
        embedded_parts()
        return True
    except ModelLoadError:
        return False


# tests that load the embedded 0.5B model: skipped where its data packages are not installed
needs_embedded = pytest.mark.skipif(not _embedded_installed(),
                                    reason="embedded model parts not installed (make test installs them)")


def _offline_installed(name: str) -> bool:
    from kvtier.models import ModelLoadError, embedded_parts

    try:
        embedded_parts(name)
        return True
    except ModelLoadError:
        return False


# the second model scale (1.1 GB, installed on demand by `make model-1.5b`; not by make venv or CI)
needs_1p5b = pytest.mark.skipif(not _offline_installed("qwen2.5-coder-1.5b-instruct"),
                                reason="qwen2.5-coder-1.5b-instruct parts not installed (make model-1.5b)")


@pytest.fixture
def fake_cpuinfo(monkeypatch, tmp_path):
    """``fake_cpuinfo(text)``: kvtier.kernels.cpu reads ``text`` as /proc/cpuinfo (None: no such file) and returns the
    fake file. The reader keeps the file's lines per process, so each call, and the teardown, clears what it kept:
    every fake is read afresh, and later tests read the real file."""
    from kvtier.kernels import cpu

    info = tmp_path / "cpuinfo"
    real = cpu.Path
    monkeypatch.setattr(cpu, "Path", lambda p, *a: info if str(p) == "/proc/cpuinfo" else real(p, *a))

    def fake(text: str | None) -> Path:
        if text is None:
            info.unlink(missing_ok=True)
        else:
            info.write_text(text)
        cpu._cpuinfo_lines.cache_clear()
        return info

    yield fake
    cpu._cpuinfo_lines.cache_clear()


@pytest.fixture(scope="session")
def qwen2():
    return random_model("tiny-qwen2", dtype=torch.float32)


@pytest.fixture(scope="session")
def llama():
    return random_model("tiny-llama", dtype=torch.float32)


@pytest.fixture(scope="session")
def qwen2_fast():
    """tiny-qwen2 with the prepared CPU step (kvtier.step.prepare_step: packed linears, fused norms)."""
    from kvtier.step import prepare_step

    model = random_model("tiny-qwen2", dtype=torch.float32)
    prepare_step(model, "packed")
    return model


def prompt_ids(batch=1, length=16, seed=0, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)


def padded_batch(lengths, total, seed=0):
    """Left-padded (B, total) ids and mask: row r holds ``lengths[r]`` real tokens (prompt seed ``seed + r``)."""
    ids = torch.cat([prompt_ids(length=total, seed=seed + i) for i in range(len(lengths))])
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        mask[r, total - n :] = 1
        ids[r, : total - n] = 0
    return ids, mask


def padded_greedy(model, cache, steps=128):
    """Greedy generation of a fixed left-padded batch of 3 (20, 13 and 7 real tokens) through ``cache``, ``steps``
    tokens each: (sequences, logits (steps, 3, V))."""
    ids, mask = padded_batch([20, 13, 7], 20, seed=4)
    out = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=steps,
                         do_sample=False, output_logits=True, return_dict_in_generate=True, min_new_tokens=steps)
    return out.sequences, torch.stack(out.logits)


def generate(model, policy, ids, new_tokens=64, attention_mask=None, custom_generate=None, **params):
    """Greedy generation through a kvtier cache; returns (sequences, logits (steps, B, V), cache).
    ``custom_generate``: generate's decoding loop (kvtier.step.decode.decode: decode steps through the direct step)."""
    cache = kvtier.make_cache(policy, model, **params)
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    out = model.generate(
        ids,
        attention_mask=attention_mask,
        **cache_kw(model, cache),
        custom_generate=custom_generate,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, torch.stack(out.logits), cache


def model_and_loop(request, name: str):
    """``name``: a model fixture, or one with ``+direct``: (the model, the ``custom_generate`` loop for
    :func:`generate`: kvtier.step.decode.decode with ``+direct``, else None)."""
    from kvtier.step.decode import decode

    base, _, loop = name.partition("+")
    return request.getfixturevalue(base), (decode if loop == "direct" else None)


def decode_loop(model, cache, ids, steps, on_step=None, attention_mask=None):
    """Manual greedy decoding (one forward per token) so tests can look at the cache between steps."""
    mask = torch.ones_like(ids) if attention_mask is None else attention_mask
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), use_cache=True)
        logits = [out.logits[:, -1]]
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for s in range(steps):
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            out = model(input_ids=tok, attention_mask=mask, **cache_kw(model, cache), use_cache=True)
            logits.append(out.logits[:, -1])
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            if on_step is not None:
                on_step(s, cache)
    return torch.stack(logits)


def forced_logits(model, cache, seq, prompt_len):
    """Teacher-forced decoding of ``seq`` (B, T): prefill ``prompt_len`` tokens, then one token per step.

    Both caches see the same tokens, so logit differences measure the cache alone, not a diverged text.
    """
    with torch.no_grad():
        out = model(input_ids=seq[:, :prompt_len], attention_mask=torch.ones_like(seq[:, :prompt_len]), **cache_kw(model, cache))
        logits = [out.logits[:, -1]]
        for i in range(prompt_len, seq.shape[1]):
            out = model(input_ids=seq[:, i : i + 1], attention_mask=torch.ones_like(seq[:, : i + 1]), **cache_kw(model, cache))
            logits.append(out.logits[:, -1])
    return torch.stack(logits)


@pytest.fixture(scope="session")
def tiny():
    """random:tiny-qwen2 in float32 and its byte tokenizer, one per session (the serve tests'; a test that changes
    the model works on a copy; a module with a ``tiny`` of its own uses that)."""
    from kvtier.models import byte_tokenizer

    return random_model("tiny-qwen2", dtype=torch.float32), byte_tokenizer()


def pytest_collection_modifyitems(config, items):
    """A test that uses a module's real server (the ``server`` or ``keyed`` fixture) is a ``server`` test too."""
    for item in items:
        if {"server", "keyed"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)
