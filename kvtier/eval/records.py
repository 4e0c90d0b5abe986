"""Run folders: one writer at a time, records read without touching the file, resume keys that cover everything
that changes an answer.

A run folder holds ``records.jsonl`` (one JSON object per (configuration, problem, sample)), for sweeps run on Ray
also ``shards/*.jsonl`` (one file per task, each with one writer; together they *are* the run), and, while a writer
runs, ``.lock`` — an exclusive ``fcntl.flock`` that the kernel drops when the holder exits, even on SIGKILL, so a
killed run's lock is taken over by the next writer without any cleanup. Readers (``kvtier report``) never lock
and never write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

RECORDS = "records.jsonl"
SHARDS = "shards"  # distributed sweeps: one records file per (configuration, shard) task, never shared
LOCK = ".lock"
REQUIRED = ("config_key", "id", "benchmark", "policy", "params", "completion", "correct", "generated_tokens",
            "tier_tokens", "tier_bytes", "seconds")


class RecordsError(ValueError):
    """A records file or run folder cannot be used; the message names the file (and line) and what to do."""


class RunLock:
    """Exclusive writer lock on a run folder (a context manager)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        import fcntl

        path = self.run_dir / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                who = f" (PID {holder})" if holder else ""
                raise RecordsError(
                    f"run folder {self.run_dir} is in use by another kvtier process{who}; "
                    "wait for it to finish or give another --out"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def check_parents(path: Path, flag: str) -> None:
    """The nearest existing folder above ``path`` must be a folder, so that ``path`` can be created."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RecordsError(f"{flag} {path}: {parent} is a file, not a directory")
            return


def check_run_dir(run_dir: str | Path, flag: str = "--out") -> Path:
    """A run folder that can be created or reused; a clear error when it names a file."""
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise RecordsError(f"{flag} {p} is a file; give a directory (records go to {p}/{RECORDS})")
    check_parents(p, flag)
    return p


def parse_records(data: bytes, path: Path) -> tuple[list[dict], int]:
    """Records in ``data`` and the byte offset up to which the file is well formed.

    A last line without a newline is kept when it is a complete record (and counted as well formed once the
    writer adds the newline), and ignored when it is torn (a kill during a write). Any other unreadable line
    raises :class:`RecordsError` naming the file and the line.
    """
    out: list[dict] = []
    lines = data.split(b"\n")
    offset = 0
    for i, raw in enumerate(lines, start=1):
        last = i == len(lines)
        end = offset + len(raw) + (0 if last else 1)
        if raw.strip():
            try:
                rec = json.loads(raw.decode("utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                if last:  # torn tail: ignored by readers, cut by the next writer
                    log.warning("%s: ignoring a torn last line %d", path, i)
                    return out, offset
                raise RecordsError(f"{path} line {i} is not valid JSON ({e.__class__.__name__}: {e}); "
                                   "fix or remove that line") from None
            if not isinstance(rec, dict):
                raise RecordsError(f"{path} line {i} is not a kvtier record (a JSON object), got "
                                   f"{type(rec).__name__}; fix or remove that line")
            missing = [k for k in REQUIRED if k not in rec]
            if missing:
                raise RecordsError(f"{path} line {i} is not a kvtier record: missing {missing}; fix or remove that line")
            out.append(rec)
        offset = end
    return out, offset


def records_files(run_dir: str | Path) -> list[Path]:
    """``records.jsonl`` then every shard file, in name order."""
    run_dir = Path(run_dir)
    main = [run_dir / RECORDS] if (run_dir / RECORDS).is_file() else []
    return main + sorted((run_dir / SHARDS).glob("*.jsonl"))


def read_records(run_dir: str | Path, skip: Path | None = None) -> list[dict]:
    """Every record of a run folder, read-only (a torn last line is ignored, the file is never modified); ``skip``:
    a file the caller has read already (:func:`open_for_append` returns its records)."""
    out: list[dict] = []
    for path in records_files(run_dir):
        if skip is None or path != skip:
            out += parse_records(path.read_bytes(), path)[0]
    return out


def open_for_append(run_dir: Path, path: Path | None = None) -> tuple[list[dict], Path]:
    """For the lock holder (or a shard's one writer): the records of ``path`` (default ``records.jsonl``) so far,
    with a torn tail cut and a missing final newline added."""
    path = run_dir / RECORDS if path is None else path
    if not path.is_file():
        return [], path
    data = path.read_bytes()
    recs, good = parse_records(data, path)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
        data = data[:good]
    if data and not data.endswith(b"\n"):
        with open(path, "ab") as f:
            f.write(b"\n")
    return recs, path


def stable_hash(obj, n: int = 12) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def problem_hash(question: str, gold: str, choices: list[str]) -> str:
    """What a problem *is*: two problem sets with the same ids but other questions or golds differ here."""
    return stable_hash({"q": question, "gold": gold, "choices": list(choices)})


def dedupe(records: list[dict]) -> list[dict]:
    """One record per (config, problem, sample, problem content): the first written wins."""
    seen, out = set(), []
    for r in records:
        k = (r["config_key"], r["id"], r.get("sample", 0), r.get("problem_hash"))
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out
