"""What a prefix-cache hit saves: time to first token of a prompt whose shared start is cached vs the same prompt cold.

In one process, the continuous engine (no HTTP) on a real model, one request at a time: for each of ``--prefixes``
shared prefixes of ``--prefix-tokens`` random tokens, a first request (the prefix + ``--suffix-tokens`` unique
tokens: a miss, which stores the prefix) then ``--hits`` requests with other suffixes (hits), and each of those
prompts again on an engine with the prefix cache off (cold). Each request decodes ``--max-tokens`` greedy tokens.
With ``--device-kv-budget`` the engine runs under that budget too (the store lives in host memory: hits do not
depend on it). Reports medians: hit / cold time to first token, the hit rate in tokens, the store's host bytes.

    python benchmarks/serve/prefix_ttft.py --out benchmarks/results/prefix_ttft_DATE_CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def ttft(eng, prompt: list[int], max_tokens: int) -> tuple[float, dict]:
    """One request alone: seconds from submission to its first token, and its usage block."""
    from kvtier.serve.engine import GenRequest

    done, first, end = threading.Event(), [], []

    def sink(ev):
        if ev[0] == "delta" and not first:
            first.append(time.monotonic())
        if ev[0] in ("done", "error"):
            end.append(ev)
            done.set()

    t0 = time.monotonic()
    eng.submit(GenRequest(prompt_ids=prompt, max_tokens=max_tokens, sink=sink, ignore_eos=True))
    done.wait(1800)
    if end[0][0] != "done":
        raise RuntimeError(f"request failed: {end[0]}")
    return first[0] - t0, end[0][2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--suffix-tokens", type=int, default=100)
    ap.add_argument("--prefixes", type=int, default=3)
    ap.add_argument("--hits", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--device-kv-budget", default=None, help="bytes or 64MiB: the engine's device-KV budget")
    a = ap.parse_args()
    import torch

    import kvtier
    from kvtier.config import parse_bytes
    from kvtier.serve.continuous import ContinuousEngine
    from kvtier.serve.engine import EngineConfig

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "lscpu.txt").write_text(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (a.out / "command.txt").write_text(f"python benchmarks/serve/prefix_ttft.py {' '.join(sys.argv[1:])}\n"
                                       f"commit {commit}\n")
    model, tok = kvtier.load_model(a.model, device="cpu", dtype=a.dtype, linear="eager")
    budget = parse_bytes("--device-kv-budget", a.device_kv_budget) if a.device_kv_budget else None
    cfg = dict(max_batch=4, linear="auto", device_kv_budget=budget)
    warm = ContinuousEngine(model, tok, EngineConfig(**cfg, prefix_cache=True)).start()
    cold = ContinuousEngine(model, tok, EngineConfig(**cfg, prefix_cache=False)).start()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    ttft(warm, rand(64), 2)  # each engine's first step (the prepared model's first shapes) outside the timings
    ttft(cold, rand(64), 2)
    rows = []
    with open(a.out / "rows.jsonl", "w") as f:
        for p in range(a.prefixes):
            prefix = rand(a.prefix_tokens)
            for i in range(1 + a.hits):
                prompt = prefix + rand(a.suffix_tokens)
                order = (warm, cold) if (p + i) % 2 == 0 else (cold, warm)  # alternate which engine runs first
                got = {}
                for eng in order:
                    got[eng is warm] = ttft(eng, prompt, a.max_tokens)
                (t_warm, u), (t_cold, _) = got[True], got[False]
                r = {"prefix": p, "request": i, "kind": "miss" if i == 0 else "hit", "prompt_tokens": len(prompt),
                     "cached_tokens": u["prompt_tokens_details"]["cached_tokens"], "ttft_s": t_warm,
                     "cold_ttft_s": t_cold, "store_bytes": warm.prefix.bytes}
                print(json.dumps(r), flush=True)
                f.write(json.dumps(r) + "\n")
                rows.append(r)
    warm.shutdown(grace_s=1)
    cold.shutdown(grace_s=1)
    hits = [r for r in rows if r["kind"] == "hit"]
    misses = [r for r in rows if r["kind"] == "miss"]
    med = statistics.median
    summary = {
        "hit_ttft_s": med(r["ttft_s"] for r in hits), "cold_ttft_s": med(r["cold_ttft_s"] for r in hits),
        "hit_over_cold": med(r["ttft_s"] / r["cold_ttft_s"] for r in hits),
        "miss_over_cold": med(r["ttft_s"] / r["cold_ttft_s"] for r in misses),
        "hit_rate_tokens": sum(r["cached_tokens"] for r in hits) / sum(r["prompt_tokens"] for r in hits),
        "shared_rate_tokens": a.prefix_tokens / (a.prefix_tokens + a.suffix_tokens),
        "store_bytes_max": max(r["store_bytes"] for r in rows), "device_kv_budget": budget,
        "dtype": str(model.dtype), "commit": commit}
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# Prefix-cache hits: time to first token ({a.model}, {model.dtype}, commit {commit[:7]})", "",
             f"`python benchmarks/serve/prefix_ttft.py {' '.join(sys.argv[1:])}`", "",
             f"{a.prefixes} prefixes of {a.prefix_tokens} tokens, each + {a.suffix_tokens} unique tokens; one miss "
             f"and {a.hits} hits per prefix, every prompt also on an engine with no prefix cache (cold), one request "
             f"at a time, order alternating. Device-KV budget: {a.device_kv_budget or 'none'}.", "",
             "| | median TTFT s | cold median TTFT s | ratio (median of pairs) |", "|---|---|---|---|",
             f"| miss | {med(r['ttft_s'] for r in misses):.3f} | {med(r['cold_ttft_s'] for r in misses):.3f} | "
             f"{summary['miss_over_cold']:.2f}x |",
             f"| hit | {summary['hit_ttft_s']:.3f} | {summary['cold_ttft_s']:.3f} | {summary['hit_over_cold']:.2f}x |",
             "", f"Hits reused {summary['hit_rate_tokens']:.1%} of their prompt tokens (the shared share is "
             f"{summary['shared_rate_tokens']:.1%}; whole {warm.prefix.block}-token blocks); the store held at most "
             f"{summary['store_bytes_max'] / 2**20:.1f} MiB of host memory."]
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
