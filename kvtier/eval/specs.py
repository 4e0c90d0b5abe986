"""A benchmark spec string: its base name and its options (``math500?shuffle=7``, ``gsm8k?steps=5-11``), and the error for a bad one."""

from __future__ import annotations

from dataclasses import dataclass

FILE_OPTIONS = "?shuffle=<integer seed> and, for gsm8k, ?steps=<n> or <lo>-<hi> (joined by '&')"


class DataError(ValueError):
    """A benchmark could not be read; the message says what to pass instead."""


@dataclass(frozen=True)
class BenchOptions:
    """A file benchmark's options: ``shuffle``, the seed of a fixed permutation of its problems (``limit`` then
    takes a seeded random subset); ``steps`` (lo, hi), GSM8K only: keep the problems whose reference solution
    takes lo..hi lines before its ``####`` answer (a length knob that the data itself carries)."""

    shuffle: int | None = None
    steps: tuple[int, int] | None = None


def _steps(name: str, v: str) -> tuple[int, int]:
    lo, dash, hi = v.partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()):
        raise DataError(f"benchmark {name!r}: steps must be <n> or <lo>-<hi> (integers >= 1), got {v!r}")
    a, b = int(lo), int(hi) if dash else int(lo)
    if a < 1 or b < a:
        raise DataError(f"benchmark {name!r}: steps must be <n> or <lo>-<hi> with 1 <= lo <= hi, got {v!r}")
    return a, b


def benchmark_options(name: str) -> tuple[str, BenchOptions]:
    """``gsm8k?steps=2-3&shuffle=7`` -> ("gsm8k", BenchOptions(shuffle=7, steps=(2, 3))); ``rg:`` specs keep their
    own options (returned whole, with no file options)."""
    if name.startswith("rg:") or "?" not in name:
        return name, BenchOptions()
    base, _, query = name.partition("?")
    seen: dict[str, object] = {}
    for part in query.split("&"):
        k, eq, v = part.partition("=")
        if not eq or k in seen:
            raise DataError(f"benchmark {name!r}: the options of a file benchmark are {FILE_OPTIONS}, each once")
        if k == "shuffle" and v.lstrip("-").isdigit() and v not in ("", "-"):
            seen[k] = int(v)
        elif k == "steps" and base == "gsm8k":
            seen[k] = _steps(name, v)
        else:
            raise DataError(f"benchmark {name!r}: the options of a file benchmark are {FILE_OPTIONS}")
    return base, BenchOptions(**seen)


def base_benchmark(name: str) -> str:
    """The benchmark whose prompt and grader a spec uses (``math500?shuffle=0`` -> ``math500``)."""
    return name if name.startswith("rg:") else name.partition("?")[0]
