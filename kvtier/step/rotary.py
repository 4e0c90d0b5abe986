"""The rotary embedding of q and k in one kernel call each (bf16, CPU) for kvtier.step.direct, transformers' rounding.

Why: transformers' ``apply_rotary_pos_emb`` is ~14 eager ops a layer (two unsqueezes; per tensor two slices, a
negation, a cat, two products and a sum); at decode their dispatch, not their arithmetic, is the cost, 24 layers a
step for the 0.5B model.

Exactness: the kernel (``kvtier/kernels/csrc/step_cpu.cpp``) rounds each of the three ops that round in bf16 — ``x * cos``,
``rotate_half(x) * sin`` and their sum — as torch does (float32 arithmetic, round to nearest even); the negation and
the cat are exact. So it equals the model's function bit for bit (``tests/step/test_rotary.py``: many shapes and
layouts, and through the whole direct step). Other dtypes, devices and shapes take the model's function.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels.build import step_module as _module  # the one build of kernels/csrc/step_cpu.cpp

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def fused_rotary(reference: Rotary) -> Rotary:
    """``(q, k, cos, sin) -> (q, k)`` equal to ``reference`` (the model's ``apply_rotary_pos_emb``): the kernel for
    what it takes — q/k (B, H, N, D) bf16 CPU tensors, last dim contiguous (contiguous, the per-head view of a
    (B, N, H, D) projection output, or of a column slice of a fused q/k/v product: their strides are read); cos/sin
    (1 or B, N, D) bf16, last dim contiguous (1: every row at the same positions, a batch decode step); no gradient —
    else ``reference`` itself. Where the kernel cannot be built: ``reference``."""
    mod = _module()
    if mod is None:
        return reference

    def rotary(q, k, cos, sin):
        n, d = q.shape[-2], q.shape[-1]
        if (q.dtype == k.dtype == cos.dtype == sin.dtype == torch.bfloat16 and q.device.type == "cpu"
                and q.dim() == k.dim() == 4 and q.shape[0] == k.shape[0] and d % 2 == 0
                and k.shape[-2:] == q.shape[-2:] and cos.shape == sin.shape and cos.shape[0] in (1, q.shape[0])
                and cos.shape[1:] == (n, d)
                and q.stride(-1) == k.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
                and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
            return tuple(mod.rotary(q, k, cos, sin))
        return reference(q, k, cos, sin)

    return rotary
