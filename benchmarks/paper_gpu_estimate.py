"""GPU-hours of a sweep config from `kvtier plan`'s decode-step floors (no GPU needed).

    python benchmarks/paper_gpu_estimate.py benchmarks/sweeps/paper_gpu.json --hardware h200 \
        > benchmarks/sweeps/paper_gpu_estimate.md

Per configuration: sequences = problems x samples; batches = sequences / batch size; steps per batch =
max_new_tokens (a static batch decodes until its longest row stops, and with reasoning chains one row nearly always
runs to the cap); time per step = the planner's floor at the batch's mean context (prompt + max_new_tokens / 2: KV
bytes read grow linearly with the context). Policies map to the planner as: full = the full-cache floor; tiered
and quant = the best T1 mode at their ratios; evict and the eviction baselines = a full cache of the tokens they
keep. Floors are lower bounds (every byte read once at datasheet bandwidth); prefill, sampling and Python overhead
come on top, so the table also shows 3x the floor, a guess until the GPU check measures the ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.eval.sweep import config_parts, expand_grid  # noqa: E402
from kvtier.tools.memplan import plan  # noqa: E402

SIZES = {"gsm8k": 1319, "math500": 500, "math_level5": 1324, "arc_challenge": 1172}  # test split sizes
PROMPT_TOKENS = 200  # the R1 template + one question, rounded up


def configs(path: Path) -> tuple[dict, list]:
    file = json.loads(path.read_text())
    out = []
    for part in config_parts(file, str(path)):
        as_list = lambda v: v if isinstance(v, list) else [x.strip() for x in str(v).split(",") if x.strip()]  # noqa: E731
        out += expand_grid(model=file["model"], benchmarks=as_list(part["benchmark"]), policies=as_list(part["policy"]),
                           evict_ratios=[float(x) for x in as_list(part.get("evict_ratio", "0.03"))],
                           hbm_ratios=[float(x) for x in as_list(part.get("hbm_ratio", "0.3"))],
                           quant_ratio=float(part.get("quant_ratio", 0.0)), policy_params=part.get("policy_params"),
                           compare=part.get("compare", "equal-eviction"), limit=part.get("limit"),
                           max_new_tokens=int(part.get("max_new_tokens", 512)),
                           temperature=float(part.get("temperature", 0.0)), top_p=float(part.get("top_p", 1.0)),
                           samples=int(part.get("samples", 1)), seed=int(part.get("seed", 0)))
    return file, out


def step_seconds(c, batch: int, ctx: int, hardware: str) -> tuple[float, str]:
    p = c.full_params
    if c.policy == "full":
        return plan(c.model, batch, ctx, hbm_ratio=1.0, evict_ratio=0.0, hardware=hardware)["step_floor_ms"]["full_cache"] / 1e3, "full cache"
    if c.policy in ("tiered", "quant"):
        q = p.get("quant_ratio", 0.0) if c.policy == "tiered" else round(1 - p["hbm_ratio"] - p["evict_ratio"], 6)
        r = plan(c.model, batch, ctx, hbm_ratio=p["hbm_ratio"], evict_ratio=p["evict_ratio"], quant_ratio=q, hardware=hardware)
        return r["step_floor_ms"][r["best_mode"]] / 1e3, f"{r['best_mode']} (T1 {r['tokens_per_seq']['T1']}, T2 {r['tokens_per_seq']['T2']} tok)"
    kept = 1 - p["evict_ratio"] if c.policy == "evict" else (p.get("budget_ratio") or 1.0)
    n = max(1, int(ctx * kept))
    return plan(c.model, batch, n, hbm_ratio=1.0, evict_ratio=0.0, hardware=hardware)["step_floor_ms"]["full_cache"] / 1e3, f"full cache of {kept:.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--batch", type=int, default=None, help="default: the config's batch_size")
    args = ap.parse_args()
    file, cfgs = configs(args.config)
    batch = args.batch or int(file.get("batch_size", 1))
    lines = [f"# Estimated GPU time of `{args.config}` on one {args.hardware}", "",
             f"Model {file['model']}, batch {batch}, from `kvtier plan` floors (`benchmarks/paper_gpu_estimate.py`; "
             "method in its docstring).", "",
             "| # | benchmark | policy | params | sequences | steps/batch | mean context | floor ms/step | T1 mode | GPU-h (floor) | GPU-h (3x floor) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    total = 0.0
    for i, c in enumerate(cfgs, 1):
        base = c.benchmark.partition("?")[0]
        n_seq = min(c.limit or SIZES[base], SIZES[base]) * c.samples
        ctx = PROMPT_TOKENS + c.max_new_tokens // 2
        sec, mode = step_seconds(c, batch, ctx, args.hardware)
        batches = -(-n_seq // batch)
        hours = batches * c.max_new_tokens * sec / 3600
        total += hours
        shown = ", ".join(f"{k}={v}" for k, v in c.params.items())
        lines.append(f"| {i} | {c.benchmark} | {c.policy} | {shown} | {n_seq} | {c.max_new_tokens} | {ctx} | {1e3 * sec:.1f} | "
                     f"{mode} | {hours:.2f} | {3 * hours:.1f} |")
    lines += ["", f"**Total: {total:.1f} GPU-hours at the floor, ~{3 * total:.0f} at 3x the floor** "
              f"({len(cfgs)} configurations).", ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
