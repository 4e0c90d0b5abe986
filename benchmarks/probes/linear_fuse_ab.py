"""Two preparations of the CPU step side by side in one process, on serve's whole rows step: sibling projections
fused (q/k/v, gate/up as one packed weight) vs packed one by one (``--ab linears``), or the RMSNorms fused vs the
model's own (``--ab norms``, linears packed and fused in both).

    python benchmarks/probes/linear_fuse_ab.py --model random:qwen2.5-0.5b --rows 1,8,32 --context 512 --out DIR [--ab norms]

One eager load, two deep copies prepared each way (``pack_linears(..., fuse=False)`` / ``fuse=True``; or
``pack_linears`` alone / with ``fuse_norms``); for each row count, B one-row ``full`` caches prefilled with
``--context`` random tokens per model, then the two steps timed in turn (what ``ContinuousEngine`` runs: a packed
``RowsCache`` step and the greedy pick), medians of ``--reps``. Writes ``fuse_ab.json`` / ``fuse_ab.md`` (linears) or
``norm_ab.json`` / ``norm_ab.md`` (norms), with lscpu, into ``--out``.
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
from kvtier.compat import cache_kw
from kvtier.step import fuse_norms, pack_linears


def rows_step(model, batch: int, context: int, seed: int):
    ids = torch.randint(10, model.config.vocab_size - 10, (batch, context), generator=torch.Generator().manual_seed(seed))
    caches = [kvtier.make_cache("full", model) for _ in range(batch)]
    last = [int(model(input_ids=ids[i : i + 1], **cache_kw(model, c), use_cache=True, logits_to_keep=1)
                .logits[0, -1].float().argmax()) for i, c in enumerate(caches)]

    def step():
        rc = RowsCache(caches, lengths=[1] * batch)
        o = model(input_ids=torch.tensor([last]), position_ids=rc.positions(), **cache_kw(model, rc), use_cache=True,
                  logits_to_keep=rc.last_positions())
        last[:] = o.logits[0].max(dim=-1).indices.tolist()

    return step


def _linears(model, name: str) -> None:
    pack_linears(model, "packed", fuse=name == "fused")


def _norms(model, name: str) -> None:
    pack_linears(model, "packed")
    if name == "fused_norms" and not fuse_norms(model, "packed"):
        raise SystemExit("the fused norm kernel could not be built here")


# --ab: (the two copies' names, baseline first), how a copy is prepared, the output files' stem, the title
AB = {"linears": (("separate", "fused"), _linears, "fuse_ab", "Fused sibling projections vs separate"),
      "norms": (("stock_norms", "fused_norms"), _norms, "norm_ab", "Fused RMSNorms vs the model's own")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ab", default="linears", choices=sorted(AB), help="what the two copies differ in")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    base, _ = kvtier.load_model(a.model, device="cpu", dtype=a.dtype, linear="eager")
    (old, new), prepare, stem, title = AB[a.ab]
    models = {}
    for name in (old, new):
        m = copy.deepcopy(base)
        prepare(m, name)
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
            rows.append({"rows": b, f"ms_{old}": med[old], f"ms_{new}": med[new], f"{new}_vs_{old}": med[new] / med[old]})
            print(f"rows {b}: {old} {med[old]:.1f} ms, {new} {med[new]:.1f} ms ({med[new] / med[old]:.3f}x)", flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "model": a.model, "dtype": a.dtype, "context": a.context,
            "reps": a.reps, "ab": a.ab, "results": rows}
    (a.out / f"{stem}.json").write_text(json.dumps(meta, indent=1))
    table = [f"| rows | {old} ms/step | {new} ms/step | {new} / {old} |", "|---|---|---|---|"]
    table += [f"| {r['rows']} | {r[f'ms_{old}']:.1f} | {r[f'ms_{new}']:.1f} | {r[f'{new}_vs_{old}']:.3f} |" for r in rows]
    (a.out / f"{stem}.md").write_text(
        f"# {title}, serve's rows step ({meta['date']})\n\n"
        f"`python benchmarks/probes/linear_fuse_ab.py --model {a.model} --dtype {a.dtype} --rows {a.rows} "
        f"--context {a.context} --reps {a.reps} --ab {a.ab}` · torch {torch.__version__} · {meta['threads']} threads\n\n"
        + "\n".join(table) + "\n\n```\n" + lscpu + "```\n")


if __name__ == "__main__":
    main()
