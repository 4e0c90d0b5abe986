"""claims.md and claims.json for a run folder (``kvtier report DIR --claims``): the claim rows, how long the chains
are, the second campaign's grid and the cliff's strata."""

from __future__ import annotations

import json
from pathlib import Path

from ..records import dedupe
from .campaigns import evaluate
from .cliff import cells, cliff_lines
from .eviction import grid, grid_lines
from .rules import by_config, pct, quantile


def chain_lengths(records: list[dict]) -> list[dict]:
    """Generated tokens per completion of ``full``, per benchmark: how long our chains are."""
    out = []
    for recs in by_config(records).values():
        r0 = recs[0]
        if r0["policy"] != "full":
            continue
        xs = sorted(r["generated_tokens"] for r in recs)
        cap = r0["max_new_tokens"]
        out.append({"benchmark": r0["benchmark"], "n": len(xs), "max_new_tokens": cap, "median": quantile(xs, 0.5),
                    "p10": quantile(xs, 0.1), "p90": quantile(xs, 0.9), "max": xs[-1],
                    "at_cap": sum(x >= cap for x in xs) / len(xs),
                    "mean_prompt_tokens": sum(r["prompt_tokens"] for r in recs) / len(recs)})
    return sorted(out, key=lambda x: x["benchmark"])


def write_claims(records: list[dict], out: Path, model: str = "", strata: list[dict] | None = None) -> dict[str, Path]:
    """claims.md and claims.json: the claim-by-claim rows, the chain lengths, the v2 grids and the cliff's strata
    (``strata``: :func:`~kvtier.eval.claims.cliff.cells` of these records where the caller has them already)."""
    rows, chains = evaluate(records), chain_lengths(records)
    by = by_config(records)
    strata = cells(by) if strata is None else strata
    in_strata = {s["benchmark"] for s in strata}  # their own table: the cliff's
    v2 = {b: grid(by, b) for b in sorted({r["benchmark"] for r in records} - in_strata)}
    v2 = {b: g for b, g in v2.items() if g}
    paths = {"claims_md": out / "claims.md", "claims_json": out / "claims.json"}
    paths["claims_json"].write_text(json.dumps({"claims": [r.as_dict() for r in rows], "chains": chains, "v2_grid": v2,
                                                "cliff": strata}, indent=2, default=float))
    lines = ["# The paper's claims, side by side", "", f"{model + ': ' if model else ''}{len(dedupe(records))} records.", "",
             "| claim | paper | kvtier | verdict | rule |", "|---|---|---|---|---|"]
    lines += [f"| {r.claim} | {r.paper} | {r.kvtier} | **{r.verdict}** | {r.rule} |" for r in rows]
    lines += ["", "## How long the chains are (full cache)", "",
              "| benchmark | n | prompt tokens (mean) | generated: p10 / median / p90 / max | at the cap |", "|---|---|---|---|---|"]
    lines += [f"| {c['benchmark']} | {c['n']} | {c['mean_prompt_tokens']:.0f} | {c['p10']} / {c['median']} / {c['p90']} / "
              f"{c['max']} (cap {c['max_new_tokens']}) | {pct(c['at_cap'])} |" for c in chains]
    for b, g in v2.items():
        lines += [x.replace("(v2 grid)", f"(v2 grid, {b})") for x in grid_lines(g)]
    lines += cliff_lines(strata)
    paths["claims_md"].write_text("\n".join(lines) + "\n")
    return paths
