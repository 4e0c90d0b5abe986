"""kvtier: keep a reasoning model's whole chain of thought without keeping it all in GPU memory."""

from __future__ import annotations

from . import _moved
from .attention.registration import prepare_model
from .cache import KVTierCache
from .config import TierConfig
from .make import make_cache
from .policies import POLICIES, get_policy
from .step.decode import decode

__version__ = "0.1.0"
_moved.install()


def load_model(*args, **kwargs):
    """See :func:`kvtier.models.load_model`."""
    from .models import load_model as _load

    return _load(*args, **kwargs)


__all__ = ["POLICIES", "KVTierCache", "TierConfig", "decode", "get_policy", "load_model", "make_cache", "prepare_model"]
