"""Reference tables generated from the code itself: the command line (docs/CLI.md), the policy registry (docs/POLICIES.md) and the environment switches (docs/GUIDE.md); a test keeps the docs equal to them."""

from __future__ import annotations

import typer

from ..policies import POLICIES
from .common import app

END = "<!-- END generated -->"


def begin(name: str) -> str:
    return f"<!-- BEGIN generated {name} by `python -m kvtier.cli.reference` -->"


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(p) -> str:
    d = p.default
    if p.required:
        return "required"
    if d is None or d == [] or d == ():
        return ""
    if isinstance(d, bool):
        flag = p.opts[0] if d else (p.secondary_opts[0] if p.secondary_opts else "")
        return f"`{flag}`" if flag else str(d)
    return f"`{d}`"


def cli_markdown() -> str:
    """One section per command, in ``kvtier --help`` order: what it does, then a table of its arguments and options."""
    group = typer.main.get_command(app)
    out: list[str] = []
    for name, cmd in group.commands.items():
        out += [f"### `kvtier {name}`", "", " ".join((cmd.help or "").split()), "",
                "| argument / option | default | what |", "|---|---|---|"]
        for p in cmd.params:
            if getattr(p, "hidden", False):
                continue
            flag = p.name.upper() if p.param_type_name == "argument" else " / ".join(p.opts + p.secondary_opts)
            out.append(f"| `{flag}` | {_default(p)} | {_cell(p.help or '')} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def policies_markdown() -> str:
    """One row per registered policy: name, family, what it is, every parameter with its default."""
    out = ["| name | family | what | parameters (defaults) |", "|---|---|---|---|"]
    for name, cls in POLICIES.items():
        params = ", ".join(f"{k}={v!r}" for k, v in cls.params().items())
        out.append(f"| `{name}` | {cls.family} | {_cell(cls.description)} | `{params}` |")
    return "\n".join(out)


def switches_markdown() -> str:
    """Every ``KVTIER_*`` environment switch (:data:`kvtier.env.SWITCHES`)."""
    from ..env import markdown

    return markdown()


BLOCKS = {"cli": cli_markdown, "policies": policies_markdown, "switches": switches_markdown}


def splice(doc: str) -> str:
    """``doc`` with every generated block it holds replaced by the current one."""
    found = False
    for name, make in BLOCKS.items():
        head, sep, rest = doc.partition(begin(name))
        if not sep:
            continue
        _, sep2, tail = rest.partition(END)
        if not sep2:
            raise ValueError(f"no {END!r} after {begin(name)!r}")
        doc = head + begin(name) + "\n\n" + make() + "\n\n" + END + tail
        found = True
    if not found:
        raise ValueError("no generated block in the document")
    return doc


if __name__ == "__main__":  # python -m kvtier.cli.reference [FILE ...]: rewrite their generated blocks in place
    import sys
    from pathlib import Path

    for path in map(Path, sys.argv[1:] or ["docs/CLI.md", "docs/POLICIES.md", "docs/GUIDE.md"]):
        path.write_text(splice(path.read_text(encoding="utf-8")), encoding="utf-8")
