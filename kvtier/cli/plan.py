"""``kvtier plan``: the device-memory plan of a model, context and batch, without loading the model."""

from __future__ import annotations

import json
from typing import Optional

import typer
import typer.core
from rich.table import Table

from .common import app, console, run_command


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
        from ..tools.memplan import plan as make_plan

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
        lay = p["layers"]
        if lay["sliding"]:
            console.print(f"{lay['sliding']} of {lay['sliding'] + lay['full']} layers slide over {lay['window']} tokens: "
                          f"their K/V ({p['sliding_kv_bytes_per_batch'] / g:.3f} GB, "
                          f"{100 * p['sliding_share_of_kv']:.2f}% of the KV) stay on the device; the tiers split the "
                          f"{lay['full']} full-attention layers' K/V")
        if p["weights_read_per_step_bytes"] != p["weights_bytes"]:
            console.print(f"mixture of experts: a step at batch {batch} reads "
                          f"{p['weights_read_per_step_bytes'] / g:.2f} GB of the {p['weights_bytes'] / g:.2f} GB of "
                          "weights (the experts its rows route to, uniform routing)")
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

    run_command(go)
