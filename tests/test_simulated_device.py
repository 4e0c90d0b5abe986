"""The CUDA path's ordering, proven without a GPU: the whole tiered decode on the simulated asynchronous device
(``tests/simdevice.py``) gives the CPU's floats in every T1 mode, and leaving out any one synchronization point of
the engine or the host worker makes a run fail (the mutation check; the list is in docs/DESIGN.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_loop, padded_batch, prompt_ids
from simdevice import Hazard, SimSeam

import kvtier
from kvtier.tiers.planner import T0, T1, T2
from kvtier.transfer import SYNC_POINTS, TransferEngine, use_seam

SEEDS = (0, 1, 2, 3, 4)  # the whole decode, per T1 mode
MUTATION_SEEDS = (0, 1, 2)
PARAMS = dict(hbm_ratio=0.2, evict_ratio=0.1, quant_ratio=0.1, retier_interval=8, recent_window=8, sink_tokens=2,
              protect_prompt=False, kernel="eager")  # the eager split step: the path a CUDA device takes


def _decode(model, ids, steps, mode, seam=None, mask=None, stream_rows=None, bandwidth=None, on_step=None, **extra):
    """Greedy decode with a tiered cache: (logits (steps+1, B, V), cache, tier maps after each step)."""
    params = {**PARAMS, **extra}
    maps = []

    def step(s, c):
        maps.append(c.tier_map())
        if on_step is not None:
            on_step(s, c)

    def run():
        cache = kvtier.make_cache("tiered", model, t1_attention=mode, **params)
        cache.state.fixed_stream_rows = stream_rows
        cache.state.bandwidth = bandwidth
        return decode_loop(model, cache, ids, steps=steps, on_step=step, attention_mask=mask), cache

    if seam is None:
        logits, cache = run()
    else:
        with use_seam(seam), seam.watch():
            logits, cache = run()
    return logits, cache, maps


def _same(a, b):
    (la, ca, ma), (lb, cb, mb) = a, b
    assert torch.equal(la, lb), (la - lb).abs().max()
    assert torch.equal(ca.scores(), cb.scores())
    assert len(ma) == len(mb) and all(torch.equal(x, y) for x, y in zip(ma, mb))


# ---- the whole decode: the simulated device gives the CPU's floats --------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_streamed_t1_equals_the_cpu_run(qwen2, seed):
    """T1/T2 staged on the side stream (prefetched a layer ahead), batch 2, 64 steps with reassignments every 8:
    logits, scores and tier maps bit for bit as on the CPU; tokens moved both ways between device and host."""
    ids = prompt_ids(batch=2, length=20, seed=8)
    sim = SimSeam(seed=seed)
    got = _decode(qwen2, ids, 64, "stream", sim)
    _same(got, _decode(qwen2, ids, 64, "stream"))
    c = got[1].stats()["transfer"]
    assert c["stream_h2d_bytes"] > 0 and c["migration_h2d_bytes"] > 0 and c["migration_d2h_bytes"] > 0
    assert {"stage.ready", "take.wait_ready", "release.consumed", "stage.after_consumed"} <= sim.used
    assert sim.copies > 0 and not sim.hazards


@pytest.mark.parametrize("seed", SEEDS)
def test_host_attended_t1_equals_the_cpu_run(qwen2, seed):
    """T1/T2 attended on the host worker (a real thread with seeded delays) while the device attends T0 and the
    tail: the CPU's floats (there the job runs inline), scores folded in the same order."""
    ids = prompt_ids(batch=2, length=20, seed=9)
    sim = SimSeam(seed=seed)
    got = _decode(qwen2, ids, 64, "host", sim)
    _same(got, _decode(qwen2, ids, 64, "host"))
    assert got[1].state.host.threaded and got[1].stats()["t1_attention"]["host_jobs"] >= 2 * 50
    assert {"host.q_ready", "host.wait_q", "host.f_ready", "host.wait_f"} <= sim.used


@pytest.mark.parametrize("seed", SEEDS)
def test_rows_split_between_stream_and_host_equal_the_cpu_run(qwen2, seed):
    """"both": row 0 streams its host tiers, rows 1-2 attend them on the host worker, batch 3."""
    ids = prompt_ids(batch=3, length=20, seed=10)
    sim = SimSeam(seed=seed)
    got = _decode(qwen2, ids, 64, "auto", sim, stream_rows=1)
    _same(got, _decode(qwen2, ids, 64, "auto", stream_rows=1))
    assert got[1].stats()["t1_attention"]["current"] == "both"


def test_auto_splits_the_batch_from_its_bandwidths(qwen2):
    """``auto`` on an asynchronous device chooses the row split from bandwidths (here: H2D and host attention
    equally fast, no latency, so one row of two streams): the CPU run with that split, bit for bit."""
    ids = prompt_ids(batch=2, length=20, seed=11)
    bw = {"h2d_gbps": 10.0, "host_attention_gbps": 10.0, "host_latency_s": 0.0}
    got = _decode(qwen2, ids, 48, "auto", SimSeam(seed=3), bandwidth=bw)
    assert got[1].stats()["t1_attention"]["current"] == "both" and got[1].state.stream_rows == 1
    _same(got, _decode(qwen2, ids, 48, "auto", stream_rows=1))


@pytest.mark.parametrize("mode", ["stream", "host"])
def test_left_padded_batch_equals_the_cpu_run(qwen2, mode):
    """Rows of different prompt lengths (left padding), quantized T2 promoted back to T0 through the device."""
    ids, mask = padded_batch([20, 13, 7], 20, seed=4)
    got = _decode(qwen2, ids, 48, mode, SimSeam(seed=5), mask=mask, quant_ratio=0.3)
    _same(got, _decode(qwen2, ids, 48, mode, mask=mask, quant_ratio=0.3))
    assert got[1].stats()["tokens"]["T2"] > 0


def test_ordered_reference_equals_the_cpu_run(qwen2):
    """The ordered path assembles every kept token in position order from staged copies (take, release)."""
    ids = prompt_ids(batch=2, length=20, seed=12)
    sim = SimSeam(seed=6)
    got = _decode(qwen2, ids, 40, "stream", sim, attention="ordered")
    _same(got, _decode(qwen2, ids, 40, "stream", attention="ordered"))
    assert {"take.wait_ready", "release.consumed"} <= sim.used


@pytest.mark.parametrize("t1", ["stream", "host"])
def test_serving_rows_with_demotion_equal_the_cpu_run(qwen2, t1):
    """``kvtier serve``'s step on the simulated device: three one-row caches (two ``full``, one tiered) stepped
    together through a ``RowsCache``, memory pressure demoting two of them mid-run (a ``full`` row turned tiered:
    its coldest tokens copied device-to-host) and lifting the limit later — every step's logits as on the CPU."""
    from kvtier.cache.rows import RowsCache
    from kvtier.compat import cache_kw

    prompts = [prompt_ids(length=n, seed=20 + n) for n in (12, 20, 7)]
    policies = [("full", {}), ("tiered", dict(hbm_ratio=0.3, evict_ratio=0.0, retier_interval=8, recent_window=4)),
                ("full", {})]

    def run(seam=None):
        caches = [kvtier.make_cache(p, qwen2, kernel="eager", **params) for p, params in policies]
        for c in caches:
            c.state.t1_attention = t1  # what a demoted full row does with its T1 (it has no such parameter)
        seen, last = [], []
        with torch.no_grad():
            for c, ids in zip(caches, prompts):
                out = qwen2(input_ids=ids, **cache_kw(qwen2, c), use_cache=True)
                last.append(int(out.logits[0, -1].argmax()))
            for step in range(40):
                if step == 10:
                    caches[0].limit_device(4)
                    caches[1].limit_device(2)
                if step == 25:
                    caches[0].limit_device(None)
                rc = RowsCache(caches, lengths=[1] * len(caches))
                out = qwen2(input_ids=torch.tensor([last]), position_ids=rc.positions(), **cache_kw(qwen2, rc),
                            use_cache=True, logits_to_keep=rc.last_positions())
                seen.append(out.logits[0].clone())
                last = out.logits[0].argmax(-1).tolist()
        return torch.stack(seen), caches

    ref, _ = run()
    sim = SimSeam(seed=9)
    with use_seam(sim), sim.watch():
        got, caches = run(sim)
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert caches[0].state.retier_enabled and caches[0].stats()["transfer"]["migration_d2h_bytes"] > 0
    assert "to_host.sync" in sim.used and not sim.hazards


# ---- device memory: its own pool, and each tier on its side ------------------------------------------------------
def test_device_pool_is_what_the_cache_accounts(qwen2):
    """After every step the simulated device's live bytes are exactly the cache's device buffers (T0 + tail of
    every layer) and the engine's staging and work buffers: nothing else left on the device, nothing unaccounted."""
    ids = prompt_ids(batch=2, length=20, seed=13)
    sim = SimSeam(seed=7)
    seen = []

    def check(step, cache):
        st = cache.state
        kv = sum(layer._device_bytes() for layer in st.layers)
        seen.append((sim.memory_allocated(None), kv + st.engine.staging_bytes()))

    _, cache, _ = _decode(qwen2, ids, 40, "stream", sim, on_step=check)
    assert seen and all(a == b for a, b in seen), seen[:5]
    s = cache.stats()
    # the device's own count (what stats() reads from CUDA's allocator) covers the cache's peak; a migration's
    # transient copies come on top
    assert s["cuda_max_allocated_delta_bytes"] >= s["peak_device_bytes"] > 0


def test_every_tier_lives_on_its_side(qwen2):
    """T1 and T2 in pinned host memory, T0 + tail and staging in the device pool; host-worker jobs never touch the
    device pool and no op mixes the two (the simulator raises if one does: see the planted races below)."""
    ids = prompt_ids(batch=2, length=20, seed=14)
    sim = SimSeam(seed=8)
    _, cache, _ = _decode(qwen2, ids, 24, "host", sim)
    for layer in cache.state.layers:
        assert all(sim.is_host(t) for t in (layer.k1, layer.v1, layer.k2, layer.v2, layer.k2s, layer.v2s))
        assert sim.is_device(layer.dev_k) and sim.is_device(layer.dev_v)
        assert not sim.is_host(layer.dev_k) and not sim.is_device(layer.k1)
    assert cache.stats()["tokens"]["T1"] > 0


# ---- the mutation check: every synchronization point is needed ---------------------------------------------------
# the mode whose decode reaches each point (to_host.sync: every mode that demotes a token to the host)
_POINT_MODE = {p: ("host" if p.startswith("host.") else "stream") for p in SYNC_POINTS}


@pytest.mark.parametrize("point", sorted(SYNC_POINTS))
def test_leaving_out_a_sync_point_fails(qwen2, point):
    """With ``point`` left out (its wait does nothing, its event is never recorded) the decode that reaches it
    trips the simulator: a read before a copy landed, a source or a slot overwritten while in use."""
    ids = prompt_ids(batch=2, length=20, seed=8)
    caught = []
    for seed in MUTATION_SEEDS:
        sim = SimSeam(seed=seed, skip=(point,))
        with pytest.raises(Hazard) as err:
            _decode(qwen2, ids, 40, _POINT_MODE[point], sim)
        caught.append(str(err.value))
    assert len(caught) == len(MUTATION_SEEDS)


def test_every_sync_point_is_reached():
    """The points the decode calls are exactly :data:`SYNC_POINTS` (a new one must come with its mutation test)."""
    from kvtier.models import random_model

    model = random_model("tiny-qwen2", dtype=torch.float32)
    used = set()
    for mode in ("stream", "host"):
        sim = SimSeam(seed=0)
        _decode(model, prompt_ids(batch=2, length=20, seed=8), 24, mode, sim)
        used |= sim.used
    assert used == set(SYNC_POINTS)


# ---- the simulator itself catches what it claims to ---------------------------------------------------------------
def _planted(fn):
    sim = SimSeam(seed=0, early_landing=0.0)
    with use_seam(sim):
        eng = TransferEngine(torch.device("cpu"))
        with sim.watch():
            fn(sim, eng)
    return sim


def test_planted_read_before_the_copy_landed_is_caught():
    def race(sim, eng):
        src = eng.host_zeros((4, 8), torch.float32).add_(1)
        eng.stage(0, ("l", 0), {"k": src})
        buf = eng.slots[0].buffers["k"][:32].view(4, 8)
        buf.sum()  # no take(): the compute stream did not wait for the side stream
    with pytest.raises(Hazard, match="has not landed"):
        _planted(race)


def test_planted_source_write_while_copy_pending_is_caught():
    def race(sim, eng):
        src = eng.host_zeros((4, 8), torch.float32)
        eng.stage(0, ("l", 0), {"k": src})
        src.add_(1)  # the host writes T1 while the side stream may still read it
    with pytest.raises(Hazard, match="source of a pending"):
        _planted(race)


def test_planted_slot_reuse_before_release_is_caught():
    def race(sim, eng):
        src = eng.host_zeros((4, 8), torch.float32)
        got = eng.take(0, ("l", 0), {"k": src})
        got["k"].sum()  # the compute stream reads the slot ...
        eng.slots[0].tag = None  # ... and, without release(), the next layer's copy overwrites it
        eng.stage(0, ("l", 1), {"k": src})
    with pytest.raises(Hazard, match="overwrites device memory"):
        _planted(race)


def test_planted_wrong_side_and_worker_touching_the_device_are_caught():
    def mix(sim, eng):
        host = eng.host_zeros((4, 8), torch.float32)
        dev = sim.device_empty((4, 8), torch.float32, torch.device("cpu")).zero_()
        host + dev  # on CUDA: "Expected all tensors to be on the same device"
    with pytest.raises(Hazard, match="mixes pinned host memory and device memory"):
        _planted(mix)

    def worker(sim, eng):
        dev = sim.device_empty((4, 8), torch.float32, torch.device("cpu")).zero_()
        sim.executor("t").submit(lambda: dev.sum()).result()
    with pytest.raises(Hazard, match="host worker touches device memory"):
        _planted(worker)


def test_ordered_copies_pass_and_poison_is_real():
    """The same copies, ordered: values arrive; a destination read before its copy lands holds NaN."""
    def ordered(sim, eng):
        src = eng.host_zeros((4, 8), torch.float32).add_(2)
        got = eng.take(0, ("l", 0), {"k": src})
        with sim._quiet():  # a test's own look across the sides (on CUDA it would copy first)
            assert torch.equal(got["k"], src)
        eng.release(0)
        src2 = eng.host_zeros((4, 8), torch.float32).add_(3)
        eng.stage(0, ("l", 1), {"k": src2})
        with sim._quiet():  # peek past the checks: the slot holds poison until the copy lands
            assert torch.isnan(eng.slots[0].buffers["k"][:32]).all()
        got = eng.take(0, ("l", 1), {"k": src2})
        with sim._quiet():
            assert torch.equal(got["k"], src2)
        d = torch.arange(6.0)
        h = eng.to_host(d)
        assert torch.equal(h, d) and sim.is_host(h)
    sim = _planted(ordered)
    assert not sim.hazards and sim.copies == 3


def test_unknown_skip_point_is_named():
    with pytest.raises(ValueError, match="unknown synchronization points"):
        SimSeam(skip=("stage.nope",))
