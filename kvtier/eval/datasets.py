"""Benchmarks: GSM8K, MATH-500, MATH Level 5, ARC-Challenge (JSONL in ``--data-dir`` or the hub) and reasoning-gym.

Each loader returns :class:`Problem` records with a stable ``id`` so that runs can resume and pair up.
``--data-dir`` holds ``<benchmark>/test.jsonl`` in the schemas of the shared data READMEs.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from .grading import extract_boxed
from .specs import FILE_OPTIONS, DataError, base_benchmark, benchmark_options

BENCHMARKS = ("gsm8k", "math500", "math_level5", "arc_challenge")
HUB = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "math_level5": ("EleutherAI/hendrycks_math", None, "test"),  # one config per subject; filtered to Level 5
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
}

MATH_SUBJECTS = ["algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus"]


class ProblemSet(list):
    """The problems read (a list) and ``fingerprint``: what was read — the file's content hash, the hub rows'
    hash, or the reasoning-gym task and seed — independent of ``limit`` so that a larger limit resumes."""

    fingerprint: str = ""


@dataclass
class Problem:
    id: str
    question: str
    gold: str
    choices: list[str] = field(default_factory=list)  # ARC: texts in order, labelled A, B, C, ... by position


def check_benchmark(name: str) -> None:
    if not isinstance(name, str):
        raise DataError(f"benchmark must be a string, got {name!r}")
    if name.startswith("rg:") and len(name) > 3:
        return
    if base_benchmark(name) in BENCHMARKS:
        benchmark_options(name)
        return
    raise DataError(f"benchmark must be one of {', '.join(BENCHMARKS)} (options: {FILE_OPTIONS}) "
                    f"or rg:<reasoning-gym task>, got {name!r}")


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, row) for every non-empty line; a bad line is a DataError naming the file and the line."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason})") from None
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path} line {i}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path} line {i}: expected a JSON object, got {type(row).__name__}")
        rows.append((i, row))
    return rows


def _gsm8k_gold(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


def gsm8k_steps(answer: str) -> int:
    """The reference solution's steps: its non-empty lines before the ``####`` answer line."""
    return sum(1 for line in answer.split("####")[0].splitlines() if line.strip())


# the fields each benchmark's rows must have (the shared data READMEs' schemas)
REQUIRED = {"gsm8k": ("question", "answer"), "math500": ("unique_id", "problem", "answer"),
            "math_level5": ("problem",), "arc_challenge": ("id", "question", "choices", "answerKey")}


def _one(name: str, i: int, r: dict) -> Problem:
    if name == "gsm8k":
        return Problem(f"gsm8k-{i}", str(r["question"]), _gsm8k_gold(str(r["answer"])))
    if name == "math500":
        return Problem(str(r["unique_id"]), str(r["problem"]), str(r["answer"]))
    if name == "math_level5":
        gold = r.get("answer") or extract_boxed(str(r.get("solution", ""))) or ""
        return Problem(f"math5-{r.get('idx', i)}", str(r["problem"]), str(gold))
    if name == "arc_challenge":
        choices = r["choices"]
        if isinstance(choices, dict):  # hub schema: {"text": [...], "label": [...]}
            choices = [{"label": lab, "text": t} for lab, t in zip(choices["label"], choices["text"])]
        labels = [c["label"] for c in choices]
        if r["answerKey"] not in labels:
            raise ValueError(f"answerKey {r['answerKey']!r} is not one of the choice labels {labels}")
        if len(labels) > 8:
            raise ValueError(f"{len(labels)} choices; at most 8 (A-H) are supported")
        gold = "ABCDEFGH"[labels.index(r["answerKey"])]  # numeric labels map by position
        return Problem(str(r["id"]), str(r["question"]), gold, [str(c["text"]) for c in choices])
    raise DataError(f"unknown benchmark {name!r}")


def _from_rows(name: str, rows: list[tuple[int, dict]], source: str) -> list[Problem]:
    """Problems from (line, row) pairs; ``source`` names the file (or the hub) in errors."""
    out = []
    for i, (line, r) in enumerate(rows):
        where = f"{source} line {line}" if line else f"{source} row {i}"
        missing = [k for k in REQUIRED[name] if k not in r]
        if missing:
            raise DataError(f"{where}: missing field(s) {missing} (a {name} row needs {list(REQUIRED[name])})")
        try:
            out.append(_one(name, i, r))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise DataError(f"{where}: {e}") from None
    if not out:
        raise DataError(f"{source} holds no problems")
    return out


def _from_hub(name: str) -> list[dict]:
    try:
        import datasets  # optional
    except ImportError:
        raise DataError(
            f"no --data-dir given and the `datasets` package is missing (pip install 'kvtier[hub]'); "
            f"or pass --data-dir DIR holding {name}/test.jsonl"
        ) from None
    repo, config, split = HUB[name]
    configs = MATH_SUBJECTS if name == "math_level5" else [config]
    try:
        rows = [dict(r) for c in configs for r in datasets.load_dataset(repo, c, split=split)]
    except Exception as e:  # offline, gated, renamed ...
        raise DataError(f"cannot read {repo} from the hub ({type(e).__name__}); pass --data-dir DIR holding {name}/test.jsonl") from None
    if name == "math_level5":
        rows = [dict(r, answer=extract_boxed(r["solution"]), idx=i) for i, r in enumerate(rows) if r.get("level") == "Level 5"]
    return rows


def _rg_value(v: str):
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_rg(spec: str) -> tuple[str, dict]:
    """``chain_sum?min_terms=2&max_digits=2`` -> ("chain_sum", {"min_terms": 2, "max_digits": 2}): a
    reasoning-gym task and its config fields (numbers, true/false, text)."""
    task, _, query = spec.partition("?")
    cfg = {}
    for part in filter(None, query.split("&")):
        k, eq, v = part.partition("=")
        if not eq or not k:
            raise DataError(f"rg:{spec}: task options are key=value pairs joined by '&', got {part!r}")
        cfg[k] = _rg_value(v)
    return task, cfg


def _reasoning_gym(spec: str, limit: int | None, seed: int) -> list[Problem]:
    try:
        import reasoning_gym
    except ImportError:
        raise DataError("rg:<task> needs reasoning-gym: pip install 'kvtier[eval]'") from None
    task, cfg = parse_rg(spec)
    size = limit or 100
    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **cfg)
    except Exception as e:
        raise DataError(f"reasoning-gym cannot build task {task!r} with options {cfg} ({type(e).__name__}: {e})") from None
    out = ProblemSet(Problem(f"rg-{spec}-{seed}-{i}", x["question"], str(x["answer"])) for i, x in enumerate(ds))
    out.fingerprint = f"rg:{spec}:seed{seed}"
    return out


def load_problems(name: str, data_dir: str | Path | None = None, limit: int | None = None, seed: int = 0) -> list[Problem]:
    """Problems of ``name`` (first ``limit``), from ``data_dir`` if given, else the hub; ``rg:<task>`` offline;
    ``<name>?shuffle=<seed>``: the first ``limit`` of a seeded permutation; ``gsm8k?steps=<lo>-<hi>``: only the
    problems whose reference solution has lo..hi steps (:func:`gsm8k_steps`). Ids are the whole file's either way."""
    check_benchmark(name)
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise DataError(f"--limit must be an integer >= 1, got {limit!r}")
    if name.startswith("rg:"):
        return _reasoning_gym(name[3:], limit, seed)
    name, opts = benchmark_options(name)
    if data_dir is not None:
        path = Path(data_dir).expanduser() / name / "test.jsonl"
        if not path.is_file():
            raise DataError(f"{path} does not exist; --data-dir must hold {name}/test.jsonl")
        rows, source = _read_jsonl(path), str(path)
        fingerprint = "file:" + hashlib.sha1(path.read_bytes()).hexdigest()[:16]
    else:
        rows, source = [(0, r) for r in _from_hub(name)], f"the hub's {HUB[name][0]}"
        fingerprint = ""
    probs = _from_rows(name, rows, source)
    if not fingerprint:
        fingerprint = "hub:" + hashlib.sha1(json.dumps([(p.id, p.question, p.gold, p.choices) for p in probs]).encode()).hexdigest()[:16]
    if opts.steps is not None:  # before the permutation: a stratum of the file, then its own seeded order
        lo, hi = opts.steps
        probs = [p for p, (_, r) in zip(probs, rows) if lo <= gsm8k_steps(str(r["answer"])) <= hi]
        if not probs:
            raise DataError(f"{source} holds no gsm8k problem with {lo}-{hi} reference steps")
        fingerprint += f":steps{lo}-{hi}"
    if opts.shuffle is not None:  # the whole set is permuted first, so a larger limit extends the same subset
        random.Random(opts.shuffle).shuffle(probs)
        fingerprint += f":shuffle{opts.shuffle}"
    out = ProblemSet(probs[:limit] if limit else probs)
    out.fingerprint = fingerprint
    return out

