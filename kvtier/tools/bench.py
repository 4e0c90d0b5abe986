"""System benchmark: decode throughput and transfer costs of each policy, measured side by side in one run.

For every batch size the same random prompt is decoded by stock transformers (SDPA + ``DynamicCache`` and SDPA +
``StaticCache``, the strongest stock peer), kvtier ``full`` and every requested policy/ratio, each tiered point once
per attention mode (``split``/``ordered``) and T1 mode (``stream``/``host``/``auto``), repeats interleaved (A B C A B C ...) so that drift hits
all configurations alike. Each run: fresh cache, prefill, ``warmup_steps`` untimed decode steps (long enough
for a first reassignment, so the tiered cache is in its steady state), then ``new_tokens`` timed steps with
a device synchronize around the timer. Reported: median over repeats.
"""

from __future__ import annotations

import logging
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Callable

import torch

from ..kernels.rows import argmax_rows
from ..compat import cache_kw
from ..models import load_model, resolve_device
from ..step import expert_weights, packed_count, step_weight_bytes
from ..kernels.cpu import cpu_isa
from ..step.decode import step_for
from ..step.direct import batch_logits
from ..transfer import memcpy_peak_gbps, seam_for

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    model: str = "random:tiny-qwen2"
    context: int = 512
    new_tokens: int = 64
    batches: tuple[int, ...] = (1, 4)
    policies: tuple[str, ...] = ("full", "tiered")
    hbm_ratios: tuple[float, ...] = (0.3, 0.5, 0.7)
    evict_ratios: tuple[float, ...] = (0.03,)
    retier_interval: int = 64
    recent_window: int = 128
    repeats: int = 3
    warmup_steps: int | None = None  # default: retier_interval + 8
    stock: bool = True
    warm_repeat: bool = True  # run every configuration once untimed first (kernels, allocators)
    interleave: bool = False  # all configurations' caches at once, one step of each in turn (noisy machines)
    t1_on_device: bool = False  # also time each tiered point with a device copy of T1 (the HBM-for-PCIe trade)
    attentions: tuple[str, ...] = ("split",)  # each tiered point (and full) is timed once per attention mode
    t1_attentions: tuple[str, ...] = ("auto",)  # ... and, in split mode, once per T1 mode
    kernels: tuple[str, ...] = ("auto",)  # ... and once per split-step implementation (fused CPU kernel / eager)
    linears: tuple[str, ...] = ("auto",)  # the model's projections (kvtier.step.linear): one model load per mode
    # kvtier caches decode through kvtier.step.direct where the model takes it (Llama/Qwen2/Qwen3/Mistral, checked
    # bit for bit at load), except with linear "eager": that mode is transformers' stock step
    direct: bool = True
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0

    @property
    def warmup(self) -> int:
        """Untimed decode steps per run: ``warmup_steps``, by default long enough for a first reassignment."""
        return self.warmup_steps if self.warmup_steps is not None else self.retier_interval + 8

    def __post_init__(self) -> None:
        for name in ("context", "new_tokens", "repeats", "retier_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        w = self.warmup_steps
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise ValueError(f"--warmup-steps must be an integer >= 0, got {w!r}")
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"batch sizes must be integers >= 1, got {self.batches!r}")
        import math

        from ..policies import get_policy

        if not self.policies:
            raise ValueError("--policy needs at least one policy")
        for p in self.policies:
            get_policy(p)
        for name in ("hbm_ratios", "evict_ratios"):
            for v in getattr(self, name):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
                    raise ValueError(f"--{name[:-1].replace('_', '-')} values must be numbers in [0, 1], got {v!r}")
        if isinstance(self.recent_window, bool) or not isinstance(self.recent_window, int) or self.recent_window < 0:
            raise ValueError(f"--recent-window must be an integer >= 0, got {self.recent_window!r}")
        from ..attention.fused_cpu import KERNEL_MODES
        from ..cache import ATTENTION_MODES, T1_MODES

        from ..step import LINEAR_MODES

        flags = {"attentions": "--attention", "t1_attentions": "--t1-attention", "kernels": "--kernel",
                 "linears": "--linear"}
        for name, allowed in (("attentions", ATTENTION_MODES), ("t1_attentions", T1_MODES), ("kernels", KERNEL_MODES),
                              ("linears", LINEAR_MODES)):
            values = getattr(self, name)
            if not values or any(v not in allowed for v in values):
                flag = flags[name]
                raise ValueError(f"{flag} values must be among {list(allowed)}, got {list(values)!r}")


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work before reading the clock (a no-op on a CPU device)."""
    seam_for(device).synchronize(device)


def _modes(cfg: BenchConfig) -> list[dict]:
    """(attention, t1_attention[, kernel]) combinations: the ordered path streams (it attends on the device only)
    and has no kernel choice; ``kernel`` is named only when more than the default is asked for."""
    out = []
    for a in cfg.attentions:
        for t in cfg.t1_attentions if a == "split" else ("stream",):
            for k in cfg.kernels if a == "split" else ("auto",):
                mode = dict(attention=a, t1_attention=t)
                if k != "auto" or len(cfg.kernels) > 1:
                    mode["kernel"] = k
                if mode not in out:
                    out.append(mode)
    return out


def stock_attention(model) -> str:
    """transformers' attention the stock rows run: SDPA, or eager for a model without SDPA support (gpt-oss: its
    sinks); with ``--interleave`` the stock caches go through kvtier's entry point, which does the same."""
    return "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"


def _configs(cfg: BenchConfig) -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = []
    if cfg.stock:
        out.append(("stock_sdpa", {}))
        out.append(("stock_static", {}))
    out.append(("full", {}))
    if len(cfg.kernels) > 1:  # full's own implementations (the kernel without scores, SDPA) beside its default
        out.extend(("full", {"kernel": k}) for k in cfg.kernels if k != "auto")
    if "ordered" in cfg.attentions:
        out.append(("full", {"attention": "ordered"}))
    for p in cfg.policies:
        if p == "full":
            continue
        common = dict(retier_interval=cfg.retier_interval, recent_window=cfg.recent_window, protect_prompt=False)
        if p == "tiered":
            for e in cfg.evict_ratios:
                for h in cfg.hbm_ratios:
                    for mode in _modes(cfg):
                        out.append((p, dict(hbm_ratio=h, evict_ratio=e, **mode, **common)))
                    if cfg.t1_on_device:
                        out.append((p, dict(hbm_ratio=h, evict_ratio=e, t1_on_device=True, t1_attention="stream",
                                            **common)))
        elif p in ("evict",):
            for e in cfg.evict_ratios:
                out.append((p, dict(evict_ratio=e, **common)))
        elif p == "quant":
            for h in cfg.hbm_ratios:
                for mode in _modes(cfg):
                    out.append((p, dict(hbm_ratio=h, **mode, **common)))
        else:
            for e in cfg.evict_ratios:
                out.append((p, dict(budget_ratio=1.0 - e)))
    return out


class _Run:
    """One configuration's generation: prefill at construction, then timed single steps (synchronized). A kvtier
    cache's steps go through ``direct`` (:class:`kvtier.step.direct.DirectStep`) where given, else the model's
    forward; every step's greedy pick is :func:`kvtier.kernels.rows.argmax_rows` (one pass over the logits in
    their dtype, the tokens ``float().argmax`` picks: at 32 rows of a 152K vocabulary in bf16, ``argmax`` on the
    bf16 logits took ~9 ms a step on a 2-core EPYC, argmax_rows well under 1)."""

    def __init__(self, model, ids: torch.Tensor, make: Callable, device: torch.device, direct=None) -> None:
        import kvtier

        self.model, self.device = model, device
        self.cache = make()
        self.is_kvtier = isinstance(self.cache, kvtier.KVTierCache)
        self.direct = direct if self.is_kvtier else None
        self.cache_kw = cache_kw(model, self.cache)  # once: the timed step does nothing but the forward
        with torch.no_grad():
            # the last position's logits only: all of them are B x context x vocab (39.8 GB in bf16 at 32 x 4096
            # with a 151,936-token vocabulary), what ran the largest points out of memory
            out = model(input_ids=ids, **self.cache_kw, use_cache=True, logits_to_keep=1)
        self.tok = argmax_rows(out.logits[:, -1]).unsqueeze(-1)
        self.steps: list[float] = []
        self.before = None

    def step(self, timed: bool) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            if self.direct is not None:
                logits = batch_logits(self.model, self.direct, self.cache, self.tok)
            else:
                logits = self.model(input_ids=self.tok, **self.cache_kw, use_cache=True).logits
            self.tok = argmax_rows(logits[:, -1]).unsqueeze(-1)
        _sync(self.device)
        if timed:
            self.steps.append(time.perf_counter() - t0)

    def start_timing(self) -> None:
        self.before = self.cache.stats() if self.is_kvtier else None

    def record(self, seconds: float | None = None) -> dict:
        dev = self.device
        rec = {"seconds": sum(self.steps) if seconds is None else seconds, "step_seconds": list(self.steps),
               "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}
        if self.before is not None:
            after = self.cache.stats()
            tb, ta = self.before["transfer"], after["transfer"]
            rec.update(
                transfer_seconds=ta["seconds"] - tb["seconds"],
                t1_mode=after["t1_attention"]["current"] if isinstance(after.get("t1_attention"), dict) else None,
                kernel=(after.get("kernel") or {}).get("current"),
                peak_device_kv_bytes=after.get("peak_device_kv_bytes"),
                stream_h2d_bytes=ta["stream_h2d_bytes"] - tb["stream_h2d_bytes"],
                migration_bytes=(ta["migration_h2d_bytes"] + ta["migration_d2h_bytes"])
                - (tb["migration_h2d_bytes"] + tb["migration_d2h_bytes"]),
                tokens=after["tokens"],
                kv_bytes=after["bytes"],
                allocated_bytes=after["allocated_bytes"],
                retiers=after["retiers"],
            )
        else:
            kv = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.cache.layers
                     if getattr(layer, "keys", None) is not None)
            rec.update(kv_bytes={"T0": kv, "T1": 0, "T2": 0}, allocated_bytes={"device": kv, "host": 0, "staging": 0})
        return rec


def _one_run(model, ids: torch.Tensor, make: Callable, warmup: int, steps: int, device: torch.device,
             direct=None) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = _Run(model, ids, make, device, direct)
    for _ in range(warmup):
        run.step(timed=False)
    run.start_timing()
    t = time.perf_counter()
    for _ in range(steps):
        run.step(timed=True)
    return run.record(time.perf_counter() - t)


def _interleaved(model, ids: torch.Tensor, makes: list[Callable], warmup: int, steps: int, device: torch.device,
                 direct=None) -> list[dict]:
    """Every configuration's cache at once, one decode step of each in turn: a slow spell of a shared machine then
    hits every configuration alike (their caches must fit together)."""
    runs = [_Run(model, ids, make, device, direct) for make in makes]
    for _ in range(warmup):
        for run in runs:
            run.step(timed=False)
    for run in runs:
        run.start_timing()
    for _ in range(steps):
        for run in runs:
            run.step(timed=True)
    recs = [run.record() for run in runs]
    for rec in recs:
        rec["peak_device_bytes"] = None  # one allocator peak for all of them: not any one configuration's
    return recs


def run_bench(cfg: BenchConfig, on_progress: Callable[[str], None] | None = None,
              on_rows: Callable[[dict], None] | None = None) -> dict:
    """Run the benchmark; returns a JSON-ready dict (``results``: one row per batch x configuration).

    ``on_rows`` gets the result so far each time a batch size's rows are finished (to save them as they come)."""
    from transformers import DynamicCache, StaticCache

    import kvtier

    device = resolve_device(cfg.device)
    warmup = cfg.warmup
    peak = memcpy_peak_gbps(device)
    floors = {"read_peak_gbps": read_peak_gbps(device)}
    rows: list[dict] = []
    for linear in cfg.linears:
        model, _ = load_model(cfg.model, device=str(device), dtype=cfg.dtype, seed=cfg.seed, linear=linear)
        if "step_weight_bytes" not in floors:
            eb, ne, nk = expert_weights(model)
            floors.update(step_weight_bytes=step_weight_bytes(model), weight_itemsize=model.dtype.itemsize,
                          expert_weight_bytes=eb, experts=ne, experts_per_token=nk)
        # the GEMM peak as the fastest mode runs it: the floor is one number for every mode
        floors["gemm_peak_gflops"] = max(floors.get("gemm_peak_gflops", 0.0), gemm_peak_gflops(model, device))
        _bench_model(cfg, model, linear, device, warmup, peak, floors, rows, on_progress, on_rows)
        del model
    return _result(cfg, device, warmup, peak, floors, rows)


def _bench_model(cfg: BenchConfig, model, linear: str, device: torch.device, warmup: int, peak: float, floors: dict,
                 rows: list[dict], on_progress, on_rows) -> None:
    """Every batch size and configuration on one loaded model; appends to ``rows``."""
    from transformers import DynamicCache, StaticCache

    import kvtier

    packed = packed_count(model)
    # the direct step, checked against the model's forward on the model as loaded (None where it does not take it)
    direct = step_for(model) if cfg.direct and linear != "eager" else None
    tag = f"linear {linear}: " if len(cfg.linears) > 1 else ""
    vocab = min(model.config.vocab_size, 256)
    g = torch.Generator().manual_seed(cfg.seed)
    for B in cfg.batches:
        ids = torch.randint(0, vocab, (B, cfg.context), generator=g).to(device)
        runs: dict[int, list[dict]] = {}
        configs = _configs(cfg)
        first = 0 if cfg.warm_repeat else 1
        if cfg.interleave:
            kvtier.prepare_model(model)  # stock caches then run transformers' SDPA through kvtier's entry point
        for r in range(first, cfg.repeats + 1):  # repeat 0 warms up kernels and allocators; not reported
            makes = []
            for i, (name, params) in enumerate(configs):
                if name == "stock_sdpa":
                    if not cfg.interleave:
                        model.set_attn_implementation(stock_attention(model))
                    make = lambda: DynamicCache(config=model.config)  # noqa: E731
                elif name == "stock_static":
                    if not cfg.interleave:
                        model.set_attn_implementation(stock_attention(model))
                    length = cfg.context + warmup + cfg.new_tokens + 1
                    make = lambda n=length: StaticCache(config=model.config, max_cache_len=n)  # noqa: E731
                else:
                    make = lambda n=name, p=params: kvtier.make_cache(n, model, **p)  # noqa: E731
                if cfg.interleave:
                    makes.append(make)
                    continue
                rec = _one_run(model, ids, make, warmup, cfg.new_tokens, device, direct)
                if r > 0:
                    runs.setdefault(i, []).append(rec)
                if on_progress:
                    on_progress(f"{tag}batch {B} repeat {r}/{cfg.repeats} {name} {params}")
            if cfg.interleave:
                for i, rec in enumerate(_interleaved(model, ids, makes, warmup, cfg.new_tokens, device, direct)):
                    if r > 0:
                        runs.setdefault(i, []).append(rec)
                if on_progress:
                    on_progress(f"{tag}batch {B} repeat {r}/{cfg.repeats}: {len(configs)} configurations interleaved")
        base = {}
        for i, (name, params) in enumerate(configs):
            recs = runs[i]
            med = statistics.median(x["seconds"] for x in recs)
            last = recs[-1]
            row = {
                "batch": B,
                "linear": linear,
                "packed_linears": packed,
                # what ran the decode steps: kvtier's direct step or the model's forward (stock caches: always it)
                "step": "direct" if direct is not None and not name.startswith("stock_") else "model",
                "policy": name,
                "params": params,
                "decode_tok_s": B * cfg.new_tokens / med,
                "ms_per_step": 1e3 * med / cfg.new_tokens,
                # median of every timed step of every repeat: robust to bursts of interference on a shared machine
                # (and it leaves out the one reassignment step per retier_interval, which ms_per_step includes)
                "ms_per_step_median": 1e3 * statistics.median(x for rec in recs for x in rec["step_seconds"]),
                "seconds_repeats": [x["seconds"] for x in recs],
                "peak_device_bytes": last["peak_device_bytes"],
                "kv_bytes": last["kv_bytes"],
                "allocated_bytes": last["allocated_bytes"],
            }
            if "transfer_seconds" in last:
                ts = statistics.median(x["transfer_seconds"] for x in recs)
                sb = last["stream_h2d_bytes"]
                row.update(
                    transfer_seconds=ts,
                    transfer_share=ts / med if med else 0.0,
                    h2d_bytes_per_step=sb / cfg.new_tokens,
                    migration_bytes_per_step=last["migration_bytes"] / cfg.new_tokens,
                    h2d_gbps=(sb / ts / 1e9) if ts > 0 else None,
                    # the step time T1/T2 streaming alone would take at the measured peak: compare with ms_per_step
                    # to see whether transfers can hide under compute (they cannot once this exceeds the full step)
                    h2d_floor_ms_per_step=1e3 * (sb / cfg.new_tokens) / (peak * 1e9),
                    h2d_fraction_of_peak=((sb / ts / 1e9) / peak) if ts > 0 else None,
                    tokens=last["tokens"],
                    retiers=last["retiers"],
                    t1_mode=last["t1_mode"],
                    kernel=last.get("kernel"),
                    peak_device_kv_bytes=last["peak_device_kv_bytes"],
                )
            if (name == "full" and not params) or name in ("stock_sdpa", "stock_static"):  # the bases of the ratios
                base[name] = row["decode_tok_s"]
            rows.append(row)
        stock = max((base[k] for k in ("stock_sdpa", "stock_static") if k in base), default=None)
        mine = [r for r in rows if r["batch"] == B and r["linear"] == linear]
        med = {r["policy"]: r["ms_per_step_median"] for r in mine if not r["params"]}
        stock_med = min((med[k] for k in ("stock_sdpa", "stock_static") if k in med), default=None)
        for row in mine:
            row["ratio_to_full"] = row["decode_tok_s"] / base["full"]
            # against the faster of the two stock paths, measured in the same run
            row["ratio_to_stock"] = row["decode_tok_s"] / stock if stock else None
            row["median_ratio_to_full"] = med["full"] / row["ms_per_step_median"]
            row["median_ratio_to_stock"] = stock_med / row["ms_per_step_median"] if stock_med else None
        if on_rows:
            on_rows(_result(cfg, device, warmup, peak, floors, rows))


def step_floor(floors: dict, batch: int) -> dict:
    """The fastest a decode step of ``batch`` rows could be on this machine: every weight it needs read once at the
    measured read bandwidth, or every multiply-add done at the measured GEMM peak, whichever takes longer (ms). A
    mixture of experts needs only the experts its rows route to: ``E * (1 - (1 - k/E)^batch)`` of them read in
    expectation (uniform routing, as ``kvtier plan`` counts), and ``k`` of them multiplied per row."""
    w = floors["step_weight_bytes"]
    e, k, ew = floors.get("experts") or 0, floors.get("experts_per_token") or 0, floors.get("expert_weight_bytes") or 0
    read_bytes, mac_bytes = w, w
    if e and k and ew:
        touched = e * (1 - (1 - k / e) ** batch)
        read_bytes = w - ew * (1 - touched / e)
        mac_bytes = w - ew * (1 - k / e)
    read_ms = 1e3 * read_bytes / (floors["read_peak_gbps"] * 1e9)
    itemsize = floors.get("weight_itemsize", 2)
    flops = 2 * batch * mac_bytes / itemsize
    gemm_ms = 1e3 * flops / (floors["gemm_peak_gflops"] * 1e9) if floors.get("gemm_peak_gflops") else 0.0
    return {"floor_ms": max(read_ms, gemm_ms), "floor_kind": "bandwidth" if read_ms >= gemm_ms else "matmul"}


def _best_seconds(fn: Callable[[], object], device: torch.device, reps: int, warm: bool = False) -> float:
    """The fastest of ``reps`` synchronized calls of ``fn`` (``warm``: after one untimed call)."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def read_peak_gbps(device: torch.device, mib: int = 256, reps: int = 5) -> float:
    """Read bandwidth in GB/s: the best of ``reps`` sums over ``mib`` MiB of float32 (a read with no write back)."""
    x = torch.ones(mib * (1 << 18), device=device)
    return x.numel() * 4 / _best_seconds(x.sum, device, reps) / 1e9


def gemm_peak_gflops(model, device: torch.device, rows: int = 256, reps: int = 5) -> float:
    """Multiply-add throughput of the model's own largest projection (as the model runs it: packed or not) on
    ``rows`` rows, in GFLOP/s: best of ``reps``."""
    from torch import nn

    from ..step import PackedLinear

    lin = max((m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))),
              key=lambda m: m.in_features * m.out_features if m.out_features < 65536 else 0)  # not the vocab head
    x = torch.randn(rows, lin.in_features, device=device).to(model.dtype)
    with torch.no_grad():
        best = _best_seconds(lambda: lin(x), device, reps, warm=True)
    return 2 * rows * lin.in_features * lin.out_features / best / 1e9


def _result(cfg: BenchConfig, device: torch.device, warmup: int, peak: float, floors: dict, rows: list[dict]) -> dict:
    import kvtier

    for row in rows:  # against the floor as measured so far (the GEMM peak is the fastest linear mode's)
        row.update(step_floor(floors, row["batch"]))
        row["vs_floor"] = row["ms_per_step_median"] / row["floor_ms"] if row["floor_ms"] else None
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "kvtier": kvtier.__version__,
        "config": asdict(cfg),
        "warmup_steps": warmup,
        "memcpy_peak_gbps": peak,
        **floors,
        "cpu_isa": cpu_isa() if device.type == "cpu" else None,
        "results": rows,
    }
