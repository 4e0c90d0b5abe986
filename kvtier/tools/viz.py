"""Pictures of where tokens lived: self-contained HTML (inline CSS and SVG, no script needed, nothing fetched)
and PNG (matplotlib), both drawn from :class:`kvtier.tiers.tiermap.TokenTiers` only.

- Every token is colored by its final tier (T0 HBM, T1 DRAM, T2 int8, T3 evicted; per-head policies: the
  share of layers x kv-heads still holding it); protected tokens are outlined; hovering shows position,
  cumulative score and every recorded tier change.
- The heat strip: one row per recorded reassignment (decode step, top to bottom), tokens left to right.
"""

from __future__ import annotations

import html
import unicodedata
from pathlib import Path

from ..tiers.tiermap import NOT_CACHED, NOT_YET, TIER_NAMES, TIERS, TokenTiers

TIER_COLORS = {0: "#9ad49a", 1: "#8fc1f0", 2: "#f5c36b", 3: "#f08a8a", NOT_CACHED: "#ffffff"}
TIER_LABELS = {0: "T0 device (HBM)", 1: "T1 host DRAM, full precision", 2: "T2 host, int8", 3: "T3 evicted",
               NOT_CACHED: "not cached yet (sampled last)"}
PAD_COLOR = "#eeeeee"

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 6px} h2{font-size:16px;margin:18px 0 6px} .meta{color:#555;font-size:13px}
.legend span.sw{display:inline-block;width:14px;height:14px;vertical-align:middle;border:1px solid #999;margin:0 4px 0 12px}
.text{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:13px;line-height:1.7;
      white-space:pre-wrap;word-break:break-word;border:1px solid #ddd;padding:10px;border-radius:4px}
.tk{border-radius:2px} .tk:hover{outline:2px solid #333}
.t3{text-decoration:line-through;color:#7a1d1d} .tn{outline:1px dashed #999}
.pr{box-shadow:inset 0 -2px 0 #333} .prompt{color:#444}
.sep{display:block;border-top:1px dashed #aaa;margin:6px 0}
table{border-collapse:collapse;font-size:13px} th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f4f4f4;cursor:pointer} td.l,th.l{text-align:left}
.strip{border:1px solid #ddd;margin-top:6px}
"""


def share_color(pct: int) -> str:
    """0% (every head dropped it) red .. 100% (all held) green, through yellow."""
    p = max(0, min(100, pct)) / 100
    if p < 0.5:
        a, b, t = (240, 138, 138), (245, 215, 110), p / 0.5
    else:
        a, b, t = (245, 215, 110), (154, 212, 154), (p - 0.5) / 0.5
    return "#%02x%02x%02x" % tuple(round(x + (y - x) * t) for x, y in zip(a, b))


def code_color(kind: str, c: int) -> str:
    if c == NOT_CACHED:
        return TIER_COLORS[NOT_CACHED]
    if c < 0:
        return PAD_COLOR
    return TIER_COLORS[c] if kind == TIERS else share_color(c)


def code_name(kind: str, c: int) -> str:
    if c == NOT_CACHED:
        return "not cached"
    if kind == TIERS:
        return TIER_NAMES[c]
    return f"held by {c}% of layer x kv-head pairs"


def legend(kind: str) -> str:
    if kind == TIERS:
        items = [(TIER_COLORS[c], TIER_LABELS[c]) for c in (0, 1, 2, 3, NOT_CACHED)]
    else:
        items = [(share_color(p), f"{p}% of layers x kv-heads hold it") for p in (100, 50, 0)]
        items.append((TIER_COLORS[NOT_CACHED], TIER_LABELS[NOT_CACHED]))
    out = "".join(f'<span class="sw" style="background:{c}"></span>{html.escape(t)}' for c, t in items)
    return f'<div class="legend meta">{out}<span class="sw pr" style="background:#fff"></span>protected (underlined)</div>'


def _title(m: TokenTiers, i: int) -> str:
    parts = [f"token {i}" + (" (prompt)" if i < m.n_prompt else f" (generated #{i - m.n_prompt + 1})"),
             code_name(m.kind, m.codes[i])]
    if m.scores is not None:
        parts.append(f"score {m.scores[i]:.4g}")
    if m.protected is not None and m.protected[i]:
        parts.append("protected")
    moves = m.transitions(i)
    if moves:
        parts.append("history: " + " → ".join(f"{code_name(m.kind, c)} @ step {s}" for s, c in moves))
    return " · ".join(parts)


def token_spans(m: TokenTiers, start: int = 0, stop: int | None = None) -> str:
    """The tokens ``start:stop`` as colored ``<span>``s (hover: ``title``)."""
    stop = len(m.tokens) if stop is None else stop
    out = []
    for i in range(start, stop):
        c = m.codes[i]
        cls = ["tk"]
        if m.kind == TIERS and c == 3:
            cls.append("t3")
        if c == NOT_CACHED:
            cls.append("tn")
        if m.protected is not None and m.protected[i]:
            cls.append("pr")
        text = html.escape(m.tokens[i])
        out.append(f'<span class="{" ".join(cls)}" style="background:{code_color(m.kind, c)}" '
                   f'title="{html.escape(_title(m, i), quote=True)}">{text}</span>')
    return "".join(out)


def heat_strip(m: TokenTiers, width: int = 1000, row_h: int | None = None) -> str:
    """Inline SVG: one row per recorded placement (decode step down), one column per token (position right),
    run-length encoded so a row costs one rectangle per run of equal codes; the last row is the final map."""
    rows = list(zip(m.history_steps, m.history)) + [("end", m.codes)]
    row_h = row_h or max(4, min(16, 200 // len(rows)))
    n = max(1, len(m.tokens))
    w = width / n
    left, top = 70, 16
    h = top + row_h * len(rows) + 22
    parts = [f'<svg class="strip" xmlns="http://www.w3.org/2000/svg" width="{width + left + 10}" height="{h}" '
             f'role="img" aria-label="tiers over decode steps">',
             f'<text x="{left}" y="11" font-size="11" fill="#555">position → (prompt | generated); '
             f'rows: decode step ↓</text>']
    for r, (step, codes) in enumerate(rows):
        y = top + r * row_h
        if r % max(1, 9 * len(rows) // 200 + 1) == 0 or step == "end":
            parts.append(f'<text x="{left - 4}" y="{y + row_h - 1}" font-size="9" text-anchor="end" fill="#555">'
                         f'{"final" if step == "end" else f"step {step}"}</text>')
        i = 0
        while i < len(codes):
            j = i
            while j < len(codes) and codes[j] == codes[i]:
                j += 1
            if codes[i] != NOT_YET:
                parts.append(f'<rect x="{left + i * w:.2f}" y="{y}" width="{(j - i) * w:.2f}" height="{row_h}" '
                             f'fill="{code_color(m.kind, codes[i])}"/>')
            i = j
    xp = left + m.n_prompt * w
    parts.append(f'<line x1="{xp:.2f}" x2="{xp:.2f}" y1="{top}" y2="{top + row_h * len(rows)}" stroke="#333" '
                 f'stroke-dasharray="3,2"/>')
    parts.append(f'<text x="{left}" y="{h - 6}" font-size="10" fill="#555">0</text>'
                 f'<text x="{left + width}" y="{h - 6}" font-size="10" text-anchor="end" fill="#555">{n}</text>')
    parts.append("</svg>")
    return "".join(parts)


def summary_line(m: TokenTiers) -> str:
    gen = len(m.tokens) - m.n_prompt
    s = f"{m.n_prompt} prompt + {gen} generated tokens"
    if m.kind == TIERS:
        s += " · final: " + ", ".join(f"{k} {v}" for k, v in m.counts().items())
    s += f" · {len(m.history_steps)} recorded placements"
    return s


def tier_page(m: TokenTiers, title: str = "kvtier tier map", meta: str = "") -> str:
    """A self-contained HTML page for one sequence."""
    body = (f"<h1>{html.escape(title)}</h1><div class=meta>{html.escape(meta)}</div>"
            f"<div class=meta>{html.escape(summary_line(m))}</div>{legend(m.kind)}"
            f"<h2>Tokens, colored by tier at the end</h2><div class=text>"
            f"<span class=prompt>{token_spans(m, 0, m.n_prompt)}</span><span class=sep></span>"
            f"{token_spans(m, m.n_prompt)}</div>"
            f"<h2>Tiers over time</h2>{heat_strip(m)}")
    return page(title, body)


def page(title: str, body: str, script: str = "") -> str:
    js = f"<script>{script}</script>" if script else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{CSS}</style></head><body>{body}{js}</body></html>\n")


def write_html(m: TokenTiers, path: str | Path, title: str = "kvtier tier map", meta: str = "") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tier_page(m, title, meta), encoding="utf-8")
    return path


def write_png(m: TokenTiers, path: str | Path, cols: int = 110, title: str = "") -> Path:
    """The same picture as PNG: tokens on a monospace grid with tier backgrounds, then the heat strip."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    cells: list[tuple[int, int, int, str, str]] = []  # (line, col, width, color, text) per token run
    line = col = 0
    for i, tok in enumerate(m.tokens):
        tok = "".join(ch if ch == "\n" or unicodedata.category(ch)[0] != "C" and ch != "\ufffd" else "·" for ch in tok)
        color = code_color(m.kind, m.codes[i])
        if i == m.n_prompt and col:
            line, col = line + 1, 0  # the completion starts on a fresh line
        for part_i, part in enumerate(tok.replace("\t", "    ").split("\n")):
            if part_i:
                line, col = line + 1, 0
            while part:
                room = cols - col
                if room <= 0:
                    line, col = line + 1, 0
                    continue
                chunk, part = part[:room], part[room:]
                cells.append((line, col, len(chunk), color, chunk))
                col += len(chunk)
    n_lines = line + 1
    strip_rows = len(m.history) + 1
    char_w, line_h = 0.602 * 8 / 72, 0.19  # inches: DejaVu Sans Mono advances 0.602 em at 8 pt
    fig_w = cols * char_w + 0.6
    text_h, strip_h = n_lines * line_h, max(0.6, 0.08 * strip_rows + 0.4)
    fig_w += 0.4  # room for the strip's row labels
    fig = plt.figure(figsize=(fig_w, text_h + strip_h + 0.9), dpi=110)
    total_h = text_h + strip_h + 0.9
    ax = fig.add_axes([0.7 / fig_w, (strip_h + 0.5) / total_h, cols * char_w / fig_w, text_h / total_h])
    ax.set_xlim(0, cols)
    ax.set_ylim(n_lines, 0)
    ax.axis("off")
    rects, colors = [], []
    for ln, c0, w, color, chunk in cells:
        rects.append(Rectangle((c0, ln + 0.08), w, 0.84))
        colors.append(color)
        ax.text(c0, ln + 0.5, chunk, family="monospace", fontsize=8, va="center", ha="left")
    ax.add_collection(PatchCollection(rects, facecolors=colors, edgecolors="none"))
    if title:
        fig.suptitle(title, fontsize=10, x=0.02, ha="left", y=1 - 0.15 / total_h)
    import numpy as np
    from matplotlib.colors import to_rgb

    sx = fig.add_axes([0.7 / fig_w, 0.35 / total_h, cols * char_w / fig_w, strip_h / total_h - 0.05 / total_h])
    rows = m.history + [m.codes]
    img = np.ones((len(rows), max(1, len(m.tokens)), 3))
    for r, codes in enumerate(rows):
        for i, c in enumerate(codes):
            img[r, i] = (1, 1, 1) if c == NOT_YET else to_rgb(code_color(m.kind, c))
    sx.imshow(img, aspect="auto", interpolation="nearest")
    every = max(1, len(rows) // 12)
    ticks = [r for r in range(len(rows)) if r % every == 0 or r == len(rows) - 1]
    labels = [f"step {s}" for s in m.history_steps] + ["final"]
    sx.set_yticks(ticks, [labels[r] for r in ticks], fontsize=6)
    sx.set_xlabel("position (prompt | generated); rows: recorded placements", fontsize=7)
    sx.axvline(m.n_prompt - 0.5, color="#333", lw=0.8, ls="--")
    sx.tick_params(axis="x", labelsize=6)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
