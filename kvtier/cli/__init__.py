"""``kvtier``: a thin command line over the library (typer + rich), one module per command group.

Errors a user can fix print one line (:mod:`.common`); each command module registers itself on the one ``app``.
"""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")

# importing a command module registers its commands, in this order in ``kvtier --help``
# isort: off
from . import generate, serve, evals, bench, plan  # noqa: F401
# isort: on
from .common import app

__all__ = ["DEBUG_FORMAT", "app", "main"]

# KVTIER_LOG=debug lines carry their time (benchmarks/serve/serve_steps.py reads the served steps' timing from them)
DEBUG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def main() -> None:
    from ..env import choice

    try:
        level = choice("KVTIER_LOG")
    except ValueError as e:  # before any command runs: one line, as the commands' own errors
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=level.upper(), format=DEBUG_FORMAT
                        if level == "debug" else "%(levelname)s %(name)s: %(message)s")
    app()
