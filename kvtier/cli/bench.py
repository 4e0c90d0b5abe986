"""``kvtier bench``: decode throughput, transfer share and memory per policy, and its table."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from .common import (EMBEDDED, MODEL_HELP, app, check_json_out, console, int_option, parse_numbers, run_command,
                     write_json)
from .progress import StatusProgress


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
    linear: Optional[str] = typer.Option(None, help="comma-separated ways to run the model's step, one model load "
                                                    "each: auto, packed (oneDNN-prepacked projections; both fuse the "
                                                    "RMSNorms), eager (stock F.linear and norms); default: kvtier "
                                                    "--linear, else auto"),
    direct: bool = typer.Option(True, help="kvtier caches decode through kvtier's direct step (Llama/Qwen2/Qwen3/"
                                           "Mistral: the model's ops from one loop, checked bit for bit at load; "
                                           "not with --linear eager); --no-direct: the model's forward"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
):
    """Decode throughput, transfer share and memory per policy, as ratios measured in one run."""

    def go():
        from ..models import resolve_device
        from ..step import linear_mode
        from ..tools.bench import BenchConfig, run_bench

        gpu = resolve_device(device).type == "cuda"
        if json_out is not None:
            check_json_out(json_out)
        cfg = BenchConfig(
            model=model or ("random:qwen2-7b" if gpu else EMBEDDED),
            context=(4096 if gpu else 512) if context is None else context,
            new_tokens=(256 if gpu else 64) if new_tokens is None else new_tokens,
            batches=tuple(int_option("--batch", x) for x in (batch or ("1,8" if gpu else "1,4")).split(",") if x.strip()),
            policies=tuple(p.strip() for p in policy.split(",") if p.strip()),
            hbm_ratios=tuple(parse_numbers("--hbm-ratio", [x for x in hbm_ratio.split(",") if x.strip()])),
            evict_ratios=tuple(parse_numbers("--evict-ratio", [x for x in evict_ratio.split(",") if x.strip()])),
            retier_interval=retier_interval, recent_window=recent_window, repeats=repeats, stock=stock,
            warmup_steps=warmup_steps, warm_repeat=warm_repeat, interleave=interleave,
            t1_on_device=t1_on_device, device=device, dtype=dtype,
            attentions=tuple(x.strip() for x in attention.split(",") if x.strip()),
            t1_attentions=tuple(x.strip() for x in t1_attention.split(",") if x.strip()),
            kernels=tuple(x.strip() for x in kernel.split(",") if x.strip()),
            linears=tuple(x.strip() for x in linear.split(",") if x.strip()) if linear else (linear_mode(),),
            direct=direct,
        )
        from ..models import peek_position_limit, resolve_dtype

        resolve_dtype(dtype, resolve_device(device))
        total = cfg.context + cfg.warmup + cfg.new_tokens
        lim = peek_position_limit(cfg.model)
        if lim is not None and total > lim:
            raise ValueError(f"--context + --warmup-steps + --new-tokens = {total} does not fit {cfg.model}'s {lim} positions")
        save = (lambda partial: write_json(json_out, partial)) if json_out else None
        with StatusProgress("bench") as progress:
            res = run_bench(cfg, on_progress=progress, on_rows=save)
        print_bench(res)
        if json_out:
            write_json(json_out, res)
            console.print(f"wrote {json_out}")

    run_command(go)


def print_bench(res: dict) -> None:
    on_cpu = str(res["device"]).startswith("cpu")
    # On a CPU the "peak" is a DRAM-to-DRAM memcpy of 256 MiB, while a streamed block is copied just before it is
    # read and its destination stays in cache: more than 100% there is not an error, and not PCIe.
    t = Table(title=f"kvtier bench: {res['config']['model']} on {res['device']}, context {res['config']['context']}, "
                    f"{res['config']['new_tokens']} steps, memcpy peak {res['memcpy_peak_gbps']:.1f} GB/s"
                    + (f", floor: {res['step_weight_bytes'] / 1e6:.0f} MB of weights at {res['read_peak_gbps']:.1f} "
                       f"GB/s read, GEMM {res['gemm_peak_gflops']:.0f} GFLOP/s" if res.get("read_peak_gbps") else ""),
              caption="CPU: copy GB/s is T1/T2 streamed into cache-resident staging, compared with a DRAM-to-DRAM "
                      "memcpy; over 100% means the copies hit cache" if on_cpu else None)
    linears = len({r.get("linear") for r in res["results"]}) > 1
    for col in ("batch", *(("linear",) if linears else ()), "policy", "params", "tok/s", "ms/step", "median ms/step",
                "floor ms (x)", "vs full (median)", "vs stock (median)",
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
        floor = f"{r['floor_ms']:.1f} ({r['vs_floor']:.2f}x)" if r.get("vs_floor") else "–"
        policy = r["policy"] + (" (direct)" if r.get("step") == "direct" else "")
        t.add_row(str(r["batch"]), *((f"{r['linear']} ({r['packed_linears']})",) if linears else ()), policy, p,
                  f"{r['decode_tok_s']:.1f}", f"{r['ms_per_step']:.1f}", f"{r['ms_per_step_median']:.1f}", floor,
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
