"""Whether two run folders' records hold the same generations: same keys, completions and per-token tier maps.

    python benchmarks/eval/same_records.py A/records.jsonl B/records.jsonl

Used to show that a change which should not change behaviour did not (e.g. the demo before and after a refactor);
prints the counts and exits 1 on any difference.
"""

from __future__ import annotations

import json
import sys


def load(path: str) -> dict:
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out[(r["config_key"], r["id"], r.get("sample", 0))] = r
    return out


def main(a_path: str, b_path: str) -> int:
    a, b = load(a_path), load(b_path)
    fields = ("completion", "extracted", "correct", "generated_tokens", "tier_tokens", "tier_map")
    same = [k for k in a if k in b and all(a[k].get(f) == b[k].get(f) for f in fields)]
    print(f"{len(a)} vs {len(b)} records; {len(set(a) & set(b))} keys in both; {len(same)} identical in {', '.join(fields)}")
    return 0 if len(same) == len(a) == len(b) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
