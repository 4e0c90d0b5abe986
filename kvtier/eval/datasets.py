"""Benchmarks: GSM8K, MATH-500, MATH Level 5, ARC-Challenge (JSONL in ``--data-dir`` or the hub) and reasoning-gym.

Each loader returns :class:`Problem` records with a stable ``id`` so that runs can resume and pair up.
``--data-dir`` holds ``<benchmark>/test.jsonl`` in the schemas of the shared data READMEs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARKS = ("gsm8k", "math500", "math_level5", "arc_challenge")
HUB = {
    "gsm8k": ("openai/gsm8k", "main", "test"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test"),
    "math_level5": ("EleutherAI/hendrycks_math", None, "test"),  # one config per subject; filtered to Level 5
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
}

MATH_SUBJECTS = ["algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                 "prealgebra", "precalculus"]


class DataError(ValueError):
    """A benchmark could not be read; the message says what to pass instead."""


@dataclass
class Problem:
    id: str
    question: str
    gold: str
    choices: list[str] = field(default_factory=list)  # ARC: texts in order, labelled A, B, C, ... by position


def check_benchmark(name: str) -> None:
    if name in BENCHMARKS or (name.startswith("rg:") and len(name) > 3):
        return
    raise DataError(f"benchmark must be one of {', '.join(BENCHMARKS)} or rg:<reasoning-gym task>, got {name!r}")


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _gsm8k_gold(answer: str) -> str:
    return answer.split("####")[-1].strip().replace(",", "")


def _from_rows(name: str, rows: list[dict]) -> list[Problem]:
    if name == "gsm8k":
        return [Problem(f"gsm8k-{i}", r["question"], _gsm8k_gold(r["answer"])) for i, r in enumerate(rows)]
    if name == "math500":
        return [Problem(r["unique_id"], r["problem"], r["answer"]) for r in rows]
    if name == "math_level5":
        from .grading import extract_boxed

        out = []
        for i, r in enumerate(rows):
            gold = r.get("answer") or extract_boxed(r["solution"]) or ""
            out.append(Problem(f"math5-{r.get('idx', i)}", r["problem"], gold))
        return out
    if name == "arc_challenge":
        out = []
        for r in rows:
            choices = r["choices"]
            if isinstance(choices, dict):  # hub schema: {"text": [...], "label": [...]}
                choices = [{"label": lab, "text": t} for lab, t in zip(choices["label"], choices["text"])]
            labels = [c["label"] for c in choices]
            gold = "ABCDEFGH"[labels.index(r["answerKey"])]  # numeric labels map by position
            out.append(Problem(r["id"], r["question"], gold, [c["text"] for c in choices]))
        return out
    raise DataError(f"unknown benchmark {name!r}")


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
        from .grading import extract_boxed

        rows = [dict(r, answer=extract_boxed(r["solution"]), idx=i) for i, r in enumerate(rows) if r.get("level") == "Level 5"]
    return rows


def _reasoning_gym(task: str, limit: int | None, seed: int) -> list[Problem]:
    try:
        import reasoning_gym
    except ImportError:
        raise DataError("rg:<task> needs reasoning-gym: pip install 'kvtier[eval]'") from None
    size = limit or 100
    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed)
    except Exception as e:
        raise DataError(f"reasoning-gym has no task {task!r} ({e})") from None
    return [Problem(f"rg-{task}-{seed}-{i}", x["question"], str(x["answer"])) for i, x in enumerate(ds)]


def load_problems(name: str, data_dir: str | Path | None = None, limit: int | None = None, seed: int = 0) -> list[Problem]:
    """Problems of ``name`` (first ``limit``), from ``data_dir`` if given, else the hub; ``rg:<task>`` offline."""
    check_benchmark(name)
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise DataError(f"--limit must be an integer >= 1, got {limit!r}")
    if name.startswith("rg:"):
        return _reasoning_gym(name[3:], limit, seed)
    if data_dir is not None:
        path = Path(data_dir).expanduser() / name / "test.jsonl"
        if not path.is_file():
            raise DataError(f"{path} does not exist; --data-dir must hold {name}/test.jsonl")
        rows = _read_jsonl(path)
    else:
        rows = _from_hub(name)
    probs = _from_rows(name, rows)
    return probs[:limit] if limit else probs

