"""Time to first token of a burst of requests through the continuous engine alone (no HTTP), by prefill setting (#28).

    python benchmarks/serve/ttft_burst.py --clients 32 --prefill-tokens 1024,2048,4096 --reps 2 --out DIR

Why: at 32 closed-loop clients, the p99 time to first token of `kvtier serve` is set by the first burst (every
client sends at once): the last prompt of the burst gets its first token only after every earlier prompt's prefill
and the decode steps between. This script submits `--clients` GSM8K chat prompts at once to one
`ContinuousEngine` (the served model, its linears packed on the engine's thread as `kvtier serve` does), and
records each request's first-token time from its submission, the steps the engine took, and the burst's prompt
tokens per second; per `--prefill-tokens` setting (the engine's step size changed between bursts; the settings take turns
each repetition so that none is always measured first). Beside it, one packed prefill step of the burst's first
prompts is profiled by op category (on the main thread, with a second copy of the model packed there).
Writes `ttft_burst.json` and `ttft_burst.md` into `--out`, with `lscpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvtier
from kvtier.serve.continuous import ContinuousEngine
from kvtier.serve.engine import EngineConfig, GenRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "decode"))
from step_profile import category  # noqa: E402  (the decode profile's op categories, benchmarks/decode/)

ROOT = Path(__file__).resolve().parents[2]


def prompts(tok, n: int, data: Path) -> list[list[int]]:
    """The first ``n`` GSM8K test questions as chat prompts, tokenized as ``kvtier serve`` does."""
    rows = [json.loads(x) for x in (data / "gsm8k" / "test.jsonl").read_text().splitlines()[:n]]
    out = []
    for r in rows:
        text = tok.apply_chat_template([{"role": "user", "content": r["question"] + " Please reason step by step."}],
                                       tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def burst(eng: ContinuousEngine, ids: list[list[int]], max_tokens: int) -> dict:
    """Submit every prompt at once; wait for all to finish; first-token times (s) from submission."""
    first: dict[int, float] = {}
    done = threading.Semaphore(0)
    steps0 = eng.metrics.steps
    t0 = time.monotonic()
    reqs = []
    for i, p in enumerate(ids):
        def sink(ev, i=i):
            if ev[0] == "delta" and i not in first:
                first[i] = time.monotonic() - t0
            if ev[0] in ("done", "error"):
                first.setdefault(i, time.monotonic() - t0)
                done.release()
        reqs.append(GenRequest(prompt_ids=p, max_tokens=max_tokens, sink=sink, ignore_eos=True))
    for r in reqs:
        eng.submit(r)
    for _ in reqs:
        done.acquire()
    wall = time.monotonic() - t0
    ttft = sorted(first.values())
    return {"ttft_s": ttft, "wall_s": wall, "steps": eng.metrics.steps - steps0}


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def profile_prefill(model_name: str, dtype: str, linear: str, ids: list[list[int]], budget: int) -> dict:
    """One packed step of the first prompts that fit in ``budget`` tokens, as the engine's first step runs it."""
    from kvtier.cache.rows import RowsCache
    from kvtier.compat import cache_kw

    model, _ = kvtier.load_model(model_name, device="cpu", dtype=dtype, linear=linear)
    take, n = [], 0
    for p in ids:
        if take and n + len(p) > budget:
            break
        take.append(p)
        n += len(p)

    def step():
        caches = [kvtier.make_cache("full", model) for _ in take]
        rc = RowsCache(caches, lengths=[len(p) for p in take])
        with torch.no_grad():
            model(input_ids=torch.tensor([[t for p in take for t in p]]), position_ids=rc.positions(),
                  **cache_kw(model, rc), use_cache=True, logits_to_keep=rc.last_positions())

    step()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    wall = statistics.median(times)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    by: dict[str, float] = {}
    for e in prof.key_averages():
        by[category(e.key)] = by.get(category(e.key), 0.0) + e.self_cpu_time_total / 1e3
    del model
    return {"rows": len(take), "tokens": n, "ms": 1e3 * wall, "ms_each": [round(1e3 * x, 1) for x in times],
            "tok_per_s": n / wall,
            "ms_by_category": dict(sorted(by.items(), key=lambda kv: -kv[1]))}


def lscpu() -> str:
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except Exception:  # noqa: BLE001 - a description only
        return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--linear", default="auto")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8, help="per request: the burst's first tokens are the point")
    ap.add_argument("--prefill-tokens", default="1024,2048,4096")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--prefill-only", action="store_true", help="only the packed prefill step (timed, then profiled), "
                    "in a process that has run nothing else: for an A/B of process-wide settings (KVTIER_MALLOC)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    settings = [int(x) for x in a.prefill_tokens.split(",")]
    if a.prefill_only:
        _, tok = kvtier.load_model(a.model, device="cpu", dtype=a.dtype, linear="eager")
        ids = prompts(tok, a.clients, a.data)
        prof = profile_prefill(a.model, a.dtype, a.linear, ids, max(settings))
        out = {"KVTIER_MALLOC": os.environ.get("KVTIER_MALLOC"), "command": "python benchmarks/serve/ttft_burst.py "
               + " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(a).items()
                          if v not in (False, None)), "prefill_profile": prof}
        (a.out / "prefill_step.json").write_text(json.dumps(out, indent=1))
        (a.out / "lscpu.txt").write_text(lscpu())
        print(json.dumps(out, indent=1))
        return
    model, tok = kvtier.load_model(a.model, device="cpu", dtype=a.dtype, linear="eager")  # the engine's thread packs
    ids = prompts(tok, a.clients, a.data)
    eng = ContinuousEngine(model, tok, EngineConfig(max_batch=a.clients, max_queue=4 * a.clients,
                                                    linear=a.linear)).start()
    try:
        burst(eng, ids[:4], 2)  # warm-up: kernels built, first shapes seen (untimed)
        runs: dict[int, list[dict]] = {p: [] for p in settings}
        for rep in range(a.reps):
            order = settings[rep % len(settings):] + settings[: rep % len(settings)]
            for p in order:
                # the step's token budget (--max-batched-tokens; this script's --prefill-tokens predates chunking)
                eng.max_batched_tokens = eng.scheduler.max_batched_tokens = p
                r = burst(eng, ids, a.max_tokens)
                runs[p].append(r)
                print(json.dumps({"prefill_tokens": p, "rep": rep, "ttft_p50_s": q(r["ttft_s"], 0.5),
                                  "ttft_max_s": max(r["ttft_s"]), "steps": r["steps"]}), flush=True)
    finally:
        eng.shutdown(1.0)
    del eng, model
    n_tok = sum(len(p) for p in ids)
    rows = []
    for p, rs in runs.items():
        ttfts = [t for r in rs for t in r["ttft_s"]]
        rows.append({"prefill_tokens": p, "bursts": len(rs), "ttft_p50_s": q(ttfts, 0.5), "ttft_p99_s": q(ttfts, 0.99),
                     "ttft_max_s": max(ttfts), "last_first_token_s": statistics.median(max(r["ttft_s"]) for r in rs),
                     "prompt_tok_per_s": n_tok / statistics.median(max(r["ttft_s"]) for r in rs)})
    prof = None if a.no_profile else profile_prefill(a.model, a.dtype, a.linear, ids, max(settings))
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "model": a.model, "dtype": a.dtype, "linear": a.linear,
            "clients": a.clients, "prompt_tokens": n_tok, "max_tokens": a.max_tokens,
            "KVTIER_MALLOC": os.environ.get("KVTIER_MALLOC"), "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM"),
            "command": "python benchmarks/serve/ttft_burst.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k not in ("no_profile",))}
    (a.out / "ttft_burst.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": {str(k): v for k, v in
                                                       runs.items()}, "prefill_profile": prof}, indent=1))
    (a.out / "lscpu.txt").write_text(lscpu())
    lines = [f"# A burst of {a.clients} GSM8K chat prompts ({n_tok} tokens) through the continuous engine",
             "", f"{meta['date']} · torch {meta['torch']} · {meta['threads']} threads · {a.model} {a.dtype} · "
             f"linear={a.linear} · KVTIER_MALLOC={meta['KVTIER_MALLOC'] or 'keep (default)'}", "", f"`{meta['command']}`", "",
             "| prefill tokens a step | bursts | TTFT p50 s | TTFT p99 s | last first token s (median) | prompt tok/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prefill_tokens']} | {r['bursts']} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{r['last_first_token_s']:.2f} | {r['prompt_tok_per_s']:.0f} |")
    if prof:
        lines += ["", f"One packed prefill step of {prof['rows']} prompts ({prof['tokens']} tokens): "
                  f"{prof['ms']:.0f} ms ({prof['tok_per_s']:.0f} tok/s); self CPU ms by op category (profiled):", ""]
        lines += [f"- {k}: {v:.1f}" for k, v in prof["ms_by_category"].items()]
    (a.out / "ttft_burst.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
