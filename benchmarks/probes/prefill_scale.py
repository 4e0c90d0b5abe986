"""Tokens a second of one packed prefill step by its size: the burst's GSM8K prompts up to each token budget (#28).

    python benchmarks/probes/prefill_scale.py --budgets 256,512,1024,2048,3072,4096 --reps 3 --data ../shared/data > OUT.txt

Why: a burst's last first token comes after every earlier prompt's prefill, so the step size that prefills most
tokens a second is the one that lowers the TTFT p99 at many clients (`kvtier serve --prefill-tokens`, whose default
is chosen per CPU in kvtier.serve.engine). Each step is what the continuous engine's first step runs: whole prompts
laid end to end through a `RowsCache` of empty `full` caches, the served model prepared as `load_model` prepares it.
The budgets take turns in every repetition (one warm-up step each first), so none is always measured first. Prints
`lscpu`, then one line per budget: prompts, tokens, median ms, tokens a second, each ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import kvtier
from kvtier.cache.rows import RowsCache
from kvtier.compat import cache_kw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
from ttft_burst import lscpu, prompts  # noqa: E402  (benchmarks/serve/)

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--budgets", default="256,512,1024,2048,3072,4096")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    a = ap.parse_args()
    budgets = [int(b) for b in a.budgets.split(",")]
    model, tok = kvtier.load_model(a.model, device="cpu", dtype=a.dtype)
    ids = prompts(tok, 64, a.data)

    def take(budget: int) -> list[list[int]]:
        out, n = [], 0
        for p in ids:
            if out and n + len(p) > budget:
                break
            out.append(p)
            n += len(p)
        return out

    def step(batch: list[list[int]]) -> None:
        rc = RowsCache([kvtier.make_cache("full", model) for _ in batch], lengths=[len(p) for p in batch])
        with torch.no_grad():
            model(input_ids=torch.tensor([[t for p in batch for t in p]]), position_ids=rc.positions(),
                  **cache_kw(model, rc), use_cache=True, logits_to_keep=rc.last_positions())

    sets = {b: take(b) for b in budgets}
    for b in budgets:
        step(sets[b])
    times: dict[int, list[float]] = {b: [] for b in budgets}
    for _ in range(a.reps):
        for b in budgets:
            t = time.perf_counter()
            step(sets[b])
            times[b].append(time.perf_counter() - t)
    print(lscpu())
    print(f"{a.model} {a.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads, {a.reps} repetitions")
    for b in budgets:
        n, m = sum(map(len, sets[b])), statistics.median(times[b])
        print(f"budget {b}: {len(sets[b])} prompts {n} tokens: {m * 1e3:.0f} ms, {n / m:.0f} tok/s  "
              f"{[round(x * 1e3) for x in times[b]]}")


if __name__ == "__main__":
    main()
