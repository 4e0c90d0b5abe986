"""``kvtier``: a thin command line over the library (typer + rich). Errors a user can fix print one line."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a flag typer cannot parse, an unknown option) as one ``error:`` line and exit code 2, like
    every other bad input, instead of click's usage box."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        import sys

        from typer._click import exceptions as cx

        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except cx.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help() if e.ctx else str(e))
            code = 2
        except cx.ClickException as e:
            msg = " ".join(e.format_message().split())
            where = f" (see `{e.ctx.command_path} --help`)" if getattr(e, "ctx", None) is not None else ""
            err.print(f"[red]error:[/red] {msg}{where}", highlight=False, soft_wrap=True, markup=True)
            code = e.exit_code
        except (KeyboardInterrupt, EOFError):
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


app = typer.Typer(cls=_OneLineErrors, add_completion=False, no_args_is_help=True,
                  help="Tiered KV cache for reasoning LLMs.")
console = Console()
err = Console(stderr=True)

MODEL_HELP = "hub id, local dir, .gguf file, 'qwen2.5-coder-0.5b-instruct' (embedded, offline) or random:<preset>"
EMBEDDED = "qwen2.5-coder-0.5b-instruct"


def _fail(msg: str) -> None:
    err.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


_DEBUG = {"on": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="show Python tracebacks instead of one-line errors")):
    """Tiered KV cache for reasoning LLMs."""
    _DEBUG["on"] = debug


def _run(fn):
    """Turn the library's user-facing errors into one line and exit code 2 (no traceback wall); anything
    unexpected is one line and exit code 1 (``--debug`` shows the traceback)."""
    from .eval.datasets import DataError
    from .models import ModelLoadError

    try:
        return fn()
    except typer.Exit:
        raise
    except (ValueError, ModelLoadError, DataError, NotImplementedError, FileNotFoundError, IsADirectoryError,
            NotADirectoryError, PermissionError) as e:
        if _DEBUG["on"]:
            raise
        _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    except KeyboardInterrupt:
        err.print("interrupted; rerun the same command to resume", highlight=False)
        raise typer.Exit(130) from None
    except Exception as e:  # a bug: still one line, but not exit 2, so that it is not mistaken for bad input
        if _DEBUG["on"]:
            raise
        first = str(e).splitlines()[0] if str(e) else ""
        err.print(f"[red]error:[/red] internal error {type(e).__name__}: {first} (rerun with --debug for the traceback)",
                  highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the user gave option ``name`` on the command line (not its default)."""
    src = ctx.get_parameter_source(name)  # typer may bundle its own click: compare by name, not by class
    return getattr(src, "name", None) in ("COMMANDLINE", "ENVIRONMENT")


def _check_limits(model: str, max_new_tokens: int) -> None:
    """What can be said about the model's positions before loading it."""
    from .models import peek_position_limit

    lim = peek_position_limit(model)
    if lim is not None and max_new_tokens >= lim:
        raise ValueError(f"--max-new-tokens {max_new_tokens} does not fit {model}'s {lim} positions")


def _numbers(name: str, xs) -> list[float]:
    """Finite numbers from a flag or a config file; one clear error otherwise."""
    import math

    out = []
    for x in xs:
        try:
            v = float(x) if not isinstance(x, bool) else float("nan")
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be comma-separated numbers, got {x!r}") from None
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite numbers, got {x!r}")
        out.append(v)
    if not out:
        raise ValueError(f"{name} needs at least one value")
    return out


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


def _max_new(value: int | None, device: str) -> int:
    """``None`` means not given (the device's default); 0 or less is an error, never "the default"."""
    return _default_max_new(device) if value is None else value


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
    dtype: str = typer.Option("auto", help="auto (bf16 on CUDA and bf16-capable CPUs, else fp32), bf16, fp16, fp32"),
    html: Optional[Path] = typer.Option(None, "--html", help="write the completion colored by tier (+ tiers over time) here"),
    png: Optional[Path] = typer.Option(None, "--png", help="the same tier map as a PNG image"),
):
    """Generate one answer and print it with the cache's stats (``--html``/``--png``: where every token lived)."""

    def go():
        import torch

        import kvtier

        from .models import chat_prompt

        params = {**_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio, budget_tokens=budget_tokens), **_parse_params(param)}
        from .eval.runner import validate_policy

        validate_policy(policy, params)
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be an integer >= 1, got {max_new_tokens}")
        _check_limits(model, max_new_tokens)
        for flag, path in (("--html", html), ("--png", png)):
            if path is not None and path.is_dir():
                raise ValueError(f"{flag} {path}: is a folder; give a file path")
        m, tok = kvtier.load_model(model, device=device, dtype=dtype)
        enc = tok([chat_prompt(tok, prompt)], return_tensors="pt").to(m.device)
        cache = kvtier.make_cache(policy, m, record_tiers=bool(html or png), **params)
        with torch.no_grad():
            from .compat import cache_kw

            out = m.generate(**enc, **cache_kw(m, cache), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        plen = enc.input_ids.shape[1]
        # the model's text verbatim: rich would read "\[" and "[b]" in it as markup
        console.print(tok.decode(out[0, plen:], skip_special_tokens=True), markup=False, highlight=False)
        console.print_json(json.dumps(cache.stats()))
        if html or png:
            from .tiers.tiermap import sequence_map, token_pieces
            from .tools import viz

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

    _run(go)


# ---- serve -------------------------------------------------------------------------------------------
@app.command()
def serve(
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    policy: str = typer.Option("tiered", help="default cache policy (a request's kvtier.policy overrides it)"),
    hbm_ratio: Optional[float] = typer.Option(None, help="tiered/quant: T0 fraction"),
    evict_ratio: Optional[float] = typer.Option(None, help="tiered/evict/quant: T3 fraction"),
    quant_ratio: Optional[float] = typer.Option(None, help="tiered: T2 fraction"),
    budget_ratio: Optional[float] = typer.Option(None, help="eviction baselines: kept fraction"),
    param: list[str] = typer.Option([], help="any other policy parameter, key=value (repeatable)"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8000),
    served_name: Optional[str] = typer.Option(None, help="the model id clients send and /v1/models lists (default --model)"),
    max_batch: int = typer.Option(8, help="requests decoded together in one batch"),
    max_queue: int = typer.Option(64, help="requests that may wait for a batch; beyond it, 429 with Retry-After"),
    max_new_tokens: Optional[int] = typer.Option(None, help="cap on a request's max_tokens (default 4096 GPU, 512 CPU)"),
    max_prompt_tokens: Optional[int] = typer.Option(None, help="longest prompt accepted (default: the model's positions)"),
    request_timeout: float = typer.Option(600.0, help="seconds from arrival; a request still running ends there"),
    reasoning: str = typer.Option("separate", help="separate: <think> text as reasoning_content (DeepSeek's API); inline"),
    batch_wait: float = typer.Option(0.02, help="seconds the engine waits for companions after a first arrival"),
    grace: float = typer.Option(10.0, help="on SIGTERM/SIGINT: seconds in-flight requests get to finish"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto", help="auto (bf16 on CUDA and bf16-capable CPUs, else fp32), bf16, fp16, fp32"),
):
    """An OpenAI-compatible server (chat/completions, SSE streaming, /metrics) decoding with a kvtier cache."""

    def go():
        import kvtier

        from .models import resolve_device, resolve_dtype
        from .serve import EngineConfig, _uvicorn
        from .serve import serve as run_server
        from .serve.app import ServeSettings

        _uvicorn()
        params = {**_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio), **_parse_params(param)}
        cap = _max_new(max_new_tokens, device)
        _check_limits(model, cap)
        if not 1 <= port <= 65535:
            raise ValueError(f"--port must be an integer in [1, 65535], got {port}")
        import socket

        try:  # before minutes of model loading: is the address free?
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as e:
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
        if grace < 0:
            raise ValueError(f"--grace must be >= 0 seconds, got {grace}")
        settings = ServeSettings(served_name=served_name or model, policy=policy, params=params, max_new_tokens=cap,
                                 max_prompt_tokens=max_prompt_tokens, request_timeout_s=request_timeout,
                                 reasoning=reasoning)
        ecfg = EngineConfig(max_batch=max_batch, max_queue=max_queue, batch_wait_s=batch_wait)
        resolve_dtype(dtype, resolve_device(device))
        m, tok = kvtier.load_model(model, device=device, dtype=dtype)
        settings.position_limit = getattr(m.config, "max_position_embeddings", None)
        shown = ", ".join(f"{k} {v}" for k, v in params.items())

        def ready(server):
            console.print(f"kvtier serve: {settings.served_name} on http://{host}:{port}/v1 · policy {policy}"
                          f"{f' ({shown})' if shown else ''} · batch {max_batch}, queue {max_queue}", highlight=False)

        run_server(m, tok, settings, ecfg, host=host, port=port, grace_s=grace, on_ready=ready)
        console.print("kvtier serve: stopped", highlight=False)

    _run(go)


@app.command("bench-serve")
def bench_serve_cmd(
    model: str = typer.Option(EMBEDDED, help=MODEL_HELP),
    url: Optional[str] = typer.Option(None, help="a running kvtier serve (default: start one with the flags below)"),
    concurrency: str = typer.Option("1,8,32", help="comma-separated numbers of clients in flight"),
    policy: str = typer.Option("full,tiered", help="comma-separated policies, each sent per request"),
    hbm_ratio: float = typer.Option(0.3, help="tiered/quant"),
    evict_ratio: float = typer.Option(0.03, help="tiered/evict/quant"),
    param: list[str] = typer.Option([], help="another parameter for every policy but full, key=value (repeatable)"),
    max_tokens: int = typer.Option(128, help="per request"),
    requests_per_client: int = typer.Option(2),
    max_batch: int = typer.Option(32, help="started server: --max-batch"),
    max_queue: int = typer.Option(64, help="started server: --max-queue"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the rows here (a .txt table beside it)"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Throughput and p50/p99 time-to-first-token / inter-token latency at several concurrencies, per policy."""

    def go():
        import os
        import signal
        import socket
        import subprocess
        import sys

        from .serve.loadgen import bench_serve

        levels = [_int_option("--concurrency", x) for x in concurrency.split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise ValueError(f"--concurrency must be comma-separated integers >= 1, got {concurrency!r}")
        for flag, v in (("--max-tokens", max_tokens), ("--requests-per-client", requests_per_client)):
            if v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v}")
        if json_out is not None:
            _check_json_out(json_out)
        pols = []
        for name in [x.strip() for x in policy.split(",") if x.strip()]:
            from .eval.runner import validate_policy

            params = {"hbm_ratio": hbm_ratio, "evict_ratio": evict_ratio} if name in ("tiered", "quant") else (
                {"evict_ratio": evict_ratio} if name == "evict" else {})
            if name != "full":
                params.update(_parse_params(param))
            validate_policy(name, params)
            pols.append({"policy": name, **params})
        proc = None
        target = url
        if target is None:
            with socket.socket() as s_:
                s_.bind(("127.0.0.1", 0))
                port = s_.getsockname()[1]
            cmd = [sys.executable, "-m", "kvtier", "serve", "--model", model, "--port", str(port), "--device", device,
                   "--dtype", dtype, "--max-batch", str(max_batch), "--max-queue", str(max_queue),
                   "--max-new-tokens", str(max_tokens)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
            target = f"http://127.0.0.1:{port}"
            import httpx

            t_end = time.monotonic() + 900
            while True:
                if proc.poll() is not None:
                    raise ValueError(f"the server exited: {proc.stdout.read()[-500:]}")
                try:
                    if httpx.get(target + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > t_end:
                    proc.kill()
                    raise ValueError("the server did not come up in 900 s")
                time.sleep(0.5)
        target = target.rstrip("/").removesuffix("/v1")
        import httpx

        health = httpx.get(target + "/health", timeout=30).json()
        try:
            t0 = time.monotonic()
            rows = bench_serve(target, levels, pols, requests_per_client, max_tokens,
                               on_level=lambda r: console.print(
                                   f"bench-serve: {r['concurrency']} clients, {r['policy']}: {r['tok_s']:.1f} tok/s, "
                                   f"TTFT p50 {r['ttft_p50_s']:.2f} s · {time.monotonic() - t0:.0f} s", highlight=False))
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
        t = Table(title=f"kvtier bench-serve: {model}, {max_tokens} tokens max per request, {requests_per_client} "
                        f"requests per client" + (f", server --max-batch {max_batch}" if url is None else ""))
        for col in ("clients", "policy", "requests", "429", "tokens", "tok/s", "vs 1 client", "vs full",
                    "TTFT p50 / p99 s", "ITL p50 / p99 ms"):
            t.add_column(col)
        f2 = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
        for r in rows:
            t.add_row(str(r["concurrency"]), r["policy"], str(r["requests"]), str(r["rejected_429"]), str(r["tokens"]),
                      f"{r['tok_s']:.1f}", f2(r["tok_s_vs_lowest_concurrency"]), f2(r["tok_s_vs_full"]),
                      f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}", f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f}")
        wide = Console(width=200, record=True)
        wide.print(t)
        if json_out is not None:
            import platform

            cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                       platform.processor()) if Path("/proc/cpuinfo").is_file() else platform.processor()
            _write_json(json_out, {"model": health.get("model", model), "device": health.get("device"), "cpu": cpu,
                                   "dtype": health.get("dtype"), "max_tokens": max_tokens, "requests_per_client": requests_per_client,
                              "max_batch": max_batch if url is None else None, "rows": rows})
            json_out.with_suffix(".txt").write_text(wide.export_text())

    _run(go)


# ---- eval / sweep / report ---------------------------------------------------------------------------
def _eval_progress_cb(progress: Progress, task):
    def cb(p):
        rate = f"{p['tokens'] / p['seconds']:.1f} tok/s" if p["seconds"] else ""
        progress.update(task, total=p["total"], completed=p["done"], rate=rate)

    return cb


def _progress_interval() -> float:
    """Seconds between plain progress lines when output is not a terminal (``KVTIER_PROGRESS_INTERVAL``)."""
    import os

    try:
        return max(0.0, float(os.environ.get("KVTIER_PROGRESS_INTERVAL", "10")))
    except ValueError:
        return 10.0


class _PlainLines:
    """Progress for logs and CI (output not a terminal): one plain line at the start, then at most one every
    ``interval`` seconds, and one at the end."""

    def __init__(self, label: str):
        self.label, self.clock, self.last, self.t0 = label, time.monotonic, None, time.monotonic()
        self.interval = _progress_interval()
        self.pending: str | None = None

    def line(self, text: str, final: bool = False) -> None:
        now = self.clock()
        if final or self.last is None or now - self.last >= self.interval:
            console.print(f"{self.label}: {text} · {now - self.t0:.0f} s", markup=False, highlight=False, soft_wrap=True)
            self.last, self.pending = now, None
        else:
            self.pending = text

    def close(self) -> None:
        if self.pending is not None:
            self.line(self.pending, final=True)


class _LazyProgress:
    """A progress bar that appears with the first report (after the run folder is locked and the model loaded),
    so a command rejected before that prints its one error line and nothing else. When output is not a
    terminal: plain lines (:class:`_PlainLines`)."""

    def __init__(self, label: str):
        self.label, self.progress, self.task = label, None, None
        self.plain = None if console.is_terminal else _PlainLines(label)

    def __call__(self, p: dict) -> None:
        if self.plain is not None:
            rate = f" · {p['tokens'] / p['seconds']:.1f} tok/s" if p["seconds"] else ""
            left = ""
            if p["seconds"] and p["done"]:
                left = f" · ~{p['seconds'] / p['done'] * (p['total'] - p['done']):.0f} s left"
            self.plain.line(f"{p['done']}/{p['total']} done{rate}{left}", final=p["done"] == p["total"] and p["total"] > 0)
            return
        if self.progress is None:
            self.progress = _progress()
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=None, rate="")
        _eval_progress_cb(self.progress, self.task)(p)

    def __enter__(self) -> "_LazyProgress":
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.plain is not None:
            self.plain.close()


class _StatusProgress:
    """Text progress (bench): a spinner on a terminal, plain lines otherwise."""

    def __init__(self, label: str):
        self.status = console.status(label) if console.is_terminal else None
        self.plain = None if console.is_terminal else _PlainLines(label)

    def __call__(self, message: str) -> None:
        if self.status is not None:
            self.status.update(message)
        else:
            self.plain.line(message)

    def __enter__(self) -> "_StatusProgress":
        if self.status is not None:
            self.status.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.status is not None:
            self.status.__exit__(*exc)
        else:
            self.plain.close()


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

        from .eval.records import check_run_dir
        from .eval.report import write_report
        from .eval.runner import EvalConfig, load_all, run_eval
        from .models import resolve_device, resolve_dtype

        if batch_size < 1:
            raise ValueError(f"--batch-size must be an integer >= 1, got {batch_size}")
        resolve_dtype(dtype, resolve_device(device))
        params = {**_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio, budget_tokens=budget_tokens), **_parse_params(param)}
        cfg = EvalConfig(model=model, benchmark=benchmark, policy=policy, params=params, limit=limit,
                         max_new_tokens=_max_new(max_new_tokens, device), temperature=temperature,
                         top_p=top_p, samples=samples, seed=seed)
        check_run_dir(out)
        _check_limits(model, cfg.max_new_tokens)
        problems = load_all([cfg], data_dir)
        with _LazyProgress(f"{benchmark} {policy}") as progress:
            run_eval([cfg], out, batch_size=batch_size, on_progress=progress,
                     loaded=lambda: kvtier.load_model(model, device=device, dtype=dtype), problems=problems)
        paths = write_report(out)
        console.print(paths["md"].read_text(), soft_wrap=True, markup=False, highlight=False)

    _run(go)


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

        from .eval.records import check_run_dir
        from .eval.report import write_report
        from .eval.runner import load_all, run_eval
        from .eval.sweep import config_parts, expand_grid, load_config_file
        from .models import resolve_device, resolve_dtype

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
            return flags[name] if _given(ctx, name) or name not in src else src[name]

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
                evict_ratios=_numbers("--evict-ratio", as_list(opt("evict_ratio", part))),
                hbm_ratios=_numbers("--hbm-ratio", as_list(opt("hbm_ratio", part))),
                quant_ratio=_numbers("--quant-ratio", [opt("quant_ratio", part)])[0],
                policy_params=part.get("policy_params"),
                compare=opt("compare", part),
                budget_tokens=[_int_option("--budget-tokens", x) for x in as_list(opt("budget_tokens", part))],
                skipped=skipped,
                limit=opt("limit", part),
                max_new_tokens=_max_new(opt("max_new_tokens", part), dev),
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
        _check_limits(cfgs[0].model, max(c.max_new_tokens for c in cfgs))
        problems = load_all(cfgs, opt("data_dir"))
        if skipped:
            console.print(f"note: skipped {len(skipped)} grid point(s) whose ratios sum over 1: {', '.join(skipped)}",
                          soft_wrap=True)
        console.print(f"{len(cfgs)} configurations")
        with _LazyProgress("sweep") as progress:
            if ray is not None:
                from .eval.ray_sweep import run_eval_ray

                run_eval_ray(cfgs, out, address=ray, workers=ray_workers, gpus_per_task=gpus_per_task, shards=shards,
                             batch_size=bs, device=dev, dtype=dt, data_dir=opt("data_dir"), max_retries=max_retries,
                             on_progress=progress)
            else:
                run_eval(cfgs, out, batch_size=bs, on_progress=progress,
                         loaded=lambda: kvtier.load_model(cfgs[0].model, device=dev, dtype=dt), problems=problems)
        paths = write_report(out)
        console.print(paths["md"].read_text(), soft_wrap=True, markup=False, highlight=False)

    _run(go)


@app.command()
def report(run_dir: Path = typer.Argument(..., help="a directory written by eval or sweep"),
           out: Optional[Path] = typer.Option(None, help="where to write (default: run_dir)"),
           html: bool = typer.Option(False, "--html", help="also write report.html: table, plots, completions by tier"),
           html_problems: int = typer.Option(40, help="--html: problems shown side by side (per benchmark)"),
           claims: bool = typer.Option(False, "--claims", help="also write claims.md/.json: the seed paper's claims "
                                       "beside this run's numbers, with a verdict each (the paper_cpu.json campaign)")):
    """Markdown/CSV/JSON summary with Wilson intervals and paired tests, PNG plots (``--html``: one page)."""

    def go():
        from .eval.report import write_report

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

    _run(go)


# ---- demo --------------------------------------------------------------------------------------------
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

        from .eval.datasets import check_benchmark
        from .eval.demo import DEMO_BENCHMARK, run_demo
        from .eval.records import check_run_dir
        from .models import resolve_device, resolve_dtype

        for flag, v in (("--problems", problems), ("--max-new-tokens", max_new_tokens), ("--batch-size", batch_size)):
            if v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v}")
        bench = benchmark or DEMO_BENCHMARK
        check_benchmark(bench)
        resolve_dtype(dtype, resolve_device(device))
        check_run_dir(out)
        _check_limits(model, max_new_tokens)
        t0 = time.monotonic()
        with _LazyProgress("demo") as progress:
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
        from .eval.report import write_report

        paths = write_report(out, html=True, html_problems=problems)
        console.print(f"records: {out / 'records.jsonl'} (rerun to resume) · {time.monotonic() - t0:.0f} s")
        console.print(f"report: {paths['html']}  (every completion colored by where its tokens lived)")

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
    warmup_steps: Optional[int] = typer.Option(None, help="untimed decode steps before timing (default retier_interval + 8)"),
    warm_repeat: bool = typer.Option(True, help="run every configuration once untimed before the timed repeats"),
    interleave: bool = typer.Option(False, help="hold every configuration's cache at once and time one step of each in "
                                                "turn (robust on a shared machine; the caches must fit together)"),
    stock: bool = typer.Option(True, help="also time stock transformers (SDPA + DynamicCache and StaticCache)"),
    t1_on_device: bool = typer.Option(False, "--t1-on-device", help="also time tiered with a device copy of T1 (HBM for PCIe)"),
    attention: str = typer.Option("split", help="comma-separated attention modes to time: split, ordered"),
    t1_attention: str = typer.Option("auto", help="comma-separated T1 modes to time in split mode: stream, host, auto"),
    kernel: str = typer.Option("auto", help="comma-separated split-step implementations to time: auto, fused, eager"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Decode throughput, transfer share and memory per policy, as ratios measured in one run."""

    def go():
        from .models import resolve_device
        from .tools.bench import BenchConfig, run_bench

        gpu = resolve_device(device).type == "cuda"
        if json_out is not None:
            _check_json_out(json_out)
        cfg = BenchConfig(
            model=model or ("random:qwen2-7b" if gpu else EMBEDDED),
            context=(4096 if gpu else 512) if context is None else context,
            new_tokens=(256 if gpu else 64) if new_tokens is None else new_tokens,
            batches=tuple(_int_option("--batch", x) for x in (batch or ("1,8" if gpu else "1,4")).split(",") if x.strip()),
            policies=tuple(p.strip() for p in policy.split(",") if p.strip()),
            hbm_ratios=tuple(_numbers("--hbm-ratio", [x for x in hbm_ratio.split(",") if x.strip()])),
            evict_ratios=tuple(_numbers("--evict-ratio", [x for x in evict_ratio.split(",") if x.strip()])),
            retier_interval=retier_interval, recent_window=recent_window, repeats=repeats, stock=stock,
            warmup_steps=warmup_steps, warm_repeat=warm_repeat, interleave=interleave,
            t1_on_device=t1_on_device, device=device, dtype=dtype,
            attentions=tuple(x.strip() for x in attention.split(",") if x.strip()),
            t1_attentions=tuple(x.strip() for x in t1_attention.split(",") if x.strip()),
            kernels=tuple(x.strip() for x in kernel.split(",") if x.strip()),
        )
        from .models import peek_position_limit, resolve_dtype

        resolve_dtype(dtype, resolve_device(device))
        total = cfg.context + cfg.warmup + cfg.new_tokens
        lim = peek_position_limit(cfg.model)
        if lim is not None and total > lim:
            raise ValueError(f"--context + --warmup-steps + --new-tokens = {total} does not fit {cfg.model}'s {lim} positions")
        save = (lambda partial: _write_json(json_out, partial)) if json_out else None
        with _StatusProgress("bench") as progress:
            res = run_bench(cfg, on_progress=progress, on_rows=save)
        print_bench(res)
        if json_out:
            _write_json(json_out, res)
            console.print(f"wrote {json_out}")

    _run(go)


def _check_json_out(path: Path) -> None:
    """--json must name a file we can write, checked before minutes of benchmarking."""
    if path.is_dir() or str(path).endswith(("/", "\\")):
        raise ValueError(f"--json {path} is a directory; give a file name, e.g. {path / 'bench.json'}")
    from .eval.records import check_parents

    check_parents(path, "--json")


def _write_json(path: Path, obj: dict) -> None:
    """Written aside and renamed: an interrupted write never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    tmp.replace(path)


def print_bench(res: dict) -> None:
    on_cpu = str(res["device"]).startswith("cpu")
    # On a CPU the "peak" is a DRAM-to-DRAM memcpy of 256 MiB, while a streamed block is copied just before it is
    # read and its destination stays in cache: more than 100% there is not an error, and not PCIe.
    t = Table(title=f"kvtier bench: {res['config']['model']} on {res['device']}, context {res['config']['context']}, "
                    f"{res['config']['new_tokens']} steps, memcpy peak {res['memcpy_peak_gbps']:.1f} GB/s",
              caption="CPU: copy GB/s is T1/T2 streamed into cache-resident staging, compared with a DRAM-to-DRAM "
                      "memcpy; over 100% means the copies hit cache" if on_cpu else None)
    for col in ("batch", "policy", "params", "tok/s", "ms/step", "median ms/step", "vs full (median)", "vs stock (median)",
                "xfer share", "copy GB/s (% memcpy)" if on_cpu else "H2D GB/s (% peak)",
                "H2D MiB/step", "peak dev MiB", "KV MiB T0/T1/T2"):
        t.add_column(col)
    mib = 2**20
    for r in res["results"]:
        p = ", ".join(f"{k.replace('_ratio', '')}={v}" for k, v in r["params"].items() if k.endswith("ratio"))
        p += ", T1 on device" if r["params"].get("t1_on_device") else ""
        if "attention" in r["params"]:
            p += f", {r['params']['attention']}"
            if r["params"]["attention"] == "split" and "t1_attention" in r["params"]:
                mode = r["params"]["t1_attention"]
                p += f"/{mode}" + (f"->{r['t1_mode']}" if mode == "auto" and r.get("t1_mode") else "")
            if "kernel" in r["params"]:
                p += f", {r['params']['kernel']}" + (f"->{r['kernel']}" if r.get("kernel") and
                                                     r["params"]["kernel"] == "auto" else "")
        gb = f"{r['h2d_gbps']:.1f} ({100 * r['h2d_fraction_of_peak']:.0f}%)" if r.get("h2d_gbps") else "–"
        kv = r["kv_bytes"]
        t.add_row(str(r["batch"]), r["policy"], p, f"{r['decode_tok_s']:.1f}", f"{r['ms_per_step']:.1f}",
                  f"{r['ms_per_step_median']:.1f}",
                  f"{r['ratio_to_full']:.3f} ({r['median_ratio_to_full']:.3f})",
                  f"{r['ratio_to_stock']:.3f} ({r['median_ratio_to_stock']:.3f})" if r.get("ratio_to_stock") else "–",
                  f"{100 * r['transfer_share']:.1f}%" if "transfer_share" in r else "–", gb,
                  f"{r['h2d_bytes_per_step'] / mib:.2f}" if "h2d_bytes_per_step" in r else "–",
                  f"{r['peak_device_bytes'] / mib:.0f}" if r.get("peak_device_bytes") else "–",
                  f"{kv['T0'] / mib:.1f}/{kv['T1'] / mib:.1f}/{kv['T2'] / mib:.1f}")
    # A wide table: keep it whole when the output goes to a file or a log rather than a terminal. A fixed 220
    # columns still wrapped the params cell whenever the number columns came out wide; rich prints a table at
    # its natural width, so a console far wider than any row never wraps and pads nothing.
    (console if console.is_terminal else Console(width=1000)).print(t)


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
    hardware: str = typer.Option("h200", help="bandwidth profile: h200, h100, a100, l40s, rtx5080, cpu"),
    pcie_gbps: Optional[float] = typer.Option(None, help="host->device GB/s (overrides the profile)"),
    hbm_gbps: Optional[float] = typer.Option(None, help="device memory GB/s (overrides the profile)"),
    host_gbps: Optional[float] = typer.Option(None, help="host attention GB/s over T1 (overrides the profile)"),
    json_out: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
):
    """KV bytes per tier, device memory saved, and decode-step floors per T1 mode (stream / host / both)."""

    def go():
        from .tools.memplan import plan as make_plan

        p = make_plan(model, batch, seq_len, hbm_ratio, evict_ratio, quant_ratio, dtype, pcie_gbps, hbm_gbps,
                      protected_tokens, hardware=hardware, host_gbps=host_gbps)
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
        f, hw = p["step_floor_ms"], p["hardware"]
        console.print(f"full KV on device: {p['full_kv_bytes_per_batch'] / g:.2f} GB; tiered device KV: {p['device_kv_bytes'] / g:.2f} GB "
                      f"(saves {p['device_bytes_saved'] / g:.2f} GB); weights {p['weights_bytes'] / g:.2f} GB; host T1+T2 "
                      f"{p['host_bytes'] / g:.2f} GB")
        console.print(f"{hw['name']}: HBM {hw['hbm_gbps']:g} GB/s, PCIe {hw['pcie_gbps']:g} GB/s, host attention "
                      f"{hw['host_gbps']:g} GB/s")
        m = Table(title="decode-step floor per T1 mode")
        for col in ("mode", "floor ms", "vs full cache", "smallest hbm_ratio within 5%"):
            m.add_column(col)
        m.add_row("full cache", f"{f['full_cache']:.2f}", "1.00x", "-")
        small = p["smallest_hbm_ratio_within_5pct"]
        for mode in ("stream", "host", "both"):
            star = " (best)" if mode == p["best_mode"] else ""
            m.add_row(mode + star, f"{f[mode]:.2f}", f"{p['throughput_ratio_floor_by_mode'][mode]:.2f}x",
                      "none" if small[mode] is None else f"{small[mode]:g}")
        console.print(m)

    _run(go)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
