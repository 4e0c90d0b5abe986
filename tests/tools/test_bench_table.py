"""benchmarks/decode/bench_table.py: one row per bench JSON, ordered by batch then context, `full`'s median step and its
ratio to stock ("–" in a run without the stock caches), every other configuration's recorded ratio to `full`."""

from __future__ import annotations

import json

from scripts import benchmark_script


def _point(folder, context, batch, full_ms, stock, ratios):
    res = [{"policy": "full", "params": {}, "ms_per_step_median": full_ms, "median_ratio_to_full": 1.0,
            "median_ratio_to_stock": stock}]
    res += [{"policy": "tiered", "params": {"t1_attention": mode}, "median_ratio_to_full": r, "median_ratio_to_stock": None}
            for mode, r in ratios.items()]
    if stock is not None:
        res.append({"policy": "stock-static", "params": {}, "median_ratio_to_full": 0.8, "median_ratio_to_stock": 1.0})
    cfg = {"context": context, "batches": [batch], "dtype": "bf16"}
    (folder / f"ctx{context}_b{batch}_bf16.json").write_text(json.dumps({"config": cfg, "results": res}))


def test_rows_by_batch_then_context_with_or_without_stock(tmp_path):
    mod = benchmark_script("bench_table")
    _point(tmp_path, 4096, 1, 64.2, None, {"host": 0.977, "stream": 0.947})
    _point(tmp_path, 512, 4, 63.0, 1.08, {"host": 0.975})
    _point(tmp_path, 512, 1, 60.4, None, {"host": 0.984, "stream": 0.964})
    cols, table = mod.rows(tmp_path)
    assert cols == ["tiered host", "tiered stream"]  # stock is not a column; first seen first
    assert table == [["512", "1 (bf16)", "60 ms, –", "0.98×", "0.96×"],
                     ["4096", "1 (bf16)", "64 ms, –", "0.98×", "0.95×"],
                     ["512", "4 (bf16)", "63 ms, 1.08×", "0.97×", "–"]]
