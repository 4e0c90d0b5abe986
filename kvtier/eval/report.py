"""Summaries, paired tests and plots from recorded evaluations (``kvtier report DIR``)."""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict
from pathlib import Path

from .claims import MIN_FULL_ACCURACY, by_config, write_claims
from .claims.cliff import CELLS as CLIFF_CELLS
from .claims.cliff import cells
from .configs import (comparison, comparison_base, device_kv_bytes, device_tokens, differing_fields, eviction_ratio,
                      family, full_params, settings)
from .records import dedupe, read_records
from .stats import cochran_q, mcnemar_exact, wilson

def summarize(records: list[dict]) -> dict:
    """Per-configuration accuracy, intervals, retention, memory and paired tests against ``full``."""
    records = dedupe(records)
    by_cfg: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_cfg[r["config_key"]].append(r)
    rows = []
    full_of: dict[tuple, str] = {}
    for key, recs in by_cfg.items():
        if family(recs[0]["policy"]) == "reference":
            full_of[comparison_base(recs[0])] = key
    for key, recs in by_cfg.items():
        r0 = recs[0]
        params = full_params(r0)
        n = len(recs)
        k = sum(bool(r.get("correct")) for r in recs)
        lo, hi = wilson(k, n)
        row = {
            "config_key": key,
            "benchmark": r0["benchmark"],
            "policy": r0["policy"],
            "params": r0["params"],
            "key_inputs": r0.get("key_inputs"),
            "comparison": comparison(r0["policy"], params, r0.get("params")),
            "settings": settings(r0.get("params") or {}),
            "evict_ratio": eviction_ratio(r0["policy"], params),
            "hbm_ratio": params.get("hbm_ratio"),
            # device tokens per sequence at the batch's peak (older records: at the end), and (baselines) what the
            # budget allowed
            "mean_device_tokens": sum(device_tokens(r) for r in recs) / n,
            "mean_budget_tokens": (sum(r["budget_tokens"] for r in recs) / n
                                   if all(r.get("budget_tokens") is not None for r in recs) else None),
            "n": n,
            "correct": k,
            "accuracy": k / n if n else 0.0,
            "ci_low": lo,
            "ci_high": hi,
            "mean_generated_tokens": sum(r["generated_tokens"] for r in recs) / n,
            "mean_device_kv_bytes": sum(device_kv_bytes(r) for r in recs) / n,
            "mean_evicted_fraction": sum(r["tier_tokens"]["T3"] / max(1, sum(r["tier_tokens"].values())) for r in recs) / n,
            "seconds": sum(r["seconds"] for r in recs),
        }
        fk = full_of.get(comparison_base(r0))
        if fk is not None:
            full = {(r["id"], r["sample"]): r for r in by_cfg[fk]}
            pairs = [(full[(r["id"], r["sample"])], r) for r in recs if (r["id"], r["sample"]) in full]
            if pairs:
                fa = sum(a["correct"] for a, _ in pairs) / len(pairs)
                b = sum(a["correct"] and not x["correct"] for a, x in pairs)
                c = sum(x["correct"] and not a["correct"] for a, x in pairs)
                row.update(
                    paired_n=len(pairs),
                    full_accuracy=fa,
                    retention=(sum(x["correct"] for _, x in pairs) / len(pairs)) / fa if fa else None,
                    mcnemar_p=mcnemar_exact(b, c),
                    identical_to_full=sum(a["completion"] == x["completion"] for a, x in pairs) / len(pairs),
                    device_kv_vs_full=(sum(device_kv_bytes(x) for _, x in pairs)
                                       / max(1, sum(device_kv_bytes(a) for a, _ in pairs))),
                )
        rows.append(row)
    rows.sort(key=lambda x: (x["benchmark"], family(x["policy"]) != "reference", x["policy"], x["evict_ratio"] or 0, x["hbm_ratio"] or 0))
    return {"configs": rows, "hbm_independence": hbm_independence(by_cfg), "differing": differing_fields(records)}


def hbm_independence(by_cfg: dict[str, list[dict]]) -> list[dict]:
    """For tiered runs that differ only in hbm_ratio: Cochran's Q across the ratios, and whether outputs are identical."""
    groups: dict[tuple, dict[float, list[dict]]] = defaultdict(dict)
    for recs in by_cfg.values():
        r0 = recs[0]
        params = full_params(r0)
        if family(r0["policy"]) != "hierarchy" or params.get("hbm_ratio") is None:
            continue
        rest = tuple(sorted((k, json.dumps(v)) for k, v in params.items() if k != "hbm_ratio"))
        groups[(comparison_base(r0), rest)][params["hbm_ratio"]] = recs
    out = []
    for (base, rest), by_h in groups.items():
        if len(by_h) < 2:
            continue
        hs = sorted(by_h)
        maps = [{(r["id"], r["sample"]): r for r in by_h[h]} for h in hs]
        common = sorted(set.intersection(*(set(m) for m in maps)))
        table = [[int(m[i]["correct"]) for m in maps] for i in common]
        q, p = cochran_q(table)
        identical = all(len({m[i]["completion"] for m in maps}) == 1 for i in common)
        out.append({"benchmark": base[0], "params": {k: json.loads(v) for k, v in rest}, "hbm_ratios": hs, "n": len(common),
                    "accuracies": [sum(t[j] for t in table) / max(1, len(table)) for j in range(len(hs))],
                    "cochran_q": q, "p_value": p, "identical_outputs": identical})
    return out


def _fmt(x, pct=False):
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{100 * x:.1f}%" if pct else f"{x:.3g}"
    return str(x)


def write_report(run_dir: str | Path, out_dir: str | Path | None = None, html: bool = False,
                 html_problems: int = 40, claims: bool = False) -> dict[str, Path]:
    """Write summary.md, summary.csv, summary.json and PNG plots (and, with ``html``, report.html showing
    ``html_problems`` problems per benchmark side by side); returns their paths."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a run folder (a directory written by kvtier eval or sweep)")
    records = read_records(run_dir)
    if not records:
        raise ValueError(f"no records in {run_dir / 'records.jsonl'}; run `kvtier eval` or `kvtier sweep` with --out {run_dir}")
    out = Path(out_dir) if out_dir else run_dir
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(records)
    rows = s["configs"]
    paths = {"json": out / "summary.json", "csv": out / "summary.csv", "md": out / "summary.md"}
    paths["json"].write_text(json.dumps(s, indent=2))
    cols = ["benchmark", "policy", "comparison", "settings", "evict_ratio", "hbm_ratio", "mean_budget_tokens", "mean_device_tokens", "n", "accuracy", "ci_low", "ci_high", "retention",
            "mcnemar_p", "identical_to_full", "mean_device_kv_bytes", "device_kv_vs_full", "mean_generated_tokens", "params"]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow([json.dumps(r.get(c)) if c == "params" else r.get(c) for c in cols])
    lines = ["# kvtier evaluation", "", f"{len(records)} records from `{run_dir}`.", ""]
    if s["differing"]:
        lines += ["Configurations differ in: " + "; ".join(f"{k} = {v}" for k, v in s["differing"].items()), ""]
    lines += [
             "Budget: what a baseline's budget allowed at the end (mean tokens per problem, its forced set included); "
             "device tokens: what each policy held on the device per sequence at its peak (records from before peaks "
             "were recorded: at the end); device KV vs full compares those peaks.", "",
             "| benchmark | policy | comparison | settings | evict | hbm | budget (tokens) | device tokens | n | accuracy (95% CI) | retention | McNemar p vs full | identical to full | device KV vs full |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = "–" if r.get("mean_budget_tokens") is None else f"{r['mean_budget_tokens']:.0f}"
        lines.append(
            f"| {r['benchmark']} | {r['policy']} | {r['comparison']} | {r['settings'] or '–'} | {_fmt(r['evict_ratio'])} | {_fmt(r['hbm_ratio'])} | "
            f"{budget} | {r['mean_device_tokens']:.0f} | {r['n']} | "
            f"{100 * r['accuracy']:.1f}% ({100 * r['ci_low']:.1f}–{100 * r['ci_high']:.1f}) | {_fmt(r.get('retention'), True)} | "
            f"{_fmt(r.get('mcnemar_p'))} | {_fmt(r.get('identical_to_full'), True)} | {_fmt(r.get('device_kv_vs_full'), True)} |"
        )
    if s["hbm_independence"]:
        lines += ["", "## Does accuracy depend on the HBM ratio? (tiered, fixed eviction)", "",
                  "| benchmark | fixed params | hbm ratios | accuracies | Cochran's Q | p | identical outputs |", "|---|---|---|---|---|---|---|"]
        for h in s["hbm_independence"]:
            lines.append(f"| {h['benchmark']} | {h['params']} | {h['hbm_ratios']} | {[round(a, 3) for a in h['accuracies']]} | "
                         f"{h['cochran_q']:.3g} | {h['p_value']:.3g} | {'yes' if h['identical_outputs'] else 'no'} |")
    paths["md"].write_text("\n".join(lines) + "\n")
    strata = cells(by_config(records))
    if len(strata) >= 2:  # one figure across the strata says what their per-benchmark plots would say piecemeal
        paths.update(plot_cliff(strata, out))
    in_strata = {r["benchmark"] for r in strata} if len(strata) >= 2 else set()
    paths.update(plot_all([r for r in rows if r["benchmark"] not in in_strata], out))
    if claims:
        paths.update(write_claims(records, out, model=rows[0]["key_inputs"].get("model", "") if rows[0].get("key_inputs") else "",
                                  strata=strata))
    if html:
        from .report_html import write_html_report

        plots = {k: p for k, p in paths.items() if p.suffix == ".png"}
        paths["html"] = write_html_report(run_dir, out, s, records, plots, max_problems=html_problems)
    return paths


def plot_all(rows: list[dict], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    for bench in sorted({r["benchmark"] for r in rows}):
        br = [r for r in rows if r["benchmark"] == bench]
        # 1. accuracy vs eviction ratio per policy: the cliff vs the knob
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        markers = "osD^v<>Xp*h"
        for i, pol in enumerate(sorted({r["policy"] for r in br})):
            h_min = min((x["hbm_ratio"] for x in br if x["policy"] == pol and x["hbm_ratio"] is not None), default=None)
            pts = sorted((r["evict_ratio"], r["accuracy"], r["ci_low"], r["ci_high"]) for r in br
                         if r["policy"] == pol and r["evict_ratio"] is not None and r["hbm_ratio"] == h_min)
            if not pts:
                continue
            xs, ys = [p[0] for p in pts], [100 * p[1] for p in pts]
            err = [[max(0.0, 100 * (p[1] - p[2])) for p in pts], [max(0.0, 100 * (p[3] - p[1])) for p in pts]]
            if family(pol) == "reference":
                style = dict(marker="*", markersize=14, linestyle="none", color="black")
            else:  # open markers and dashes keep policies that coincide (tiered = evict) visible
                style = dict(marker=markers[i % len(markers)], markersize=7, fillstyle="none",
                             linestyle=("--" if family(pol) == "hierarchy" else "-"), capsize=3, alpha=0.9)
            label = pol if h_min is None else f"{pol} (hbm {h_min})"
            ax.errorbar([x + 0.004 * (i - 3) for x in xs], ys, yerr=err, label=label, **style)
        ax.set(xlabel="eviction ratio (fraction of tokens destroyed)", ylabel="accuracy (%), 95% Wilson interval",
               title=f"{_short_name(bench)}: accuracy vs eviction ratio")
        ax.grid(alpha=0.3)
        ax.legend()
        paths[f"{bench}_eviction"] = _save(fig, out / f"{_safe(bench)}_accuracy_vs_eviction.png")
        # 2. tiered HBM x eviction heatmap
        tr = [r for r in br if family(r["policy"]) == "hierarchy" and r["hbm_ratio"] is not None and r["evict_ratio"] is not None]
        if tr:
            hs = sorted({r["hbm_ratio"] for r in tr})
            es = sorted({r["evict_ratio"] for r in tr})
            grid = [[next((100 * r["accuracy"] for r in tr if r["hbm_ratio"] == h and r["evict_ratio"] == e), float("nan")) for h in hs] for e in es]
            fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(hs), 1.4 + 0.8 * len(es)))
            im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
            ax.set_xticks(range(len(hs)), [str(h) for h in hs])
            ax.set_yticks(range(len(es)), [str(e) for e in es])
            for i in range(len(es)):
                for j in range(len(hs)):
                    cell = grid[i][j]
                    ax.text(j, i, "–" if cell != cell else f"{cell:.1f}", ha="center", va="center",
                            color="w" if cell == cell else "k")
            ax.set(xlabel="HBM ratio (T0)", ylabel="eviction ratio (T3)", title=f"{_short_name(bench)}: tiered accuracy (%)")
            fig.colorbar(im, ax=ax)
            paths[f"{bench}_heatmap"] = _save(fig, out / f"{_safe(bench)}_hbm_evict_heatmap.png")
        # 3. device KV memory vs accuracy, every policy and comparison on one figure
        fig, ax = plt.subplots(figsize=(7.2, 4.6))
        rel = all(r.get("device_kv_vs_full") is not None for r in br)
        for i, pol in enumerate(sorted({r["policy"] for r in br})):
            pr = [r for r in br if r["policy"] == pol]
            xs = [100 * r["device_kv_vs_full"] if rel else r["mean_device_kv_bytes"] / 2**20 for r in pr]
            ys = [100 * r["accuracy"] for r in pr]
            err = [[max(0.0, 100 * (r["accuracy"] - r["ci_low"])) for r in pr], [max(0.0, 100 * (r["ci_high"] - r["accuracy"])) for r in pr]]
            style = dict(marker="*", markersize=14, color="black") if family(pol) == "reference" else dict(marker=markers[i % len(markers)], markersize=7)
            ax.errorbar(xs, ys, yerr=err, linestyle="none", capsize=2, alpha=0.85, label=pol, **style)
            for x, y, r in zip(xs, ys, pr):
                tag = _short(r)
                if tag:
                    ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        ax.set(xlabel="peak device KV, % of full" if rel else "peak device KV per sequence (MiB)",
               ylabel="accuracy (%), 95% Wilson interval", title=f"{_short_name(bench)}: device memory vs accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths[f"{bench}_memory"] = _save(fig, out / f"{_safe(bench)}_memory_vs_accuracy.png")
    return paths


def plot_cliff(strata: list[dict], out: Path) -> dict[str, Path]:
    """Accuracy and retention against chain length over the protected window, one line per configuration of the
    cliff's cells (:func:`kvtier.eval.claims.cliff.cells`): where eviction starts to cost, and whether the hierarchy
    at the same device share does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["chain_over_window"] for r in strata]
    labels = [r["benchmark"].partition("=")[2] for r in strata]
    names = [n for n, _, _ in CLIFF_CELLS if any(n in r["cells"] for r in strata)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    for i, name in enumerate(names):
        pts = [(x, r["cells"][name]) for x, r in zip(xs, strata) if name in r["cells"]]
        acc = [100 * c["accuracy"]["accuracy"] for _, c in pts]
        err = [[max(0.0, a - 100 * c["accuracy"]["ci"][0]) for a, (_, c) in zip(acc, pts)],
               [max(0.0, 100 * c["accuracy"]["ci"][1] - a) for a, (_, c) in zip(acc, pts)]]
        style = dict(marker="osD^"[i % 4], linestyle="-" if name in ("full", "evict 0.5") else "--", capsize=3,
                     fillstyle="none" if i == 3 else "full", color=f"C{i}")
        ax.errorbar([x + 0.05 * (i - 1.5) for x, _ in pts], acc, yerr=err, label=name, **style)
        ret = [(x, c["retention"]) for (x, c), r in zip(pts, strata) if c["retention"] is not None and name != "full"
               and r["cells"]["full"]["accuracy"]["accuracy"] >= MIN_FULL_ACCURACY]  # else a ratio of noise
        if ret:
            ax2.plot([x for x, _ in ret], [100 * y for _, y in ret], label=name, **{k: v for k, v in style.items()
                                                                                 if k != "capsize"})
    for a in (ax, ax2):
        a.set_xticks(xs, [f"{x:.1f}\n({lab} steps)" for x, lab in zip(xs, labels)])
        a.set_xlabel(f"full's median chain / protected window ({strata[0]['window']} tokens)")
        a.grid(alpha=0.3)
    ax.set(ylabel="accuracy (%), 95% Wilson interval", title="GSM8K by reference steps: accuracy")
    ax2.axhline(25, color="grey", linestyle=":", linewidth=1)
    ax2.annotate("the cliff: <= 25% of full", (xs[0], 26), fontsize=8, color="grey")
    weak = [lab for r, lab in zip(strata, labels) if r["cells"]["full"]["accuracy"]["accuracy"] < MIN_FULL_ACCURACY]
    ax2.set(ylabel="retention vs full (%)", title="kept of full's accuracy"
            + (f" (not shown: {', '.join(weak)} steps, full < {100 * MIN_FULL_ACCURACY:.0f}%)" if weak else ""))
    ax2.title.set_fontsize(9 if weak else 12)
    ax.legend(fontsize=8)
    return {"cliff": _save(fig, out / "cliff_accuracy_vs_chain_length.png")}


def _short(r: dict) -> str:
    """A point label: e = equal eviction ratio, m = equal memory at hbm, t = fixed tokens, h = tiered hbm."""
    c = r["comparison"]
    if c.startswith("equal memory"):
        return f"m{r['params'].get('budget_ratio')}"
    if c.startswith("fixed budget"):
        return f"t{r['params'].get('budget_tokens')}"
    if family(r["policy"]) == "reference":
        return ""
    if r["evict_ratio"] is not None:
        return f"e{r['evict_ratio']:g}" + (f"/h{r['hbm_ratio']:g}" if r.get("hbm_ratio") is not None else "")
    return ""


def _safe(bench: str) -> str:
    """A benchmark name as part of a file name (reasoning-gym options hold ?, & and =)."""
    return re.sub(r"[^A-Za-z0-9_.:+-]+", "_", bench)


def _short_name(bench: str) -> str:
    """Plot titles: a reasoning-gym task without its options (they are in the file name and the table)."""
    return bench.split("?")[0] + (" (options)" if "?" in bench else "")


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
