"""``kvtier eval``, ``sweep``, ``report`` and ``demo``: resumable evaluation runs and what they measured."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from .common import (EMBEDDED, MODEL_HELP, app, check_limits, console, given_policy_params, int_option,
                     max_new_or_default, option_given, parse_numbers, parse_params, run_command)
from .progress import LazyProgress


@app.command("eval")
def eval_cmd(
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    benchmark: str = typer.Option("gsm8k", help="gsm8k, math500, math_level5, arc_challenge or rg:<task>"),
    policy: str = typer.Option("tiered"),
    hbm_ratio: Optional[float] = typer.Option(None),
    evict_ratio: Optional[float] = typer.Option(None),
    quant_ratio: Optional[float] = typer.Option(None),
    budget_ratio: Optional[float] = typer.Option(None, help="eviction baselines: kept fraction of the current length"),
    budget_tokens: Optional[int] = typer.Option(None, help="eviction baselines: absolute budget in tokens"),
    param: list[str] = typer.Option([], help="any other policy parameter, key=value (repeatable)"),
    limit: Optional[int] = typer.Option(None, help="first N problems"),
    out: Path = typer.Option(Path("runs/eval"), help="run directory (records.jsonl is appended and resumed)"),
    data_dir: Optional[Path] = typer.Option(None, help="directory holding <benchmark>/test.jsonl; default: the hub"),
    batch_size: int = typer.Option(4),
    max_new_tokens: Optional[int] = typer.Option(None, help="default 4096 on GPU, 512 on CPU"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    samples: int = typer.Option(1, help="samples per problem (pass@1 over samples); needs --temperature > 0"),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Evaluate one configuration; resumable (rerun the same command to continue)."""

    def go():
        import kvtier

        from ..eval.records import check_run_dir
        from ..eval.report import write_report
        from ..eval.runner import EvalConfig, load_all, run_eval
        from ..models import resolve_device, resolve_dtype

        if batch_size < 1:
            raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size}")
        resolve_dtype(dtype, resolve_device(device))
        params = {**given_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio, budget_tokens=budget_tokens), **parse_params(param)}
        cfg = EvalConfig(model=model, benchmark=benchmark, policy=policy, params=params, limit=limit,
                         max_new_tokens=max_new_or_default(max_new_tokens, device), temperature=temperature,
                         top_p=top_p, samples=samples, seed=seed)
        check_run_dir(out)
        check_limits(model, cfg.max_new_tokens)
        problems = load_all([cfg], data_dir)
        with LazyProgress(f"{benchmark} {policy}") as progress:
            run_eval([cfg], out, batch_size=batch_size, on_progress=progress,
                     loaded=lambda: kvtier.load_model(model, device=device, dtype=dtype), problems=problems)
        paths = write_report(out)
        console.print(paths["md"].read_text(), soft_wrap=True, markup=False, highlight=False)

    run_command(go)


@app.command()
def sweep(
    ctx: typer.Context,
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    benchmark: str = typer.Option("gsm8k", help="comma-separated benchmarks"),
    policy: str = typer.Option("full,tiered,evict,h2o,rkv,streaming_llm", help="comma-separated policies"),
    evict_ratio: str = typer.Option("0.03,0.1,0.25,0.5", help="comma-separated; baselines get budget = 1 - ratio"),
    hbm_ratio: str = typer.Option("0.3,0.5,0.7", help="comma-separated (tiered, quant)"),
    quant_ratio: float = typer.Option(0.0, help="tiered T2 fraction for every grid point"),
    compare: str = typer.Option("equal-eviction", help="baselines: equal-eviction (budget = 1 - evict ratio), "
                                "equal-memory (the hierarchy's T0 tokens at each hbm ratio), or both"),
    budget_tokens: str = typer.Option("", help="comma-separated absolute budgets for the baselines, e.g. 128,256,512"),
    config: Optional[Path] = typer.Option(None, help="JSON/TOML file with these keys (+ policy_params, and parts: a list of sub-grids each overriding the top-level keys); options given on the command line win"),
    limit: Optional[int] = typer.Option(None),
    out: Path = typer.Option(Path("runs/sweep")),
    data_dir: Optional[Path] = typer.Option(None),
    batch_size: int = typer.Option(4),
    max_new_tokens: Optional[int] = typer.Option(None, help="default 4096 on GPU, 512 on CPU"),
    temperature: float = typer.Option(0.0),
    top_p: float = typer.Option(1.0),
    samples: int = typer.Option(1),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    ray: Optional[str] = typer.Option(None, "--ray", help="run on a Ray cluster: auto (the running one, else local) "
                                      "or its ADDRESS; needs kvtier[ray]"),
    gpus_per_task: float = typer.Option(1.0, help="--ray: GPUs per worker (0 on a CPU-only cluster)"),
    shards: int = typer.Option(2, help="--ray: tasks per configuration (problems split evenly)"),
    ray_workers: Optional[int] = typer.Option(None, help="--ray: workers to start (default: GPUs / --gpus-per-task, or 2)"),
    max_retries: int = typer.Option(2, help="--ray: retries of a failed task before it is reported"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the configurations (in run order) and exit"),
):
    """Run a grid of policies x ratios x benchmarks into one resumable run directory (``--ray``: on a cluster)."""

    def go():
        import kvtier

        from ..eval.records import check_run_dir
        from ..eval.report import write_report
        from ..eval.runner import load_all, run_eval
        from ..eval.sweep import config_parts, expand_grid, load_config_file
        from ..models import resolve_device, resolve_dtype

        file = load_config_file(config) if config else {}
        flags = dict(model=model, benchmark=benchmark, policy=policy, evict_ratio=evict_ratio, hbm_ratio=hbm_ratio,
                     quant_ratio=quant_ratio, compare=compare, budget_tokens=budget_tokens, limit=limit,
                     data_dir=data_dir, batch_size=batch_size, max_new_tokens=max_new_tokens, temperature=temperature,
                     top_p=top_p, samples=samples, seed=seed, device=device, dtype=dtype)
        allowed = sorted(flags) + ["parts", "policy_params"]
        parts = config_parts(file, f"--config {config}")
        for where, d in [("", file)] + [(f" parts[{i}]", p) for i, p in enumerate(file.get("parts") or [])]:
            unknown = sorted(set(d) - set(allowed))
            if unknown:
                raise ValueError(f"--config {config}{where}: unknown key(s) {unknown}; allowed: {allowed}")

        def opt(name, src=file):  # a flag given on the command line wins over the file, which wins over the default
            return flags[name] if option_given(ctx, name) or name not in src else src[name]

        as_list = lambda v: v if isinstance(v, list) else [x.strip() for x in str(v).split(",") if x.strip()]  # noqa: E731
        dev, dt = opt("device"), opt("dtype")
        if not dry_run:  # a dry run may list a GPU campaign from a machine without one
            resolve_dtype(dt, resolve_device(dev))
        skipped: list[str] = []
        cfgs = []
        for part in parts:
            cfgs += expand_grid(
                model=opt("model"),
                benchmarks=as_list(opt("benchmark", part)),
                policies=as_list(opt("policy", part)),
                evict_ratios=parse_numbers("--evict-ratio", as_list(opt("evict_ratio", part))),
                hbm_ratios=parse_numbers("--hbm-ratio", as_list(opt("hbm_ratio", part))),
                quant_ratio=parse_numbers("--quant-ratio", [opt("quant_ratio", part)])[0],
                policy_params=part.get("policy_params"),
                compare=opt("compare", part),
                budget_tokens=[int_option("--budget-tokens", x) for x in as_list(opt("budget_tokens", part))],
                skipped=skipped,
                limit=opt("limit", part),
                max_new_tokens=max_new_or_default(opt("max_new_tokens", part), dev),
                temperature=opt("temperature", part),
                top_p=opt("top_p", part),
                samples=opt("samples", part),
                seed=opt("seed", part),
            )
        bs = opt("batch_size")
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"--batch-size must be an integer >= 1, got {bs!r}")
        if dry_run:
            t = Table(title=f"{len(cfgs)} configurations, in run order")
            for col in ("#", "benchmark", "policy", "params", "problems", "max new tokens"):
                t.add_column(col)
            for i, c in enumerate(cfgs):
                t.add_row(str(i + 1), c.benchmark, c.policy, ", ".join(f"{k}={v}" for k, v in c.params.items()),
                          str(c.limit or "all"), str(c.max_new_tokens))
            (console if console.is_terminal else Console(width=200)).print(t)
            return
        check_run_dir(out)
        check_limits(cfgs[0].model, max(c.max_new_tokens for c in cfgs))
        problems = load_all(cfgs, opt("data_dir"))
        if skipped:
            console.print(f"note: skipped {len(skipped)} grid point(s) whose ratios sum over 1: {', '.join(skipped)}",
                          soft_wrap=True)
        console.print(f"{len(cfgs)} configurations")
        with LazyProgress("sweep") as progress:
            if ray is not None:
                from ..eval.ray_sweep import run_eval_ray

                run_eval_ray(cfgs, out, address=ray, workers=ray_workers, gpus_per_task=gpus_per_task, shards=shards,
                             batch_size=bs, device=dev, dtype=dt, data_dir=opt("data_dir"), max_retries=max_retries,
                             on_progress=progress)
            else:
                run_eval(cfgs, out, batch_size=bs, on_progress=progress,
                         loaded=lambda: kvtier.load_model(cfgs[0].model, device=dev, dtype=dt), problems=problems)
        paths = write_report(out)
        console.print(paths["md"].read_text(), soft_wrap=True, markup=False, highlight=False)

    run_command(go)


@app.command()
def report(run_dir: Path = typer.Argument(..., help="a directory written by eval or sweep"),
           out: Optional[Path] = typer.Option(None, help="where to write (default: run_dir)"),
           html: bool = typer.Option(False, "--html", help="also write report.html: table, plots, completions by tier"),
           html_problems: int = typer.Option(40, help="--html: problems shown side by side (per benchmark)"),
           claims: bool = typer.Option(False, "--claims", help="also write claims.md/.json: the seed paper's claims "
                                       "beside this run's numbers, with a verdict each (the paper_cpu.json campaign)")):
    """Markdown/CSV/JSON summary with Wilson intervals and paired tests, PNG plots (``--html``: one page)."""

    def go():
        from ..eval.report import write_report

        if html_problems < 0:
            raise ValueError(f"--html-problems must be an integer >= 0, got {html_problems}")
        paths = write_report(run_dir, out, html=html, html_problems=html_problems, claims=claims)
        console.print(paths["md"].read_text(), soft_wrap=True, markup=False, highlight=False)
        for k, p in paths.items():
            if p.suffix == ".png":
                console.print(f"plot: {p}")
        if "html" in paths:
            console.print(f"report: {paths['html']}")
        if "claims_md" in paths:
            console.print(paths["claims_md"].read_text(), soft_wrap=True, markup=False, highlight=False)

    run_command(go)


@app.command()
def demo(
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    problems: int = typer.Option(16, help="fresh problems from --benchmark (fixed seed)"),
    benchmark: Optional[str] = typer.Option(None, help="any benchmark eval takes (default: the demo task, "
                                            "rg:chain_sum?min_terms=3&max_terms=4&max_digits=2; rg:<task> needs no data)"),
    max_new_tokens: int = typer.Option(256),
    batch_size: int = typer.Option(16),
    out: Path = typer.Option(Path("runs/demo")),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Offline demo: full vs tiered (hbm 0.3, evict 0.03) vs evict (0.5), prompt unprotected, on the embedded model;
    writes runs/demo/report.html."""

    def go():
        import kvtier

        from ..eval.datasets import check_benchmark
        from ..eval.demo import DEMO_BENCHMARK, run_demo
        from ..eval.records import check_run_dir
        from ..models import resolve_device, resolve_dtype

        for flag, v in (("--problems", problems), ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size)):
            if v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v}")
        bench = benchmark or DEMO_BENCHMARK
        check_benchmark(bench)
        resolve_dtype(dtype, resolve_device(device))
        check_run_dir(out)
        check_limits(model, max_new_tokens)
        t0 = time.monotonic()
        with LazyProgress("demo") as progress:
            rows = run_demo(model, problems, max_new_tokens, batch_size, out, device, dtype, on_progress=progress,
                            loaded=lambda: kvtier.load_model(model, device=device, dtype=dtype), benchmark=bench)
        t = Table(title=f"kvtier demo: {model}, {problems} {bench} problems, greedy, {max_new_tokens} new tokens max; "
                        "tiered and evict: prompt unprotected, recent window 32")
        for col in ("policy", "accuracy", "gen tokens", "peak device KV MiB (vs full)", "moved MiB", "streamed MiB", "tok/s",
                    "same text / answer as full"):
            t.add_column(col)
        for r in rows:
            vs = f" ({100 * r['device_kv_vs_full']:.0f}%)" if r["device_kv_vs_full"] is not None else ""
            params = ", ".join(f"{k.removesuffix('_ratio')} {v}" for k, v in r["params"].items())
            t.add_row(f"{r['policy']} ({params})" if params else r["policy"], f"{100 * r['accuracy']:.0f}%", str(r["generated_tokens"]),
                      f"{r['device_kv_mib']:.1f}{vs}", f"{r['moved_mib']:.1f}", f"{r['streamed_mib']:.0f}",
                      f"{r['tok_s']:.1f}", f"{r['identical_completions']}/{r['problems']} / {r['identical_answers']}/{r['problems']}")
        (console if console.is_terminal else Console(width=200)).print(t)
        from ..eval.report import write_report

        paths = write_report(out, html=True, html_problems=problems)
        console.print(f"records: {out / 'records.jsonl'} (rerun to resume) · {time.monotonic() - t0:.0f} s")
        console.print(f"report: {paths['html']}  (every completion colored by where its tokens lived)")

    run_command(go)
