"""A real headless browser opens the pages kvtier writes: no console messages, a screenshot that is not blank,
and the sort script ran. Chromium comes from the test setup (``make browser``, run by ``make test``);
``KVTIER_NO_BROWSER=1`` is the only way to skip these."""

from __future__ import annotations

import os
import re

import pytest
import torch
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.eval.report import write_report
from kvtier.eval.runner import EvalConfig, run_eval
from kvtier.models import byte_tokenizer, random_model
from kvtier.tools import browser as browser_tools


@pytest.fixture(scope="module")
def browser():
    if os.environ.get("KVTIER_NO_BROWSER") == "1":
        pytest.skip("KVTIER_NO_BROWSER=1")
    b = browser_tools.find_browser()
    if b is None:
        pytest.fail("no Chromium on PATH: `make browser` installs it (apt-get install chromium)")
    return b


def _not_blank(png) -> float:
    import matplotlib.image as mpimg

    img = mpimg.imread(png)[..., :3]
    return float((img.min(axis=-1) < 0.9).mean())  # share of pixels that are not (near) white


def _check_page(browser, page, shot, height=1600):
    console = browser_tools.screenshot(page, shot, height=height, browser=browser)
    assert console == [], console
    assert _not_blank(shot) > 0.02


def test_report_html_in_a_browser(browser, tmp_path):
    model = random_model("tiny-qwen2", dtype=torch.float32)
    loaded = (model, byte_tokenizer())
    cfgs = [EvalConfig(model="random:tiny-qwen2", benchmark="rg:basic_arithmetic", policy=p, params=q, limit=3,
                       max_new_tokens=40)
            for p, q in (("full", {}), ("tiered", {"retier_interval": 8, "recent_window": 8, "protect_prompt": False,
                                                   "evict_ratio": 0.2}), ("h2o", {"budget_ratio": 0.5}))]
    run_eval(cfgs, tmp_path / "run", batch_size=3, loaded=loaded)
    paths = write_report(tmp_path / "run", html=True)
    page = paths["html"]
    _check_page(browser, page, tmp_path / "report.png", height=2400)
    dom = browser_tools.dump_dom(page, browser=browser)
    assert 'class="sortable ready"' in dom  # the sort script ran without error
    assert dom.count("<details") == 3 and "<details open" in dom and "T3 evicted" in dom


def test_generate_html_in_a_browser(browser, tmp_path):
    page, png = tmp_path / "gen.html", tmp_path / "gen.png"
    res = CliRunner().invoke(app, ["generate", "What is 2+3?", "--model", "random:tiny-qwen2", "--max-new-tokens", "60",
                                   "--evict-ratio", "0.2", "--param", "retier_interval=16", "--param", "recent_window=8",
                                   "--param", "protect_prompt=false", "--dtype", "fp32", "--html", str(page),
                                   "--png", str(png)])
    assert res.exit_code == 0, res.output
    _check_page(browser, page, tmp_path / "gen_shot.png")
    assert _not_blank(png) > 0.02
    text = page.read_text()
    n_prompt, n_gen = map(int, re.search(r"(\d+) prompt \+ (\d+) generated tokens", text).groups())
    assert 0 < n_gen <= 60 and text.count('class="tk') == n_prompt + n_gen
