"""What a policy is: a name, its parameters with defaults, and a cache builder."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar


class Policy:
    """A named way to build a cache. Subclasses define ``name``, ``build(num_layers, **params)``."""

    name: ClassVar[str]
    description: ClassVar[str] = ""

    @classmethod
    def params(cls) -> dict[str, Any]:
        """Accepted parameters and their defaults, read from ``build``'s signature."""
        sig = inspect.signature(cls.build)
        return {k: p.default for k, p in sig.parameters.items() if k not in ("cls", "num_layers")}

    @classmethod
    def check_params(cls, params: dict[str, Any]) -> None:
        unknown = sorted(set(params) - set(cls.params()))
        if unknown:
            raise ValueError(
                f"unknown parameter(s) {unknown} for policy {cls.name!r}; it accepts {sorted(cls.params())}"
            )

    @classmethod
    def build(cls, num_layers: int, **params):  # pragma: no cover - abstract
        raise NotImplementedError
