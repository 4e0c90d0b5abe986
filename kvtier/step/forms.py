"""Which of a model's modules kvtier's step may replace: a class whose ``forward`` is a known transformers form.

A module is replaced by a fused one only where its ``forward`` source, whitespace removed, is exactly the form the
kernel implements (a subclass or a remote-code model that changes the math keeps its own); :func:`replace` swaps
every such child of a model in place.
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Callable

from torch import nn


@lru_cache(maxsize=None)
def forward_is(cls: type, form: str) -> bool:
    """Whether ``cls.forward``'s body, whitespace removed, is ``form``."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    head_end = src.find(":\n")  # the end of the def line(s)
    return head_end > 0 and "".join(src[head_end + 2 :].split()) == form


def replace(model: nn.Module, pick: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module],
            ready: Callable[[], bool]) -> int:
    """Every child module of ``model`` for which ``pick`` holds replaced by ``make(child)``, if ``ready()`` — asked
    only when there is one (it may build a kernel: a model with nothing to replace, a CUDA one, never pays for
    that); returns how many were replaced."""
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children() if pick(child)]
    if not targets or not ready():
        return 0
    for parent, name in targets:
        setattr(parent, name, make(getattr(parent, name)))
    return len(targets)
