"""Real `kvtier serve` subprocesses for the serve tests, in one place: a free port, a server started and waited for, stopped (the shared `tiny` model and the `server` marker are in tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

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
