"""The second campaign's claims (``benchmarks/sweeps/paper_cpu_v2.json``): eviction that bites, the hierarchy at the
device share eviction keeps, and HBM independence on the default (split) path — plus the grid they come from, with
each row's tokens destroyed and attended at the step its answer ended (the records' ``answer_step``).

Rows appear only where the run holds the second campaign (a configuration with a 32-token recent window,
:func:`in_run`); :func:`kvtier.eval.claims.evaluate` says which first-campaign rows they replace. Verdicts come from
:data:`kvtier.eval.claims.rules.VERDICTS`, each with the rule that gave it.
"""

from __future__ import annotations

from statistics import median

from ..configs import full_params
from ..stats import cochran_q
from .rules import MIN_FULL_ACCURACY, TOO_WEAK, ClaimRow, acc_text, cliff_verdict, find, paired, pct

WINDOWS = (32, 128)
EVICTS = (0.25, 0.5, 0.75)
PAIR_EVICT = 0.03  # the hierarchy's own eviction beside each evict ratio: the rest of the tokens go to T1
C2_RETENTION = 0.91  # the paper's GSM8K retention at 3% eviction
C3_P = 0.3  # the paper: Cochran's Q p > 0.3 across HBM 0.3 / 0.5 / 0.7


def answer_counts(recs: list[dict]) -> dict | None:
    """Medians over rows of the tokens destroyed / attended at the answer step, and of the destroyed share of each
    row's tokens; None when the records predate ``answer_step``."""
    rows = [r["answer_step"] for r in recs if r.get("answer_step")]
    if not rows:
        return None
    return {"n": len(rows), "destroyed": median(a["destroyed"] for a in rows),
            "attended": median(a["attended"] for a in rows),
            "destroyed_share": median(a["destroyed"] / a["tokens"] if a["tokens"] else 0.0 for a in rows)}


def _counts_text(c: dict | None) -> str:
    if c is None:
        return "–"
    return f"{c['destroyed']:g} destroyed ({pct(c['destroyed_share'])}), {c['attended']:g} attended"


def in_run(by: dict, bench: str) -> bool:
    """Whether the run holds the second campaign on ``bench``: a configuration with a 32-token recent window (the
    first campaign ran the default 128 only; its evict 0.5 stays its own C1 row)."""
    return any(recs[0]["benchmark"] == bench and full_params(recs[0]).get("recent_window") == 32
               for recs in by.values())


def grid(by: dict, bench: str = "gsm8k") -> list[dict]:
    """Every v2 configuration found on ``bench``: policy, window, evict ratio, hbm ratio, accuracy, retention and
    McNemar p against ``full`` on shared problems, and the answer-step counts (medians per row). Empty outside a
    v2 run (:func:`in_run`)."""
    if not in_run(by, bench):
        return []
    full = find(by, bench, "full")
    out = []
    for w in WINDOWS:
        for e in (PAIR_EVICT, *EVICTS):  # evict 0.03: every method attends what tiered attends (equal information)
            for name, recs in (("evict", find(by, bench, "evict", evict_ratio=e, recent_window=w)),
                               ("tiered", find(by, bench, "tiered", hbm_ratio=round(1 - e, 6),
                                                evict_ratio=PAIR_EVICT, recent_window=w, attention="split",
                                                protect_prompt=True, quant_ratio=0.0))):
                if not recs:
                    continue
                row = {"policy": name, "window": w, "evict": e if name == "evict" else PAIR_EVICT,
                       "hbm": None if name == "evict" else round(1 - e, 6), "device_share": round(1 - e, 6),
                       "counts": answer_counts(recs)}
                if full:
                    p = paired(full, recs)
                    row.update(n=p["n"], accuracy=p["b"], full=p["a"], retention=p["retention"],
                               mcnemar_p=p["mcnemar_p"])
                else:
                    row.update(n=len(recs), accuracy=None, full=None, retention=None, mcnemar_p=None)
                out.append(row)
    return out


def evaluate(by: dict, bench: str = "gsm8k") -> list[ClaimRow]:
    """The v2 claim rows found in ``by`` (configurations keyed as :func:`kvtier.eval.claims.rules.by_config` keys them);
    empty outside a v2 run (:func:`in_run`)."""
    rows: list[ClaimRow] = []
    if not in_run(by, bench):
        return rows
    full = find(by, bench, "full")
    short = bench.partition("?")[0]
    for w in WINDOWS:
        ev = find(by, bench, "evict", evict_ratio=0.5, recent_window=w)
        ti = find(by, bench, "tiered", hbm_ratio=0.5, evict_ratio=PAIR_EVICT, recent_window=w, attention="split",
                   protect_prompt=True, quant_ratio=0.0)
        if full and ev:
            rows.append(c1(full, ev, w, short))
        if full and ev and ti:
            rows.append(c2(full, ev, ti, w, short))
    by_hbm = {h: find(by, bench, "tiered", hbm_ratio=h, evict_ratio=0.25, recent_window=32, attention="split",
                      protect_prompt=True, quant_ratio=0.0) for h in (0.3, 0.5, 0.7)}
    if all(by_hbm.values()):
        rows.append(c3(by_hbm, short))
    ti = find(by, bench, "tiered", hbm_ratio=0.5, evict_ratio=PAIR_EVICT, recent_window=32, attention="split",
               protect_prompt=True, quant_ratio=0.0)
    base = _protected_baselines(by, bench)
    if ti and base:
        same_info = find(by, bench, "evict", evict_ratio=PAIR_EVICT, recent_window=32)
        rows.append(baselines(ti, base, short, same_info))
    return rows


def _protected_baselines(by: dict, bench: str) -> dict[str, list[dict]]:
    """Each per-head baseline at tiered's device share (budget ratio 0.5, floored at its 32-token window) with the
    prompt protected, keyed by name (R-KV once per buffer)."""
    from ...policies import equal_memory_baselines

    out = {}
    for recs in by.values():
        r0 = recs[0]
        if r0["benchmark"] != bench or r0["policy"] not in equal_memory_baselines():
            continue
        p = full_params(r0)
        if p.get("budget_ratio") == 0.5 and p.get("budget_floor") == 32 and p.get("protect_prompt") is True:
            name = r0["policy"] + (f" (buffer {p['buffer']})" if "buffer" in p else "")
            if len(recs) > len(out.get(name, [])):
                out[name] = recs
    return dict(sorted(out.items()))


def baselines(ti: list[dict], base: dict[str, list[dict]], bench: str, same_info: list[dict] | None = None) -> ClaimRow:
    """``same_info``: evict at tiered's T3 (3%, window 32), everything else on the device: it attends what tiered
    attends, so beside the baselines it tells memory from information (reported, not part of the verdict)."""
    ps = {b: paired(v, ti) for b, v in base.items()}  # tiered is "b"
    info = paired(same_info, ti) if same_info else None
    wins = all(p["b"]["accuracy"] > p["a"]["accuracy"] and p["mcnemar_p"] < 0.05 for p in ps.values())
    loses = any(p["a"]["accuracy"] >= p["b"]["accuracy"] and p["mcnemar_p"] < 0.05 for p in ps.values())
    if wins:
        verdict, rule = "reproduced", "reproduced if the hierarchy beats every baseline with McNemar p < 0.05"
    elif loses:
        verdict, rule = "not reproduced", "a baseline is as good or better with McNemar p < 0.05"
    else:
        verdict, rule = "not testable here", "no baseline significantly better, not all significantly worse: this n cannot tell"
    return ClaimRow(claim=f"Baselines at equal device memory and equal protection, {bench}: the hierarchy beats eviction "
                     "methods given the same device share",
            paper="H2O 2–30%, R-KV 0–32%, the hierarchy 56–65% (baselines without prompt protection)",
            kvtier=f"tiered hbm 0.5, evict 0.03, window 32 {acc_text(next(iter(ps.values()))['b'])}, at the answer "
                      f"{_counts_text(answer_counts(ti))}; "
                      + "; ".join(f"{b} {acc_text(p['a'])} (p {p['mcnemar_p']:.2g}), at the answer "
                                  f"{_counts_text(answer_counts(base[b]))}" for b, p in ps.items())
                      + ("" if info is None else
                         f"; equal information (evict 0.03, window 32, all on the device) {acc_text(info['a'])} "
                         f"(p {info['mcnemar_p']:.2g})"),
            verdict=verdict, rule=rule,
            data={**ps, **({} if info is None else {"equal information: evict 0.03": info})},
            n=min(p["n"] for p in ps.values()),
            short=f"tiered {pct(next(iter(ps.values()))['b']['accuracy'])}; "
                     + ", ".join(f"{b} {pct(p['a']['accuracy'])}" for b, p in ps.items())
                     + ("" if info is None else f"; equal information (evict 0.03) {pct(info['a']['accuracy'])}"))


def c1(full: list[dict], ev: list[dict], w: int, bench: str) -> ClaimRow:
    p = paired(full, ev)
    c = answer_counts(ev)
    verdict, rule = cliff_verdict(p)
    return ClaimRow(claim=f"C1 eviction bites on {bench} (window {w}, prompt protected): evicting 50% takes accuracy to ~0",
            paper="~0 whatever the score function",
            kvtier=f"full {acc_text(p['a'])} -> evict 0.5 {acc_text(p['b'])}; retention {pct(p['retention'])}, "
                      f"McNemar p {p['mcnemar_p']:.2g}; at the answer (median per row): {_counts_text(c)}",
            verdict=verdict, rule=rule, data={**p, "answer_counts": c, "window": w}, n=p["n"],
            short=f"full {pct(p['a']['accuracy'])} → evict 0.5 {pct(p['b']['accuracy'])} (p {p['mcnemar_p']:.2g})"
                     + ("" if c is None else f"; {pct(c['destroyed_share'])} of a row destroyed at its answer"))


def c2(full: list[dict], ev: list[dict], ti: list[dict], w: int, bench: str) -> ClaimRow:
    pf, pe = paired(full, ti), paired(ev, ti)  # tiered is "b" in both
    ret = pf["retention"]
    if pf["a"]["accuracy"] < MIN_FULL_ACCURACY:
        verdict, rule = TOO_WEAK
    elif ret is not None and ret >= C2_RETENTION and pe["b"]["accuracy"] > pe["a"]["accuracy"] and pe["mcnemar_p"] < 0.05:
        verdict, rule = "reproduced", (f"tiered keeps >= the paper's {100 * C2_RETENTION:.0f}% of full and beats evict "
                                       "at the same device share with McNemar p < 0.05")
    elif (pf["mcnemar_p"] < 0.05 and ret is not None and ret < C2_RETENTION) or \
            (pe["a"]["accuracy"] >= pe["b"]["accuracy"] and pe["mcnemar_p"] < 0.05):
        verdict, rule = "not reproduced", ("tiered loses significantly to full (below the paper's retention), or evict "
                                           "at the same device share is significantly better")
    else:
        verdict, rule = "not testable here", ("neither a significant win over evict with the paper's retention nor a "
                                              "significant loss: this n cannot tell")
    return ClaimRow(claim=f"C2 at the device share evict keeps, {bench} (window {w}): HBM 0.5 with 3% evicted vs evict 0.5",
            paper=f"the hierarchy keeps {100 * C2_RETENTION:.0f}% of full where eviction collapses",
            kvtier=f"full {acc_text(pf['a'])}; tiered {acc_text(pf['b'])} (retention {pct(ret)}, vs full McNemar p "
                      f"{pf['mcnemar_p']:.2g}); evict 0.5 {acc_text(pe['a'])} (vs tiered McNemar p {pe['mcnemar_p']:.2g}); "
                      f"at the answer: tiered {_counts_text(answer_counts(ti))}, evict {_counts_text(answer_counts(ev))}",
            verdict=verdict, rule=rule, data={"vs_full": pf, "vs_evict": pe, "window": w}, n=pf["n"],
            short=f"tiered {pct(pf['b']['accuracy'])} ({pct(ret)} of full {pct(pf['a']['accuracy'])}) vs evict "
                     f"0.5 {pct(pe['a']['accuracy'])} (p {pe['mcnemar_p']:.2g})")


def c3(grid3: dict, bench: str) -> ClaimRow:
    maps = [{(r["id"], r.get("sample", 0)): r for r in grid3[h]} for h in (0.3, 0.5, 0.7)]
    common = sorted(set.intersection(*(set(m) for m in maps)))
    same = sum(len({m[k]["completion"] for m in maps}) == 1 for k in common)
    q, p = cochran_q([[int(m[k]["correct"]) for m in maps] for k in common])
    accs = [sum(m[k]["correct"] for k in common) / max(1, len(common)) for m in maps]
    if p >= C3_P:
        verdict, rule = "reproduced", f"Cochran's Q p >= the paper's {C3_P}"
    elif p < 0.05:
        verdict, rule = "not reproduced", "Cochran's Q p < 0.05: the HBM ratio changes accuracy"
    else:
        verdict, rule = "not testable here", f"0.05 <= Cochran's Q p < {C3_P}: between the paper's bound and a difference"
    return ClaimRow(claim=f"C3 HBM independence on the default (split) path, {bench}: at fixed eviction the HBM ratio "
                     "changes nothing",
            paper="p > 0.3 across hbm 0.3/0.5/0.7",
            kvtier=f"evict 0.25 (window 32), hbm 0.3/0.5/0.7: accuracy "
                      + " / ".join(pct(a) for a in accs)
                      + f" (n={len(common)}), Cochran's Q p {p:.2g}; {same}/{len(common)} completions identical across "
                        "the three (the split path merges T0 and T1 partials in float32, so where a token lives "
                        "changes the rounding, and greedy decoding can follow a rounding)",
            verdict=verdict, rule=rule,
            data={"n": len(common), "identical": same, "cochran_q": q, "p": p, "accuracies": accs},
            n=len(common),
            short=" / ".join(pct(a) for a in accs) + f" at hbm 0.3 / 0.5 / 0.7 (Cochran's Q p {p:.2g}); "
                     f"{same}/{len(common)} completions identical")


def grid_lines(rows: list[dict]) -> list[str]:
    """The grid as a markdown table (empty when there is none)."""
    if not rows:
        return []
    out = ["", "## Eviction that bites, and the hierarchy at the same device share (v2 grid)", "",
           "Device share: the tokens kept on the device (evict: 1 - e; tiered: its HBM ratio, 3% evicted, the rest in "
           "T1). At the answer: medians over rows of the tokens destroyed (share of the row's tokens) and attended, "
           "at the step the row's answer ended.", "",
           "| window | device share | policy | accuracy | retention vs full | McNemar p vs full | at the answer |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = acc_text(r["accuracy"]) if r["accuracy"] else "–"
        pv = "–" if r["mcnemar_p"] is None else f"{r['mcnemar_p']:.2g}"
        name = f"evict {r['evict']:g}" if r["policy"] == "evict" else f"tiered hbm {r['hbm']:g}, evict {r['evict']:g}"
        out.append(f"| {r['window']} | {r['device_share']:g} | {name} | {acc} | {pct(r['retention'])} | {pv} | "
                   f"{_counts_text(r['counts'])} |")
    return out
