"""The one build recipe of kvtier's C++ kernels (``csrc/``): flags, the cache key, the build directory, and the two extensions, each built once per process.

Built on first use (~40 s each) by torch's JIT extension loader (needs gcc and the ``ninja`` package, the
``kernels`` extra) with ``-O3 -march=native``, into ``$KVTIER_KERNEL_DIR`` (default ``$KVTIER_CACHE/kernels``)
under a name hashed from the source, every header of ``csrc/`` it may include, the flags, torch's version and this
CPU's ISA flags, so a build made on an AVX-512 machine is never loaded on an AVX2 one and a changed header is a new
build; it compiles that directory's own copies of the source and headers, so another clone or checkout of the same
sources loads the build instead of compiling again. ``$KVTIER_KERNEL_MARCH`` builds for another target than
``native`` (e.g. ``x86-64-v3``: AVX2 and FMA without AVX-512, the code an AVX2-only CPU runs; ``make test-isa``
tests that build on any x86 machine). One process builds a directory at a time, under an ``flock`` that the
operating system releases however its holder dies; so a torch build ``lock`` file found by the process holding it
was left by a killed build, and is removed (torch would wait on it forever), never waited on. If a build fails, one
warning is logged and its extension is None (the eager paths run). ``KVTIER_KERNEL=eager`` builds neither.

- :func:`decode_module`: ``csrc/fused_decode_cpu.cpp``, the fused decode attention (:mod:`kvtier.attention.fused_cpu`)
  and the row ops (:mod:`.rows`);
- :func:`step_module`: ``csrc/step_cpu.cpp``, the step's norms, rotary, SiLU x product and AMX projections
  (:mod:`kvtier.step`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from ..env import choice, kernel_dir
from ..env import march as env_march
from .cpu import cpuinfo

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
DECODE_SRC = CSRC / "fused_decode_cpu.cpp"
STEP_SRC = CSRC / "step_cpu.cpp"


def headers(src: Path) -> list[Path]:
    """The headers a build of ``src`` compiles with: every ``.h`` beside it (copied into the build directory)."""
    return sorted(src.parent.glob("*.h"))


def march() -> str:
    """The ``-march=`` target of kvtier's kernels: ``$KVTIER_KERNEL_MARCH``, default ``native``."""
    return env_march("KVTIER_KERNEL_MARCH")


def flags() -> list[str]:
    """The compiler flags of a kernel build (OpenMP: at::parallel_for is header code)."""
    return ["-O3", f"-march={march()}", "-fno-math-errno", "-fopenmp"]


def cpu_signature() -> str:
    """The ISA this build targets (-march=native): the cpuinfo flags line, else the platform string."""
    return cpuinfo("flags", "Features") or platform.processor() or platform.machine()


def build_name(src: Path = DECODE_SRC, prefix: str = "kvtier_fused_cpu") -> str:
    """``<prefix>_<hash>``: the hash of ``src`` and its :func:`headers` (names and text), the flags, torch's version
    and this CPU's ISA flags (a build is never loaded by another source, header, torch or CPU kind)."""
    h = hashlib.sha256()
    parts = [src.read_bytes()] + [p.name.encode() + b"\0" + p.read_bytes() for p in headers(src)]
    for part in (*parts, " ".join(flags()).encode(), torch.__version__.encode(), cpu_signature().encode()):
        h.update(part)
        h.update(b"\0")
    return f"{prefix}_{h.hexdigest()[:16]}"


def build_dir(name: str) -> Path:
    """``name``'s directory under :func:`~kvtier.env.kernel_dir` (made if missing)."""
    out = kernel_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextmanager
def builder(directory: Path):
    """Be the one process building in ``directory``: an exclusive ``flock`` on its ``kvtier.lock`` (holding the
    holder's PID), which the kernel releases when the holder exits or is killed. Every kvtier build takes it before
    torch's own file lock (``lock``, created and deleted by the build and waited on forever while it exists), so a
    ``lock`` file present while this is held was left by a killed build: it is removed, with one warning. A build
    in progress in another process is waited for, with one warning naming its PID."""
    import fcntl

    with open(directory / "kvtier.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            log.warning("kvtier: waiting for the kernel build in progress in %s (PID %s)", directory,
                        f.read().strip() or "unknown")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        stale = directory / "lock"
        if stale.exists():
            log.warning("kvtier: removing %s, the build lock a killed build left behind", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _place(path: Path, directory: Path) -> Path:
    """``path``'s copy in ``directory`` (written atomically when it differs: a concurrent build reads the whole
    file or none)."""
    local = directory / path.name
    text = path.read_bytes()
    if not local.is_file() or local.read_bytes() != text:
        tmp = directory / f".{path.name}.{os.getpid()}"
        tmp.write_bytes(text)
        os.replace(tmp, local)
    return local


def build(name: str, src: Path, directory: Path):
    """Compile ``src`` (with its :func:`headers`) as the extension ``name`` into ``directory`` with kvtier's flags
    and load it (the one place the build is spelled out: ``benchmarks/kernels/kernel_ab.py`` builds other revisions of the
    kernel through it).

    The sources are compiled from the build directory's own copies: ninja rebuilds when a source's path or mtime
    moves, and every clone or checkout of kvtier would otherwise pay the build again for the same source (the
    directory is named by the sources' hash, so its copies never change). A build that compiles says so before it
    starts: it is the one pause of a first run that no progress line explains (a warning, so that the command line
    shows it)."""
    from torch.utils.cpp_extension import load

    for h in headers(src):
        _place(h, directory)
    local = _place(src, directory)
    so = directory / f"{name}.so"
    fresh = not so.is_file() or so.stat().st_mtime < local.stat().st_mtime
    if fresh:
        log.warning("kvtier: compiling the CPU kernels of %s (once per machine, CPU kind and torch; about a minute)",
                    src.name)
    t = time.perf_counter()
    with builder(directory):
        mod = load(name=name, sources=[str(local)], extra_cflags=flags(), extra_ldflags=["-fopenmp"],
                   extra_include_paths=[str(directory)], build_directory=str(directory), verbose=False)
    if fresh:
        log.info("kvtier: %s built in %.0f s into %s", src.name, time.perf_counter() - t, directory)
    return mod


def enabled() -> bool:
    """Whether kvtier may build its kernels at all (``KVTIER_KERNEL`` is not ``eager``)."""
    return choice("KVTIER_KERNEL") != "eager"


@lru_cache(maxsize=1)
def decode_module():
    """The built fused decode extension, or None (``KVTIER_KERNEL=eager``, or the build failed: one warning)."""
    if not enabled():
        return None
    name = build_name()  # outside the try: a bad KVTIER_KERNEL_MARCH is the caller's error, not a failed build
    try:
        return build(name, DECODE_SRC, build_dir(name))
    except Exception as exc:  # a missing compiler or ninja: the eager path still works, only slower
        log.warning("kvtier: the fused CPU decode kernel could not be built (%s: %s); using the eager path "
                    "(it needs gcc and `pip install kvtier[kernels]`)",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return None


@lru_cache(maxsize=1)
def step_module():
    """The built ``step_cpu`` extension, or None where it cannot be built (``KVTIER_KERNEL=eager``, no compiler:
    the decode extension's build failed first): then every op keeps the model's own path."""
    if decode_module() is None:
        return None
    try:
        name = build_name(STEP_SRC, "kvtier_step_cpu")
        return build(name, STEP_SRC, build_dir(name))
    except Exception as exc:  # noqa: BLE001 - the eager paths still work
        log.warning("kvtier: the step's CPU kernels could not be built (%s); keeping the model's own ops",
                    type(exc).__name__)
        return None
