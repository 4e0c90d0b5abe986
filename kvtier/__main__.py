"""``python -m kvtier``: the command line (kvtier.cli)."""

from .cli import main

main()
