"""Serving side by side, one server at a time: vLLM's CPU build and ``kvtier serve`` on the same model, prompts and load (#28).

Closed-loop streaming clients (greedy, ``max_tokens``, ``stream_options.include_usage``) send GSM8K test questions
as chat messages (``--prompt-tokens N``: each after its own worked training examples, N tokens long); per system and
number of clients: tokens/s, time to first token and inter-token latency p50/p99, and, for kvtier, the server's own
scheduler counters (``/metrics``), for vLLM its preemptions. Each row is written to ``rows.jsonl`` as it completes (a
rerun skips the rows already there) and ``table.md`` is rebuilt.

    python benchmarks/serve/serve_peer.py --out benchmarks/results/serve_peer_DATE_CPU \
        --vllm-python /path/to/vllm-venv/bin/python --clients 1,8,32 --systems vllm,kvtier-full,kvtier-tiered

Systems: ``vllm`` (``python -m vllm.entrypoints.openai.api_server`` from its own venv, ``VLLM_CPU_OMP_THREADS_BIND``
set to every core, ``VLLM_CPU_KVCACHE_SPACE`` GiB, or ``--num-gpu-blocks-override`` for a KV budget in blocks of
``--block-size`` tokens, 128 by default on CPU), ``kvtier-<policy>[:<scheduler>[:<on-pressure>]]`` (``kvtier serve`` with that default policy; e.g.
``kvtier-full:static``, ``kvtier-full:continuous:queue``). ``--device-kv-budget`` applies to every kvtier system.
Never two servers at once: each is started, loaded and stopped before the next.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from kvtier.serve.loadgen import free_port, pct, stream_chat  # noqa: E402


def cpu_info() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    get = lambda k: (re.search(rf"^{k}:\s*(.*)$", out, re.M) or [None, None])[1]  # noqa: E731
    flags = get("Flags") or ""
    return {"model": get("Model name"), "cpus": get("CPU\\(s\\)"), "family": get("CPU family"), "model_id": get("Model"),
            "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_tile" in flags}


def gsm8k_questions(n: int, data: Path) -> list[str]:
    rows = [json.loads(line) for line in (data / "gsm8k" / "test.jsonl").read_text().splitlines()[:n]]
    return [r["question"] + " Please reason step by step." for r in rows]


def long_questions(questions: list[str], data: Path, tokens: int, model_dir: str) -> tuple[list[str], list[int]]:
    """Each question after its own worked GSM8K training examples (no two prompts share a prefix, so vLLM's prefix
    cache saves nothing), as many as keep the chat prompt within ``tokens`` tokens of the model's tokenizer; and
    each prompt's length in tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    train = [json.loads(line) for line in (data / "gsm8k" / "train.jsonl").read_text().splitlines()]

    def length(text: str) -> int:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return len(tok(chat).input_ids)

    out, lengths, i = [], [], 0
    for q in questions:
        head, tail = "Worked examples:\n\n", "Now solve this one.\n" + q
        used = length(head + tail)
        parts: list[str] = []
        while True:
            r = train[i % len(train)]
            ex = f"Question: {r['question']}\nAnswer: {r['answer']}\n\n"
            n = len(tok(ex).input_ids)
            if used + n > tokens:
                break
            parts.append(ex)
            used += n
            i += 1
        while parts and length(head + "".join(parts) + tail) > tokens:  # token merges at the joins
            parts.pop()
        out.append(head + "".join(parts) + tail)
        lengths.append(length(out[-1]))
    return out, lengths


async def one(client, url: str, model: str, question: str, max_tokens: int, extra: dict, st: dict) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    while (s := await stream_chat(client, url, body)) is None:  # 429: retried after its Retry-After
        st["rejected"] += 1
    st["tokens"] += s.tokens
    st["ttft"] += [] if s.ttft is None else [s.ttft]
    st["itl"] += s.itl
    st["requests"] += 1


async def load(url: str, model: str, questions: list[str], clients: int, per_client: int, max_tokens: int,
               extra: dict) -> dict:
    import httpx

    st = {"requests": 0, "rejected": 0, "tokens": 0, "ttft": [], "itl": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=httpx.Limits(max_connections=clients + 4)) as c:

        async def worker(k: int):
            for j in range(per_client):
                await one(c, url, model, questions[(k * per_client + j) % len(questions)], max_tokens, extra, st)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(clients)))
        st["seconds"] = time.perf_counter() - t0
    return st


VLLM_KEPT = ("vllm:num_preemptions", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc")


def running_rows(m: dict[str, float]) -> int:
    """Rows decoding now, from either server's /metrics."""
    return int(m.get("kvtier_running_rows", 0) + sum(v for k, v in m.items() if k.startswith("vllm:num_requests_running")))


def scrape(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$", line)
            if m and (m.group(1).startswith("kvtier_") or m.group(1).startswith(VLLM_KEPT)):
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server was not ready after {timeout} s")


def start(system: str, args, port: int, log) -> tuple[subprocess.Popen, str, dict]:
    """The server process, the model name to send, and the body's extra fields."""
    env = dict(os.environ)
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    if system == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib),
                   VLLM_LOGGING_LEVEL="WARNING")
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model_dir,
               "--served-model-name", "m", "--dtype", args.dtype, "--port", str(port), "--host", "127.0.0.1",
               "--max-model-len", str(args.max_model_len)]
        if args.vllm_blocks:
            cmd += ["--num-gpu-blocks-override", str(args.vllm_blocks)]
        if args.vllm_block_size:
            cmd += ["--block-size", str(args.vllm_block_size)]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), "m", extra
    policy, *rest = system.split("-", 1)[1].split(":")
    scheduler = rest[0] if rest else "continuous"
    pressure = rest[1] if len(rest) > 1 else "demote"
    cmd = [sys.executable, "-m", "kvtier", "serve", "--model", args.kvtier_model, "--policy", policy, "--port", str(port),
           "--max-batch", str(args.static_max_batch if scheduler == "static" and args.static_max_batch else args.max_batch),
           "--max-queue", "256", "--scheduler", scheduler,
           "--max-new-tokens", str(args.max_tokens), "--served-name", "m", "--dtype", args.kvtier_dtype]
    if scheduler == "continuous":
        cmd += ["--on-pressure", pressure]
        if args.device_kv_budget:
            cmd += ["--device-kv-budget", args.device_kv_budget]
        if args.max_batched_tokens:
            cmd += ["--max-batched-tokens", str(args.max_batched_tokens)]
    if policy != "full":
        cmd += ["--hbm-ratio", str(args.hbm_ratio), "--evict-ratio", str(args.evict_ratio)]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), "m", extra


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def table(rows: list[dict]) -> str:
    head = ("| system | clients | requests | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | peak rows | "
            "preemptions | recomputed tokens | demoted tokens | peak device KV / budget |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        m = r.get("metrics", {})
        vpre = [v for k, v in m.items() if k.startswith("vllm:num_preemptions_total")]  # labelled per engine
        pre = m.get("kvtier_preemptions_total", sum(vpre) if vpre else None)
        rec = m.get("kvtier_recomputed_tokens_total")
        bud = m.get("kvtier_device_kv_budget_bytes")
        peak = m.get("kvtier_device_kv_peak_bytes")
        ratio = f"{peak / bud:.2f}" if bud and peak is not None else "–"
        name = r["system"] + (f" ({r['label']})" if r.get("label") else "")
        lines.append(f"| {name} | {r['clients']} | {r['requests']} | {r['tok_s']:.1f} | {r['ttft_p50_s']:.2f} | "
                     f"{r['ttft_p99_s']:.2f} | {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | "
                     f"{r.get('peak_rows', '–')} | {'–' if pre is None else int(pre)} | "
                     f"{'–' if rec is None else int(rec)} | "
                     f"{int(m['kvtier_demoted_tokens_total']) if 'kvtier_demoted_tokens_total' in m else '–'} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--systems", default="vllm,kvtier-full,kvtier-tiered")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends in turn")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=32, help="kvtier --max-batch")
    ap.add_argument("--hbm-ratio", type=float, default=0.3)
    ap.add_argument("--evict-ratio", type=float, default=0.03)
    ap.add_argument("--device-kv-budget", default=None, help="kvtier --device-kv-budget for every kvtier system")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="kvtier --max-batched-tokens (0: the server's default)")
    ap.add_argument("--vllm-python", default="python")
    ap.add_argument("--vllm-kv-gib", type=int, default=2)
    ap.add_argument("--vllm-blocks", type=int, default=0, help="--num-gpu-blocks-override (a KV budget in blocks)")
    ap.add_argument("--vllm-block-size", type=int, default=0, help="--block-size (0: vLLM's default, 128 tokens on CPU)")
    ap.add_argument("--model-dir", default=str(Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))
                                               / "converted" / "qwen2.5-coder-0.5b-instruct-float32"))
    ap.add_argument("--kvtier-model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="float32", help="vLLM --dtype")
    ap.add_argument("--kvtier-dtype", default="fp32")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--label", default="", help="a tag stored with each row (e.g. the experiment)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="long prompts: each question after its own worked "
                    "GSM8K training examples, up to this many tokens (with the chat template; 0: the question alone)")
    ap.add_argument("--ignore-eos", action="store_true", help="every request decodes max_tokens tokens (the body's "
                    "ignore_eos, which both servers honour): a fixed output length for memory-pressure runs")
    ap.add_argument("--static-max-batch", type=int, default=0, help="kvtier --scheduler static: --max-batch (what "
                    "the budget holds at peak; the static scheduler admits by count)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / "rows.jsonl"
    done = [json.loads(x) for x in rows_path.read_text().splitlines()] if rows_path.exists() else []
    have = {(r["system"], r["clients"], r.get("label", "")) for r in done}
    qs = gsm8k_questions(256, args.data)
    levels = [int(x) for x in args.clients.split(",")]
    lengths = None
    if args.prompt_tokens:
        if args.prompt_tokens + args.max_tokens > args.max_model_len:
            ap.error(f"--prompt-tokens {args.prompt_tokens} + --max-tokens {args.max_tokens} must be within "
                     f"--max-model-len {args.max_model_len}")
        # one more than the load sends: the warm-up's own (the same prompt again would be a prefix-cache hit for vLLM)
        qs, lengths = long_questions(qs[:max(levels) * args.per_client + 1], args.data, args.prompt_tokens,
                                     args.model_dir)
        warm, qs, lengths = qs[-1:], qs[:-1], lengths[:-1]
    else:
        warm = qs[:4]
    meta = {"cpu": cpu_info(), "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv), "max_tokens": args.max_tokens, "per_client": args.per_client,
            "ignore_eos": args.ignore_eos, "device_kv_budget": args.device_kv_budget, "vllm_blocks": args.vllm_blocks,
            "vllm_block_size": args.vllm_block_size or None, "max_batched_tokens": args.max_batched_tokens or None,
            "KVTIER_LINEAR": os.environ.get("KVTIER_LINEAR"), "prompt_tokens": args.prompt_tokens or None,
            "prompt_lengths": None if lengths is None else [min(lengths), max(lengths)]}
    (args.out / f"meta{'_' + re.sub(r'[^A-Za-z0-9_.-]', '_', args.label) if args.label else ''}.json").write_text(
        json.dumps(meta, indent=1))
    for system in args.systems.split(","):
        todo = [c for c in levels if (system, c, args.label) not in have]
        if not todo:
            continue
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        with open(args.out / f"server_{system.replace(':', '_')}.log", "ab") as log:
            proc, model, extra = start(system, args, port, log)
            try:
                wait_ready(url, proc, 900)
                asyncio.run(load(url, model, warm, 1, 1, min(16, args.max_tokens), extra))  # warm-up, untimed
                for c in todo:
                    before = scrape(url)
                    peak_rows = [0]
                    stop_poll = False

                    async def run_with_poll():
                        nonlocal stop_poll

                        async def poll():
                            while not stop_poll:
                                try:
                                    m = await asyncio.to_thread(scrape, url)
                                    peak_rows[0] = max(peak_rows[0], running_rows(m))
                                except Exception:
                                    pass
                                await asyncio.sleep(1.0)

                        task = asyncio.create_task(poll())
                        try:
                            return await load(url, model, qs, c, args.per_client, args.max_tokens, extra)
                        finally:
                            stop_poll = True
                            await task

                    st = asyncio.run(run_with_poll())
                    after = scrape(url)
                    metrics = {k: v - before.get(k, 0) if k.endswith("_total") else v for k, v in after.items()}
                    row = {"system": system, "clients": c, "label": args.label, "requests": st["requests"],
                           "rejected_429": st["rejected"], "tokens": st["tokens"], "seconds": round(st["seconds"], 2),
                           "tok_s": st["tokens"] / st["seconds"], "ttft_p50_s": pct(st["ttft"], 50),
                           "ttft_p99_s": pct(st["ttft"], 99), "itl_p50_ms": 1e3 * pct(st["itl"], 50),
                           "itl_p99_ms": 1e3 * pct(st["itl"], 99),
                           "peak_rows": peak_rows[0], "metrics": metrics,
                           "cpu": meta["cpu"]["model"], "date": meta["date"]}
                    with open(rows_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    done.append(row)
                    print(f"{system} c={c}: {row['tok_s']:.1f} tok/s, TTFT p99 {row['ttft_p99_s']:.2f} s, "
                          f"ITL p50 {row['itl_p50_ms']:.0f} ms", flush=True)
                    (args.out / "table.md").write_text(table(done))
            finally:
                stop(proc)
    (args.out / "table.md").write_text(table(done))


if __name__ == "__main__":
    main()
