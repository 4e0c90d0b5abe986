"""Resumable evaluation: one JSON line per (config, problem, sample), appended and flushed as each batch ends.

Killing a run loses at most the batch in flight; rerunning the same command skips what is recorded, never
duplicates, and tolerates a torn last line (it is cut off before appending).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from .datasets import Problem, check_benchmark, load_problems
from .grading import extract_answer, grade
from .prompts import build_prompt

log = logging.getLogger(__name__)
RECORDS = "records.jsonl"


@dataclass
class EvalConfig:
    """One evaluation configuration: a model, a benchmark, a policy with its parameters, generation settings."""

    model: str
    benchmark: str
    policy: str = "full"
    params: dict = field(default_factory=dict)
    limit: int | None = None
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    samples: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        from ..policies import get_policy

        check_benchmark(self.benchmark)
        get_policy(self.policy).check_params(self.params)
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"--limit must be an integer >= 1, got {self.limit!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"--samples must be an integer >= 1, got {self.samples!r}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("--temperature must be >= 0 and --top-p in (0, 1]")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("--samples > 1 needs --temperature > 0 (greedy samples would all be equal)")

    def key(self) -> str:
        """Identity of the configuration (problems excluded, limit excluded so a larger --limit resumes)."""
        d = asdict(self)
        d.pop("limit")
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def _repair_and_read(path: Path) -> list[dict]:
    """Records in ``path``; a torn last line (killed mid-write) is cut off so appends stay well formed."""
    if not path.exists():
        return []
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut != len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    out = []
    for line in data.decode("utf-8").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("skipping an unreadable line in %s", path)
    return out


def read_records(out_dir: str | Path) -> list[dict]:
    return _repair_and_read(Path(out_dir) / RECORDS)


def _row_stats(cache, row: int) -> dict:
    """Tier tokens and bytes of one batch row."""
    s = cache.stats()
    counts = cache.row_tokens(row)
    bpt = s.get("bytes_per_token", {})
    row_budget = getattr(cache, "row_budget", None)
    return {
        "tier_tokens": counts,
        "tier_bytes": {t: counts[t] * bpt.get(t, 0) for t in ("T0", "T1", "T2")},
        "budget_tokens": row_budget(row) if row_budget else None,
    }


def load_all(cfgs: list[EvalConfig], data_dir: str | Path | None = None) -> dict[str, list[Problem]]:
    """The problems of every benchmark the configurations need (each read once)."""
    problems: dict[str, list[Problem]] = {}
    for c in cfgs:
        if c.benchmark not in problems:
            lims = [x.limit for x in cfgs if x.benchmark == c.benchmark]
            problems[c.benchmark] = load_problems(c.benchmark, data_dir, None if None in lims else max(lims), c.seed)
    return problems


def run_eval(
    cfgs: Iterable[EvalConfig],
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    batch_size: int = 4,
    device: str = "auto",
    dtype: str = "auto",
    on_progress: Callable[[dict], None] | None = None,
    loaded: tuple | None = None,
    problems: dict[str, list[Problem]] | None = None,
) -> Path:
    """Evaluate every configuration; returns the records path. Configurations share one loaded model.

    ``problems`` (from :func:`load_all`) and ``loaded`` (model, tokenizer) may be prepared by the caller, so that
    every input error surfaces before anything starts.
    """
    import kvtier

    cfgs = list(cfgs)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
    if problems is None:
        problems = load_all(cfgs, data_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RECORDS
    done = {(r["config_key"], r["id"], r["sample"]) for r in _repair_and_read(path)}
    if loaded is None:
        loaded = kvtier.load_model(cfgs[0].model, device=device, dtype=dtype)
    model, tok = loaded
    todo = []
    for c in cfgs:
        probs = problems[c.benchmark][: c.limit] if c.limit else problems[c.benchmark]
        for p in probs:
            for s in range(c.samples):
                if (c.key(), p.id, s) not in done:
                    todo.append((c, p, s))
    total = len(todo)
    progress = {"done": 0, "total": total, "tokens": 0, "seconds": 0.0}
    if on_progress:
        on_progress(dict(progress))
    with open(path, "a", encoding="utf-8") as f:
        i = 0
        while i < total:
            c = todo[i][0]
            batch = [todo[i]]
            while len(batch) < batch_size and i + len(batch) < total and todo[i + len(batch)][0] is c:
                batch.append(todo[i + len(batch)])
            i += len(batch)
            recs = _run_batch(model, tok, c, batch)
            for r in recs:
                f.write(json.dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
            progress["done"] += len(batch)
            progress["tokens"] += sum(r["generated_tokens"] for r in recs)
            progress["seconds"] += recs[0]["batch_seconds"]
            if on_progress:
                on_progress(dict(progress))
    return path


def _as_set(ids) -> set[int]:
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


def _run_batch(model, tok, c: EvalConfig, batch: list) -> list[dict]:
    import kvtier

    prompts = [build_prompt(tok, c.benchmark, p) for _, p, _ in batch]
    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    cache = kvtier.make_cache(c.policy, model, **c.params)
    gen = dict(max_new_tokens=c.max_new_tokens, pad_token_id=tok.pad_token_id)
    if c.temperature > 0:
        torch.manual_seed(c.seed * 1_000_003 + batch[0][2])
        gen.update(do_sample=True, temperature=c.temperature, top_p=c.top_p)
    else:
        gen.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, cache=cache, **gen)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    plen = enc.input_ids.shape[1]
    eos = _as_set(tok.eos_token_id) | _as_set(getattr(model.generation_config, "eos_token_id", None))
    stats = cache.stats()
    recs = []
    for row, (cfg, p, s) in enumerate(batch):
        ids = out[row, plen:].tolist()
        n_gen = next((j + 1 for j, x in enumerate(ids) if x in eos or x == tok.pad_token_id), len(ids))
        text = tok.decode(ids[:n_gen], skip_special_tokens=True)
        recs.append({
            "benchmark": cfg.benchmark,
            "id": p.id,
            "sample": s,
            "config_key": cfg.key(),
            "policy": cfg.policy,
            "params": cfg.params,
            "model": cfg.model,
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "completion": text,
            "extracted": extract_answer(cfg.benchmark, text),
            "gold": p.gold,
            "correct": bool(grade(cfg.benchmark, text, p.gold)),
            "prompt_tokens": int(enc.attention_mask[row].sum()),
            "generated_tokens": n_gen,
            **_row_stats(cache, row),
            "peak_device_kv_bytes": stats.get("peak_device_kv_bytes"),
            "streamed_bytes": stats["transfer"]["stream_h2d_bytes"] / len(batch),
            "moved_bytes": (stats["transfer"]["migration_h2d_bytes"] + stats["transfer"]["migration_d2h_bytes"]) / len(batch),
            "batch_size": len(batch),
            "batch_seconds": dt,
            "seconds": dt / len(batch),
        })
    return recs
