"""Give records written before the resume key covered the model, dtype, device and problem set (kvtier 0.1.0 up
to commit 7522346) the current key, so that `kvtier sweep`/`eval` resume them instead of running them again.

What produced a legacy record is not in the record, so you state it (model, dtype, device, data dir) and the
script checks everything it can: each record's legacy key must equal the hash of its own fields (so the fields
are what ran), and its question's gold must equal the gold in the data file for that id (so the data is the
same). Records that fail a check are left untouched and listed; nothing is written unless every record passes.

    python benchmarks/eval/migrate_legacy_records.py RUN_DIR --model qwen2.5-coder-0.5b-instruct --dtype bfloat16 \\
        --device cpu --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from kvtier.eval.datasets import load_problems
from kvtier.eval.records import RECORDS, RunLock, problem_hash, read_records
from kvtier.eval.runner import EvalConfig
from kvtier.models import model_fingerprint


def legacy_key(r: dict) -> str:
    """The key kvtier 0.1.0 wrote: sha1 of the config's fields except ``limit``."""
    d = {"model": r["model"], "benchmark": r["benchmark"], "policy": r["policy"], "params": r["params"],
         "max_new_tokens": r["max_new_tokens"], "temperature": r["temperature"], "top_p": r["top_p"],
         "samples": r.get("samples", 1), "seed": r["seed"]}
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True, help="as torch names it: bfloat16, float32, float16")
    ap.add_argument("--device", required=True, help="cpu, or the CUDA device name")
    ap.add_argument("--data-dir", type=Path, required=True)
    a = ap.parse_args()
    records = read_records(a.run_dir)
    identity = {"model": a.model, "model_fingerprint": model_fingerprint(a.model), "dtype": a.dtype, "device": a.device}
    problems, bad, out, n_migrated = {}, [], [], 0
    for i, r in enumerate(records, start=1):
        if "key_inputs" in r:
            out.append(r)
            continue
        if r["model"] != a.model or legacy_key(r) != r["config_key"]:
            bad.append(f"line {i}: its fields do not hash to its key, or another model")
            continue
        if r["benchmark"] not in problems:
            problems[r["benchmark"]] = load_problems(r["benchmark"], a.data_dir, None, r["seed"])
        ps = problems[r["benchmark"]]
        p = next((x for x in ps if x.id == r["id"]), None)
        if p is None or p.gold != r["gold"]:
            bad.append(f"line {i}: problem {r['id']} is not in {a.data_dir} with gold {r['gold']!r}")
            continue
        cfg = EvalConfig(model=r["model"], benchmark=r["benchmark"], policy=r["policy"], params=r["params"],
                         max_new_tokens=r["max_new_tokens"], temperature=r["temperature"], top_p=r["top_p"],
                         seed=r["seed"])
        out.append({**r, "config_key": cfg.key(identity, ps.fingerprint),
                    "problem_hash": problem_hash(p.question, p.gold, p.choices),
                    "key_inputs": cfg.key_inputs(identity, ps.fingerprint), "legacy_config_key": r["config_key"]})
        n_migrated += 1
    if bad:
        print(f"not migrated ({len(bad)} records fail a check):", *bad[:20], sep="\n  ", file=sys.stderr)
        return 2
    with RunLock(a.run_dir):
        path = a.run_dir / RECORDS
        tmp = path.with_name(RECORDS + ".tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in out))
        tmp.replace(path)
    print(f"{n_migrated} records given the current key, {len(out) - n_migrated} already had it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
