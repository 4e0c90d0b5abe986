"""Tier maps: what the recorder keeps equals the cache's own placement, the picture shows exactly those tiers,
and recording off costs nothing."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import generate, prompt_ids

import kvtier
from kvtier.compat import cache_kw
from kvtier.models import byte_tokenizer
from kvtier.tiers import tiermap
from kvtier.tiers.planner import protected_mask
from kvtier.tiers.tiermap import NOT_CACHED, SHARE, TIERS, TokenTiers
from kvtier.tools import viz

TIERED = dict(hbm_ratio=0.3, evict_ratio=0.2, quant_ratio=0.1, retier_interval=8, recent_window=4, sink_tokens=2,
              protect_prompt=False)


def _decode(model, cache, ids, mask, steps, after=None):
    """Greedy decoding one token per forward; ``after(step, cache)`` after the prefill (step -1) and each step."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **cache_kw(model, cache), use_cache=True)
        if after:
            after(-1, cache)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        for s in range(steps):
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            out = model(input_ids=tok, attention_mask=mask, **cache_kw(model, cache), use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            if after:
                after(s, cache)


def test_recorded_rows_are_the_placements_of_each_reassignment(qwen2):
    ids = prompt_ids(2, 24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in row 1
    cache = kvtier.make_cache("tiered", qwen2, record_tiers=True, **TIERED)
    snaps = {}
    _decode(qwen2, cache, ids, mask, 40, after=lambda s, c: snaps.__setitem__(s, c.tier_map().clone()))
    rec = cache.tier_history()
    assert rec.kind == TIERS
    assert rec.steps == [0, 8, 16, 24, 32, 40][: len(rec.steps)] and len(rec.steps) == 5
    # the prefill placement is the map right after prefill
    assert torch.equal(rec.rows[0], snaps[-1])
    for step, row in zip(rec.steps[1:], rec.rows[1:]):
        # a reassignment runs at the start of the forward of decode step ``step`` (before its token is stored):
        # the map after that forward is the recorded row plus one new token, on the device
        after = snaps[step]
        assert row.shape[1] == after.shape[1] - 1
        assert torch.equal(row, after[:, :-1])
        assert (after[:, -1] == 0).all()
    assert (rec.rows[-1][1, :5] == -1).all() and (rec.rows[-1][0] >= 0).all()
    assert {0, 1, 2, 3} <= set(rec.rows[-1].unique().tolist())  # the small case exercises every tier
    assert rec.nbytes() == sum(r.numel() for r in rec.rows)  # one int8 per position per reassignment


def test_recording_changes_nothing_and_off_records_nothing(qwen2, monkeypatch):
    ids = prompt_ids(2, 20, seed=3)
    seq_on, logits_on, c_on = generate(qwen2, "tiered", ids, new_tokens=30, record_tiers=True, **TIERED)

    def boom(*a, **k):
        raise AssertionError("a recorder was built or used with recording off")

    monkeypatch.setattr(tiermap.TierRecorder, "__init__", boom)
    monkeypatch.setattr(tiermap.TierRecorder, "note", boom)
    for policy, params in (("tiered", TIERED), ("full", {}), ("h2o", {"budget_ratio": 0.5})):
        seq, logits, cache = generate(qwen2, policy, ids, new_tokens=30, **params)
        assert cache.tier_history() is None and cache.state.recorder is None
        if policy == "tiered":
            assert torch.equal(seq, seq_on) and torch.equal(logits, logits_on)
            strip = lambda st: {**st, "transfer": {k: v for k, v in st["transfer"].items() if k != "seconds"}}  # noqa: E731
            assert strip(cache.stats()) == strip(c_on.stats())


def test_callback_receives_rows_and_nothing_is_kept(qwen2):
    got = []
    cache = kvtier.make_cache("tiered", qwen2, record_tiers=lambda step, row: got.append((step, row.clone())), **TIERED)
    _decode(qwen2, cache, prompt_ids(1, 16), torch.ones(1, 16, dtype=torch.long), 20)
    kept = kvtier.make_cache("tiered", qwen2, record_tiers=True, **TIERED)
    _decode(qwen2, kept, prompt_ids(1, 16), torch.ones(1, 16, dtype=torch.long), 20)
    assert [s for s, _ in got] == [0, 8, 16] == kept.tier_history().steps
    assert all(torch.equal(a, b) for (_, a), b in zip(got, kept.tier_history().rows))
    assert cache.tier_history().rows == [] and all(r.dtype == torch.int8 for _, r in got)


def test_bad_record_tiers_is_one_clear_error(qwen2):
    with pytest.raises(ValueError, match="record_tiers must be"):
        kvtier.make_cache("tiered", qwen2, record_tiers="yes")


def test_sequence_map_matches_tier_map_scores_and_protection(qwen2):
    ids = prompt_ids(2, 24, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    cache = kvtier.make_cache("tiered", qwen2, record_tiers=True, **TIERED)
    _decode(qwen2, cache, ids, mask, 30)
    tm, sc = cache.tier_map(), cache.scores()
    st = cache.state
    prot = protected_mask(st.valid[:, : st.n_total], st.prompt[:, : st.n_total], st.cfg)
    n = tm.shape[1]
    for row, pad in ((0, 3), (1, 0)):
        n_tok = n - pad + 1  # + the token sampled last (never fed back)
        m = tiermap.sequence_map(cache, row, pad, n_tok, ["x"] * n_tok, 24 - pad)
        assert m.codes[:-1] == tm[row, pad:].tolist() and m.codes[-1] == NOT_CACHED
        assert m.scores[:-1] == sc[row, pad:].tolist()
        assert m.protected[:-1] == prot[row, pad:].tolist()
        assert len(m.history) == len(cache.tier_history().steps)
        # history rows: later positions not yet generated are -3; recorded ones equal the recorder's
        for step, h in zip(m.history_steps, m.history):
            r = cache.tier_history().rows[m.history_steps.index(step)][row, pad:].tolist()
            assert h[: len(r)] == r and all(c == -3 for c in h[len(r):])
        # transitions: the first recorded code, then each change
        i = next(i for i in range(n_tok - 1) if len({h[i] for h in m.history if h[i] != -3}) > 1)
        moves = m.transitions(i)
        assert len(moves) >= 2 and all(a[1] != b[1] for a, b in zip(moves, moves[1:]))


def test_headwise_map_is_the_share_of_layers_and_heads(qwen2):
    ids = prompt_ids(1, 24, seed=2)
    cache = kvtier.make_cache("h2o", qwen2, record_tiers=True, budget_ratio=0.5)
    _decode(qwen2, cache, ids, torch.ones_like(ids), 70)
    kept = cache.kept_mask()  # (L, B, H, N)
    share = torch.round(kept.float().mean(dim=(0, 2)) * 100).to(torch.int8)[0]
    m = tiermap.sequence_map(cache, 0, 0, kept.shape[-1], ["x"] * kept.shape[-1], 24)
    assert m.kind == SHARE and m.codes == share.tolist()
    assert cache.tier_history().steps == [0, 64]
    assert all(0 <= c <= 100 for c in m.codes)
    assert len(set(m.codes)) > 2  # heads disagree: that is why the map shows a share


def _spans(page: str) -> list[tuple[str, str, str]]:
    return re.findall(r'<span class="([^"]*)" style="background:([^"]+)" title="[^"]*">([^<]*)</span>', page)


def test_known_small_case_colors():
    m = TokenTiers(TIERS, ["<p>", "a", "b", "c", "d", "e"], 1, [0, 0, 1, 2, 3, NOT_CACHED],
                   scores=[0.5, 0.4, 0.3, 0.2, 0.1, 0.0], protected=[True, False, False, False, False, False],
                   history_steps=[0, 64], history=[[0, 1, 1, 1, -3, -3], [0, 0, 1, 2, 3, -3]])
    spans = _spans(viz.token_spans(m))
    assert [s[2] for s in spans] == ["&lt;p&gt;", "a", "b", "c", "d", "e"]
    assert [s[1] for s in spans] == [viz.TIER_COLORS[c] for c in (0, 0, 1, 2, 3, NOT_CACHED)]
    assert "pr" in spans[0][0].split() and "pr" not in spans[1][0].split()
    assert "t3" in spans[4][0].split() and "tn" in spans[5][0].split()
    assert m.transitions(1) == [(0, 1), (64, 0)] and m.transitions(4) == [(64, 3)]
    titles = re.findall(r'title="([^"]*)"', viz.token_spans(m))
    assert "T1 @ step 0 → T0 @ step 64" in titles[1] and "score 0.4" in titles[1]
    strip = viz.heat_strip(m)
    # one rectangle per run of equal codes per row: row 0 -> 0,111 ; row 1 -> 00,1,2,3 ; final -> 00,1,2,3,new
    assert strip.count("<rect ") == 2 + 4 + 5
    page = viz.tier_page(m, "t")
    assert page.startswith("<!DOCTYPE html>") and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert m.counts() == {"T0": 2, "T1": 1, "T2": 1, "T3": 1}


def test_share_colors_run_from_red_to_green():
    assert viz.share_color(0) == "#f08a8a" and viz.share_color(100) == "#9ad49a"
    m = TokenTiers(SHARE, ["a", "b"], 0, [100, 0])
    spans = _spans(viz.token_spans(m))
    assert [s[1] for s in spans] == ["#9ad49a", "#f08a8a"]


def test_token_pieces_join_to_the_text_even_when_bytes_split():
    tok = byte_tokenizer()
    text = "déjà vu: 3×4 = 12 ✓"
    ids = tok(text).input_ids
    pieces = tiermap.token_pieces(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert len(pieces) == len(ids)


def test_compact_round_trip():
    m = TokenTiers(TIERS, ["p", "q", "Hel", "lo", " w", "!"], 2, [0, 1, 0, 3, 2, NOT_CACHED])
    c = tiermap.compact(m, 2)
    assert c == {"kind": TIERS, "prompt": "01", "completion": "032.", "ends": [3, 5, 7, 8]}
    back = tiermap.from_compact(c, "Hello w!")
    assert back.tokens == ["Hel", "lo", " w", "!"] and back.codes == [0, 3, 2, NOT_CACHED]
    s = TokenTiers(SHARE, ["a", "b", "c"], 0, [100, 47, 0])
    cs = tiermap.compact(s, 0)
    assert cs["completion"] == "kfa" and tiermap.decode_codes(SHARE, cs["completion"]) == [100, 50, 0]
    json.dumps(c)


def test_png_is_drawn(tmp_path):
    pytest.importorskip("matplotlib", reason="--png needs the eval extra (make test-compat installs only core + dev)")
    m = TokenTiers(TIERS, ["question\n", "a", "b\tc", "d" * 300], 1, [0, 1, 2, 3],
                   history_steps=[0], history=[[0, 0, 1, -3]])
    p = viz.write_png(m, tmp_path / "m.png", title="t")
    import matplotlib.image as mpimg

    img = mpimg.imread(p)[..., :3]
    colored = ((abs(img[..., 0] - img[..., 1]) > 0.05) | (abs(img[..., 1] - img[..., 2]) > 0.05)).mean()
    assert colored > 0.02  # tier backgrounds, not only black text on white
