"""The transfer engine: reused buffers, byte counters, prefetched slots; on CUDA, tiered equals full."""

from __future__ import annotations


import pytest
import torch
from conftest import decode_loop, prompt_ids

import kvtier
from kvtier.compat import cache_kw
from kvtier.transfer import TransferEngine

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_staging_and_work_buffers_are_reused(qwen2):
    cache = kvtier.make_cache("tiered", qwen2, hbm_ratio=0.2, evict_ratio=0.05, retier_interval=8, recent_window=4,
                              protect_prompt=False)
    seen = []

    def on_step(step, c):
        eng = c.state.engine
        seen.append((eng.allocations, eng.staging_bytes()))

    decode_loop(qwen2, cache, prompt_ids(batch=2, length=8), steps=200, on_step=on_step)
    allocs = [a for a, _ in seen]
    # buffers grow geometrically with T1 and in 256-column granules with the sequence: a handful of growth
    # events over 200 steps, never one per step
    grew = sum(b > a for a, b in zip(allocs, allocs[1:]))
    assert grew <= 20, allocs[::10]
    assert allocs[-1] - allocs[100] <= 8
    st = cache.stats()
    assert st["tokens"]["T1"] > 0
    # device staging: one layer's host tiers (with 25% growth headroom) plus one layer's work buffer (256-column
    # granules): at most two layers' worth of KV
    per_layer_kv = st["bytes_per_token"]["T0"] // qwen2.config.num_hidden_layers
    assert st["allocated_bytes"]["staging"] <= 2 * (st["logical_tokens"] + 256 * 2) * per_layer_kv


def test_counters_equal_tokens_moved_times_bytes_per_token():
    eng = TransferEngine(torch.device("cpu"))
    x = torch.randn(2, 10, 8)  # (H, tokens, D) float32
    y = eng.to_host(x)
    z = eng.to_device(y[:, :3])
    assert torch.equal(y, x) and torch.equal(z, x[:, :3])
    assert eng.counters.migration_d2h_bytes == 2 * 10 * 8 * 4
    assert eng.counters.migration_h2d_bytes == 2 * 3 * 8 * 4
    got = eng.take(0, ("layer", 1), {"k": x, "v": x[:, :5]})
    assert torch.equal(got["k"], x) and torch.equal(got["v"], x[:, :5])
    assert eng.counters.stream_h2d_bytes == (10 + 5) * 2 * 8 * 4
    eng.release(0)
    before = eng.allocations
    eng.take(0, ("layer", 2), {"k": x[:, :7], "v": x[:, :2]})  # smaller: reuses the same buffers
    assert eng.allocations == before
    assert eng.counters.seconds >= 0 and eng.counters.copies == 6


def test_prefetched_slot_is_used_once():
    eng = TransferEngine(torch.device("cpu"))
    x = torch.randn(2, 4, 8)
    eng.stage(0, ("L3", 7), {"k": x})
    n = eng.counters.stream_h2d_bytes
    eng.take(0, ("L3", 7), {"k": x})  # the prefetch matches: no second copy
    assert eng.counters.stream_h2d_bytes == n
    eng.release(0)
    eng.take(0, ("L3", 7), {"k": x})  # released: staged again
    assert eng.counters.stream_h2d_bytes == 2 * n


@cuda
def test_cuda_tiered_matches_full_bitwise():
    from kvtier.models import random_model

    model = random_model("tiny-qwen2", device="cuda", dtype=torch.float32)
    ids = prompt_ids(length=16).cuda()
    outs = []
    for policy, params in (("full", dict(attention="ordered")),
                           ("tiered", dict(hbm_ratio=0.1, evict_ratio=0.0, retier_interval=8, recent_window=4,
                                           attention="ordered"))):
        cache = kvtier.make_cache(policy, model, **params)
        o = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache), max_new_tokens=96, min_new_tokens=96,
                           do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        outs.append(torch.stack(o.logits))
        if policy == "tiered":
            s = cache.stats()
            assert s["tokens"]["T1"] > 0 and s["transfer"]["stream_h2d_bytes"] > 0 and s["transfer"]["seconds"] > 0
            assert cache.layers[0].k1.is_pinned()
    assert torch.equal(outs[0], outs[1])


@cuda
def test_cuda_rows_split_between_host_and_stream():
    """On CUDA: host rows on the worker thread with pinned q / partial / factor copies, streamed rows through the
    staging slot (prefetched), one merge: the tokens and placements of streaming every row, logits within 1e-5."""
    from kvtier.models import random_model

    model = random_model("tiny-qwen2", device="cuda", dtype=torch.float32)
    ids = torch.cat([prompt_ids(length=20, seed=s) for s in range(3)]).cuda()
    params = dict(hbm_ratio=0.2, evict_ratio=0.1, quant_ratio=0.1, retier_interval=8, recent_window=8, sink_tokens=2,
                  protect_prompt=False)
    out = {}
    for mode in ("stream", "both", "host"):
        cache = kvtier.make_cache("tiered", model, t1_attention="stream" if mode == "stream" else "host"
                                  if mode == "host" else "auto", **params)
        if mode == "both":
            cache.state.fixed_stream_rows = 2
        o = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache), max_new_tokens=64,
                           min_new_tokens=64, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           pad_token_id=0)
        out[mode] = (o.sequences, torch.stack(o.logits), cache.tier_map(), cache.stats())
    for mode in ("both", "host"):
        assert torch.equal(out[mode][0], out["stream"][0]) and torch.equal(out[mode][2], out["stream"][2]), mode
        assert (out[mode][1] - out["stream"][1]).abs().max().item() <= 1e-5, mode
    st = out["both"][3]
    assert st["t1_attention"]["current"] == "both" and st["t1_attention"]["stream_rows"] == 2
    assert 0 < st["transfer"]["stream_h2d_bytes"] < out["stream"][3]["transfer"]["stream_h2d_bytes"]
