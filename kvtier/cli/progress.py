"""Progress for long commands: a rich bar on a terminal, throttled plain lines elsewhere (CI, logs)."""

from __future__ import annotations

import time

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .common import console


def progress_bar() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)


def eval_progress_cb(progress: Progress, task):
    def cb(p):
        rate = f"{p['tokens'] / p['seconds']:.1f} tok/s" if p["seconds"] else ""
        if not p["done"] and p.get("warmup_seconds"):
            rate = f"warm-up {p['warmup_seconds']:.1f} s (untimed)"
        progress.update(task, total=p["total"], completed=p["done"], rate=rate)

    return cb


def progress_interval() -> float:
    """Seconds between plain progress lines when output is not a terminal (``KVTIER_PROGRESS_INTERVAL``)."""
    from ..env import seconds

    return seconds("KVTIER_PROGRESS_INTERVAL")


class PlainLines:
    """Progress for logs and CI (output not a terminal): one plain line at the start, then at most one every
    ``interval`` seconds, and one at the end."""

    def __init__(self, label: str):
        self.label, self.clock, self.last, self.t0 = label, time.monotonic, None, time.monotonic()
        self.interval = progress_interval()
        self.pending: str | None = None

    def line(self, text: str, final: bool = False) -> None:
        now = self.clock()
        if final or self.last is None or now - self.last >= self.interval:
            console.print(f"{self.label}: {text} · {now - self.t0:.0f} s", markup=False, highlight=False, soft_wrap=True)
            self.last, self.pending = now, None
        else:
            self.pending = text

    def close(self) -> None:
        if self.pending is not None:
            self.line(self.pending, final=True)


class LazyProgress:
    """A progress bar that appears with the first report (after the run folder is locked and the model loaded),
    so a command rejected before that prints its one error line and nothing else. When output is not a
    terminal: plain lines (:class:`PlainLines`)."""

    def __init__(self, label: str):
        self.label, self.progress, self.task = label, None, None
        self.plain = None if console.is_terminal else PlainLines(label)

    def __call__(self, p: dict) -> None:
        if self.plain is not None:
            rate = f" · {p['tokens'] / p['seconds']:.1f} tok/s" if p["seconds"] else ""
            if not p["done"] and p.get("warmup_seconds"):  # tok/s never include it
                rate = f" · warm-up {p['warmup_seconds']:.1f} s (untimed)"
            left = ""
            if p["seconds"] and p["done"]:
                left = f" · ~{p['seconds'] / p['done'] * (p['total'] - p['done']):.0f} s left"
            self.plain.line(f"{p['done']}/{p['total']} done{rate}{left}", final=p["done"] == p["total"] and p["total"] > 0)
            return
        if self.progress is None:
            self.progress = progress_bar()
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=None, rate="")
        eval_progress_cb(self.progress, self.task)(p)

    def __enter__(self) -> "LazyProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.plain is not None:
            self.plain.close()


class StatusProgress:
    """Text progress (bench): a spinner on a terminal, plain lines otherwise."""

    def __init__(self, label: str):
        self.status = console.status(label) if console.is_terminal else None
        self.plain = None if console.is_terminal else PlainLines(label)

    def __call__(self, message: str) -> None:
        if self.status is not None:
            self.status.update(message)
        else:
            self.plain.line(message)

    def __enter__(self) -> "StatusProgress":
        if self.status is not None:
            self.status.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.status is not None:
            self.status.__exit__(*exc)
        else:
            self.plain.close()
