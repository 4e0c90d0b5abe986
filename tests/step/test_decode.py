"""kvtier.step.decode: generate's loop with a kvtier cache's decode steps through the direct step, generate's tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_embedded
from transformers import DynamicCache, LogitsProcessorList

import kvtier
from kvtier.compat import cache_kw
from kvtier.eval.sampling import RowSampler
from kvtier.models import random_model
from kvtier.step import decode as decode_mod
from kvtier.step import prepare_step
from kvtier.step.decode import decode, decode_kw, step_for
from kvtier.step.direct import DirectStep

TIERED = {"hbm_ratio": 0.3, "evict_ratio": 0.1, "recent_window": 4, "retier_interval": 8}


def _batch(vocab: int):
    """Three prompts of 7, 12 and 4 tokens, left-padded (each row its own positions)."""
    g = torch.Generator().manual_seed(11)
    lens = [7, 12, 4]
    ids = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, 12 - n:] = torch.randint(3, vocab - 1, (n,), generator=g)
        mask[i, 12 - n:] = 1
    return ids, mask


@pytest.fixture
def count_direct(monkeypatch):
    """How many times a DirectStep ran a step."""
    calls = []
    real = DirectStep.__call__

    def counted(self, *a, **k):
        calls.append(a[0].shape)
        return real(self, *a, **k)

    monkeypatch.setattr(DirectStep, "__call__", counted)
    return calls


def _gen(model, policy, params, ids, mask, steps=40, how=None, **gen):
    cache = kvtier.make_cache(policy, model, **params) if policy else DynamicCache(config=model.config)
    extra = {} if how is None else {"custom_generate": how}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), max_new_tokens=steps,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True, **extra, **gen)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("dtype,mode", [(torch.float32, "eager"), (torch.bfloat16, "packed")])
def test_generate_through_the_direct_step_gives_generates_tokens_and_logits(preset, dtype, mode, count_direct):
    """A left-padded batch, greedy, full and tiered (reassignments, eviction): the same sequences and every step's
    logits bit for bit, with each decode step through the direct step (the prompt through the model's forward)."""
    model = random_model(preset, dtype=dtype)
    prepare_step(model, mode)
    ids, mask = _batch(model.config.vocab_size)
    for policy, params in (("full", {}), ("tiered", TIERED)):
        seq, logits = _gen(model, policy, params, ids, mask)
        count_direct.clear()
        seq_d, logits_d = _gen(model, policy, params, ids, mask, how=decode)
        assert torch.equal(seq_d, seq), policy
        assert logits_d.dtype == logits.dtype and torch.equal(logits_d, logits), policy
        assert count_direct.count(torch.Size([3, 1])) == 39, policy  # every decode step after the prompt's


def test_sampling_stopping_and_padding_are_generates(count_direct):
    """Sampled rows (a logits processor with per-row seeds, as kvtier eval runs them) and a row that ends early at
    an end-of-sequence token (padded after it, the others going on): generate's sequences."""
    model = random_model("tiny-qwen2", dtype=torch.float32)
    ids, mask = _batch(model.config.vocab_size)
    proc = lambda: LogitsProcessorList([RowSampler([1, 2, 3], 0.8, 0.9)])  # noqa: E731
    sampled = [_gen(model, "tiered", TIERED, ids, mask, how=h, logits_processor=proc(), do_sample=False)[0]
               for h in (None, decode)]
    assert torch.equal(*sampled)
    greedy, _ = _gen(model, "full", {}, ids, mask)
    eos = int(greedy[1, 12 + 5])  # row 1's sixth token ends it
    ended = [_gen(model, "full", {}, ids, mask, how=h, eos_token_id=eos)[0] for h in (None, decode)]
    assert torch.equal(*ended)
    assert (ended[0][1, 12 + 6:] == 0).all() and ended[0].shape[1] > 12 + 6  # padded after; the rest went on
    assert count_direct


def test_what_the_direct_step_does_not_take_runs_generate_as_is(monkeypatch, count_direct):
    """A stock cache, a model the step does not know, and KVTIER_DIRECT=0 (decode_kw gives nothing, and decode
    itself runs the model's forward): generate's results, no direct step."""
    model = random_model("tiny-qwen2", dtype=torch.float32)
    ids, mask = _batch(model.config.vocab_size)
    a, b = (_gen(model, None, {}, ids, mask, how=h)[0] for h in (None, decode))
    assert torch.equal(a, b) and not count_direct
    gemma = random_model("tiny-gemma3", dtype=torch.float32)
    a, b = (_gen(gemma, "full", {}, ids, mask, steps=8, how=h)[0] for h in (None, decode))
    assert torch.equal(a, b) and not count_direct and step_for(gemma) is None
    assert decode_kw() == {"custom_generate": decode}
    monkeypatch.setenv("KVTIER_DIRECT", "maybe")
    with pytest.raises(ValueError, match="KVTIER_DIRECT must be one of"):
        decode_kw()
    monkeypatch.setenv("KVTIER_DIRECT", "0")
    assert decode_kw() == {}
    a, b = (_gen(model, "full", {}, ids, mask, how=h)[0] for h in (None, decode))
    assert torch.equal(a, b) and not count_direct


def test_the_step_is_checked_once_per_model_and_again_after_its_modules_change(monkeypatch):
    model = random_model("tiny-qwen2", dtype=torch.bfloat16)
    checks = []
    real = decode_mod.direct_step
    monkeypatch.setattr(decode_mod, "direct_step", lambda m, *why: checks.append(1) or real(m, *why))
    first = step_for(model)
    assert step_for(model) is first and len(checks) == 1
    prepare_step(model, "packed")  # replaces the linears, norms and MLPs the first step calls
    second = step_for(model)
    assert second is not first and len(checks) == 2 and step_for(model) is second


@pytest.mark.slow
@needs_embedded
def test_embedded_model_generates_the_same_256_tokens_and_logits_through_the_direct_step(count_direct):
    """Acceptance 1 on the embedded model in bf16 as kvtier loads it (the default step): 256 greedy steps of a GSM8K
    chat prompt, full and tiered (reassignments every 64 steps, 3% evicted), generate's tokens and every logit bit
    for bit through the direct step (the bound: 0)."""
    from kvtier.models import EMBEDDED_NAME, chat_prompt

    model, tok = kvtier.load_model(EMBEDDED_NAME, device="cpu", dtype="bf16")
    q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many " \
        "clips did Natalia sell altogether in April and May? Think step by step."
    ids = tok([chat_prompt(tok, q)], return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    tiered = {"hbm_ratio": 0.3, "evict_ratio": 0.03, "retier_interval": 64, "recent_window": 32}
    for policy, params in (("full", {}), ("tiered", tiered)):
        seq, logits = _gen(model, policy, params, ids, mask, steps=256, min_new_tokens=256)
        count_direct.clear()
        seq_d, logits_d = _gen(model, policy, params, ids, mask, steps=256, how=decode, min_new_tokens=256)
        assert seq.shape[1] == ids.shape[1] + 256 and torch.equal(seq_d, seq), policy
        assert torch.equal(logits_d, logits), policy
        assert count_direct.count(torch.Size([1, 1])) == 255, policy
