"""``kvtier generate``: one answer with the cache's stats, and optionally its tier map."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
import typer.core

from .common import EMBEDDED, MODEL_HELP, app, check_limits, console, given_policy_params, parse_params, run_command


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="the question; formatted with the model's chat template"),
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    policy: str = typer.Option("tiered", help="a name in kvtier.POLICIES"),
    hbm_ratio: Optional[float] = typer.Option(None, help="tiered/quant: T0 fraction"),
    evict_ratio: Optional[float] = typer.Option(None, help="tiered/evict/quant: T3 fraction"),
    quant_ratio: Optional[float] = typer.Option(None, help="tiered: T2 fraction"),
    budget_ratio: Optional[float] = typer.Option(None, help="eviction baselines: kept fraction of the current length"),
    budget_tokens: Optional[int] = typer.Option(None, help="eviction baselines: absolute budget in tokens"),
    param: list[str] = typer.Option([], help="any other policy parameter, key=value (repeatable)"),
    max_new_tokens: int = typer.Option(256),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto", help="auto (bf16 on CUDA and bf16-capable CPUs, else fp32), bf16, fp16, fp32"),
    html: Optional[Path] = typer.Option(None, "--html", help="write the completion colored by tier (+ tiers over time) here"),
    png: Optional[Path] = typer.Option(None, "--png", help="the same tier map as a PNG image"),
):
    """Generate one answer and print it with the cache's stats (``--html``/``--png``: where every token lived)."""

    def go():
        import torch

        import kvtier

        from ..models import chat_prompt

        params = {**given_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio, budget_tokens=budget_tokens), **parse_params(param)}
        from ..policies import validate_policy

        validate_policy(policy, params)
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens}")
        check_limits(model, max_new_tokens)
        for flag, path in (("--html", html), ("--png", png)):
            if path is not None and path.is_dir():
                raise ValueError(f"{flag} {path}: is a folder; give a file path")
        m, tok = kvtier.load_model(model, device=device, dtype=dtype)
        enc = tok([chat_prompt(tok, prompt)], return_tensors="pt").to(m.device)
        cache = kvtier.make_cache(policy, m, record_tiers=bool(html or png), **params)
        with torch.no_grad():
            from ..compat import cache_kw
            from ..step.decode import decode_kw

            out = m.generate(**enc, **cache_kw(m, cache), **decode_kw(), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        plen = enc.input_ids.shape[1]
        # the model's text verbatim: rich would read "\[" and "[b]" in it as markup
        console.print(tok.decode(out[0, plen:], skip_special_tokens=True), markup=False, highlight=False)
        console.print_json(json.dumps(cache.stats()))
        if html or png:
            from ..tiers.tiermap import sequence_map, token_pieces
            from ..tools import viz

            p_ids, c_ids = enc.input_ids[0].tolist(), out[0, plen:].tolist()
            pieces = token_pieces(tok, p_ids, skip_special=False) + token_pieces(tok, c_ids)
            shown = ", ".join(f"{k}={v}" for k, v in params.items())
            title = f"{policy}" + (f" ({shown})" if shown else "")
            tmap = sequence_map(cache, 0, 0, len(pieces), pieces, len(p_ids), title=title)
            meta = f"model {model} · greedy · {len(c_ids)} new tokens (max {max_new_tokens}) · question: {prompt[:200]}"
            if html:
                console.print(f"tier map: {viz.write_html(tmap, html, title=f'kvtier: {title}', meta=meta)}")
            if png:
                console.print(f"tier map: {viz.write_png(tmap, png, title=f'kvtier {title} - {model}')}")

    run_command(go)
