"""The screenshots under docs/: real headless-Chromium renderings of pages kvtier wrote.

    kvtier demo                                   # writes runs/demo/report.html
    kvtier generate "QUESTION" --html runs/demo/tier_map.html --evict-ratio 0.03 --param protect_prompt=false ...
    python benchmarks/docs_screenshots.py --report runs/demo/report.html --page runs/demo/tier_map.html
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvtier.tools import browser


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--page", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    a = ap.parse_args()
    for src, name, h in ((a.report, "report.png", 2200), (a.page, "tier_map.png", 1100)):
        console = browser.screenshot(src, a.out / name, width=1280, height=h)
        print(f"{a.out / name}: console messages {console or 'none'}")


if __name__ == "__main__":
    main()
