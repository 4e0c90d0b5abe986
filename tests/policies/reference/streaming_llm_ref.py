"""StreamingLLM's selection as released, in loops.

Follows github.com/mit-han-lab/streaming-llm at commit d729b3ffc947caca63fc0f7644b7468ca2d50881,
``streaming_llm/kv_cache.py``: ``StartRecentKVCache.__call__``, applied to the cache after each forward
(as ``examples/eval_long_ppl.py`` does): once it holds more than ``start_size + recent_size`` tokens, keep the
first ``start_size`` (the attention sinks) and the last ``recent_size``. Positions are not shifted (the
``pos_shift`` variant re-rotates keys; kvtier does not). Written from reading that code; nothing is copied.
"""

from __future__ import annotations


def streaming_history(prefill, T, start_size, recent_size):
    kept = list(range(prefill))

    def trim():
        nonlocal kept
        if len(kept) > start_size + recent_size:
            kept = kept[:start_size] + kept[len(kept) - recent_size :]

    history = []
    trim()
    history.append(list(kept))
    for t in range(prefill, T):
        kept.append(t)
        trim()
        history.append(list(kept))
    return history
