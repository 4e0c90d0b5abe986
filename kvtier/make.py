"""make_cache: a policy's transformers ``Cache`` for a model, the model prepared for it (``kvtier.make_cache``)."""

from __future__ import annotations

from .attention.registration import prepare_model
from .cache import KVTierCache
from .policies import get_policy


def make_cache(policy: str, model, record_tiers=False, **params) -> KVTierCache:
    """Build a transformers ``Cache`` for ``policy`` and prepare ``model`` to use it.

    Args:
        policy: a name in :data:`POLICIES` (``"full"``, ``"tiered"``, ...).
        model: a transformers causal LM (Qwen2, Llama, Mistral, Qwen3-style decoders).
        record_tiers: ``True`` keeps one int8 row of placements per reassignment (``cache.tier_history()``, for
            :mod:`kvtier.tiers.tiermap` and ``kvtier generate --html``); a callable ``f(step, row)`` receives the rows
            instead; ``False`` (default) records nothing.
        **params: the policy's parameters, e.g. ``hbm_ratio=0.3, evict_ratio=0.03``.
    Raises:
        ValueError: unknown policy or parameter, or a parameter out of range.
        NotImplementedError: the model's attention is not supported (soft-capping, MLA, every layer sliding); a
            hybrid model's sliding layers keep their window and the policy takes the full ones; attention sinks
            (gpt-oss) join every softmax.
    """
    from .tiers.tiermap import attach_recorder, check_record_tiers

    cls = get_policy(policy)
    cls.check_params(params)
    check_record_tiers(record_tiers)
    prepare_model(model)
    from .attention.registration import has_sinks, num_cache_layers
    from .cache.base import model_shape
    from .cache.sliding import interleave, layer_plan

    hybrid = layer_plan(model.config)
    if hybrid is None:
        cache = cls.build(num_cache_layers(model), **params)
    else:  # the policy over the full-attention layers; each sliding layer keeps its window (kvtier.cache.sliding)
        types, window = hybrid
        cache = interleave(cls.build(sum(t != "sliding_attention" for t in types), **params), types, window)
    cache.model_shape = model_shape(model.config)  # (layers, kv-heads, head_dim): checked at the first prefill
    if has_sinks(model) and hasattr(cache, "state"):
        cache.state.model_sinks = True  # SDPA has no sink logit: full's step takes the kernel (or the eager merge)
    attach_recorder(cache, record_tiers)
    return cache
