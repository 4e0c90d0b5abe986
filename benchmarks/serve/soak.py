"""Soak `kvtier serve`: start it under a device-KV and a host budget, run kvtier.serve.soak's mix against it, stop it with SIGTERM, write the figures.

    python benchmarks/serve/soak.py --duration 1800 --out benchmarks/results/soak_<date>_<machine>
    python benchmarks/serve/soak.py --model random:tiny-qwen2 --dtype fp32 --duration 60 --out /tmp/soak   # a try

Loopback only: the server listens on 127.0.0.1 with a generated API key (so the wrong-key share is exercised).
Writes soak.json and soak.png (kvtier.serve.soak.write_soak), summary.md (the verdict beside each goal),
server.log (everything the server printed), command.txt, commit.txt and lscpu.txt. Exit 1 if an invariant failed
(unexpected answers, a budget breach, not idle afterwards, a sampled text unequal to its solo rerun, or the server
not stopping cleanly on SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvtier.serve.loadgen import free_port, wait_until_up  # noqa: E402
from kvtier.serve.soak import SoakConfig, run_soak, write_soak  # noqa: E402
from kvtier.config import parse_bytes  # noqa: E402

GOALS = (  # (figure, goal, passes)
    ("budget_breaches", "0", lambda v: v == 0),
    ("unexpected", "0 (every request completes or gets one documented error)", lambda v: v == 0),
    ("reruns_equal", "all", lambda v: v.split("/")[0] == v.split("/")[1]),
    ("idle_after", "true", lambda v: v is True),
    ("rss_drift", "<= 5% (idle afterwards over after warm-up)", lambda v: v is None or v <= 0.05),
    ("p99_per_token_last_over_first", "<= 1.2", lambda v: v is None or v <= 1.2),
)
MUST = {"budget_breaches", "unexpected", "reruns_equal", "idle_after"}  # the exit code's; the others are reported


def _summary(result: dict, stopped: int, args: argparse.Namespace) -> str:
    v = result["verdict"]
    lines = [f"# Soak: {args.model}, {args.duration:g} s, {args.clients} clients", "",
             f"Server: `--device-kv-budget {args.device_kv_budget} --host-kv-budget {args.host_kv_budget} "
             f"--max-batch {args.max_batch}`; SIGTERM at the end: exit {stopped}.", "",
             "| figure | measured | goal | held |", "|---|---|---|---|"]
    for name, goal, ok in GOALS:
        val = v[name]
        shown = f"{100 * val:+.1f}%" if name == "rss_drift" and val is not None else (
            f"{val:.2f}" if isinstance(val, float) else str(val))
        lines.append(f"| {name} | {shown} | {goal} | {'yes' if ok(val) else '**no**'} |")
    rss, pt = v["rss_mib"], v["per_token_requests"]
    lines += ["", f"RSS (MiB): {rss['after_warm_up']:.0f} after warm-up, {rss['peak']:.0f} at its peak under load, "
              f"{rss['idle_after']:.0f} idle afterwards. Seconds per token: {pt['first_window']} requests ended in the "
              f"first {pt['window_s']:g} s, {pt['last_window']} in the last.",
              "", f"Requests {v['requests']}: " + ", ".join(f"{k} {n}" for k, n in v["by_outcome"].items()),
              "By kind: " + ", ".join(f"{k} {n}" for k, n in v["by_kind"].items()),
              f"Generated tokens {v['generated_tokens']:.0f}; preemptions {v['preemptions']:.0f}; demoted token-columns "
              f"{v['demoted_tokens']:.0f}."]
    if v["unexpected_details"]:
        lines += ["", "Unexpected: " + "; ".join(v["unexpected_details"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--device-kv-budget", default="16MiB", help="keeps demotion busy")
    ap.add_argument("--host-kv-budget", default="64MiB", help="small enough that some rows are preempted")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--short-tokens", default="64,256")
    ap.add_argument("--long-tokens", default="1024,4096")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rejudge", action="store_true", help="recompute OUT/soak.json's verdict and summary.md with "
                    "this version's judge (no traffic)")
    a = ap.parse_args(argv)
    if a.rejudge:
        import json

        from kvtier.serve.soak import judge

        result = json.loads((a.out / "soak.json").read_text())
        result["verdict"] = judge(result)
        write_soak(result, a.out)
        (a.out / "summary.md").write_text(_summary(result, result.get("server_exit", -1), a))
        print((a.out / "summary.md").read_text())
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "command.txt").write_text(shlex.join([sys.executable, *sys.argv]) + "\n")
    (a.out / "commit.txt").write_text(subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                                                     text=True).stdout)
    (a.out / "lscpu.txt").write_text(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)
    key, port = secrets.token_hex(16), free_port()
    env = dict(os.environ, KVTIER_API_KEY=key)
    log = open(a.out / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", "--model", a.model, "--dtype", a.dtype,
                             "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(a.max_batch),
                             "--device-kv-budget", a.device_kv_budget, "--host-kv-budget", a.host_kv_budget],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    stopped = -1
    try:
        wait_until_up(url, proc, 900)
        short, long_ = (tuple(int(x) for x in s.split(",")) for s in (a.short_tokens, a.long_tokens))
        cfg = SoakConfig(url, a.duration, clients=a.clients, api_key=key, short_tokens=short, long_tokens=long_,
                         host_kv_budget_bytes=parse_bytes("--host-kv-budget", a.host_kv_budget), server_pid=proc.pid, seed=a.seed)
        result = run_soak(cfg)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                stopped = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                stopped = proc.wait()
        log.close()
    result["server_exit"] = stopped
    write_soak(result, a.out)
    text = _summary(result, stopped, a)
    (a.out / "summary.md").write_text(text)
    print(text)
    v = result["verdict"]
    return 0 if stopped == 0 and all(ok(v[n]) for n, _, ok in GOALS if n in MUST) else 1


if __name__ == "__main__":
    sys.exit(main())
