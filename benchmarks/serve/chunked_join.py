"""What a long prompt joining costs the rows already decoding: the longest step they wait through, whole vs chunked.

In one process, the continuous engine (no HTTP) on a real model: ``--rows`` requests decode (greedy, ``ignore_eos``)
while ``--joins`` prompts of ``--prompt-tokens`` tokens arrive; per ``--max-batched-tokens`` setting (the first is
large enough to take each prompt whole, as the engine did before chunked prefill), the step log gives every step's
milliseconds: the decoding rows' worst gap (the longest step carrying prompt tokens), the p50 step, and the
seconds until the last joined prompt's first token. Settings take turns over ``--reps`` (alternating order).

    python benchmarks/serve/chunked_join.py --out benchmarks/results/chunked_join_DATE_CPU
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


def run_once(model, tok, batched: int, rows: int, joins: int, prompt_tokens: int, max_tokens: int) -> dict:
    from kvtier.serve.continuous import ContinuousEngine
    from kvtier.serve.engine import EngineConfig, GenRequest

    eng = ContinuousEngine(model, tok, EngineConfig(max_batch=rows + joins, max_batched_tokens=batched,
                                                    linear="auto")).start()
    first: dict[int, float] = {}
    done = threading.Event()
    left = [rows + joins]

    def sink_for(i):
        def sink(ev):
            if ev[0] == "delta" and i not in first:
                first[i] = time.monotonic()
            if ev[0] in ("done", "error"):
                left[0] -= 1
                if not left[0]:
                    done.set()
        return sink

    vocab = model.config.vocab_size
    for i in range(rows):
        eng.submit(GenRequest(prompt_ids=[(97 * i + 11 * j) % vocab for j in range(64)], max_tokens=max_tokens,
                              sink=sink_for(i), ignore_eos=True))
    while len(first) < rows:
        time.sleep(0.01)
    t_join = time.monotonic()
    for k in range(joins):
        eng.submit(GenRequest(prompt_ids=[(31 * k + 7 * j + 5) % vocab for j in range(prompt_tokens)], max_tokens=8,
                              sink=sink_for(rows + k), ignore_eos=True))
    done.wait(1800)
    eng.shutdown(grace_s=1)
    steps = list(eng.step_log)
    joined = [s for s in steps if s["chunks"]]
    decode_only = [s["ms"] for s in steps if not s["chunks"]]
    with_prompt = [s["ms"] for s in steps if s["chunks"] and s["decode"]]
    return {"max_batched_tokens": batched, "worst_gap_ms": max(with_prompt) if with_prompt else None,
            "decode_step_p50_ms": statistics.median(decode_only) if decode_only else None,
            "prompt_steps": len(with_prompt), "steps": len(steps),
            "last_join_first_token_s": max(first[rows + k] for k in range(joins)) - t_join, "joined_steps": len(joined)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--settings", default="8192,2048,512")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--joins", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=3500)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    import kvtier

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "lscpu.txt").write_text(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    model, tok = kvtier.load_model(a.model, device="cpu", dtype=a.dtype, linear="eager")
    settings = [int(x) for x in a.settings.split(",")]
    rows = []
    with open(a.out / "rows.jsonl", "a") as f:
        for rep in range(a.reps):
            order = settings if rep % 2 == 0 else settings[::-1]
            for b in order:
                r = run_once(model, tok, b, a.rows, a.joins, a.prompt_tokens, a.max_tokens)
                r.update(rep=rep, commit=commit)
                print(json.dumps(r), flush=True)
                f.write(json.dumps(r) + "\n")
                f.flush()
                rows.append(r)
    lines = [f"# {a.joins} prompts of {a.prompt_tokens} tokens joining {a.rows} decoding rows ({a.model}, {a.dtype}, "
             f"commit {commit[:7]})", "", f"`python benchmarks/serve/chunked_join.py {' '.join(sys.argv[1:])}`", "",
             "| --max-batched-tokens | worst step a decoding row waits through, ms (median of reps) | decode-only step "
             "p50 ms | steps carrying prompt tokens | last joined prompt's first token, s |", "|---|---|---|---|---|"]
    for b in settings:
        rs = [r for r in rows if r["max_batched_tokens"] == b]
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        lines.append(f"| {b} | {med('worst_gap_ms'):.0f} | {med('decode_step_p50_ms'):.1f} | {med('prompt_steps'):.0f} "
                     f"| {med('last_join_first_token_s'):.2f} |")
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
