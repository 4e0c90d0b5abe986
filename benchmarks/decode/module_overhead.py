"""What transformers' module machinery costs a decode step: the model's forward vs kvtier.step.direct.

    python benchmarks/decode/module_overhead.py --rows 1,8,32 --context 384 --reps 4 --out benchmarks/results/<folder>/

``--layout rows`` (default): serve's packed rows step, below. ``--layout batch``: one batch cache of B rows, as
``generate`` and ``kvtier bench`` run it (prefilled by the model's forward, then twin caches stepped one token a
row through the model's forward and through the direct step, :func:`kvtier.step.direct.batch_logits`).

Why (#29): the decode step's matmuls are at vLLM-CPU's (the same oneDNN kernel, measured apart), yet the whole step
is 1.2-1.3x its inter-token time at 8 and 32 rows; what is left is the attention kernel, small ops and Python. This
separates one part of the Python: the modules' ``__call__``, forward wrappers, keyword plumbing, the causal mask and
config reads of transformers' forward. ``direct`` is :class:`kvtier.step.direct.DirectStep` (what ``kvtier serve``'s
engine steps through): the very ops the modules run, in the same order, from one loop. Its logits must equal the
model's bit for bit (checked every step; the script exits non-zero otherwise), so the difference in time is the
machinery alone.

``full`` rows of the model as ``kvtier.load_model`` prepares it (``linear=auto``). For each row count, B one-row
caches are prefilled with ``--context`` random tokens, then ``model`` and ``direct`` alternate (``--reps`` rounds;
each two twin cache sets prefilled alike, then ``--steps`` timed steps after 4 untimed, every step the model on one
set and the direct step on the other back to back). Writes ``module_overhead.json`` and ``module_overhead.md`` with
lscpu into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvtier
from kvtier.attention import fused_cpu
from kvtier.compat import cache_kw
from kvtier.step.direct import batch_logits, direct_step, rows_logits


def paired(model, direct, batch: int, context: int, steps: int, seed: int) -> tuple[list, list, bool]:
    """Twin sets of ``batch`` one-row caches prefilled alike; each step runs the model's forward on one set and
    ``direct`` on the other, back to back (which goes first alternates), so that the machine's drift (other guests'
    memory traffic moves a 32-row step by 20 ms here) hits both alike. Returns the per-step ms of each and whether
    every step's logits were equal."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, model.config.vocab_size - 10, (batch, context), generator=gen)
    sets, lasts = [], []
    for _ in range(2):
        caches = [kvtier.make_cache("full", model) for _ in range(batch)]
        lasts.append([int(model(input_ids=ids[i : i + 1], **cache_kw(model, c), use_cache=True, logits_to_keep=1)
                          .logits[0, -1].float().argmax()) for i, c in enumerate(caches)])
        sets.append(caches)
    ms = {"model": [], "direct": []}
    equal = True
    for s in range(4 + steps):
        out = {}
        for how in ("model", "direct") if s % 2 == 0 else ("direct", "model"):
            caches, last = (sets[0], lasts[0]) if how == "model" else (sets[1], lasts[1])
            t = time.perf_counter()
            lg = rows_logits(model, direct if how == "direct" else None, caches, [[x] for x in last])[0]
            last[:] = fused_cpu.argmax_rows(lg).tolist()
            if s >= 4:
                ms[how].append(1e3 * (time.perf_counter() - t))
            out[how] = lg
        equal = equal and torch.equal(out["model"], out["direct"])
    return ms["model"], ms["direct"], equal


def paired_batch(model, direct, batch: int, context: int, steps: int, seed: int) -> tuple[list, list, bool]:
    """As :func:`paired`, on twin batch caches of ``batch`` rows (``generate`` / ``kvtier bench``'s layout)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, model.config.vocab_size - 10, (batch, context), generator=gen)
    caches, toks = [], []
    for _ in range(2):
        c = kvtier.make_cache("full", model)
        lg = model(input_ids=ids, **cache_kw(model, c), use_cache=True, logits_to_keep=1).logits
        caches.append(c)
        toks.append(fused_cpu.argmax_rows(lg[:, -1]).unsqueeze(-1))
    ms = {"model": [], "direct": []}
    equal = True
    for s in range(4 + steps):
        out = {}
        for how in ("model", "direct") if s % 2 == 0 else ("direct", "model"):
            i = 0 if how == "model" else 1
            t = time.perf_counter()
            lg = batch_logits(model, direct if how == "direct" else None, caches[i], toks[i])
            toks[i] = fused_cpu.argmax_rows(lg[:, -1]).unsqueeze(-1)
            if s >= 4:
                ms[how].append(1e3 * (time.perf_counter() - t))
            out[how] = lg
        equal = equal and torch.equal(out["model"], out["direct"])
    return ms["model"], ms["direct"], equal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--layout", default="rows", choices=["rows", "batch"])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    model, _ = kvtier.load_model(a.model, device="cpu", dtype=a.dtype)
    direct = direct_step(model)
    if direct is None:
        raise SystemExit("no direct step for this model (see the log)")
    rows, equal = [], True
    with torch.no_grad():
        for batch in [int(x) for x in a.rows.split(",")]:
            mm, dd, eq = [], [], True
            for rep in range(a.reps):
                m_ms, d_ms, e = (paired if a.layout == "rows" else paired_batch)(model, direct, batch, a.context,
                                                                                 a.steps, seed=rep)
                mm += m_ms
                dd += d_ms
                eq = eq and e
            equal = equal and eq
            rows.append({"rows": batch, "steps": len(mm), "median_model": round(statistics.median(mm), 2),
                         "median_direct": round(statistics.median(dd), 2),
                         "median_paired_saving": round(statistics.median(x - y for x, y in zip(mm, dd)), 2),
                         "direct_faster_steps": sum(x > y for x, y in zip(mm, dd)), "logits_equal": eq})
            print(rows[-1], flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "logits_equal": equal}
    (a.out / "module_overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    where = "serve's rows step" if a.layout == "rows" else "a batch cache's step (generate, kvtier bench)"
    md = [f"# transformers' module machinery in {where} ({meta['date']})", "",
          f"`{meta['command']}` · torch {meta['torch']} · {meta['threads']} threads · logits of `direct` equal "
          f"the model's at every step: **{equal}**", "",
          "| rows | steps (paired) | model ms/step, median | direct ms/step, median | saving a step (median of "
          "pairs) | steps where direct was faster |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['rows']} | {r['steps']} | {r['median_model']:.1f} | {r['median_direct']:.1f} | "
                  f"{r['median_paired_saving']:.1f} ms | {r['direct_faster_steps']} of {r['steps']} |")
    md += ["", "```", lscpu.strip(), "```", ""]
    (a.out / "module_overhead.md").write_text("\n".join(md))
    if not equal:
        raise SystemExit("direct's logits differ from the model's: the comparison does not hold")


if __name__ == "__main__":
    main()
