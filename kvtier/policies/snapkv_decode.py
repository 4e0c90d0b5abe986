"""``snapkv_decode``: the decode-time SnapKV of the R-KV paper's comparison table.

The R-KV authors run SnapKV's selection during decoding, on R-KV's own schedule (``Zefan-Cai/R-KV`` at
d15c976, ``rkv/compression/snapkv.py`` driven by ``rkv/modeling.py``): at prefill once the prompt reaches the
budget, then at every decode step whose preceding length is a multiple of ``buffer``; keep the ``window``
newest tokens and the top ``budget - window`` older ones by the window queries' attention (logits pooled over
a kv group's query heads by max, softmax over the older keys, mean over the window, max-pooled along the
sequence with ``kernel_size``). That is R-KV's importance without its redundancy term, so this policy is the
R-KV scorer with redundancy off; ``tests/policies/reference/rkv_ref.py`` with ``redundancy=False`` checks its kept
sets (``test_snapkv_decode_kept_sets_match_authors_code``).

For the original prompt-only SnapKV (Li et al. 2024) use ``snapkv``.
"""

from __future__ import annotations

from ..cache.headwise import HeadwiseCache
from ..config import EvictionBudget
from .base import EvictionBaseline
from .rkv import RKVScorer, check_schedule


class SnapKVDecodePolicy(EvictionBaseline):
    name = "snapkv_decode"
    description = "SnapKV's selection during decoding, every `buffer` steps (the R-KV paper's SnapKV row)"

    @classmethod
    def build(
        cls,
        num_layers: int,
        budget_ratio: float | None = None,
        budget_tokens: int | None = None,
        budget_floor: int | None = None,
        window: int = 8,
        buffer: int = 128,
        kernel_size: int = 7,
        protect_prompt: bool = False,
    ) -> HeadwiseCache:
        check_schedule(cls.name, window, buffer, kernel_size)
        scorer = RKVScorer(window, buffer, kernel_size, lam=1.0, threshold=0.5, redundancy=False)
        scorer.name = cls.name
        budget = EvictionBudget(budget_ratio, budget_tokens, budget_floor)
        return HeadwiseCache(scorer, budget, num_layers, protect_prompt, cls.name)
