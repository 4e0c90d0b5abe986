"""The serve tests' shared helpers, in one place: real `kvtier serve` subprocesses (a free port, a server started and waited for, stopped) and an engine request's event collector (the shared `tiny` model and the `server` marker are in tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from kvtier.serve.loadgen import free_port, wait_until_up  # noqa: F401 (free_port: the tests' import)


def start_server(*extra: str, env_keys: str | None = None, host: str = "127.0.0.1",
                 timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """``kvtier serve --model random:tiny-qwen2`` (fp32, CPU, one OpenMP thread) with ``extra`` flags on a free port,
    once its /health answers: (the process, its base URL). ``env_keys``: its ``KVTIER_API_KEY`` (none inherited)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("KVTIER_API_KEY", None)
    if env_keys is not None:
        env["KVTIER_API_KEY"] = env_keys
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--model", "random:tiny-qwen2", "--dtype", "fp32",
                             "--device", "cpu", "--host", host, "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_up(url, proc, timeout)  # (kvtier bench-serve's own wait: ValueError with the server's output)
    return proc, url


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> tuple[int, str]:
    """SIGTERM, wait: (its exit code, everything it printed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the server did not stop within {timeout} s of SIGTERM: {out[-2000:]}") from None
    return proc.returncode, out


class Collect:
    """An engine request's ``sink``: every event, ``done`` set at its end; ``on_delta`` runs at each delta."""

    def __init__(self, on_delta=None):
        self.events, self.done, self.on_delta = [], threading.Event(), on_delta
        self.finished_at = None

    def __call__(self, ev):
        self.events.append(ev)
        if ev[0] == "delta" and self.on_delta:
            self.on_delta()
        if ev[0] in ("done", "error"):
            self.finished_at = time.monotonic()
            self.done.set()

    @property
    def text(self) -> str:
        """Content and reasoning text, in order."""
        return "".join(e[1] + e[2] for e in self.events if e[0] == "delta")

    @property
    def end(self) -> tuple:
        return self.events[-1]

    @property
    def usage(self) -> dict:
        """The usage block of a request that ended ``done``."""
        return self.events[-1][2]
