"""``limit_device``: memory pressure moves device tokens to T1 exactly, and the device bytes follow the limit.

The ordered path keeps tokens in position order, so a limit (like any T0/T1 split) changes no float there; the
split path changes only the merge's rounding. ``device_kv_next`` must bound the bytes after every step."""

from __future__ import annotations

import pytest
import torch

import kvtier
from kvtier.compat import cache_kw


def _decode(model, policy, ids, steps, events=None, **params):
    """Greedy decode one row through its own cache; ``events``: {step: t0 limit (None lifts it)}."""
    events = events or {}
    c = kvtier.make_cache(policy, model, **params)
    toks, logits = [], []
    with torch.no_grad():
        lg = model(input_ids=torch.tensor([ids]), **cache_kw(model, c), use_cache=True).logits[:, -1]
        for s in range(steps):
            if s in events:
                c.limit_device(events[s])
            bound = c.device_kv_next()
            t = int(lg.argmax())
            toks.append(t)
            logits.append(lg)
            pos = torch.tensor([[c.state.n_total]])
            lg = model(input_ids=torch.tensor([[t]]), position_ids=pos, **cache_kw(model, c), use_cache=True).logits[:, -1]
            assert c.device_kv_bytes() <= bound, f"step {s}: {c.device_kv_bytes()} device bytes over the bound {bound}"
            assert c.device_kv_bytes() == _device_bytes_naive(c), f"step {s}"
    return toks, torch.cat(logits), c


def _device_bytes_naive(c) -> int:
    """The reference for ``device_kv_bytes`` (which sums the sizes the state notes at each allocation): every
    initialized layer's device buffers read now, plus staging and sliding layers."""
    st = c.state
    kv = sum(x.numel() * x.element_size() for layer in st.layers if layer.is_initialized
             for x in (layer.dev_k, layer.dev_v))
    return kv + st.engine.staging_bytes() + sum(s.device_bytes() for s in c.sliding_layers())


IDS = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("policy,params", [("full", {}), ("tiered", {"evict_ratio": 0.0, "hbm_ratio": 0.5})])
def test_ordered_limit_is_bitwise(qwen2, policy, params):
    params = {**params, "attention": "ordered"}
    a, la, _ = _decode(qwen2, policy, IDS, 100, **params)
    b, lb, c = _decode(qwen2, policy, IDS, 100, events={20: 8, 50: 0, 80: None}, **params)
    assert a == b and torch.equal(la, lb)
    assert c.stats()["changed_tokens"].get("T0->T1", 0) > 100  # the limit really moved tokens


@pytest.mark.parametrize("policy,params", [("full", {}), ("tiered", {"evict_ratio": 0.0, "hbm_ratio": 0.5})])
def test_split_limit_within_rounding(qwen2, policy, params):
    a, la, _ = _decode(qwen2, policy, IDS, 100, **params)
    b, lb, c = _decode(qwen2, policy, IDS, 100, events={20: 8, 50: 0, 80: None}, **params)
    assert a == b
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-4)  # fp32 merge rounding, measured ~1e-5


def test_limit_shrinks_device_memory(qwen2):
    _, _, c = _decode(qwen2, "full", IDS, 40, events={30: 8})
    col = c._col_bytes()
    assert c.device_kv_bytes() <= (8 + c.tail_reserve()) * col
    assert c.row_tokens(0)["T1"] >= 120 + 30 - 8 - c.tail_reserve()
    assert c.host_kv_bytes() == c.row_tokens(0)["T1"] * col
    c.reset()
    assert c.device_kv_bytes() == 0


def test_limit_refused_where_it_would_change_output(qwen2):
    c = kvtier.make_cache("evict", qwen2, evict_ratio=0.5)  # keeps its rest on the device (rest_tier T0)
    with pytest.raises(ValueError, match="cannot move to host"):
        c.limit_device(4)
    with pytest.raises(ValueError, match="t0_tokens"):
        kvtier.make_cache("full", qwen2).limit_device(-1)


def test_a_demoted_full_cache_takes_the_tiered_path(qwen2, monkeypatch):
    """``full`` keeps SDPA where that is the faster one-region step (bf16 on AMX, simulated here); demoted, it is a
    tiered cache and takes the tiered path (the fused kernel), not the eager split step (~3x slower, measured in
    the first memory-pressure run); ``kernel="eager"`` still refuses the kernel. The texts stay the undemoted
    ones."""
    from kvtier.attention import fused_cpu

    monkeypatch.setattr(fused_cpu, "sdpa_is_faster", lambda dtype: True)
    a, la, c0 = _decode(qwen2, "full", IDS, 40)
    assert not c0.state.fused
    b, lb, c = _decode(qwen2, "full", IDS, 40, events={20: 8})
    assert c.state.fused and c.state.retier_enabled and a == b
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-4)
    _, _, e = _decode(qwen2, "full", IDS, 30, events={20: 8}, kernel="eager")
    assert not e.state.fused
