"""The GPU check: one short run on one lent GPU (an H200), its results written in the order of their importance.

    python benchmarks/gpu_check.py --dry-run          # any machine: the steps, their commands and time budgets
    OUT=/some/dir python benchmarks/gpu_check.py      # on the GPU (benchmarks/gpu_check.sh calls this)

Steps, most important first, each in its own process under its own time limit, each writing under ``$OUT`` as it
finishes (JSON + text; ``summary.json`` after every step), so a run cut short still returns the first results:

1. ``env``            the device, torch / transformers versions, CPU, memory;
2. ``cuda_tests``     the CUDA tests (tiered == full bit for bit on the GPU; T1 streamed vs attended on the host; row
                      splits) and the simulated-device tests run against the device's torch;
3. ``decode_4k``      ``kvtier bench`` on random-weight Qwen2-7B shapes, bf16, batch 8, context 4096: ``full`` and
                      tiered (hbm 0.5, evict 0.03) once per T1 mode (stream, host, auto);
4. ``decode_16k``     the same at 16384 tokens;
5. ``serve_pressure`` ``kvtier serve`` on Qwen2.5-0.5B shapes under a device-KV budget that holds ~4 of 16 rows:
                      memory pressure demoting decode KV to host memory, then the field's policy (preempt and
                      recompute) at the same budget (needs the serve extra; skipped without it).

Nothing is downloaded: random-weight models, the device's own torch (2.11) and transformers (5.17), and no CLI
packages (typer, rich) needed. What travels is the working tree (< 64 MiB).

``--smoke`` runs the same driver, steps and files on a CPU with tiny models (tests/tools/test_gpu_check.py), so
the script is known to run before a GPU is ever lent.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
TOTAL_BUDGET_S = 360  # the limit for the whole check on an H200, start-up of the tools included


@dataclass
class Step:
    name: str
    budget_s: int
    what: str
    command: list[str]


def _bench_point(context: int, budget: int, smoke: bool) -> Step:
    return Step(f"decode_{context // 1024}k", budget,
                f"bench random:qwen2-7b bf16, batch 8, context {context}: full, tiered hbm 0.5 x T1 stream/host/auto",
                [PY, __file__, "--run-bench", str(context)] + (["--smoke"] if smoke else []))


def steps(smoke: bool = False) -> list[Step]:
    tests = ["tests/test_transfer.py", "tests/attention/test_split_attention.py", "tests/test_simulated_device.py"]
    flag = ["--smoke"] if smoke else []
    return [
        Step("env", 15, "versions, GPU, CPU", [PY, __file__, "--run-env"]),
        Step("cuda_tests", 90, "CUDA tests + the simulated-device tests on this torch",
             [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
              "-k", "cuda" if smoke else "cuda or simulated_device", "--junitxml", "{out}/cuda_tests.xml"]),
        _bench_point(4096, 75, smoke),
        _bench_point(16384, 100, smoke),
        Step("serve_pressure", 80, "kvtier serve, 16 clients x 384 tokens, device-KV budget for ~4 rows: demote, "
                                   "then recompute",
             [PY, __file__, "--run-serve"] + flag),
    ]


# ---- the steps' bodies (run in their own process) ---------------------------------------------------------------
def run_env(out: Path) -> None:
    import platform

    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None,
            "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                        platform.processor()) if Path("/proc/cpuinfo").is_file() else platform.processor(),
            "cpu_count": os.cpu_count()}
    for mod in ("fastapi", "uvicorn", "prometheus_client", "httpx", "typer", "rich"):
        try:
            __import__(mod)
            info[f"has_{mod}"] = True
        except ImportError:
            info[f"has_{mod}"] = False
    (out / "env.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info, indent=1))


def run_bench(out: Path, context: int, smoke: bool = False) -> None:
    sys.path.insert(0, str(ROOT))
    from kvtier.tools.bench import BenchConfig, run_bench as bench

    cfg = BenchConfig(model="random:qwen2-7b", context=context, new_tokens=24, batches=(8,), policies=("full", "tiered"),
                      hbm_ratios=(0.5,), evict_ratios=(0.03,), repeats=1, warmup_steps=4, stock=False, warm_repeat=False,
                      t1_attentions=("stream", "host", "auto"), device="cuda", dtype="bf16")
    if smoke:
        cfg = BenchConfig(**{**cfg.__dict__, "model": "random:tiny-qwen2", "context": context // 64, "new_tokens": 4,
                             "batches": (2,), "device": "cpu", "dtype": "fp32", "kernels": ("eager",)})
    path = out / f"decode_{context // 1024}k.json"

    def save(res: dict) -> None:
        path.write_text(json.dumps(res, indent=1) + "\n")
        lines = [f"{res['device']} torch {res['torch']} transformers {res['transformers']}, {cfg.model}, context "
                 f"{cfg.context}, batch {cfg.batches[0]}, {cfg.dtype}"]
        for r in res["results"]:
            p = r.get("params") or {}
            lines.append(f"{r['policy']:8s} {p.get('t1_attention', ''):7s} {r['ms_per_step_median']:9.2f} ms/step  "
                         f"peak device {r.get('peak_device_bytes') or 0:>14,d} B  vs floor {r.get('vs_floor') or 0:.2f}")
        path.with_suffix(".txt").write_text("\n".join(lines) + "\n")
        print(lines[-1], flush=True)

    save(bench(cfg, on_progress=lambda s: print(s, flush=True), on_rows=save))


def run_serve(out: Path, smoke: bool = False) -> None:
    try:
        import fastapi  # noqa: F401
        import httpx  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        (out / "serve_pressure.txt").write_text(f"skipped: the serve extra is not installed here ({e})\n")
        print(f"skipped: {e}")
        return
    import socket

    sys.path.insert(0, str(ROOT))
    from kvtier.serve.loadgen import bench_serve, server_counters, wait_until_up

    # Qwen2.5-0.5B: 24 layers x 2 KV heads x 64 dims x (K, V) x 2 bytes = 12 KiB a token; 4 rows of ~450 tokens
    # smoke: tiny-qwen2's full rows take 128 KiB each (256-token granules), so 300 KiB holds 2 of the 4
    budget, clients, tokens = ("300KiB", 4, 24) if smoke else ("24MiB", 16, 384)
    for mode in ("demote", "recompute"):  # the first is the one that matters: written before the second starts
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [PY, __file__, "--run-server", str(port), "--budget", budget, "--on-pressure", mode]
        proc = subprocess.Popen(cmd + (["--smoke"] if smoke else []), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_up(url, proc, 60)
            rows = bench_serve(url, [clients], [{"policy": "full"}], 1, tokens)
            metrics = server_counters(url)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        name = "serve_pressure" if mode == "demote" else f"serve_pressure_{mode}"
        res = {"budget": budget, "on_pressure": mode, "clients": clients, "max_tokens": tokens, "rows": rows,
               "server_metrics": metrics}
        (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
        keep = {k: v for k, v in metrics.items()
                if any(w in k for w in ("budget", "peak", "demot", "preempt", "recomput", "violation"))}
        text = "\n".join([f"on_pressure {mode}, budget {budget}"] + [json.dumps(r) for r in rows] + [json.dumps(keep)])
        (out / f"{name}.txt").write_text(text + "\n")
        print(text, flush=True)


def run_server(port: int, budget: str, on_pressure: str = "demote", device: str = "cuda", dtype: str = "bf16",
               model: str = "random:qwen2.5-0.5b", max_batch: int = 16, max_new: int = 384) -> None:
    """``kvtier serve`` without the CLI's packages: continuous batching under the device-KV budget."""
    sys.path.insert(0, str(ROOT))
    import kvtier
    from kvtier.config import parse_bytes
    from kvtier.serve import EngineConfig
    from kvtier.serve import serve as serve_forever
    from kvtier.serve.app import ServeSettings

    m, tok = kvtier.load_model(model, device=device, dtype=dtype, linear="eager")
    settings = ServeSettings(served_name=model, policy="full", params={}, max_new_tokens=max_new)
    settings.position_limit = getattr(m.config, "max_position_embeddings", None)
    ecfg = EngineConfig(max_batch=max_batch, max_queue=64, scheduler="continuous", on_pressure=on_pressure,
                        device_kv_budget=parse_bytes("--device-kv-budget", budget))
    serve_forever(m, tok, settings, ecfg, host="127.0.0.1", port=port)


# ---- the driver ---------------------------------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list the steps and their time budgets, run nothing")
    ap.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT, else "
                                                             "benchmarks/results/gpu_check_<date>)")
    ap.add_argument("--run-env", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-bench", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run-server", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", default="24MiB", help=argparse.SUPPRESS)
    ap.add_argument("--on-pressure", default="demote", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="the same steps on a CPU with tiny models (a test of this "
                                                         "script; its numbers mean nothing)")
    a = ap.parse_args(argv)
    if a.run_server:
        if a.smoke:
            run_server(a.run_server, a.budget, a.on_pressure, device="cpu", dtype="fp32", model="random:tiny-qwen2",
                       max_new=24)
        else:
            run_server(a.run_server, a.budget, a.on_pressure)
        return 0
    out = a.out or Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results" / f"gpu_check_{time.strftime('%Y-%m-%d')}")
    if a.run_env or a.run_bench or a.run_serve:
        out.mkdir(parents=True, exist_ok=True)
        if a.run_env:
            run_env(out)
        elif a.run_bench:
            run_bench(out, a.run_bench, a.smoke)
        else:
            run_serve(out, a.smoke)
        return 0
    plan = steps(a.smoke)
    total = sum(s.budget_s for s in plan)
    assert total <= TOTAL_BUDGET_S, (total, TOTAL_BUDGET_S)
    if a.dry_run:
        print(f"gpu_check: {len(plan)} steps, {total} s budgeted of {TOTAL_BUDGET_S} s, results under {out}")
        for i, s in enumerate(plan, 1):
            cmd = shlex.join(c.replace(PY, "python3").replace(str(ROOT) + "/", "").replace("{out}", str(out))
                             for c in s.command)
            print(f"{i}. {s.name:15s} {s.budget_s:4d} s  {s.what}\n   {cmd}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               OUT=str(out))
    summary = []
    for i, s in enumerate(plan, 1):
        cmd = [c.replace("{out}", str(out)) for c in s.command] + (["--out", str(out)] if s.command[1] == __file__ else [])
        t = time.monotonic()
        with open(out / f"{i:02d}_{s.name}.log", "w") as log:
            try:
                rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=s.budget_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        summary.append({"step": s.name, "rc": rc, "seconds": round(time.monotonic() - t, 1), "budget_s": s.budget_s})
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"gpu_check: {s.name}: rc {rc}, {summary[-1]['seconds']} s of {s.budget_s}", flush=True)
    return 0 if all(r["rc"] == 0 for r in summary) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
