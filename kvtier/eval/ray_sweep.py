"""Sweeps on a Ray cluster (``kvtier sweep ... --ray auto|ADDRESS``; the ``kvtier[ray]`` extra).

The driver (one per run folder: it holds the folder's lock) plans exactly what ``run_eval`` would run — every
(configuration, problem, sample) key not yet recorded — and cuts each configuration's missing keys into
``shards`` tasks. Workers are Ray actors, one per GPU (``gpus_per_task``) or per CPU slot, each loading the model
once and reusing it across tasks. A task writes its own file, ``shards/<config key>-<shard>.jsonl``, so writers
never share a file; the records of all shards *are* the run (``read_records`` and ``kvtier report`` read them
all). A task first re-reads what is recorded and runs only what is still missing, so a retried or rerun task
never duplicates a key, and a worker killed mid-task loses at most its batch in flight. A failed task is retried
on a fresh worker up to ``max_retries`` times, then reported: the driver raises, naming it, after the others end.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .records import SHARDS, RunLock, check_run_dir, open_for_append, read_records
from .runner import EvalConfig, run_todo, check_positions, load_all, plan_todo, position_limit, run_identity

log = logging.getLogger(__name__)


class RaySweepError(RuntimeError):
    """Some tasks failed after their retries; the message names them (everything else was recorded)."""


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'kvtier[ray]'") from None
    return ray


def connect(address: str) -> None:
    """``auto``: the running cluster if there is one (or the session already initialised), else a local one."""
    ray = _ray()
    if ray.is_initialized():
        return
    if address == "auto":
        try:
            ray.init(address="auto", log_to_driver=False)
        except ConnectionError:
            ray.init(log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


class SweepWorker:
    """A Ray actor: one model, loaded once, then any number of tasks."""

    def __init__(self, model: str, device: str, dtype: str, data_dir: str | None):
        import kvtier

        self.data_dir = data_dir
        self.model, self.tok = kvtier.load_model(model, device=device, dtype=dtype)
        self._identity = run_identity(model, self.model)  # a weights fingerprint: once, not per task
        self._problems: dict[tuple, dict] = {}  # every task of one configuration reads the same problems

    def pid(self) -> int:
        return os.getpid()

    def identity(self) -> dict:
        return self._identity

    def problems(self, cfgs: list[EvalConfig]) -> dict:
        key = tuple((c.benchmark, c.limit, c.seed) for c in cfgs)
        if key not in self._problems:
            self._problems[key] = load_all(cfgs, self.data_dir)
        return self._problems[key]

    def check(self, cfgs: list[EvalConfig]) -> None:
        """Prompt + max_new_tokens within the model's positions (raises ValueError naming the problem)."""
        check_positions(cfgs, self.problems(cfgs), self.tok, position_limit(self.model))

    def run(self, out_dir: str, cfgs: list[EvalConfig], ids: list[tuple[str, int]], shard: str, batch_size: int) -> dict:
        """Run configuration ``cfgs[0]``'s (problem id, sample) pairs ``ids`` that are still unrecorded, into
        ``shards/<shard>.jsonl``; returns the counts (done, tokens, seconds)."""
        out = Path(out_dir)
        identity = self._identity
        (out / SHARDS).mkdir(parents=True, exist_ok=True)
        mine, path = open_for_append(out, out / SHARDS / f"{shard}.jsonl")  # cut a torn tail left by a killed worker
        _, todo, sets = plan_todo(cfgs, self.problems(cfgs), identity, mine + read_records(out, skip=path))
        want = set(ids)
        todo = [t for t in todo if (t[2].id, t[3]) in want]
        return run_todo(self.model, self.tok, todo, path, batch_size, identity, sets, None)


@dataclass
class _Task:
    cfg: EvalConfig
    ids: list[tuple[str, int]]
    shard: str
    attempts: int = 0


def run_eval_ray(cfgs: list[EvalConfig], out_dir: str | Path, address: str = "auto", workers: int | None = None,
                 gpus_per_task: float = 0.0, shards: int = 2, batch_size: int = 4, device: str = "auto",
                 dtype: str = "auto", data_dir: str | Path | None = None, max_retries: int = 2,
                 on_progress: Callable[[dict], None] | None = None,
                 on_workers: Callable[[list[int]], None] | None = None) -> list[str]:
    """Like :func:`kvtier.eval.runner.run_eval`, with the work spread over Ray actors; returns the keys.

    ``workers``: actors to start (default: one per ``gpus_per_task`` GPUs of the cluster, or 2 without GPUs).
    ``on_workers`` receives the actors' PIDs once they are up (tests kill one).
    """
    ray = _ray()
    cfgs = list(cfgs)
    if not cfgs:
        raise ValueError("nothing to run: no configurations")
    if len({c.model for c in cfgs}) != 1:
        raise ValueError("one run evaluates one model; got " + ", ".join(sorted({c.model for c in cfgs})))
    for name, v in (("--shards", shards), ("--batch-size", batch_size), ("--max-retries", max_retries + 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= {1 if name != '--max-retries' else 0}, got {v!r}")
    if isinstance(gpus_per_task, bool) or not isinstance(gpus_per_task, (int, float)) or gpus_per_task < 0:
        raise ValueError(f"--gpus-per-task must be a number >= 0, got {gpus_per_task!r}")
    out = check_run_dir(out_dir)
    problems = load_all(cfgs, data_dir)
    out.mkdir(parents=True, exist_ok=True)
    with RunLock(out):
        connect(address)
        if workers is None:
            gpus = ray.cluster_resources().get("GPU", 0)
            workers = max(1, int(gpus // gpus_per_task)) if gpus_per_task and gpus else 2
        opts = {"num_gpus": gpus_per_task, "num_cpus": 0 if gpus_per_task else 1, "max_restarts": 0}
        Actor = ray.remote(**opts)(SweepWorker)
        dd = str(data_dir) if data_dir is not None else None

        def start():
            return Actor.remote(cfgs[0].model, device, dtype, dd)

        actors = [start() for _ in range(workers)]
        pids = ray.get([a.pid.remote() for a in actors])
        if on_workers:
            on_workers(pids)
        identity = ray.get(actors[0].identity.remote())
        try:
            ray.get(actors[0].check.remote(cfgs))
        except ray.exceptions.RayTaskError as e:
            for a in actors:
                ray.kill(a)
            raise ValueError(str(e.cause) if getattr(e, "cause", None) else str(e).splitlines()[-1]) from None
        keys, todo, _ = plan_todo(cfgs, problems, identity, read_records(out))
        tasks: list[_Task] = []
        for c, key in zip(cfgs, keys):
            mine = [(p.id, s) for cc, k, p, s, _ in todo if k == key and cc is c]
            if not mine:
                continue
            n = min(shards, len(mine))
            for i in range(n):
                part = mine[i * len(mine) // n: (i + 1) * len(mine) // n]
                tasks.append(_Task(c, part, f"{key}-{i + 1}of{n}"))
        total = sum(len(t.ids) for t in tasks)
        progress = {"done": 0, "total": total, "tokens": 0, "seconds": 0.0}  # seconds: generation, summed over workers
        if on_progress:
            on_progress(dict(progress))
        pending = list(tasks)
        running: dict = {}  # object ref -> (task, actor index)
        idle = list(range(len(actors)))
        failed: list[tuple[_Task, str]] = []
        while pending or running:
            while pending and idle:
                t, a = pending.pop(0), idle.pop(0)
                t.attempts += 1
                ref = actors[a].run.remote(str(out), [t.cfg], t.ids, t.shard, batch_size)
                running[ref] = (t, a)
            ready, _ = ray.wait(list(running), num_returns=1)
            ref = ready[0]
            t, a = running.pop(ref)
            try:
                got = ray.get(ref)
                progress["done"] += len(t.ids)  # ran now, or found recorded by an earlier attempt
                progress["tokens"] += got["tokens"]
                progress["seconds"] += got["seconds"]
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.WorkerCrashedError) as e:
                log.warning("task %s failed (attempt %d): %s", t.shard, t.attempts, type(e).__name__)
                if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)):
                    actors[a] = start()  # the worker died: a fresh one (loads the model once)
                if t.attempts <= max_retries:
                    pending.append(t)
                else:
                    failed.append((t, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            idle.append(a)
            if on_progress:
                on_progress(dict(progress))
        for a in actors:
            ray.kill(a)
        if failed:
            raise RaySweepError("; ".join(f"task {t.shard} ({len(t.ids)} problems) failed {t.attempts} times: {why}"
                                          for t, why in failed) + ". Rerun the same command to retry them.")
    return keys
