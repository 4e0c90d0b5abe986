"""kvtier.step.direct: the engine's step without transformers' module machinery gives the model's logits bit for bit."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import kvtier
from kvtier.models import random_model
from kvtier.step import FusedLinear, FusedMLP, FusedRMSNorm, PackedLinear, prepare_step
from kvtier.step import direct as direct_mod
from kvtier.compat import cache_kw
from kvtier.step.direct import DirectStep, batch_logits, direct_step, rows_logits, unsupported

NO_EVICT = {"hbm_ratio": 0.3, "evict_ratio": 0.0, "recent_window": 4, "retier_interval": 8}
# row 0 full (the rows kernel), row 1 tiered without eviction (its own split attention, reassigned every 8 steps),
# row 2 full on the eager path (its own update and attend); row 2 joins at step 6, beside the decoding rows
ROWS = [("full", {}, 9, 0), ("tiered", NO_EVICT, 5, 0), ("full", {"kernel": "eager"}, 7, 6)]


def _prompt(i: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab - 1, (n,), generator=torch.Generator().manual_seed(40 + i)).tolist()


def _steps(model, how: str, direct: DirectStep | None, steps: int = 40) -> list[torch.Tensor]:
    """Every step's logits (1, B, V) of the ROWS schedule, stepped through the model's forward or the direct step."""
    vocab = model.config.vocab_size
    caches, seqs, out = [], [], []
    for step in range(steps):
        for i, (policy, params, n, join) in enumerate(ROWS):
            if join == step:
                caches.append(kvtier.make_cache(policy, model, **params))
                seqs.append(_prompt(i, n, vocab))
        lg = rows_logits(model, direct if how == "direct" else None, caches, seqs)
        out.append(lg)
        seqs = [[int(t)] for t in lg[0].float().argmax(dim=-1)]
    return out


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama", "tiny-mistral", "tiny-qwen3"])
@pytest.mark.parametrize("dtype,mode", [(torch.float32, "eager"), (torch.bfloat16, "packed")])
def test_direct_step_gives_the_models_logits_bit_for_bit(preset, dtype, mode, monkeypatch):
    """Packed prefills, a row joining decoding rows, full / tiered / eager-kernel rows, reassignments: at every one of
    40 steps the direct step's logits equal the model forward's (twin caches, each path fed its own greedy tokens).
    Packed, it calls kvtier's linears, norms and MLP activations as their kernels, never through their modules,
    and the rotary kernel, never the model's function."""
    model = random_model(preset, dtype=dtype)
    prepare_step(model, mode)
    step = direct_step(model)
    assert step is not None
    ref = _steps(model, "model", None)
    if mode == "packed":
        for cls in (FusedLinear, PackedLinear, FusedRMSNorm, FusedMLP):
            monkeypatch.setattr(cls, "forward", lambda *a: pytest.fail("a kvtier module called"))
        # and the rotary embedding is the kernel's (q and k are column slices of the fused q/k/v product), never
        # the model's function: a step built over a function that fails
        modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", lambda *a, **k: pytest.fail("the model's rotary"))
        step = DirectStep(model)
    got = _steps(model, "direct", step)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"step {i}: max |diff| {(a.float() - b.float()).abs().max()}"


# batch caches as kvtier bench runs them: full (the fused kernel, and its eager path), tiered with reassignments and
# eviction (split attention, the ordered reference), and a baseline of the headwise kind (its own scoring)
BATCH = [("full", {}), ("full", {"kernel": "eager"}),
         ("tiered", {"hbm_ratio": 0.3, "evict_ratio": 0.1, "recent_window": 4, "retier_interval": 8}),
         ("tiered", {"hbm_ratio": 0.3, "evict_ratio": 0.1, "recent_window": 4, "retier_interval": 8,
                     "attention": "ordered"}),
         ("h2o", {"budget_ratio": 0.6})]


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("dtype,mode", [(torch.float32, "eager"), (torch.bfloat16, "packed")])
def test_a_batch_decode_step_gives_the_models_logits_bit_for_bit(preset, dtype, mode):
    """Three rows prefilled by the model's forward, then 40 decode steps of a batch cache through the direct step
    and through the model's forward (twin caches, each fed its own greedy tokens): every logit equal, for each
    policy above."""
    model = random_model(preset, dtype=dtype)
    prepare_step(model, mode)
    step = direct_step(model)
    assert step is not None
    ids = torch.randint(3, model.config.vocab_size - 1, (3, 11), generator=torch.Generator().manual_seed(3))
    for policy, params in BATCH:
        runs = []
        for how in (None, step):
            cache = kvtier.make_cache(policy, model, **params)
            with torch.no_grad():
                lg = model(input_ids=ids, **cache_kw(model, cache), use_cache=True, logits_to_keep=1).logits
            out = []
            for _ in range(40):
                lg = batch_logits(model, how, cache, lg[:, -1].float().argmax(-1, keepdim=True))
                out.append(lg)
            runs.append(out)
        for i, (a, b) in enumerate(zip(*runs)):
            assert a.shape == (3, 1, model.config.vocab_size) and a.dtype == b.dtype and torch.equal(a, b), \
                f"{policy} {params} step {i}: max |diff| {(a.float() - b.float()).abs().max()}"


def test_a_batch_cache_takes_decode_steps_only():
    """A prompt needs the model's causal mask: a batch cache's direct step refuses one, and an empty cache; a cache
    of another model's layer count is named."""
    model = random_model("tiny-qwen2", dtype=torch.float32)
    step = DirectStep(model)
    cache = kvtier.make_cache("full", model)
    with pytest.raises(ValueError, match="one decode token per row of a prefilled cache"):
        step(torch.tensor([[5], [6]]), cache, torch.zeros(1, 1, dtype=torch.long))
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), **cache_kw(model, cache), use_cache=True)
        with pytest.raises(ValueError, match="one decode token per row"):
            step(torch.tensor([[5, 6]]), cache, torch.tensor([[3, 4]]))
        cache.layers = cache.layers[:1]  # as a cache made for a one-layer model would be
        with pytest.raises(ValueError, match="has 1 layers, the model 2; make the cache for the model"):
            step(torch.tensor([[5]]), cache, torch.full((1, 1), 3))


def test_models_the_step_does_not_know_keep_their_forward(caplog):
    gemma = random_model("tiny-gemma3", dtype=torch.float32)
    assert "is not one of" in unsupported(gemma)
    with caplog.at_level(logging.INFO, logger="kvtier.step.direct"):
        assert direct_step(gemma) is None
    assert "the model's own forward" in caplog.text and "gemma3" in caplog.text
    with pytest.raises(ValueError, match="no direct step"):
        DirectStep(gemma)
    sub = random_model("tiny-qwen2", dtype=torch.float32)
    sub.__class__ = type("MyQwen2", (type(sub),), {})  # a subclass may change the math: refused by name
    assert "is not transformers' Qwen2ForCausalLM" in unsupported(sub) and direct_step(sub) is None


def test_a_direct_step_that_differs_is_not_used(monkeypatch, caplog):
    """The check before use can fail: a step one unit off in one logit is refused, with the difference logged."""
    model = random_model("tiny-qwen2", dtype=torch.float32)
    real = DirectStep.__call__

    def off(self, *a):
        lg = real(self, *a)
        lg[0, 0, 0] = torch.nextafter(lg[0, 0, 0], torch.tensor(float("inf")))
        return lg

    monkeypatch.setattr(DirectStep, "__call__", off)
    with caplog.at_level(logging.INFO, logger="kvtier.step.direct"):
        assert direct_step(model) is None
    assert "prefill logits differ" in caplog.text
    monkeypatch.setattr(direct_mod, "_agree", lambda m, s: (_ for _ in ()).throw(RuntimeError("boom")))
    assert direct_step(model) is None  # a failing check keeps the model's forward too


def test_no_layer_outlives_its_direct_step():
    """A layer's ``update`` hands the layer to the attention function (kvtier.compat.hand_over); the direct step
    attends through the layer itself, so it must take the hand-over back: otherwise the last layer of the last
    step, and with it every row's K/V buffers of that layer, stayed referenced from a thread-local after the step
    (a finished request's memory, until the engine's next step)."""
    import gc
    import weakref

    from kvtier.cache.rows import RowsCache

    model = random_model("tiny-qwen2", dtype=torch.float32)
    step = direct_step(model)
    caches = [kvtier.make_cache("full", model) for _ in range(2)]
    rows_logits(model, step, caches, [[5, 6, 7], [8, 9]])
    rc = RowsCache(caches, lengths=[1, 1])
    with torch.no_grad():
        step(torch.tensor([[3, 4]]), rc, rc.positions(), rc.last_positions())
    layers, buffers = [weakref.ref(x) for x in rc.layers], [weakref.ref(x.dev_k) for c in caches for x in c.layers]
    del rc, caches
    gc.collect()
    assert all(w() is None for w in layers) and all(w() is None for w in buffers)
