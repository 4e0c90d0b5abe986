"""``kvtier``: a thin command line over the library (typer + rich), one module per command group.

Errors a user can fix print one line (:mod:`.common`); each command module registers itself on the one ``app``.
"""

from __future__ import annotations

import logging

# importing a command module registers its commands, in this order in ``kvtier --help``
# isort: off
from . import generate, serve, evals, bench, plan  # noqa: F401
# isort: on
from .common import app

__all__ = ["app", "main"]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()
