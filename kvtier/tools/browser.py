"""Headless Chromium for pictures and checks of the pages kvtier writes: find it, screenshot a page, dump its DOM."""

from __future__ import annotations

from pathlib import Path


def find_browser() -> str | None:
    """A Chromium-family browser on PATH (for headless screenshots), or None."""
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html_path: str | Path, png_path: str | Path, width: int = 1280, height: int = 1600,
               browser: str | None = None, timeout: float = 120.0) -> list[str]:
    """Open ``html_path`` in headless Chromium and save a ``width`` x ``height`` screenshot; returns the page's
    console messages (errors included: Chromium logs every console line, uncaught exceptions too)."""
    import subprocess

    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError("no Chromium found on PATH (Debian: apt-get install chromium; `make browser` does it)")
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           "--enable-logging=stderr", "--v=0", f"--window-size={width},{height}", f"--screenshot={png_path}",
           Path(html_path).resolve().as_uri()]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0 or not png_path.is_file():
        raise RuntimeError(f"{browser} failed ({res.returncode}): {res.stderr[-2000:]}")
    return [line for line in res.stderr.splitlines() if ":CONSOLE" in line]


def dump_dom(html_path: str | Path, browser: str | None = None, timeout: float = 120.0) -> str:
    """The page's DOM after its scripts ran (headless Chromium)."""
    import subprocess

    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError("no Chromium found on PATH (Debian: apt-get install chromium; `make browser` does it)")
    cmd = [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--dump-dom",
           Path(html_path).resolve().as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
