"""``kvtier report DIR --html``: one self-contained page (inline CSS, plots as data URIs, a few lines of script
to sort the table; nothing fetched at view time).

Sections: the summary table (click a header to sort), the plots, and per problem a side-by-side of the full
cache's completion and every other configuration's, each token colored by its tier at the end (records keep
this in ``tier_map``; older records show plain text), with correctness and the first token where the text
leaves the full cache's.
"""

from __future__ import annotations

import base64
import bisect
import html
import itertools
from collections import defaultdict
from pathlib import Path

from ..tiers.tiermap import TIERS, TokenTiers, decode_codes, from_compact, tier_counts
from ..tools import viz
from .records import dedupe

SORT_JS = """
document.querySelectorAll('table.sortable').forEach(function (t) {
  t.querySelectorAll('th').forEach(function (th, col) {
    th.addEventListener('click', function () {
      var body = t.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      var asc = th.getAttribute('data-dir') !== 'asc';
      t.querySelectorAll('th').forEach(function (h) { h.removeAttribute('data-dir'); });
      th.setAttribute('data-dir', asc ? 'asc' : 'desc');
      rows.sort(function (a, b) {
        var x = a.cells[col].getAttribute('data-v'), y = b.cells[col].getAttribute('data-v');
        var nx = parseFloat(x), ny = parseFloat(y);
        var c = (isNaN(nx) || isNaN(ny)) ? String(x).localeCompare(String(y)) : nx - ny;
        return asc ? c : -c;
      });
      rows.forEach(function (r) { body.appendChild(r); });
    });
  });
  t.classList.add('ready');
});
"""

EXTRA_CSS = """
.cols{display:flex;gap:10px;overflow-x:auto} .col{flex:1 0 360px;min-width:360px}
.col .text{font-size:12px;max-height:520px;overflow-y:auto}
.ok{color:#1b5e20;font-weight:600} .bad{color:#b71c1c;font-weight:600}
.div{background:#222;color:#fff;border-radius:2px;padding:0 3px;font-size:10px}
details{margin:6px 0;border:1px solid #e3e3e3;border-radius:4px;padding:4px 8px} summary{cursor:pointer}
img.plot{max-width:640px;border:1px solid #eee;margin:4px}
"""


def _cell(value, shown: str | None = None, text: bool = False) -> str:
    v = "" if value is None else value
    cls = ' class="l"' if text else ""
    return f'<td{cls} data-v="{html.escape(str(v), quote=True)}">{html.escape(shown if shown is not None else str(v))}</td>'


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _config_label(row_or_rec: dict) -> str:
    params = row_or_rec.get("params") or {}
    shown = ", ".join(f"{k.removesuffix('_ratio')} {v}" for k, v in params.items())
    return row_or_rec["policy"] + (f" ({shown})" if shown else "")


def summary_table(rows: list[dict]) -> str:
    head = ["benchmark", "configuration", "comparison", "n", "accuracy", "95% CI", "retention", "McNemar p",
            "identical to full", "device tokens", "device KV vs full", "gen tokens"]
    out = ['<table class="sortable"><thead><tr>' + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"]
    for r in rows:
        out.append("<tr>" + "".join([
            _cell(r["benchmark"], text=True), _cell(_config_label(r), text=True), _cell(r["comparison"], text=True),
            _cell(r["n"]),
            _cell(r["accuracy"], _pct(r["accuracy"])),
            _cell(r["ci_low"], f"{100 * r['ci_low']:.1f}–{100 * r['ci_high']:.1f}"),
            _cell(r.get("retention"), _pct(r.get("retention"))),
            _cell(r.get("mcnemar_p"), "–" if r.get("mcnemar_p") is None else f"{r['mcnemar_p']:.3g}"),
            _cell(r.get("identical_to_full"), _pct(r.get("identical_to_full"))),
            _cell(r["mean_device_tokens"], f"{r['mean_device_tokens']:.0f}"),
            _cell(r.get("device_kv_vs_full"), _pct(r.get("device_kv_vs_full"))),
            _cell(r["mean_generated_tokens"], f"{r['mean_generated_tokens']:.0f}"),
        ]) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _img(path: Path) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img class="plot" alt="{html.escape(Path(path).stem)}" src="data:image/png;base64,{data}">'


def first_divergence(a: str, b: str) -> int | None:
    """Index of the first character where ``b`` differs from ``a`` (None when equal)."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _record_map(r: dict) -> TokenTiers | None:
    tm = r.get("tier_map")
    if not tm or len(tm.get("ends", [])) != len(tm.get("completion", "")):
        return None
    if tm["ends"] and tm["ends"][-1] != len(r["completion"]):
        return None
    return from_compact(tm, r["completion"])


def _prompt_line(r: dict) -> str:
    tm = r.get("tier_map")
    if not tm:
        return ""
    codes = decode_codes(tm["kind"], tm["prompt"])
    if tm["kind"] == TIERS:
        return "prompt tokens: " + ", ".join(f"{k} {v}" for k, v in tier_counts(codes).items() if v)
    held = sum(codes) / max(1, 100 * len(codes))
    return f"prompt: {100 * held:.0f}% of (token, layer, kv-head) kept"


def completion_column(r: dict, full: dict | None) -> str:
    ok = '<span class="ok">correct</span>' if r.get("correct") else '<span class="bad">wrong</span>'
    head = (f"<b>{html.escape(_config_label(r))}</b> · {ok} · answer {html.escape(str(r.get('extracted')))} · "
            f"{r['generated_tokens']} tokens")
    m = _record_map(r)
    div = None if full is None or full is r else first_divergence(full["completion"], r["completion"])
    if full is not None and full is not r:
        head += " · " + ("identical to full" if div is None else "")
    if m is None:
        body = html.escape(r["completion"])
        if div is not None:
            head += f"diverges from full at character {div}"
            body = html.escape(r["completion"][:div]) + '<span class="div">▶</span>' + html.escape(r["completion"][div:])
    else:
        ends = list(itertools.accumulate(len(t) for t in m.tokens))
        k = None if div is None else bisect.bisect_right(ends, div)
        if k is not None:
            head += f"diverges from full at generated token {k + 1}"
            body = viz.token_spans(m, 0, k) + '<span class="div">▶</span>' + viz.token_spans(m, k)
        else:
            body = viz.token_spans(m)
    return (f'<div class="col"><div class="meta">{head}</div><div class="meta">{html.escape(_prompt_line(r))}</div>'
            f'<div class="text">{body}</div></div>')


def problems_section(records: list[dict], rows: list[dict], max_problems: int) -> str:
    """Per benchmark and problem: full first, then each configuration in the summary's order."""
    order = {r["config_key"]: i for i, r in enumerate(rows)}
    by_problem: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        by_problem[(r["benchmark"], r["model"], r["id"], r.get("sample", 0))].append(r)
    out, shown = [], defaultdict(int)
    # benchmarks in name order, problems in the order they were recorded (the benchmark's own order)
    for (bench, _, pid, sample), recs in sorted(by_problem.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if shown[bench] >= max_problems:
            continue
        shown[bench] += 1
        recs.sort(key=lambda r: (r["policy"] != "full", order.get(r["config_key"], 1 << 30)))
        full = recs[0] if recs[0]["policy"] == "full" else None
        n_ok = sum(bool(r.get("correct")) for r in recs)
        short = pid.removeprefix(f"rg-{bench[3:]}-") if bench.startswith("rg:") else pid
        label = f"{bench} · problem {short}" + (f" · sample {sample}" if sample else "")
        opened = " open" if shown[bench] == 1 else ""  # the first problem of each benchmark shows at once
        out.append(f"<details{opened}><summary>{html.escape(label)} — gold {html.escape(str(recs[0].get('gold')))} · "
                   f"{n_ok}/{len(recs)} configurations correct</summary><div class=cols>"
                   + "".join(completion_column(r, full) for r in recs) + "</div></details>")
    total = len({(k[0], k[2], k[3]) for k in by_problem})
    note = (f"<div class=meta>showing {sum(shown.values())} of {total} problems (--html-problems)</div>"
            if sum(shown.values()) < total else "")
    return note + "".join(out)


def write_html_report(run_dir: Path, out: Path, summary: dict, records: list[dict], plots: dict[str, Path],
                      max_problems: int = 40) -> Path:
    records = dedupe(records)
    rows = summary["configs"]
    legend_kinds = sorted({(r.get("tier_map") or {}).get("kind", TIERS) for r in records})
    body = [f"<h1>kvtier report</h1><div class=meta>{len(records)} records from {html.escape(str(run_dir))}</div>",
            "<h2>Summary</h2><div class=meta>click a column header to sort</div>", summary_table(rows)]
    if plots:
        body.append("<h2>Plots</h2>" + "".join(_img(p) for p in plots.values()))
    body.append("<h2>Completions, colored by each token's tier at the end</h2>")
    body += [viz.legend(k) for k in legend_kinds]
    body.append(problems_section(records, rows, max_problems))
    path = out / "report.html"
    page = viz.page("kvtier report", "".join(body), SORT_JS).replace("</style>", EXTRA_CSS + "</style>", 1)
    path.write_text(page, encoding="utf-8")
    return path
