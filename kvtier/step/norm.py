"""Fused RMSNorm for the CPU decode step: the model's norm modules replaced by one kernel call each.

Why: a transformers Llama/Qwen ``RMSNorm`` is eight eager ops (widen, square, mean, add, rsqrt, multiply, narrow,
weight multiply) on a vector of one row per sequence; at decode their dispatch, not their arithmetic, is the cost.
The 0.5B model runs 49 of them a step: replacing them by one call of ``kvtier/kernels/csrc/step_cpu.cpp`` each took serve's whole
rows step at 512 tokens from 61.0 to 58.5 ms at one row, 69.0 to 66.1 at eight and 110.3 to 102.5 at 32 in bf16
(2-core AMX Xeon, side by side in one process; ``benchmarks/results/fused_norm_2026-12-05_xeon_amx/``).

Exactness: the kernel computes what the module computes — the row widened to float32, its mean square in float32,
``x * rsqrt(ms + eps)`` rounded to the input dtype, times the weight in the input dtype — except the order of the
float32 sum of squares. A different last bit of the mean square moves the normalized bf16 row by one unit in ~6 of
a million elements (at most two units of the output after the weight product; float32: a few units, in ~1 element
of 4); :func:`rms_norm_reference` is the module's math, and
``tests/step/test_norm.py`` bounds the two against each other and the whole step against the eager model. A row's
result does not depend on the other rows (same per-row order at any batch size and thread count).

Only modules whose ``forward`` is exactly transformers' Llama form (:data:`LLAMA_FORM`: Llama, Qwen2, Qwen3, Mistral,
Phi-3 ...) are replaced; other norms (Gemma's ``1 + weight``, gpt-oss's float32 weight product) keep their own.
The mode is the step's (:func:`kvtier.step.linear.linear_mode`): ``eager`` replaces nothing (the stock step, bit for
bit); ``auto`` and ``packed`` replace the CPU norms where the kernel builds.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .forms import forward_is, replace
from ..kernels.build import step_module as _module  # the one build of kernels/csrc/step_cpu.cpp
from .linear import linear_mode

log = logging.getLogger(__name__)

# transformers' Llama RMSNorm forward (5.4-5.24), whitespace removed: the math the kernel implements
LLAMA_FORM = ("input_dtype=hidden_states.dtypehidden_states=hidden_states.to(torch.float32)variance=hidden_states.pow(2)"
              ".mean(-1,keepdim=True)hidden_states=hidden_states*torch.rsqrt(variance+self.variance_epsilon)return"
              "self.weight*hidden_states.to(input_dtype)")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The naive path the kernel is tested against: transformers' Llama RMSNorm, op by op. ``x`` (..., D)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` (..., D) -> (..., D): the kernel where it runs this input (CPU, float32 or bf16, the weight's dtype, no
    gradient wanted), else :func:`rms_norm_reference`."""
    mod = _module()
    if (mod is None or x.device.type != "cpu" or x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return rms_norm_reference(x, weight, eps)
    return mod.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next norm: ``(s, rms_norm(s))`` with ``s = x + y``, ``x``, ``y`` (..., D). One kernel pass
    per row where it takes the inputs (as :func:`rms_norm`, and ``y`` of ``x``'s shape and dtype): the sum rounded as
    torch's add rounds it, then the row normed as :func:`rms_norm` norms it, so the same tensors as the two calls."""
    mod = _module()
    if (mod is None or x.device.type != "cpu" or not x.dtype == y.dtype == weight.dtype or x.shape != y.shape
            or x.dtype not in (torch.float32, torch.bfloat16)
            or (torch.is_grad_enabled() and (x.requires_grad or y.requires_grad or weight.requires_grad))):
        s = x + y
        return s, rms_norm(s, weight, eps)
    s, h = mod.add_rms_norm(x, y, weight, eps)
    return s, h


class FusedRMSNorm(nn.Module):
    """Holds the replaced module's weight (the same parameter) and epsilon; ``forward`` is :func:`rms_norm`."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.replaced = type(norm).__name__

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused (was {self.replaced})"


def llama_form(cls: type) -> bool:
    """Whether ``cls.forward`` is transformers' Llama RMSNorm (:data:`LLAMA_FORM`), read from its source."""
    return forward_is(cls, LLAMA_FORM)


def fuse_norms(model: nn.Module, mode: str | None = None) -> int:
    """Replace the model's CPU RMSNorm modules of the Llama form by :class:`FusedRMSNorm` (mode ``auto`` or
    ``packed``, where the kernel builds); returns how many were replaced. For inference: the kernel takes no
    gradients (an input that wants one takes the reference path)."""
    if linear_mode(mode) == "eager":
        return 0
    n = replace(model, lambda m: llama_form(type(m)) and isinstance(getattr(m, "weight", None), torch.Tensor)
                and m.weight.device.type == "cpu", FusedRMSNorm, lambda: _module() is not None)
    if n:
        log.info("fused %d RMSNorm modules (one kernel call each)", n)
    return n


def fused_norm_count(model: nn.Module) -> int:
    return sum(isinstance(m, FusedRMSNorm) for m in model.modules())
