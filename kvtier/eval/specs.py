"""A benchmark spec string: its base name and its one option (``math500?shuffle=7``), and the error for a bad one."""

from __future__ import annotations


class DataError(ValueError):
    """A benchmark could not be read; the message says what to pass instead."""


def split_benchmark(name: str) -> tuple[str, int | None]:
    """``math500?shuffle=7`` -> ("math500", 7): a file benchmark and the seed of a fixed permutation of its
    problems (``limit`` then takes a seeded random subset); ``rg:`` specs keep their own options."""
    if name.startswith("rg:") or "?" not in name:
        return name, None
    base, _, query = name.partition("?")
    k, eq, v = query.partition("=")
    if k != "shuffle" or not eq or not v.lstrip("-").isdigit():
        raise DataError(f"benchmark {name!r}: the only option of a file benchmark is ?shuffle=<integer seed>")
    return base, int(v)


def base_benchmark(name: str) -> str:
    """The benchmark whose prompt and grader a spec uses (``math500?shuffle=0`` -> ``math500``)."""
    return name if name.startswith("rg:") else name.partition("?")[0]
