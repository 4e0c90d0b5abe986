"""The load for benchmarks/decode/vllm_step_profile.sh: N concurrent greedy completions (256 tokens, end of sequence
ignored) on an OpenAI server, its /start_profile called START s after they begin and /stop_profile STOP s later.

    python benchmarks/decode/vllm_step_load.py PORT N START STOP
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request


def post(port: int, path: str, body: dict | None = None) -> bytes:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=600).read()


def main() -> None:
    port, n, start, stop = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    post(port, "/v1/completions", {"model": "m", "prompt": "warm", "max_tokens": 8})

    def one(i: int) -> None:
        post(port, "/v1/completions", {"model": "m", "prompt": f"Question {i}: explain how a hash map works, step by "
                                       "step.", "max_tokens": 256, "temperature": 0, "ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(start)
    post(port, "/start_profile")
    print(f"profiling from {start} s into {n} requests", flush=True)
    time.sleep(stop)
    post(port, "/stop_profile")
    print(f"stopped {stop} s later", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
