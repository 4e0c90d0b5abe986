"""A gated MLP's ``act(gate) * up`` in one kernel call (bf16 SiLU, CPU): torch's two eager ops, bit for bit.

Why: a Llama/Qwen MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; on a CPU the SiLU and the product
are two passes over the (rows, intermediate) activations, each reading and writing them in memory, and the SiLU's
float32 exponential is the dearest elementwise op of the step. Measured on a 2-core AMX Xeon (the 0.5B model's
4864-wide halves of one fused gate/up product, bf16, warm, one process): 89 -> 31 us at 32 rows, 2,194 -> 815 us
for a 738-token prefill, a layer (24 layers a step; ``benchmarks/results/silu_mul_2026-12-06_xeon_amx/``).

Exactness: torch computes ``silu(g)`` rounded to bf16, then ``g' * u`` in float32 (exact: two 8-bit significands)
rounded to nearest even. The kernel (``kvtier/kernels/csrc/step_cpu.cpp``) reads ``silu(g)`` from a table of torch's own bf16 SiLU
of all 65,536 bit patterns (:func:`silu_table`, built once per process) and rounds the product as torch does, so
its result is torch's whatever ISA torch dispatched to — provided torch's SiLU of a value does not depend on where
its loops put that value (its vector path uses SLEEF's ``exp``, its scalar tails ``std::exp``). :func:`silu_table`
checks that on every finite value (a contiguous and a strided pass) and returns None, so nothing is fused, where the
two disagree. ``tests/step/test_mlp.py`` compares kernel and reference bit for bit; NaN results stay NaN (their
payload bits may differ).

Which modules: an MLP whose ``forward`` is exactly transformers' Llama form (:data:`MLP_FORM`: Llama, Qwen2,
Qwen3, Mistral ...) with a SiLU activation (transformers' ``SiLUActivation`` or ``nn.SiLU``) is replaced by
:class:`FusedMLP`, which keeps the same projection modules; the direct step (:mod:`kvtier.step.direct`) calls the
kernel for those. The mode is the step's (:func:`kvtier.step.linear.linear_mode`): ``eager`` replaces nothing.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .forms import forward_is, replace
from ..kernels.build import step_module as _module  # the one build of kernels/csrc/step_cpu.cpp
from .linear import linear_mode

log = logging.getLogger(__name__)

# transformers' Llama MLP forward (5.4-5.24), whitespace removed
MLP_FORM = "down_proj=self.down_proj(self.act_fn(self.gate_proj(x))*self.up_proj(x))returndown_proj"


def is_silu(act: object) -> bool:
    """Whether ``act`` is a plain SiLU module: ``nn.SiLU`` or transformers' ``SiLUActivation``."""
    t = type(act)
    return t is nn.SiLU or (t.__name__ == "SiLUActivation" and t.__module__ == "transformers.activations")


@lru_cache(maxsize=1)
def silu_table() -> torch.Tensor | None:
    """torch's bf16 SiLU of every bf16 bit pattern, widened to float32: (65536,), indexed by the input's bits; None
    where torch's vector and scalar paths round some finite value differently (then no one table is torch's)."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    vec = F.silu(x)  # contiguous: torch's vector loop for all of it (65536 is a multiple of any vector width)
    spread = torch.zeros(2 * 65536, dtype=torch.bfloat16)
    spread[::2] = x
    scalar = F.silu(spread[::2])  # an inner stride of 2 elements: torch's scalar loop for every value
    finite = torch.isfinite(vec.float()) | torch.isfinite(scalar.float())
    same = vec.view(torch.int16) == scalar.view(torch.int16)
    if not bool(same[finite].all()):
        log.info("kvtier: torch's bf16 SiLU rounds %d values differently on its vector and scalar paths; the MLP "
                 "keeps torch's ops", int((~same & finite).sum()))
        return None
    return vec.float()


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The naive path the kernel is tested against: the model's two ops. ``gate``, ``up`` (..., W)."""
    return F.silu(gate) * up


def _kernel():
    """(the built extension, the table), or None where the kernel cannot give torch's result."""
    mod = _module()
    if mod is None:
        return None
    table = silu_table()
    return None if table is None else (mod, table)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: ``gate``, ``up`` (..., W) -> (..., W) contiguous; the kernel where it takes the inputs
    (bf16 CPU tensors of one shape, last dim contiguous, rows of one stride each, no gradient wanted), else
    :func:`silu_mul_reference`."""
    k = _kernel()
    if (k is None or gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16 or gate.device.type != "cpu"
            or up.device.type != "cpu" or gate.shape != up.shape or gate.dim() == 0
            or gate.stride(-1) != 1 or up.stride(-1) != 1
            or (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))):
        return silu_mul_reference(gate, up)
    try:
        return k[0].silu_mul(gate, up, k[1])
    except RuntimeError:  # rows that are not one uniform stride (a view the kernel cannot flatten)
        return silu_mul_reference(gate, up)


class FusedMLP(nn.Module):
    """A Llama-form gated MLP with a SiLU activation: the same ``gate_proj``, ``up_proj``, ``down_proj`` and
    ``act_fn`` modules; ``forward(x)`` (..., hidden) -> (..., hidden) is ``down_proj(silu_mul(gate, up))``."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.replaced = type(mlp).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    def extra_repr(self) -> str:
        return f"silu(gate) * up fused (was {self.replaced})"


def act_mul(mlp: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(gate, up) -> act(gate) * up`` for ``mlp``: for a :class:`FusedMLP`, the kernel called directly (its inputs
    are the bf16 halves of one gate/up product: the checks of :func:`silu_mul` are skipped), else its own ops."""
    if type(mlp) is FusedMLP:
        k = _kernel()
        if k is not None:
            mod, table = k
            return lambda g, u: mod.silu_mul(g, u, table)
        return silu_mul
    act = mlp.act_fn
    return lambda g, u: act(g) * u


def llama_form(cls: type) -> bool:
    """Whether ``cls.forward`` is transformers' Llama MLP (:data:`MLP_FORM`), read from its source."""
    return forward_is(cls, MLP_FORM)


def _bf16_cpu(mlp: nn.Module) -> bool:
    """Whether ``mlp``'s gate and up projections give bf16 CPU tensors (the kernel's inputs): their weights, plain
    or packed (kvtier's packed linears keep no ``weight`` parameter but say their dtype)."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        m = getattr(mlp, name, None)
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor):
            if w.dtype != torch.bfloat16 or w.device.type != "cpu":
                return False
        elif getattr(m, "dtype", None) != torch.bfloat16:  # PackedLinear / FusedLinear: CPU only
            return False
    return True


def fuse_mlps(model: nn.Module, mode: str | None = None) -> int:
    """Replace the model's bf16 CPU MLPs of the Llama form with a SiLU activation by :class:`FusedMLP` (mode ``auto``
    or ``packed``, where the kernel gives torch's result); returns how many were replaced. Inference only: an input
    that wants a gradient takes the reference path."""
    if linear_mode(mode) == "eager":
        return 0
    n = replace(model, lambda m: llama_form(type(m)) and is_silu(getattr(m, "act_fn", None)) and _bf16_cpu(m), FusedMLP,
                lambda: _kernel() is not None)
    if n:
        log.info("fused %d MLP activations (silu(gate) * up: one kernel call each)", n)
    return n


def fused_mlp_count(model: nn.Module) -> int:
    return sum(isinstance(m, FusedMLP) for m in model.modules())
