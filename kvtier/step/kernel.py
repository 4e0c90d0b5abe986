"""The one build of ``csrc/step_cpu.cpp`` (the step's norms, rotary, SiLU x product and AMX projections), or None.

A module of its own so that every user of the extension (:mod:`.norm`, :mod:`.rotary`, :mod:`.mlp`,
:mod:`.linear`) imports it from here and none of them imports another for it.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "step_cpu.cpp"


@lru_cache(maxsize=1)
def module():
    """The built ``step_cpu`` extension, or None where it cannot be built (``KVTIER_KERNEL=eager``, no compiler):
    then every op keeps the model's own path."""
    from ..attention import fused_cpu  # the one build recipe (and its switch); imported here: it imports step.cpu

    if not fused_cpu.available():
        return None
    try:
        name = fused_cpu.build_name(_SRC, "kvtier_step_cpu")
        return fused_cpu.build(name, _SRC, fused_cpu.build_dir(name))
    except Exception as exc:  # noqa: BLE001 - the eager paths still work
        log.warning("kvtier: the step's CPU kernels could not be built (%s); keeping the model's own ops",
                    type(exc).__name__)
        return None
