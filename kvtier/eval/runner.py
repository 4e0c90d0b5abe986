"""Resumable evaluation: one JSON line per (config, problem, sample), appended and flushed as each batch ends.

Killing a run loses at most the batch in flight; rerunning the same command skips what is recorded, never
duplicates, and tolerates a torn last line (the writer cuts it; readers ignore it). One writer per run folder
(``records.RunLock``). A record is reused only when everything that changes an answer is the same: the model
(name and a fingerprint of its weights), dtype, device kind, the problem's content, the policy with every
parameter (defaults filled in, so ``--hbm-ratio 0.3`` and the default are one configuration), generation
settings and seed (``EvalConfig.key``). Sampled runs draw each (problem, sample) from its own seed, one at a
time, so results do not depend on how problems were batched.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..policies import validate_policy
from ..transfer import seam_for
from .datasets import Problem, check_benchmark, load_problems
from .grading import extract_answer, grade
from .prompts import build_prompt
from .records import RECORDS, RunLock, check_run_dir, dedupe, open_for_append, problem_hash, read_records, stable_hash

log = logging.getLogger(__name__)
__all__ = ["EvalConfig", "RECORDS", "load_all", "read_records", "run_eval", "validate_policy"]


SAMPLER = "row-seeded-v2"  # kvtier.eval.sampling.RowSampler over kvtier.sampling.sample_rows: temperature, top-p, one
# generator and one uniform per row a step (v1: one torch.multinomial per row; its records stay labelled v1)


# Parameters that choose how a policy computes, not what: float rounding at most. At their default they stay out
# of the resume key (adding one must not orphan every record made before it); the record says what ran.
IMPLEMENTATION_PARAMS = {"kernel": "auto"}


def key_params(full_params: dict) -> dict:
    return {k: v for k, v in full_params.items()
            if not (k in IMPLEMENTATION_PARAMS and v == IMPLEMENTATION_PARAMS[k])}


def _finite(name: str, x) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")


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
        check_benchmark(self.benchmark)
        if not isinstance(self.params, dict):
            raise ValueError(f"policy parameters must be a mapping, got {self.params!r}")
        self.full_params = validate_policy(self.policy, self.params)
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"--limit must be an integer >= 1, got {self.limit!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"--samples must be an integer >= 1, got {self.samples!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"--seed must be an integer, got {self.seed!r}")
        _finite("--temperature", self.temperature)
        _finite("--top-p", self.top_p)
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p!r}")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError("--samples > 1 needs --temperature > 0 (greedy samples would all be equal)")

    def key_inputs(self, identity: dict, problem_set: str = "") -> dict:
        """Everything that can change an answer (``limit`` and ``samples`` only add problems or samples);
        ``problem_set`` fingerprints what the benchmark's problems were read from."""
        return {
            **identity,
            "benchmark": self.benchmark,
            "problem_set": problem_set,
            "policy": self.policy,
            "params": key_params(self.full_params),
            "max_new_tokens": self.max_new_tokens,
            "temperature": float(self.temperature),
            "top_p": float(self.top_p) if self.temperature > 0 else 1.0,
            "seed": self.seed if self.temperature > 0 else 0,  # greedy decoding uses no randomness
            **({"sampler": SAMPLER} if self.temperature > 0 else {}),
        }

    def key(self, identity: dict, problem_set: str = "") -> str:
        return stable_hash(self.key_inputs(identity, problem_set))


def run_identity(name: str, model) -> dict:
    """The model side of a resume key: name, weights fingerprint, dtype, device kind."""
    from ..models import model_fingerprint

    dev = model.device
    kind = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return {"model": name, "model_fingerprint": model_fingerprint(name), "dtype": str(model.dtype).removeprefix("torch."),
            "device": kind}


def _row_stats(cache, row: int, s: dict) -> dict:
    """Tier tokens and bytes of one batch row (``s``: the batch's ``cache.stats()``, computed once)."""
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


def config_problems(c: EvalConfig, problems: dict[str, list[Problem]]) -> list[Problem]:
    """The problems configuration ``c`` evaluates: its benchmark's, the first ``limit`` of them."""
    return problems[c.benchmark][: c.limit] if c.limit else problems[c.benchmark]


def check_positions(cfgs: list[EvalConfig], problems: dict[str, list[Problem]], tok, limit: int | None) -> None:
    """Prompt + max_new_tokens must fit the model's positions (``max_position_embeddings``)."""
    if not limit:
        return
    longest: dict[tuple[str, int | None], tuple[int, str]] = {}  # (benchmark, limit) -> (prompt tokens, problem id)
    for c in cfgs:
        if c.max_new_tokens >= limit:
            raise ValueError(f"--max-new-tokens {c.max_new_tokens} does not fit the model's {limit} positions")
        k = (c.benchmark, c.limit)
        if k not in longest:
            probs = config_problems(c, problems)
            longest[k] = max((len(tok(build_prompt(tok, c.benchmark, p)).input_ids), p.id) for p in probs)
        n, pid = longest[k]
        if n + c.max_new_tokens > limit:
            raise ValueError(f"problem {pid}: {n} prompt tokens + --max-new-tokens {c.max_new_tokens} exceed the "
                             f"model's {limit} positions; lower --max-new-tokens")


def position_limit(model) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(cfg, "max_position_embeddings", None)


def sample_seed(seed: int, problem_id: str, sample: int) -> int:
    """A per-(problem, sample) seed, independent of batch composition and order."""
    return int(stable_hash([seed, problem_id, sample], n=15), 16)


def run_eval(
    cfgs: Iterable[EvalConfig],
    out_dir: str | Path,
    data_dir: str | Path | None = None,
    batch_size: int = 4,
    device: str = "auto",
    dtype: str = "auto",
    on_progress: Callable[[dict], None] | None = None,
    loaded: tuple | Callable[[], tuple] | None = None,
    problems: dict[str, list[Problem]] | None = None,
) -> list[str]:
    """Evaluate every configuration into ``out_dir/records.jsonl``; returns the configurations' keys.

    Everything is checked before the folder is touched; the folder is then locked (one writer), the model loaded
    (``loaded`` may be ``(model, tokenizer)`` or a callable returning it), prompt lengths checked against the
    model's positions, and only then does generation start.
    """
    import kvtier

    cfgs = list(cfgs)
    if not cfgs:
        raise ValueError("nothing to run: no configurations")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
    if len({c.model for c in cfgs}) != 1:
        raise ValueError("one run evaluates one model; got " + ", ".join(sorted({c.model for c in cfgs})))
    out = check_run_dir(out_dir)
    if problems is None:
        problems = load_all(cfgs, data_dir)
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out):
        existing, path = open_for_append(out)
        existing += read_records(out, skip=path)  # the shard files of an earlier Ray run
        if callable(loaded):
            loaded = loaded()
        elif loaded is None:
            loaded = kvtier.load_model(cfgs[0].model, device=device, dtype=dtype)
        model, tok = loaded
        check_positions(cfgs, problems, tok, position_limit(model))
        identity = run_identity(cfgs[0].model, model)
        keys, todo, sets = plan_todo(cfgs, problems, identity, existing)
        run_todo(model, tok, todo, path, batch_size, identity, sets, on_progress)
    return keys


def plan_todo(cfgs: list[EvalConfig], problems: dict[str, list[Problem]], identity: dict, existing: list[dict]):
    """The configurations' keys, and every (config, key, problem, sample, problem hash) not yet recorded."""
    sets = {b: getattr(ps, "fingerprint", "") for b, ps in problems.items()}
    keys = [c.key(identity, sets[c.benchmark]) for c in cfgs]
    done = {(r["config_key"], r["id"], r.get("sample", 0), r.get("problem_hash")) for r in dedupe(existing)}
    todo = []
    for c, key in zip(cfgs, keys):
        for p in config_problems(c, problems):
            ph = problem_hash(p.question, p.gold, p.choices)
            for s in range(c.samples):
                if (key, p.id, s, ph) not in done:
                    done.add((key, p.id, s, ph))  # a config listed twice runs once
                    todo.append((c, key, p, s, ph))
    return keys, todo, sets


def warm_up(model, tok, configs: list[EvalConfig]) -> float:
    """One untimed two-token greedy generation per configuration, so that first-use costs (the fused CPU kernel's
    build and load, the allocator's and the BLAS libraries' first calls) are paid here and not inside the first
    timed batch, which made the first policy of a run look slower than the rest. Returns the seconds it took."""
    import kvtier

    from ..compat import cache_kw
    from ..step.decode import decode_kw

    t = time.perf_counter()
    ids = tok(["warm up"], return_tensors="pt").input_ids.to(model.device)
    for c in configs:
        cache = kvtier.make_cache(c.policy, model, **c.params)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kw(model, cache), **decode_kw(),
                           max_new_tokens=2, do_sample=False, temperature=None, top_p=None, top_k=None,
                           pad_token_id=tok.pad_token_id)
    seam_for(model.device).synchronize(model.device)
    return time.perf_counter() - t


def run_todo(model, tok, todo, path: Path, batch_size: int, identity: dict, sets: dict, on_progress) -> dict:
    """Generate ``todo`` in batches, appending each batch's records to ``path``; returns the progress counts (with
    ``warmup_seconds``: the untimed warm-up before the first batch, :func:`warm_up`)."""
    total = len(todo)
    distinct = list({key: c for c, key, *_ in todo}.values())
    progress = {"done": 0, "total": total, "tokens": 0, "seconds": 0.0,
                "warmup_seconds": warm_up(model, tok, distinct) if todo else 0.0}
    if on_progress:
        on_progress(dict(progress))
    f = None
    try:
        i = 0
        while i < total:
            c, key = todo[i][0], todo[i][1]
            batch = [todo[i]]
            while len(batch) < batch_size and i + len(batch) < total and todo[i + len(batch)][1] == key:
                batch.append(todo[i + len(batch)])
            i += len(batch)
            recs = _run_batch(model, tok, c, key, batch, c.key_inputs(identity, sets[c.benchmark]))
            if f is None:  # opened at the first record: a run that produces nothing leaves no file
                f = open(path, "a", encoding="utf-8")
            for r in recs:
                f.write(json.dumps(r, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            progress["done"] += len(batch)
            progress["tokens"] += sum(r["generated_tokens"] for r in recs)
            progress["seconds"] += recs[0]["batch_seconds"]
            if on_progress:
                on_progress(dict(progress))
    finally:
        if f is not None:
            f.close()
    return progress


def _as_set(ids) -> set[int]:
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


def _run_batch(model, tok, c: EvalConfig, key: str, batch: list, key_inputs: dict) -> list[dict]:
    import kvtier

    from transformers import StoppingCriteriaList

    from ..compat import cache_kw
    from ..kernels.cpu import machine
    from ..step.decode import decode_kw
    from ..tiers.tiermap import cache_codes, compact, sequence_map, token_pieces
    from .answer_step import AnswerSteps

    prompts = [build_prompt(tok, c.benchmark, p) for _, _, p, _, _ in batch]
    enc = tok(prompts, return_tensors="pt", padding=True).to(model.device)
    cache = kvtier.make_cache(c.policy, model, **c.params)
    gen = dict(max_new_tokens=c.max_new_tokens, pad_token_id=tok.pad_token_id)
    gen.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if c.temperature > 0:  # every row draws from its own (problem, sample) seed, whatever shares its batch
        from transformers import LogitsProcessorList

        from .sampling import RowSampler

        seeds = [sample_seed(c.seed, p.id, s) for _, _, p, s, _ in batch]
        gen["logits_processor"] = LogitsProcessorList([RowSampler(seeds, c.temperature, c.top_p, model.device)])
    plen = enc.input_ids.shape[1]
    eos = _as_set(tok.eos_token_id) | _as_set(getattr(model.generation_config, "eos_token_id", None))
    answers = AnswerSteps(cache, eos | _as_set(tok.pad_token_id), plen)
    gen["stopping_criteria"] = StoppingCriteriaList([answers])
    sync = seam_for(model.device).synchronize  # the device's queued work inside the timed span, none outside
    sync(model.device)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**enc, **cache_kw(model, cache), **gen, **decode_kw())
    sync(model.device)
    dt = time.perf_counter() - t
    answers.finish(len(batch), out.shape[1] - plen - 1)
    stats = cache.stats()
    codes = cache_codes(cache)
    host = machine(model.device)  # bf16 rounds differently by CPU kind: a record says which one made it
    recs = []
    for row, (cfg, _, p, s, ph) in enumerate(batch):
        ids = out[row, plen:].tolist()
        n_gen = next((j + 1 for j, x in enumerate(ids) if x in eos or x == tok.pad_token_id), len(ids))
        text = tok.decode(ids[:n_gen], skip_special_tokens=True)
        n_prompt = int(enc.attention_mask[row].sum())
        pieces = [""] * n_prompt + token_pieces(tok, ids[:n_gen], text)
        tmap = sequence_map(cache, row, plen - n_prompt, n_prompt + n_gen, pieces, n_prompt, details=False, codes=codes)
        recs.append({
            "benchmark": cfg.benchmark,
            "id": p.id,
            "sample": s,
            "config_key": key,
            "problem_hash": ph,
            "key_inputs": key_inputs,
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
            "prompt_tokens": n_prompt,
            "generated_tokens": n_gen,
            "tier_map": compact(tmap, n_prompt),
            "answer_step": answers.as_record(row),
            **_row_stats(cache, row, stats),
            "peak_device_kv_bytes": stats.get("peak_device_kv_bytes"),
            "peak_device_tokens": stats.get("peak_device_tokens"),
            "kernel": (stats.get("kernel") or {}).get("current"),
            "streamed_bytes": stats["transfer"]["stream_h2d_bytes"] / len(batch),
            "moved_bytes": (stats["transfer"]["migration_h2d_bytes"] + stats["transfer"]["migration_d2h_bytes"]) / len(batch),
            "batch_size": len(batch),
            "machine": host,
            "batch_seconds": dt,
            "seconds": dt / len(batch),
        })
    return recs
