"""What differs between the transformers releases kvtier supports (5.4 - 5.24), in one place.

- How the registered attention finds its cache layer. From 5.24 the attention modules call
  ``cache.update(k, v, layer_idx, kwargs=kwargs)`` and then unpack the same ``kwargs`` into the attention
  function, so the layer puts itself there. Before, ``update`` gets no kwargs; then the layer hands itself over
  with the key tensor it returns (:func:`hand_over`), and the attention takes it back only for that very tensor
  (:func:`take_over`) — the module calls attention right after ``update`` with what ``update`` returned, so
  identity, not a name or an index, ties the two (a stale hand-over can never reach another cache's attention).
- The cache argument of ``model(...)`` and ``generate(...)``: ``cache=`` from 5.24 (``past_key_values=`` still
  accepted there, with a deprecation warning), ``past_key_values=`` before. :func:`cache_kw` gives the right
  one for a model, read from its ``forward`` signature, not from a version number.

- ``CacheLayerMixin``'s abstract ``get_max_length`` was ``get_max_cache_shape`` before 5.13: kvtier's layers
  define both (``layer_base.KVTierLayer``).

Everything else kvtier uses (``Cache`` / ``CacheLayerMixin``, ``AttentionInterface``, ``AttentionMaskInterface``,
``sdpa_mask``, ``sdpa_attention_forward``) has the same contract across the range; ``make test-compat`` runs the
core tests against both ends.
"""

from __future__ import annotations

import functools
import inspect
import threading

# The tested range (pyproject.toml states it too). 5.3 and older fail the core tests (mask handling differs).
OLDEST, NEWEST = "5.4.0", "5.24.0"


@functools.lru_cache(maxsize=None)
def _cache_arg(forward) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(model) -> str:
    """The name under which ``model``'s forward (and so ``generate``) takes a ``Cache``."""
    return _cache_arg(type(model).forward)


def cache_kw(model, cache) -> dict:
    """``{name: cache}`` for ``model(**inputs, **cache_kw(model, cache))`` or ``model.generate(...)``."""
    return {cache_arg(model): cache}


_pending = threading.local()


def hand_over(layer, key) -> None:
    """Called by a kvtier layer's ``update`` with the key tensor it returns."""
    _pending.item = (layer, key)


def take_over(key):
    """The layer whose ``update`` returned this very ``key`` tensor (and forget it), else None."""
    item = getattr(_pending, "item", None)
    _pending.item = None
    if item is not None and item[1] is key:
        return item[0]
    return None
