"""Where one whole decode step's time goes (model + cache), op by op, against the floor the weights set.

    python benchmarks/decode/step_profile.py --model random:qwen2.5-0.5b --batch 1,8,32 --context 512 --steps 16 \
        --out benchmarks/results/step_profile_<date>/

For each batch size: a `full` (or `--policy`) cache is prefilled with `--context` random tokens (`--layout batch`:
one cache of B rows, as `generate` and `kvtier bench` run; `--layout rows`: B one-row caches stepped together
through a packed `RowsCache`, as `kvtier serve`'s continuous engine runs, sampling included), `--warmup` decode
steps run untimed, then `--steps` steps run under torch.profiler. The ops' self CPU time is summed by what they do
(the projections and MLP matmuls, attention, norms, rotary, activations, sampling, copies, the rest), and the
step's wall time minus the ops' time is what Python and dispatch cost. Beside it: the weights' bytes, the read
peak `kvtier bench` measures, and the step's floor at batch 1 (the weights read once per step at that bandwidth).
Writes `profile_b<B>.txt` (torch's top ops) and `summary.json` / `summary.md`.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvtier
from kvtier.compat import cache_kw
from kvtier.tools.bench import read_peak_gbps

CATEGORIES = [  # first match wins; names of aten ops as the profiler records them
    ("matmul (projections, MLP, lm head)", r"^(aten::(addmm|mm|bmm|linear|matmul|_mkldnn|mkldnn_|onednn)|mkldnn::_linear)"),
    ("rows layer's own Python (per-row bookkeeping)", r"^kvtier::rows_"),
    ("sampling / logits processing", r"^kvtier::argmax_rows$"),
    ("attention", r"(scaled_dot_product|_flash_attention|kvtier|fused_decode|softmax)"),
    ("norm", r"(rms_norm|layer_norm|pow|rsqrt|mean)"),
    ("rotary / elementwise", r"^aten::(mul|add|sub|neg|cat|slice|cos|sin|div|where|sigmoid|silu|gelu|tanh)"),
    ("copies / layout", r"^aten::(copy_|to|_to_copy|contiguous|clone|index|index_select|index_copy|view|reshape|"
                        r"transpose|permute|expand|empty|zeros|full|fill_|masked_fill)"),
    ("sampling / logits processing", r"^aten::(argmax|topk|sort|multinomial|max|gather|scatter)"),
]


def category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name):
            return cat
    return "other ops"


def lscpu() -> str:
    try:
        import subprocess

        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        keep = [ln for ln in out.splitlines() if ln.split(":")[0].strip() in ("Model name", "CPU family", "Model",
                                                                              "CPU(s)", "Flags")]
        return "\n".join(ln if not ln.startswith("Flags") else "Flags: " + " ".join(
            f for f in ln.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma"))) for ln in keep)
    except Exception:  # noqa: BLE001 - a description only
        return platform.processor()


_MODELS: dict = {}


def label_kernel_calls() -> None:
    """Make the fused CPU kernel's calls visible to the profiler: they are not aten ops, so without a label their time
    would be counted as "Python + dispatch". Each is wrapped in a ``record_function`` named ``kvtier::<name>`` (the
    "attention" category), and a RowsCache layer's ``update``/``attend`` in ``kvtier::rows_<name>`` (their self time:
    the per-row Python around the kernel). The wrappers live in this script only; the library is unchanged."""
    from kvtier.attention import fused_cpu
    from kvtier.cache.rows import RowsLayer

    targets = [(fused_cpu, n, f"kvtier::{n}") for n in ("attend", "attend_rows", "append_rows", "argmax_rows")]
    targets += [(RowsLayer, n, f"kvtier::rows_{n}") for n in ("update", "attend")]  # a function on a class: a method
    for owner, name, label in targets:
        fn = getattr(owner, name)
        if getattr(fn, "_labelled", False):
            continue

        def wrapped(*args, _fn=fn, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _fn(*args, **kwargs)

        wrapped._labelled = True
        setattr(owner, name, wrapped)


def run(model_name: str, batch: int, context: int, steps: int, warmup: int, policy: str, dtype: str, out: Path,
        layout: str = "batch") -> dict:
    if (model_name, dtype) not in _MODELS:
        _MODELS[(model_name, dtype)] = kvtier.load_model(model_name, device="cpu", dtype=dtype)
    model, tok = _MODELS[(model_name, dtype)]
    from kvtier.step import step_weight_bytes

    weight_bytes = step_weight_bytes(model)  # packed weights included, embedding rows not
    ids = torch.randint(10, model.config.vocab_size - 10, (batch, context))
    with torch.no_grad():
        if layout == "batch":
            cache = kvtier.make_cache(policy, model)
            out_ = model(input_ids=ids, **cache_kw(model, cache), use_cache=True, logits_to_keep=1)
            nxt = out_.logits[:, -1].argmax(-1, keepdim=True)

            def step():
                nonlocal nxt
                o = model(input_ids=nxt, **cache_kw(model, cache), use_cache=True)  # positions: the cache's length
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
        else:
            from kvtier.attention import fused_cpu
            from kvtier.cache.rows import RowsCache

            caches = [kvtier.make_cache(policy, model) for _ in range(batch)]
            last = []
            for i, c in enumerate(caches):
                last.append(int(model(input_ids=ids[i : i + 1], **cache_kw(model, c), use_cache=True,
                                      logits_to_keep=1).logits[0, -1].float().argmax()))

            def step():  # what ContinuousEngine._step does for B running rows
                rc = RowsCache(caches, lengths=[1] * batch)
                o = model(input_ids=torch.tensor([last]), position_ids=rc.positions(), **cache_kw(model, rc),
                          use_cache=True, logits_to_keep=rc.last_positions())
                last[:] = fused_cpu.argmax_rows(o.logits[0]).tolist()  # the engine's greedy pick (model dtype)

        for _ in range(warmup):
            step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        wall_plain = (time.perf_counter() - t) / steps
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                step()
            wall_prof = (time.perf_counter() - t) / steps
    events = prof.key_averages()
    (out / f"profile_b{batch}.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=40))
    by: dict[str, float] = {}
    for e in events:
        by[category(e.key)] = by.get(category(e.key), 0.0) + e.self_cpu_time_total / 1e6 / steps
    ops = sum(by.values())
    return {"batch": batch, "layout": layout, "context": context, "steps": steps, "ms_per_step": 1e3 * wall_plain,
            "ms_per_step_profiled": 1e3 * wall_prof, "ms_ops": 1e3 * ops,
            "ms_python_and_dispatch": 1e3 * max(0.0, wall_prof - ops),
            "ms_by_category": {k: 1e3 * v for k, v in sorted(by.items(), key=lambda kv: -kv[1])},
            "weight_bytes": weight_bytes, "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--policy", default="full")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--layout", default="batch", choices=["batch", "rows"],
                    help="batch: one B-row cache (generate, bench); rows: B one-row caches in a packed RowsCache (serve)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    label_kernel_calls()
    peak = read_peak_gbps(torch.device("cpu"))
    rows = []
    for b in [int(x) for x in a.batch.split(",")]:
        r = run(a.model, b, a.context, a.steps, a.warmup, a.policy, a.dtype, a.out, a.layout)
        r["floor_ms_weights_at_read_peak"] = 1e3 * r["weight_bytes"] / (peak * 1e9)
        r["vs_floor"] = r["ms_per_step"] / r["floor_ms_weights_at_read_peak"]
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "ms_by_category"}), flush=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": lscpu(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "model": a.model, "policy": a.policy,
            "read_peak_gbps": peak, "command": "python benchmarks/decode/step_profile.py " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items())}
    (a.out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cats = sorted({c for r in rows for c in r["ms_by_category"]}, key=lambda c: -rows[0]["ms_by_category"].get(c, 0))
    lines = [f"# Decode step profile: {a.model}, {a.policy} cache, context {a.context}, layout {a.layout}", "",
             f"{meta['date']} · torch {meta['torch']} · {meta['threads']} threads · read peak {peak:.1f} GB/s",
             "", "```", meta["cpu"], "```", "", f"`{meta['command']}`", "",
             "| batch | ms/step | floor (weights at read peak) | vs floor | Python + dispatch | "
             + " | ".join(cats) + " |", "|" + "---|" * (5 + len(cats))]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['ms_per_step']:.1f} | {r['floor_ms_weights_at_read_peak']:.1f} | "
                     f"{r['vs_floor']:.2f}× | {r['ms_python_and_dispatch']:.1f} | "
                     + " | ".join(f"{r['ms_by_category'].get(c, 0):.1f}" for c in cats) + " |")
    lines += ["", "Categories are the ops' self CPU time per step (ms), under the profiler (its own overhead "
              "included: compare `ms_per_step_profiled` with `ms_per_step` in summary.json)."]
    (a.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
