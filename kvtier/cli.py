"""``kvtier``: a thin command line over the library (typer + rich). Errors a user can fix print one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Tiered KV cache for reasoning LLMs.")
console = Console()
err = Console(stderr=True)

MODEL_HELP = "hub id, local dir, .gguf file, 'qwen2.5-coder-0.5b-instruct' (embedded, offline) or random:<preset>"
EMBEDDED = "qwen2.5-coder-0.5b-instruct"


def _fail(msg: str) -> None:
    err.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _run(fn):
    """Turn the library's user-facing errors into one line and exit code 2 (no traceback wall)."""
    from .eval.datasets import DataError
    from .models import ModelLoadError

    try:
        return fn()
    except (ValueError, ModelLoadError, DataError, NotImplementedError, FileNotFoundError) as e:
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def _floats(s: str | None, name: str) -> list[float]:
    if s is None:
        return []
    try:
        return [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        _fail(f"{name} must be comma-separated numbers, got {s!r}")


def _ints(s: str, name: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        _fail(f"{name} must be comma-separated integers, got {s!r}")


def _int_option(name: str, x) -> int:
    """An integer from a flag or a config file (``"128"`` or ``128``); a clear error otherwise."""
    if isinstance(x, bool):
        raise ValueError(f"{name} must be integers, got {x!r}")
    try:
        return int(str(x).strip())
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {x!r}") from None


def _parse_params(pairs: list[str]) -> dict:
    out = {}
    for p in pairs or []:
        if "=" not in p:
            _fail(f"--param must look like key=value, got {p!r}")
        k, v = p.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def _policy_params(**given) -> dict:
    """The policy options the user gave (the policy itself rejects the ones it does not take)."""
    return {k: v for k, v in given.items() if v is not None}


def _default_max_new(device: str) -> int:

    from .models import resolve_device

    return 4096 if resolve_device(device).type == "cuda" else 512


def _progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console)


# ---- generate ----------------------------------------------------------------------------------------
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
    dtype: str = typer.Option("auto", help="auto (bf16), bf16, fp16, fp32"),
):
    """Generate one answer and print it with the cache's stats."""

    def go():
        import torch

        import kvtier
        from .models import chat_prompt

        params = {**_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio, budget_tokens=budget_tokens), **_parse_params(param)}
        kvtier.get_policy(policy).check_params(params)
        m, tok = kvtier.load_model(model, device=device, dtype=dtype)
        enc = tok([chat_prompt(tok, prompt)], return_tensors="pt").to(m.device)
        cache = kvtier.make_cache(policy, m, **params)
        with torch.no_grad():
            out = m.generate(**enc, cache=cache, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        console.print(tok.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True))
        console.print_json(json.dumps(cache.stats()))

    _run(go)


# ---- eval / sweep / report ---------------------------------------------------------------------------
def _eval_progress_cb(progress: Progress, task):
    def cb(p):
        rate = f"{p['tokens'] / p['seconds']:.1f} tok/s" if p["seconds"] else ""
        progress.update(task, total=p["total"], completed=p["done"], rate=rate)

    return cb


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
        from .eval.report import write_report
        from .eval.runner import EvalConfig, load_all, run_eval

        if batch_size < 1:
            raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size}")

        params = {**_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio, budget_tokens=budget_tokens), **_parse_params(param)}
        cfg = EvalConfig(model=model, benchmark=benchmark, policy=policy, params=params, limit=limit,
                         max_new_tokens=max_new_tokens or _default_max_new(device), temperature=temperature,
                         top_p=top_p, samples=samples, seed=seed)
        problems = load_all([cfg], data_dir)
        loaded = kvtier.load_model(model, device=device, dtype=dtype)
        with _progress() as progress:
            task = progress.add_task(f"{benchmark} {policy}", total=None, rate="")
            run_eval([cfg], out, batch_size=batch_size, on_progress=_eval_progress_cb(progress, task),
                     loaded=loaded, problems=problems)
        paths = write_report(out)
        console.print(paths["md"].read_text())

    _run(go)


@app.command()
def sweep(
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    benchmark: str = typer.Option("gsm8k", help="comma-separated benchmarks"),
    policy: str = typer.Option("full,tiered,evict,h2o,rkv,streaming_llm", help="comma-separated policies"),
    evict_ratio: str = typer.Option("0.03,0.1,0.25,0.5", help="comma-separated; baselines get budget = 1 - ratio"),
    hbm_ratio: str = typer.Option("0.3,0.5,0.7", help="comma-separated (tiered, quant)"),
    quant_ratio: float = typer.Option(0.0, help="tiered T2 fraction for every grid point"),
    compare: str = typer.Option("equal-eviction", help="baselines: equal-eviction (budget = 1 - evict ratio), "
                                "equal-memory (the hierarchy's T0 tokens at each hbm ratio), or both"),
    budget_tokens: str = typer.Option("", help="comma-separated absolute budgets for the baselines, e.g. 128,256,512"),
    config: Optional[Path] = typer.Option(None, help="JSON/TOML file with these keys (+ policy_params); options given here win"),
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
):
    """Run a grid of policies x ratios x benchmarks into one resumable run directory."""

    def go():
        import kvtier
        from .eval.report import write_report
        from .eval.runner import load_all, run_eval
        from .eval.sweep import expand_grid, load_config_file

        file = load_config_file(config) if config else {}
        as_list = lambda v: v if isinstance(v, list) else [x.strip() for x in str(v).split(",") if x.strip()]  # noqa: E731
        cfgs = expand_grid(
            model=file.get("model", model),
            benchmarks=as_list(file.get("benchmark", benchmark)),
            policies=as_list(file.get("policy", policy)),
            evict_ratios=[float(x) for x in as_list(file.get("evict_ratio", evict_ratio))],
            hbm_ratios=[float(x) for x in as_list(file.get("hbm_ratio", hbm_ratio))],
            quant_ratio=float(file.get("quant_ratio", quant_ratio)),
            policy_params=file.get("policy_params"),
            compare=file.get("compare", compare),
            budget_tokens=[_int_option("--budget-tokens", x) for x in as_list(file.get("budget_tokens", budget_tokens))],
            limit=file.get("limit", limit),
            max_new_tokens=file.get("max_new_tokens", max_new_tokens or _default_max_new(device)),
            temperature=file.get("temperature", temperature),
            top_p=file.get("top_p", top_p),
            samples=file.get("samples", samples),
            seed=file.get("seed", seed),
        )
        if batch_size < 1:
            raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size}")
        problems = load_all(cfgs, file.get("data_dir", data_dir))
        loaded = kvtier.load_model(cfgs[0].model, device=device, dtype=dtype)
        console.print(f"{len(cfgs)} configurations")
        with _progress() as progress:
            task = progress.add_task("sweep", total=None, rate="")
            run_eval(cfgs, out, batch_size=batch_size, on_progress=_eval_progress_cb(progress, task),
                     loaded=loaded, problems=problems)
        paths = write_report(out)
        console.print(paths["md"].read_text())

    _run(go)


@app.command()
def report(run_dir: Path = typer.Argument(..., help="a directory written by eval or sweep"),
           out: Optional[Path] = typer.Option(None, help="where to write (default: run_dir)")):
    """Markdown/CSV/JSON summary with Wilson intervals and paired tests, and PNG plots."""

    def go():
        from .eval.report import write_report

        paths = write_report(run_dir, out)
        console.print(paths["md"].read_text())
        for k, p in paths.items():
            if p.suffix == ".png":
                console.print(f"plot: {p}")

    _run(go)


# ---- demo --------------------------------------------------------------------------------------------
@app.command()
def demo(
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    problems: int = typer.Option(8, help="fresh problems from --benchmark (fixed seed)"),
    benchmark: str = typer.Option("rg:gsm_symbolic", help="any benchmark eval takes; rg:<task> needs no data"),
    max_new_tokens: int = typer.Option(384),
    batch_size: int = typer.Option(8),
    out: Path = typer.Option(Path("runs/demo")),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Offline demo: full vs tiered (hbm 0.3, evict 0.03) vs evict (0.5) on the embedded model."""

    def go():
        import kvtier
        from .eval.demo import run_demo

        loaded = kvtier.load_model(model, device=device, dtype=dtype)
        with _progress() as progress:
            task = progress.add_task("demo", total=None, rate="")
            rows = run_demo(model, problems, max_new_tokens, batch_size, out, device, dtype,
                            on_progress=_eval_progress_cb(progress, task), loaded=loaded, benchmark=benchmark)
        t = Table(title=f"kvtier demo: {model}, {problems} {benchmark} problems, greedy, {max_new_tokens} new tokens max")
        for col in ("policy", "accuracy", "gen tokens", "device KV MiB (vs full)", "moved MiB", "streamed MiB", "tok/s",
                    "same text / answer as full"):
            t.add_column(col)
        for r in rows:
            vs = f" ({100 * r['device_kv_vs_full']:.0f}%)" if r["device_kv_vs_full"] is not None else ""
            params = ", ".join(f"{k.removesuffix('_ratio')} {v}" for k, v in r["params"].items())
            t.add_row(f"{r['policy']} ({params})" if params else r["policy"], f"{100 * r['accuracy']:.0f}%", str(r["generated_tokens"]),
                      f"{r['device_kv_mib']:.1f}{vs}", f"{r['moved_mib']:.1f}", f"{r['streamed_mib']:.0f}",
                      f"{r['tok_s']:.1f}", f"{r['identical_completions']}/{r['problems']} / {r['identical_answers']}/{r['problems']}")
        (console if console.is_terminal else Console(width=200)).print(t)
        console.print(f"records: {out / 'records.jsonl'} (rerun to resume; `kvtier report {out}` for plots)")

    _run(go)


# ---- bench / plan ------------------------------------------------------------------------------------
@app.command()
def bench(
    model: Optional[str] = typer.Option(None, help=MODEL_HELP + " (default: random:qwen2-7b on GPU, the embedded model on CPU)"),
    context: Optional[int] = typer.Option(None, help="prompt tokens (default 4096 GPU, 512 CPU)"),
    new_tokens: Optional[int] = typer.Option(None, help="timed decode steps (default 256 GPU, 64 CPU)"),
    batch: Optional[str] = typer.Option(None, help="comma-separated batch sizes (default 1,8 GPU, 1,4 CPU)"),
    policy: str = typer.Option("full,tiered", help="comma-separated policies"),
    hbm_ratio: str = typer.Option("0.3,0.5,0.7"),
    evict_ratio: str = typer.Option("0.03"),
    retier_interval: int = typer.Option(64),
    recent_window: int = typer.Option(128, help="tiered: protected recent tokens (the prompt is not protected here: it stands for earlier thoughts)"),
    repeats: int = typer.Option(3),
    stock: bool = typer.Option(True, help="also time stock transformers (SDPA + DynamicCache)"),
    t1_on_device: bool = typer.Option(False, "--t1-on-device", help="also time tiered with a device copy of T1 (HBM for PCIe)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Decode throughput, transfer share and memory per policy, as ratios measured in one run."""

    def go():
        from .bench import BenchConfig, run_bench
        from .models import resolve_device

        gpu = resolve_device(device).type == "cuda"
        cfg = BenchConfig(
            model=model or ("random:qwen2-7b" if gpu else EMBEDDED),
            context=context or (4096 if gpu else 512),
            new_tokens=new_tokens or (256 if gpu else 64),
            batches=tuple(_ints(batch or ("1,8" if gpu else "1,4"), "--batch")),
            policies=tuple(p.strip() for p in policy.split(",") if p.strip()),
            hbm_ratios=tuple(_floats(hbm_ratio, "--hbm-ratio")),
            evict_ratios=tuple(_floats(evict_ratio, "--evict-ratio")),
            retier_interval=retier_interval, recent_window=recent_window, repeats=repeats, stock=stock,
            t1_on_device=t1_on_device, device=device, dtype=dtype,
        )
        with console.status("benchmarking") as status:
            res = run_bench(cfg, on_progress=lambda m: status.update(m))
        print_bench(res)
        if json_out:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(res, indent=2))
            console.print(f"wrote {json_out}")

    _run(go)


def print_bench(res: dict) -> None:
    t = Table(title=f"kvtier bench: {res['config']['model']} on {res['device']}, context {res['config']['context']}, "
                    f"{res['config']['new_tokens']} steps, memcpy peak {res['memcpy_peak_gbps']:.1f} GB/s")
    for col in ("batch", "policy", "params", "tok/s", "ms/step", "vs full", "vs stock", "xfer share", "H2D GB/s (% peak)",
                "H2D MiB/step", "peak dev MiB", "KV MiB T0/T1/T2"):
        t.add_column(col)
    mib = 2**20
    for r in res["results"]:
        p = ", ".join(f"{k.replace('_ratio', '')}={v}" for k, v in r["params"].items() if k.endswith("ratio"))
        p += ", T1 on device" if r["params"].get("t1_on_device") else ""
        gb = f"{r['h2d_gbps']:.1f} ({100 * r['h2d_fraction_of_peak']:.0f}%)" if r.get("h2d_gbps") else "–"
        kv = r["kv_bytes"]
        t.add_row(str(r["batch"]), r["policy"], p, f"{r['decode_tok_s']:.1f}", f"{r['ms_per_step']:.1f}",
                  f"{r['ratio_to_full']:.3f}", f"{r['ratio_to_stock']:.3f}" if r.get("ratio_to_stock") else "–",
                  f"{100 * r['transfer_share']:.1f}%" if "transfer_share" in r else "–", gb,
                  f"{r['h2d_bytes_per_step'] / mib:.2f}" if "h2d_bytes_per_step" in r else "–",
                  f"{r['peak_device_bytes'] / mib:.0f}" if r.get("peak_device_bytes") else "–",
                  f"{kv['T0'] / mib:.1f}/{kv['T1'] / mib:.1f}/{kv['T2'] / mib:.1f}")
    # A wide table: keep it whole when the output goes to a file or a log rather than a terminal.
    (console if console.is_terminal else Console(width=220)).print(t)


@app.command()
def plan(
    model: str = typer.Option("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", help="built-in hub id, random:<preset> or path/config.json"),
    batch: int = typer.Option(8),
    seq_len: int = typer.Option(32768),
    hbm_ratio: float = typer.Option(0.3),
    evict_ratio: float = typer.Option(0.03),
    quant_ratio: float = typer.Option(0.0),
    protected_tokens: int = typer.Option(0, help="prompt + sinks + recent window kept in T0 regardless"),
    dtype: str = typer.Option("bf16", help="bf16, fp16, fp32"),
    pcie_gbps: float = typer.Option(50.0, help="host->device bandwidth"),
    hbm_gbps: float = typer.Option(4800.0, help="device memory bandwidth (H200: 4800)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
):
    """KV bytes per tier, device memory saved, PCIe bytes per step and decode-step floors."""

    def go():
        from .plan import plan as make_plan

        p = make_plan(model, batch, seq_len, hbm_ratio, evict_ratio, quant_ratio, dtype, pcie_gbps, hbm_gbps, protected_tokens)
        if json_out:
            console.print_json(json.dumps(p))
            return
        g = 1e9
        t = Table(title=f"{model}: batch {batch} x {seq_len} tokens, {dtype}; {p['kv_bytes_per_token']:,} B/token "
                        f"(int8: {p['int8_bytes_per_token']:,})")
        for col in ("tier", "tokens/seq", "per seq GB", "per batch GB"):
            t.add_column(col)
        for tier in ("T0", "T1", "T2", "T3"):
            t.add_row(tier, f"{p['tokens_per_seq'][tier]:,}", f"{p['bytes_per_seq'][tier] / g:.3f}", f"{p['bytes_per_batch'][tier] / g:.3f}")
        console.print(t)
        f = p["step_floor_ms"]
        console.print(f"full KV on device: {p['full_kv_bytes_per_batch'] / g:.2f} GB; tiered device KV: {p['device_kv_bytes'] / g:.2f} GB "
                      f"(saves {p['device_bytes_saved'] / g:.2f} GB); weights {p['weights_bytes'] / g:.2f} GB")
        console.print(f"PCIe per decode step: {p['pcie_bytes_per_step'] / g:.3f} GB -> {f['pcie']:.2f} ms at {pcie_gbps} GB/s; "
                      f"HBM floor {f['hbm']:.2f} ms; step floor {f['overlapped']:.2f} ms overlapped ({f['serial']:.2f} serial) "
                      f"vs {f['full_cache']:.2f} ms full cache -> at most {p['throughput_ratio_floor']:.2f}x full-cache throughput")

    _run(go)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
