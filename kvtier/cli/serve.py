"""``kvtier serve`` (the OpenAI-compatible server) and ``kvtier bench-serve`` (load against one)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from .common import (EMBEDDED, MODEL_HELP, app, check_json_out, check_limits, console, given_policy_params, int_option,
                     parse_params, run_command, write_json)


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
    max_batch: int = typer.Option(8, help="rows decoded together (continuous: running rows; static: one batch)"),
    max_queue: int = typer.Option(64, help="requests that may wait for a batch; beyond it, 429 with Retry-After"),
    scheduler: str = typer.Option("continuous", help="continuous: requests join the running batch, their "
                                                     "prompts prefilled in chunks beside it; static: batches "
                                                     "through generate (as before)"),
    device_kv_budget: Optional[str] = typer.Option(None, help="device K/V bytes for all rows, e.g. 512MiB or 2GiB "
                                                              "(default: CUDA 0.9 of free memory, CPU no limit)"),
    device_kv_fraction: float = typer.Option(0.9, help="on CUDA without --device-kv-budget: share of free memory"),
    host_kv_budget: Optional[str] = typer.Option(None, help="host K/V bytes (T1/T2) for all rows (default: half "
                                                            "the RAM free at start)"),
    on_pressure: str = typer.Option("demote", help="when the budget is full: demote (device tokens to host "
                                                   "memory, exact), queue (admit at peak only), recompute (preempt)"),
    max_batched_tokens: Optional[int] = typer.Option(None, help="continuous: tokens one step carries, the running "
                                                                "rows' one each first, then prompt chunks (a longer "
                                                                "prompt is prefilled over several steps; default "
                                                                "2048, vLLM's; printed at startup)"),
    prefill_tokens: Optional[int] = typer.Option(None, hidden=True, help="replaced by --max-batched-tokens"),
    prefix_cache: bool = typer.Option(True, help="continuous: reuse the K/V of prompts' whole blocks across "
                                                 "requests of one API key (and cache_salt); a hit prefills only "
                                                 "the rest of its prompt"),
    prefix_cache_host_bytes: str = typer.Option("1GiB", help="host memory the prefix cache may hold; least "
                                                             "recently used blocks are dropped beyond it"),
    prefix_block_tokens: int = typer.Option(16, help="tokens per prefix-cache block (a prompt is reused in whole "
                                                     "blocks)"),
    direct_step: bool = typer.Option(True, help="continuous: step Llama/Qwen2/Qwen3/Mistral models through "
                                                "kvtier.step.direct (the model's ops without transformers' module "
                                                "plumbing, checked bit for bit at start); off: the model's forward"),
    max_new_tokens: Optional[int] = typer.Option(None, help="cap on a request's max_tokens (default: none beyond "
                                                            "the model's positions less the prompt, which is also "
                                                            "the default max_tokens)"),
    max_prompt_tokens: Optional[int] = typer.Option(None, help="longest prompt accepted (default: the model's positions)"),
    request_timeout: float = typer.Option(600.0, help="seconds from arrival; a request still running ends there"),
    reasoning: str = typer.Option("separate", help="separate: <think> text as reasoning_content (DeepSeek's API); inline"),
    batch_wait: float = typer.Option(0.02, help="seconds the engine waits for companions after a first arrival"),
    grace: float = typer.Option(10.0, help="on SIGTERM/SIGINT: seconds in-flight requests get to finish"),
    api_key: list[str] = typer.Option([], envvar="KVTIER_API_KEY", show_envvar=False,
                                      help="a key /v1/* requires as 'Authorization: Bearer KEY' (repeatable; or "
                                           "KVTIER_API_KEY, several comma-separated); none: no authentication"),
    protect_metrics: bool = typer.Option(False, help="/metrics needs a key too (/health stays open)"),
    max_body_bytes: int = typer.Option(1 << 20, help="larger request bodies get 413, unread"),
    max_stream_buffer: int = typer.Option(1024, help="deltas a streaming client may leave unread; beyond, its "
                                                     "request is cancelled"),
    generation_config: str = typer.Option("auto", help="sampling defaults for requests that leave fields out: auto "
                                                       "(the model's generation_config, as vLLM's), or openai "
                                                       "(temperature 1, top_p 1, ...)"),
    default_temperature: Optional[float] = typer.Option(None, help="overrides the defaults above"),
    default_top_p: Optional[float] = typer.Option(None, help="overrides the defaults above"),
    default_top_k: Optional[int] = typer.Option(None, help="overrides the defaults above (0: off)"),
    default_min_p: Optional[float] = typer.Option(None, help="overrides the defaults above"),
    default_repetition_penalty: Optional[float] = typer.Option(None, help="overrides the defaults above"),
    logprobs_mode: str = typer.Option("raw_logprobs", help="what a request's logprobs are of: raw_logprobs (the "
                                                            "model's logits, vLLM's default) or processed_logprobs "
                                                            "(the logits each token was drawn from: penalties, "
                                                            "temperature, top_k/top_p/min_p)"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto", help="auto (bf16 on CUDA and bf16-capable CPUs, else fp32), bf16, fp16, fp32"),
):
    """An OpenAI-compatible server (chat/completions, SSE streaming, /metrics) decoding with a kvtier cache."""

    def go():
        import kvtier

        from ..models import resolve_device, resolve_dtype
        from ..serve import EngineConfig, _uvicorn
        from ..serve import serve as run_server
        from ..serve.app import ServeSettings

        _uvicorn()
        params = {**given_policy_params(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio, quant_ratio=quant_ratio,
                                   budget_ratio=budget_ratio), **parse_params(param)}
        cap = max_new_tokens
        if cap is not None:
            check_limits(model, cap)
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
        keys = tuple(k.strip() for x in api_key for k in x.split(",") if k.strip())
        if api_key and not keys:
            raise ValueError("--api-key must be a non-empty printable string without spaces")
        settings = ServeSettings(served_name=served_name or model, policy=policy, params=params, max_new_tokens=cap,
                                 max_prompt_tokens=max_prompt_tokens, request_timeout_s=request_timeout,
                                 reasoning=reasoning, api_keys=keys, protect_metrics=protect_metrics,
                                 max_body_bytes=max_body_bytes, max_stream_buffer=max_stream_buffer)
        from ..config import parse_bytes
        from ..step import fused_mlp_count, fused_norm_count, linear_mode, packed_count
        from ..step.linear import amx_count

        ecfg = EngineConfig(max_batch=max_batch, max_queue=max_queue, batch_wait_s=batch_wait, scheduler=scheduler,
                            device_kv_budget=None if device_kv_budget is None
                            else parse_bytes("--device-kv-budget", device_kv_budget),
                            device_kv_fraction=device_kv_fraction, on_pressure=on_pressure,
                            host_kv_budget=None if host_kv_budget is None else parse_bytes("--host-kv-budget", host_kv_budget),
                            max_batched_tokens=max_batched_tokens, prefill_tokens=prefill_tokens,
                            linear=linear_mode(), direct_step=direct_step, logprobs_mode=logprobs_mode,
                            prefix_cache=prefix_cache,
                            prefix_cache_host_bytes=parse_bytes("--prefix-cache-host-bytes", prefix_cache_host_bytes),
                            prefix_block_tokens=prefix_block_tokens)
        if generation_config not in ("auto", "openai"):
            raise ValueError(f"--generation-config must be auto or openai, got {generation_config!r}")
        given = {k: v for k, v in (("temperature", default_temperature), ("top_p", default_top_p),
                                   ("top_k", default_top_k), ("min_p", default_min_p),
                                   ("repetition_penalty", default_repetition_penalty)) if v is not None}
        from ..sampling import OPENAI_DEFAULTS, SamplingParams, model_defaults

        try:
            SamplingParams(**{**OPENAI_DEFAULTS, **given})
        except ValueError as e:
            raise ValueError(f"--default-{str(e).replace('_', '-')}") from None
        resolve_dtype(dtype, resolve_device(device))
        m, tok = kvtier.load_model(model, device=device, dtype=dtype, linear="eager")  # the engine's thread packs
        settings.position_limit = getattr(m.config, "max_position_embeddings", None)
        from_model = model_defaults(m.generation_config) if generation_config == "auto" else {}
        settings.sampling_defaults = {**from_model, **given}
        settings.sampling_source = " + ".join(
            x for x in ("the model's generation_config" if from_model else "", "--default-*" if given else "") if x
        ) or "OpenAI's defaults"
        settings.__post_init__()
        shown = ", ".join(f"{k} {v}" for k, v in params.items())

        def ready(server):
            eng = server.config.app.state.server.engine
            packed, norms, mlps = packed_count(m), fused_norm_count(m), fused_mlp_count(m)
            amx = amx_count(m)
            step = f" · {m.dtype}, {packed} linears prepacked" if packed else f" · {m.dtype}, stock linears"
            step += f" ({amx} on AMX tiles)" if amx else ""
            step += f", {norms} norms fused" if norms else ", stock norms"
            step += f", {mlps} MLPs fused" if mlps else ""
            console.print(f"kvtier serve: {settings.served_name} on http://{host}:{port}/v1 · policy {policy}"
                          f"{f' ({shown})' if shown else ''} · {eng.describe()}, queue {max_queue}{step}"
                          + f" · sampling defaults: {_sampling_line(settings)}"
                          + (f" · {len(keys)} API key(s)" if keys else " · no API key"), highlight=False)

        run_server(m, tok, settings, ecfg, host=host, port=port, grace_s=grace, on_ready=ready)
        console.print("kvtier serve: stopped", highlight=False)

    run_command(go)


def _sampling_line(settings) -> str:
    """The startup line's account of what a request without sampling fields gets, and from where."""
    from ..sampling import OPENAI_DEFAULTS

    d = {**OPENAI_DEFAULTS, **settings.sampling_defaults}
    shown = ", ".join(f"{k} {d[k]}" for k in ("temperature", "top_p") + tuple(
        k for k in ("top_k", "min_p", "repetition_penalty") if d[k] != OPENAI_DEFAULTS[k]))
    return f"{shown} ({settings.sampling_source})"


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
    device_kv_budget: Optional[str] = typer.Option(None, help="started server: --device-kv-budget (a memory-pressure "
                                                              "point: bytes, or 512MiB / 2GiB)"),
    on_pressure: Optional[str] = typer.Option(None, help="started server: --on-pressure (demote, recompute, queue)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the rows here (a .txt table beside it)"),
    api_key: Optional[str] = typer.Option(None, envvar="KVTIER_API_KEY", show_envvar=False,
                                          help="sent as 'Authorization: Bearer KEY' (a --url server that wants one)"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Throughput and p50/p99 time-to-first-token / inter-token latency at several concurrencies, per policy."""

    def go():
        import os
        import signal
        import subprocess
        import sys

        from ..serve.loadgen import bench_serve, free_port, server_counters, wait_until_up

        levels = [int_option("--concurrency", x) for x in concurrency.split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise ValueError(f"--concurrency must be comma-separated integers >= 1, got {concurrency!r}")
        for flag, v in (("--max-tokens", max_tokens), ("--requests-per-client", requests_per_client)):
            if v < 1:
                raise ValueError(f"{flag} must be an integer >= 1, got {v}")
        if json_out is not None:
            check_json_out(json_out)
        pols = []
        for name in [x.strip() for x in policy.split(",") if x.strip()]:
            from ..policies import get_policy, validate_policy

            # the shared ratios each policy takes; --param only where the policy has parameters to set
            cls = get_policy(name)
            params = cls.accepted(hbm_ratio=hbm_ratio, evict_ratio=evict_ratio)
            if cls.family != "reference":
                params.update(parse_params(param))
            validate_policy(name, params)
            pols.append({"policy": name, **params})
        proc = None
        target = url
        if target is None:
            port = free_port()
            cmd = [sys.executable, "-m", "kvtier", "serve", "--model", model, "--port", str(port), "--device", device,
                   "--dtype", dtype, "--max-batch", str(max_batch), "--max-queue", str(max_queue),
                   "--max-new-tokens", str(max_tokens)]
            for flag, v in (("--device-kv-budget", device_kv_budget), ("--on-pressure", on_pressure)):
                if v is not None:
                    cmd += [flag, v]  # the server checks them and names what is allowed
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
            target = f"http://127.0.0.1:{port}"

            wait_until_up(target, proc, 900)
        target = target.rstrip("/").removesuffix("/v1")
        import httpx

        health = httpx.get(target + "/health", timeout=30).json()
        try:
            t0 = time.monotonic()
            rows = bench_serve(target, levels, pols, requests_per_client, max_tokens, api_key=api_key,
                               on_level=lambda r: console.print(
                                   f"bench-serve: {r['concurrency']} clients, {r['policy']}: {r['tok_s']:.1f} tok/s, "
                                   f"TTFT p50 {r['ttft_p50_s']:.2f} s · {time.monotonic() - t0:.0f} s", highlight=False))
            server_metrics = server_counters(target, api_key)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
        t = Table(title=f"kvtier bench-serve: {model}, {max_tokens} tokens max per request, {requests_per_client} "
                        f"requests per client" + (f", server --max-batch {max_batch}" if url is None else ""))
        for col in ("clients", "policy", "requests", "429", "failed", "tokens", "tok/s", "vs 1 client", "vs full",
                    "TTFT p50 / p99 s", "ITL p50 / p99 ms"):
            t.add_column(col)
        f2 = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
        for r in rows:
            t.add_row(str(r["concurrency"]), r["policy"], str(r["requests"]), str(r["rejected_429"]), str(r["failed"]),
                      str(r["tokens"]),
                      f"{r['tok_s']:.1f}", f2(r["tok_s_vs_lowest_concurrency"]), f2(r["tok_s_vs_full"]),
                      f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}", f"{r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f}")
        wide = Console(width=200, record=True)
        wide.print(t)
        for r in rows:
            if r["failed"]:
                wide.print(f"{r['concurrency']} clients, {r['policy']}: {r['failed']} request(s) failed, the first: "
                           f"{r['first_error']}", highlight=False)
        if json_out is not None:
            from ..kernels.cpu import cpu_isa, cpu_name

            cpu = f"{cpu_name()} ({cpu_isa()})"
            write_json(json_out, {"model": health.get("model", model), "device": health.get("device"), "cpu": cpu,
                                   "dtype": health.get("dtype"), "max_tokens": max_tokens, "requests_per_client": requests_per_client,
                              "max_batch": max_batch if url is None else None,
                              "device_kv_budget": device_kv_budget, "on_pressure": on_pressure, "rows": rows,
                              "server_metrics": server_metrics})
            json_out.with_suffix(".txt").write_text(wide.export_text())

    run_command(go)
