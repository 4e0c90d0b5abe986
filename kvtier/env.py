"""Every ``KVTIER_*`` environment switch in one table (its values, default and meaning), read and checked here and nowhere else.

A value outside a switch's vocabulary is one ``ValueError`` naming the variable and what it allows, raised where the
switch is first read. On/off switches share one vocabulary (:data:`ON`, :data:`OFF`). ``docs/GUIDE.md``'s table of
them is generated from :data:`SWITCHES` (``python -m kvtier.cli.reference``; a test keeps it current), and a test
checks that every ``KVTIER_`` name the package mentions is declared here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ON = ("1", "on", "true", "yes")
OFF = ("0", "off", "false", "no")


@dataclass(frozen=True)
class Switch:
    """One environment variable: ``kind`` is ``choice`` (one of ``choices``), ``onoff`` (:data:`ON` / :data:`OFF`),
    ``path``, ``seconds`` (a number >= 0), ``march`` (a gcc ``-march=`` target) or ``keys`` (comma-separated API
    keys, read by the command line's option); ``default`` as the docs show it."""

    name: str
    kind: str
    default: str
    what: str
    choices: tuple[str, ...] = ()
    flag: str = ""  # the command-line option or library argument that does the same, if any

    def allowed(self) -> str:
        return {"choice": " | ".join(self.choices), "onoff": " | ".join(ON + OFF), "path": "a directory",
                "seconds": "seconds >= 0", "march": "a gcc -march= target (native, x86-64-v3, ...)",
                "keys": "keys, comma-separated"}[self.kind]


SWITCHES: dict[str, Switch] = {s.name: s for s in (
    Switch("KVTIER_CACHE", "path", "~/.cache/kvtier", "where the embedded and downloaded models are converted and "
           "kept (and the kernels built, unless KVTIER_KERNEL_DIR says otherwise)"),
    Switch("KVTIER_KERNEL", "choice", "auto", "auto: build and use the fused CPU kernels where the machine can; "
           "eager: never build them (the eager paths, for debugging or a machine without a compiler)",
           ("auto", "eager"), "a cache's kernel= option"),
    Switch("KVTIER_KERNEL_DIR", "path", "$KVTIER_CACHE/kernels", "where the kernels are built, one folder per "
           "source, flags, torch version and CPU"),
    Switch("KVTIER_KERNEL_MARCH", "march", "native", "the -march= target the kernels are compiled for "
           "(x86-64-v3: what an AVX2-only CPU runs; make test-isa)"),
    Switch("KVTIER_LINEAR", "choice", "auto", "how a loaded model's projections run on a CPU: auto (prepacked "
           "where measured faster, norms fused), packed, eager (stock F.linear and norms, bit for bit)",
           ("auto", "packed", "eager"), "kvtier --linear, load_model(linear=...)"),
    Switch("KVTIER_LINEAR_KERNEL", "choice", "auto", "packed bf16 projections: auto (kvtier's AMX tiles where the "
           "CPU has AMX), onednn (oneDNN's always)", ("auto", "onednn")),
    Switch("KVTIER_DIRECT", "onoff", "1", "decode through kvtier.step.direct (the model's ops without "
           "transformers' module plumbing, checked bit for bit); off: generate's loop on the model's forward",
           flag="kvtier serve --no-direct-step"),
    Switch("KVTIER_MALLOC", "choice", "keep", "keep: glibc keeps freed K/V memory for reuse (mmap and trim "
           "thresholds raised once per process); system: glibc's defaults", ("keep", "system")),
    Switch("KVTIER_LOG", "choice", "warning", "the command line's log level (debug lines carry their time)",
           ("debug", "info", "warning", "error")),
    Switch("KVTIER_PROGRESS_INTERVAL", "seconds", "10", "seconds between plain progress lines when the output is "
           "not a terminal (logs, CI)"),
    Switch("KVTIER_API_KEY", "keys", "", "the keys kvtier serve requires as 'Authorization: Bearer KEY'",
           flag="kvtier serve --api-key"),
)}


def raw(name: str) -> str:
    """The variable's value as set, stripped (``""`` when unset); ``name`` must be declared."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a declared switch (kvtier/env.py)")
    return os.environ.get(name, "").strip()


def _bad(s: Switch, v: str) -> ValueError:
    return ValueError(f"{s.name} must be {'one of ' if s.kind in ('choice', 'onoff') else ''}{s.allowed()}, got {v!r}")


def choice(name: str) -> str:
    """A ``choice`` switch's value (lower-cased), its default when unset."""
    s = SWITCHES[name]
    v = raw(name).lower() or s.default
    if v not in s.choices:
        raise _bad(s, v)
    return v


def on(name: str) -> bool:
    """An ``onoff`` switch's value, its default when unset."""
    s = SWITCHES[name]
    v = raw(name).lower() or s.default
    if v not in ON + OFF:
        raise _bad(s, v)
    return v in ON


def seconds(name: str) -> float:
    s = SWITCHES[name]
    v = raw(name) or s.default
    try:
        x = float(v)
    except ValueError:
        raise _bad(s, v) from None
    if not x >= 0:
        raise _bad(s, v)
    return x


_MARCH = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


def march(name: str = "KVTIER_KERNEL_MARCH") -> str:
    s = SWITCHES[name]
    v = raw(name) or s.default
    if not _MARCH.fullmatch(v):
        raise _bad(s, v)
    return v


def cache_dir() -> Path:
    """``$KVTIER_CACHE``, else ``~/.cache/kvtier``."""
    return Path(raw("KVTIER_CACHE") or Path.home() / ".cache" / "kvtier")


def kernel_dir() -> Path:
    """``$KVTIER_KERNEL_DIR``, else ``kernels`` under :func:`cache_dir`."""
    return Path(raw("KVTIER_KERNEL_DIR") or cache_dir() / "kernels")


def markdown() -> str:
    """The table docs/GUIDE.md shows: every switch, its values, default and meaning."""
    out = ["| variable | values | default | what | same as |", "|---|---|---|---|---|"]
    for s in SWITCHES.values():
        cell = " ".join(s.what.split()).replace("|", "\\|")
        out.append(f"| `{s.name}` | {s.allowed().replace('|', chr(92) + '|')} | {f'`{s.default}`' if s.default else ''} "
                   f"| {cell} | {s.flag} |")
    return "\n".join(out)
