"""The sampling step's cost per decode step: the batched step (kvtier.sampling.sample_rows) beside the per-row sampler it replaced (v1: a float32 softmax, a full sort for top_p and one torch.multinomial per row) and beside greedy, at 1, 8 and 32 rows of a 152K vocabulary.

    python benchmarks/serve/sampling_step.py --out benchmarks/results/sampling_step_DATE_CPU

Logits are the embedded model's own (its next-token logits after random prompts, bf16 or float32 as ``--dtype``),
so top_p's partial selection meets the tails a real model has. Writes ``table.md`` and ``results.json`` (with
``lscpu``); times are medians of ``--repeats`` calls.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SETTINGS = {  # name -> SamplingParams kwargs
    "greedy": dict(temperature=0.0),
    "T 1.0": dict(temperature=1.0),
    "T 0.6, top_p 0.95": dict(temperature=0.6, top_p=0.95),
    "T 0.6, top_p 0.95, top_k 20": dict(temperature=0.6, top_p=0.95, top_k=20),
    "T 0.7, min_p 0.05, presence 0.5": dict(temperature=0.7, min_p=0.05, presence_penalty=0.5),
}


def v1_row(scores: torch.Tensor, gen: torch.Generator, temperature: float, top_p: float) -> int:
    """The per-row draw the server used before kvtier.sampling (kept here as the baseline)."""
    probs = torch.softmax(scores.float() / temperature, dim=-1)
    if top_p < 1:
        sp, idx = probs.sort(dim=-1, descending=True)
        drop = (sp.cumsum(-1) - sp) >= top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sp.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs[0], 1, generator=gen))


def previous_step(x: torch.Tensor, params: list, gens: list) -> list[int]:
    """The batched step as d8d6013 had it, for top_p rows without penalties (the baseline of the kept-set draw and
    the thresholds): top_p's cut from a topk of 64, then of 4,096, then a histogram; every row's weights masked and
    drawn over its whole vocabulary (``draw_rows``)."""
    from kvtier.sampling.batched import _top_p_cuts_by_histogram, draw_rows
    from kvtier.sampling.reference import uniform

    xs = x.clone() if x.dtype == torch.float32 else x.float()
    xs.mul_(torch.tensor([1.0 / q.temperature for q in params])[:, None])
    ks = [q.top_k for q in params]
    if any(ks):
        kth = xs.topk(max(ks), dim=-1).values[torch.arange(len(ks)), torch.tensor(ks) - 1]
        xs.masked_fill_(xs < kth[:, None], float("-inf"))
    probs = torch.softmax(xs, dim=-1)
    p = torch.tensor([q.top_p for q in params], dtype=torch.float64)
    cuts = torch.empty(len(params))
    todo = torch.arange(len(params))
    for k in (64, 4096):
        s = probs[todo].topk(k, dim=-1).values
        n = (s.double().cumsum(-1) < p[todo, None]).sum(-1)
        reached = n < k
        cuts[todo[reached]] = s[reached, n[reached]]
        todo = todo[~reached]
        if not todo.numel():
            break
    if todo.numel():
        cuts[todo] = _top_p_cuts_by_histogram(probs[todo], p[todo])
    probs.masked_fill_(probs < cuts[:, None], 0.0)
    return draw_rows(probs, torch.tensor([uniform(g) for g in gens], dtype=torch.float64)).tolist()


def timed(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    import kvtier
    from kvtier.kernels.rows import argmax_rows
    from kvtier.sampling import SamplingParams, sample_rows

    model, tok = kvtier.load_model(a.model, dtype=a.dtype)
    rows = [int(r) for r in a.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 20_000, (max(rows), 32), generator=g)
    with torch.no_grad():
        logits = model(input_ids=prompts).logits[:, -1].to(model.dtype)  # (R, V): real next-token distributions
    results = []
    for name, kw in SETTINGS.items():
        p = SamplingParams(**kw)
        for b in rows:
            x = logits[:b].contiguous()
            gens = [torch.Generator().manual_seed(i) for i in range(b)]
            hist = [(prompts[i].tolist(), [1, 2, 3]) for i in range(b)]
            new = timed(lambda: sample_rows(x, [p] * b, gens, hist, greedy_pick=argmax_rows), a.repeats)
            whole = None
            if p.top_p < 1.0 and not p.penalised:
                whole = timed(lambda: previous_step(x, [p] * b, gens), a.repeats)
            old = None
            if not p.greedy and not p.top_k and not p.min_p and not p.penalised:
                old = timed(lambda: [v1_row(x[i : i + 1], gens[i], p.temperature, p.top_p) for i in range(b)],
                            a.repeats)
            results.append({"setting": name, "rows": b, "batched_ms": new, "d8d6013_step_ms": whole,
                            "v1_per_row_ms": old})
            print(json.dumps(results[-1]), flush=True)
    lines = [f"# The sampling step, {a.model} {model.dtype} logits (V = {logits.shape[-1]}), torch "
             f"{torch.__version__}, {torch.get_num_threads()} threads; medians of {a.repeats}", "",
             "| setting | rows | batched step ms | d8d6013's step ms (top_p: topk 64 -> 4096, whole-row draw) | v1 per-row ms | "
             "v1 / batched |", "|---|---|---|---|---|---|"]
    for r in results:
        old = f"{r['v1_per_row_ms']:.2f}" if r["v1_per_row_ms"] is not None else "-"
        whole = f"{r['d8d6013_step_ms']:.2f}" if r["d8d6013_step_ms"] is not None else "-"
        ratio = f"{r['v1_per_row_ms'] / r['batched_ms']:.1f}x" if r["v1_per_row_ms"] else "-"
        lines.append(f"| {r['setting']} | {r['rows']} | {r['batched_ms']:.2f} | {whole} | {old} | {ratio} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    cmd = "python benchmarks/serve/sampling_step.py " + " ".join(sys.argv[1:])
    (a.out / "results.json").write_text(json.dumps({"results": results, "command": cmd, "lscpu": subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
