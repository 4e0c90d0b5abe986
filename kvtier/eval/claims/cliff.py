"""Where the cliff appears: accuracy against chain length over the protected window, on GSM8K strata by reference steps.

The second campaign's length knob is the data's own: ``gsm8k?steps=lo-hi`` keeps the problems whose reference
solution takes lo..hi steps (:func:`kvtier.eval.datasets.gsm8k_steps`), and longer solutions make longer chains.
Per stratum the run holds four configurations, all with the prompt protected and a 32-token recent window:
``full``; ``evict`` 0.5; tiered at the device share evict keeps (HBM 0.5, 3% evicted, the rest in T1); and tiered
with evict's T3 (HBM 0.25, evict 0.5: by Proposition 1 it writes what evict writes, up to the split path's
rounding). Each cell reports accuracy and its chains' length (generated tokens, p10 / median / p90); the claim row
asks whether evict's loss grows with chain length into the cliff.
"""

from __future__ import annotations

from ..specs import benchmark_options
from .eviction import c2
from .rules import MIN_FULL_ACCURACY, TOO_WEAK, ClaimRow, acc_text, find, paired, pct, quantile

WINDOW = 32
CELLS = (  # name, policy, parameters that identify the configuration
    ("full", "full", {}),
    ("evict 0.5", "evict", {"evict_ratio": 0.5, "recent_window": WINDOW}),
    ("tiered hbm 0.5, evict 0.03", "tiered", {"hbm_ratio": 0.5, "evict_ratio": 0.03, "recent_window": WINDOW,
                                              "attention": "split", "protect_prompt": True, "quant_ratio": 0.0}),
    ("tiered hbm 0.25, evict 0.5", "tiered", {"hbm_ratio": 0.25, "evict_ratio": 0.5, "recent_window": WINDOW,
                                              "attention": "split", "protect_prompt": True, "quant_ratio": 0.0}),
)


def strata(by: dict) -> list[str]:
    """The run's ``gsm8k?steps=...`` benchmarks that hold ``full`` and ``evict`` 0.5 (window 32), by their steps."""
    names = {recs[0]["benchmark"] for recs in by.values()}
    out = [b for b in names if b.startswith("gsm8k?") and benchmark_options(b)[1].steps is not None
           and find(by, b, "full") and find(by, b, "evict", evict_ratio=0.5, recent_window=WINDOW)]
    return sorted(out, key=lambda b: benchmark_options(b)[1].steps)


def _lengths(recs: list[dict]) -> dict:
    """Generated tokens, p10 / median / p90, as the chain-length table quantiles them."""
    xs = sorted(r["generated_tokens"] for r in recs)
    return {"p10": quantile(xs, 0.1), "median": quantile(xs, 0.5), "p90": quantile(xs, 0.9)}


def cells(by: dict) -> list[dict]:
    """One row per stratum: each configuration's accuracy, its pairing with ``full`` (retention, McNemar p,
    identical completions), and its chains' lengths; the tiered-with-evict's-T3 cell also says how many of its
    completions equal evict's."""
    out = []
    for b in strata(by):
        full = find(by, b, "full")
        lo, hi = benchmark_options(b)[1].steps
        row = {"benchmark": b, "steps": [lo, hi], "window": WINDOW, "cells": {}}
        found = {name: find(by, b, policy, **want) for name, policy, want in CELLS}
        for name, recs in found.items():
            if not recs:
                continue
            p = paired(full, recs)
            row["cells"][name] = {"n": p["n"], "accuracy": p["b"], "retention": p["retention"],
                                  "mcnemar_p": p["mcnemar_p"], "identical_to_full": p["identical"],
                                  "generated": _lengths(recs)}
        same_t3, ev = found["tiered hbm 0.25, evict 0.5"], found["evict 0.5"]
        if same_t3 and ev:
            row["cells"]["tiered hbm 0.25, evict 0.5"]["identical_to_evict"] = paired(ev, same_t3)["identical"]
        row["chain_over_window"] = row["cells"]["full"]["generated"]["median"] / WINDOW
        out.append(row)
    return out


def evaluate(by: dict) -> list[ClaimRow]:
    """The cliff claim's row, then C2 on each stratum (the hierarchy at evict's device share), or nothing when the
    run holds fewer than two strata. The cliff is judged on the strata where ``full`` is strong enough for a
    retention to mean something (accuracy >= MIN_FULL_ACCURACY): the shortest of them against the longest."""
    rows = cells(by)
    if len(rows) < 2:
        return []
    usable = [r for r in rows if r["cells"]["full"]["accuracy"]["accuracy"] >= MIN_FULL_ACCURACY]
    short, long_ = (usable[0], usable[-1]) if len(usable) >= 2 else (rows[0], rows[-1])
    ev_s, ev_l = short["cells"]["evict 0.5"], long_["cells"]["evict 0.5"]
    r_s, r_l = ev_s["retention"], ev_l["retention"]
    if len(usable) < 2 or r_s is None:
        verdict, rule = TOO_WEAK[0], f"{TOO_WEAK[1]} on all but one stratum: no length to compare"
    elif r_l is not None and r_l <= 0.25 and ev_l["mcnemar_p"] < 0.05 and r_l < r_s:
        verdict, rule = "reproduced", ("reproduced if evict 0.5 keeps <= 25% of full on the longest chains with "
                                       "McNemar p < 0.05, and less than on the shortest (strata where full >= "
                                       f"{100 * MIN_FULL_ACCURACY:.0f}%)")
    elif r_l is not None and r_l >= r_s:
        verdict, rule = "not reproduced", "evict 0.5 keeps as much of full on the longest chains as on the shortest"
    elif ev_l["mcnemar_p"] < 0.05:
        verdict, rule = "not reproduced", ("the loss grows with length and is significant on the longest chains, but "
                                           "evict keeps more than 25%: a slope, not the cliff")
    else:
        verdict, rule = "not testable here", ("the loss grows with length but is not significant on the longest "
                                              "chains (McNemar p >= 0.05): this n cannot tell")

    def one(r: dict) -> str:
        c = r["cells"]
        ti = c.get("tiered hbm 0.5, evict 0.03")
        return (f"{r['benchmark'].partition('?')[2]} (median chain {c['full']['generated']['median']:g} tokens, "
                f"{r['chain_over_window']:.1f}x the window): full {acc_text(c['full']['accuracy'])}, evict 0.5 "
                f"{pct(c['evict 0.5']['accuracy']['accuracy'])} (retention {pct(c['evict 0.5']['retention'])}, p "
                f"{c['evict 0.5']['mcnemar_p']:.2g})"
                + (f", tiered at the same device share {pct(ti['accuracy']['accuracy'])} (retention "
                   f"{pct(ti['retention'])})" if ti else ""))

    weak = [r["benchmark"].partition("?")[2] for r in rows if r not in usable]
    out = [ClaimRow(claim=f"C1 at length: on GSM8K strata by reference steps (window {WINDOW}, prompt protected), "
                     "evicting 50% costs more as chains grow, into the cliff",
            paper="eviction falls off a cliff on reasoning: a thought from hundreds of tokens ago is referenced again",
            kvtier="; ".join(one(r) for r in rows)
                      + (f" (judged without {', '.join(weak)}: full below {100 * MIN_FULL_ACCURACY:.0f}% there)"
                         if weak and len(usable) >= 2 else ""),
            verdict=verdict, rule=rule, data={"strata": rows},
            n=f"{min(r['cells']['full']['n'] for r in rows)} per stratum",
            short="evict 0.5 keeps " + " / ".join(pct(r["cells"]["evict 0.5"]["retention"]) for r in rows)
                     + " of full at " + " / ".join(r["benchmark"].partition("=")[2] for r in rows)
                     + " reference steps (full " + " / ".join(pct(r["cells"]["full"]["accuracy"]["accuracy"])
                                                              for r in rows) + ")"
                     + (f"; judged without {', '.join(weak)} (full below {100 * MIN_FULL_ACCURACY:.0f}%)"
                        if weak and len(usable) >= 2 else ""))]
    for r in rows:  # C2 where the length bites: tiered at evict's device share, per stratum
        b = r["benchmark"]
        full, ev = find(by, b, "full"), find(by, b, "evict", evict_ratio=0.5, recent_window=WINDOW)
        ti = find(by, b, CELLS[2][1], **CELLS[2][2])
        if full and ev and ti:
            out.append(c2(full, ev, ti, WINDOW, b))
    return out


def cliff_lines(rows: list[dict]) -> list[str]:
    """The strata as a markdown table (empty when there are none)."""
    if not rows:
        return []
    out = ["", f"## Where the cliff appears: GSM8K by reference steps (window {WINDOW}, prompt protected)", "",
           "Per cell: accuracy (95% CI, n), retention and McNemar p against `full` on the same problems, and the "
           "chains' generated tokens (p10 / median / p90). Tiered with evict's T3 writes what evict writes up to the "
           "split path's rounding (Proposition 1): the share of its completions identical to evict's is given.", "",
           "| reference steps | chain / window (full, median) | " + " | ".join(n for n, _, _ in CELLS) + " |",
           "|---|---|" + "---|" * len(CELLS)]
    for r in rows:
        cols = []
        for name, _, _ in CELLS:
            c = r["cells"].get(name)
            if c is None:
                cols.append("–")
                continue
            g = c["generated"]
            txt = f"{acc_text(c['accuracy'])}; {g['p10']}/{g['median']:g}/{g['p90']} tokens"
            if name != "full":
                txt += f"; retention {pct(c['retention'])}, p {c['mcnemar_p']:.2g}"
            if "identical_to_evict" in c:
                txt += f"; {pct(c['identical_to_evict'])} identical to evict"
            cols.append(txt)
        lo, hi = r["steps"]
        out.append(f"| {lo}{'' if lo == hi else f'-{hi}'} | {r['chain_over_window']:.1f} | " + " | ".join(cols) + " |")
    return out
