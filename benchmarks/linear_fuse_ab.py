"""Sibling projections fused (q/k/v, gate/up as one packed weight) vs packed one by one: serve's whole rows step,
side by side in one process.

    python benchmarks/linear_fuse_ab.py --model random:qwen2.5-0.5b --rows 1,8,32 --context 512 --out DIR

One eager load, two deep copies packed with ``pack_linears(..., fuse=False)`` and ``fuse=True``; for each row count,
B one-row ``full`` caches prefilled with ``--context`` random tokens per model, then the two steps timed in turn
(what ``ContinuousEngine`` runs: a packed ``RowsCache`` step and the greedy pick), medians of ``--reps``. Writes
``fuse_ab.json`` and ``fuse_ab.md`` (with lscpu) into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvtier
from kvtier.cache.rows import RowsCache
from kvtier.step import pack_linears


def rows_step(model, batch: int, context: int, seed: int):
    ids = torch.randint(10, model.config.vocab_size - 10, (batch, context), generator=torch.Generator().manual_seed(seed))
    caches = [kvtier.make_cache("full", model) for _ in range(batch)]
    last = [int(model(input_ids=ids[i : i + 1], past_key_values=c, use_cache=True, logits_to_keep=1)
                .logits[0, -1].float().argmax()) for i, c in enumerate(caches)]

    def step():
        rc = RowsCache(caches, lengths=[1] * batch)
        o = model(input_ids=torch.tensor([last]), position_ids=rc.positions(), past_key_values=rc, use_cache=True,
                  logits_to_keep=rc.last_positions())
        last[:] = o.logits[0].max(dim=-1).indices.tolist()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    base, _ = kvtier.load_model(a.model, device="cpu", dtype=a.dtype, linear="eager")
    models = {}
    for name, fuse in (("separate", False), ("fused", True)):
        m = copy.deepcopy(base)
        pack_linears(m, "packed", fuse=fuse)
        models[name] = m
    del base
    rows = []
    with torch.no_grad():
        for b in (int(x) for x in a.rows.split(",")):
            steps = {n: rows_step(m, b, a.context, seed=b) for n, m in models.items()}
            for s in steps.values():
                for _ in range(3):
                    s()
            times: dict[str, list[float]] = {n: [] for n in steps}
            for _ in range(a.reps):
                for n, s in steps.items():
                    t = time.perf_counter()
                    s()
                    times[n].append(time.perf_counter() - t)
            med = {n: 1e3 * statistics.median(v) for n, v in times.items()}
            rows.append({"rows": b, "ms_separate": med["separate"], "ms_fused": med["fused"],
                         "fused_vs_separate": med["fused"] / med["separate"]})
            print(f"rows {b}: separate {med['separate']:.1f} ms, fused {med['fused']:.1f} ms "
                  f"({med['fused'] / med['separate']:.3f}x)", flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "model": a.model, "dtype": a.dtype, "context": a.context,
            "reps": a.reps, "results": rows}
    (a.out / "fuse_ab.json").write_text(json.dumps(meta, indent=1))
    table = ["| rows | separate ms/step | fused ms/step | fused / separate |", "|---|---|---|---|"]
    table += [f"| {r['rows']} | {r['ms_separate']:.1f} | {r['ms_fused']:.1f} | {r['fused_vs_separate']:.3f} |"
              for r in rows]
    (a.out / "fuse_ab.md").write_text(
        f"# Fused sibling projections vs separate, serve's rows step ({meta['date']})\n\n"
        f"`python benchmarks/linear_fuse_ab.py --model {a.model} --dtype {a.dtype} --rows {a.rows} "
        f"--context {a.context} --reps {a.reps}` · torch {torch.__version__} · {meta['threads']} threads\n\n"
        + "\n".join(table) + "\n\n```\n" + lscpu + "```\n")


if __name__ == "__main__":
    main()
