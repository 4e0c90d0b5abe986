"""How fast this CPU runs the decode step's matmuls: each linear of a model's layer at 1, 8 and 32 rows, through
torch's default path (F.linear: MKL sgemm or oneDNN) and through a oneDNN-prepacked weight (torch.utils.mkldnn),
as weight GB/s and GFLOP/s.

    python benchmarks/decode/linear_probe.py --model random:qwen2.5-0.5b --rows 1,8,32 --dtype fp32 --out DIR

The shapes are one decoder layer's (q, k, v, o, gate, up, down) and the lm head; every variant is timed in turn per
repetition (a variant run right after another over the same data would find it in cache), medians of `--reps`.
The floor a decode step cannot beat at small batch is its weights read once from DRAM: compare the GB/s with the
memcpy peak printed first. Writes `linear_probe.json` and `linear_probe.md` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from kvtier.models import preset_config
from kvtier.step.linear import PACK_ROWS_HINT, _pack, _run_packed, packable
from kvtier.transfer import memcpy_peak_gbps

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of one layer's linears and the lm head, from a random:<preset>'s config."""
    c = preset_config(model.removeprefix("random:"))
    d, hd = c.hidden_size, c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * hd
    return {"q": (d, d), "k": (kv, d), "v": (kv, d), "o": (d, d), "gate": (c.intermediate_size, d),
            "up": (c.intermediate_size, d), "down": (d, c.intermediate_size), "lm_head": (c.vocab_size, d)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--kvtier", action="store_true", help="also kvtier.step's packed weight (row hint 32) and one "
                    "packed for the row count measured")
    ap.add_argument("--only", default="", help="comma-separated linears to measure (default: all)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    dt = DTYPES[a.dtype]
    peak = memcpy_peak_gbps(torch.device("cpu"))
    torch.manual_seed(0)
    rows_out = []
    from torch.utils import mkldnn as mu

    for name, (n_out, n_in) in shapes(a.model).items():
        if a.only and name not in a.only.split(","):
            continue
        lin = torch.nn.Linear(n_in, n_out, bias=False).to(dt)
        try:
            packed = mu.to_mkldnn(lin, dt) if dt == torch.bfloat16 else mu.to_mkldnn(lin)
        except Exception:  # noqa: BLE001 - a probe: report what is not available
            packed = None
        for m in [int(x) for x in a.rows.split(",")]:
            x = torch.randn(m, n_in).to(dt)
            fns = {"F.linear": lambda: F.linear(x, lin.weight)}
            if packed is not None:
                fns["oneDNN prepacked"] = lambda: packed(x)
            if a.kvtier and packable(dt):
                w32 = _pack(lin.weight.detach())  # kvtier.step's packing (row hint 32)
                fns["kvtier packed (hint 32)"] = lambda: _run_packed(x, w32, None)
                if m != PACK_ROWS_HINT:
                    wm = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach().contiguous(), m)
                    fns[f"kvtier packed (hint {m})"] = lambda: _run_packed(x, wm, None)
            times: dict[str, list[float]] = {k: [] for k in fns}
            with torch.no_grad():
                for f in fns.values():
                    f()
                for r in range(a.reps):
                    order = list(fns)[r % len(fns):] + list(fns)[: r % len(fns)]
                    for k in order:
                        t = time.perf_counter()
                        fns[k]()
                        times[k].append(time.perf_counter() - t)
            wbytes = n_out * n_in * lin.weight.element_size()
            flops = 2 * m * n_out * n_in
            for k, ts in times.items():
                med = statistics.median(ts)
                rows_out.append({"linear": name, "shape": [n_out, n_in], "rows": m, "path": k, "ms": 1e3 * med,
                                 "weight_gbps": wbytes / med / 1e9, "gflops": flops / med / 1e9})
                print(json.dumps(rows_out[-1]), flush=True)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "dtype": a.dtype, "model": a.model, "memcpy_peak_gbps": peak,
            "config": torch.__config__.show().splitlines()[2:6],
            "command": f"python benchmarks/decode/linear_probe.py --model {a.model} --rows {a.rows} --dtype {a.dtype} "
                       f"--reps {a.reps}" + (" --kvtier" if a.kvtier else "") + (f" --only {a.only}" if a.only else "")
                       + f" --out {a.out}"}
    (a.out / "linear_probe.json").write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1))
    lines = [f"# Linear probe: {a.model} shapes, {a.dtype}", "", f"{meta['date']} · torch {meta['torch']} · "
             f"{meta['threads']} threads · memcpy peak {peak:.1f} GB/s", "", f"`{meta['command']}`", "",
             "| linear | shape | rows | path | ms | weight GB/s | GFLOP/s |", "|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['linear']} | {r['shape'][0]}×{r['shape'][1]} | {r['rows']} | {r['path']} | {r['ms']:.3f} | "
                     f"{r['weight_gbps']:.1f} | {r['gflops']:.1f} |")
    (a.out / "linear_probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
