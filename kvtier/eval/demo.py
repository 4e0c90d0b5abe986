"""The offline demo (``make demo``): the embedded model on fresh reasoning-gym problems, three caches, one table
and one HTML report."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..models import EMBEDDED_NAME
from .records import dedupe
from .configs import device_kv_bytes
from .runner import EvalConfig, read_records, run_eval

# Chosen by benchmarks/probes/demo_task_search.py (results/demo_search_2026-12-01): the task the embedded model solves
# most often among those searched, where the answer needs numbers from the prompt (eviction destroys them).
DEMO_BENCHMARK = "rg:chain_sum?min_terms=3&max_terms=4&max_digits=2"
# The authors' setting for the eviction comparison: the prompt is not protected, and a short recent window, so
# that on demo-length chains (a few hundred tokens) the ratios act on most of the sequence, the question included.
DEMO_SHARED = {"protect_prompt": False, "recent_window": 32}
DEMO_CONFIGS = [
    ("full", {}),
    ("tiered", {"hbm_ratio": 0.3, "evict_ratio": 0.03, **DEMO_SHARED}),
    ("evict", {"evict_ratio": 0.5, **DEMO_SHARED}),
]


def run_demo(model: str = EMBEDDED_NAME, problems: int = 16, max_new_tokens: int = 256, batch_size: int = 16,
             out: str | Path = "runs/demo", device: str = "auto", dtype: str = "auto",
             on_progress: Callable[[dict], None] | None = None, loaded=None,
             benchmark: str = DEMO_BENCHMARK) -> list[dict]:
    cfgs = [EvalConfig(model=model, benchmark=benchmark, policy=p, params=dict(q), limit=problems,
                       max_new_tokens=max_new_tokens) for p, q in DEMO_CONFIGS]
    keys = run_eval(cfgs, out, batch_size=batch_size, device=device, dtype=dtype, on_progress=on_progress, loaded=loaded)
    return demo_table(dedupe(read_records(out)), cfgs, keys)


def demo_table(records: list[dict], cfgs: list[EvalConfig], keys: list[str]) -> list[dict]:
    by_key = {k: [r for r in records if r["config_key"] == k] for k in keys}
    full = {r["id"]: r for r in by_key[keys[0]]}
    rows = []
    for c, k in zip(cfgs, keys):
        recs = by_key[k]
        gen = sum(r["generated_tokens"] for r in recs)
        secs = sum(r["seconds"] for r in recs)
        # resident KV at each batch's peak, per sequence (as the report counts it), not the buffers' capacity:
        # each cache grows its buffers in its own granules
        peak = sum(device_kv_bytes(r) for r in recs)
        full_peak = sum(device_kv_bytes(r) for r in full.values())
        same = sum(r["completion"] == full[r["id"]]["completion"] for r in recs if r["id"] in full)
        same_ans = sum(r["extracted"] == full[r["id"]]["extracted"] for r in recs if r["id"] in full)
        rows.append({
            "policy": c.policy,
            "params": c.params,
            "problems": len(recs),
            "accuracy": sum(r["correct"] for r in recs) / max(1, len(recs)),
            "generated_tokens": gen,
            "device_kv_mib": peak / 2**20,
            "device_kv_vs_full": peak / full_peak if full_peak else None,
            "moved_mib": sum(r["moved_bytes"] for r in recs) / 2**20,
            "streamed_mib": sum(r["streamed_bytes"] for r in recs) / 2**20,
            "tok_s": gen / secs if secs else 0.0,
            "identical_completions": same,
            "identical_answers": same_ans,
        })
    return rows
