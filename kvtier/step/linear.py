"""Prepacked linear layers for the CPU decode step: the model's projections with their weights reordered once.

Why: on a CPU a decode step is mostly weight streaming (every projection reads its whole weight for a few rows of
activations). Stock ``F.linear`` in bf16 hands oneDNN a plain row-major weight and oneDNN reorders it into its
blocked layout on every call; measured on a 2-core AMX Xeon, the 0.5B model's 24 layers of projections take 49 ms
a step that way and 36 ms from a weight reordered once (``benchmarks/results/``). :class:`PackedLinear` holds only
the reordered weight (the plain one is released, so the model does not grow), and runs
``mkldnn._linear_pointwise`` on it. The reference is ``F.linear`` on the plain weight; in bf16 the two mostly run
the same oneDNN kernel and agree bit for bit, but stock runs its own GEMV at one row (it rounds ~6% of one-row
down-projections one bf16 unit the other way) and oneDNN blocks some prefill row counts differently: there they
agree to rounding (bounded in tests/step/test_linear.py).

Pack on the thread that will multiply: weights reordered on one thread and multiplied on another ran ~1.5x slower
(measured, not root-caused), which is why ``kvtier serve``'s engine packs on its own thread.

Modes (``linear=`` of :func:`kvtier.load_model`, the ``KVTIER_LINEAR`` variable, ``kvtier --linear``):
``auto`` packs bf16 models on CPUs with native bf16 (AVX512-BF16 / AMX), where it is measured faster, and leaves
everything else eager; ``packed`` packs every CPU ``nn.Linear`` in bf16 or fp32 (for measuring); ``eager`` packs
nothing: today's stock path, bit for bit.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from .cpu import cpu_bf16_native

log = logging.getLogger(__name__)

LINEAR_MODES = ("auto", "packed", "eager")
PACK_ROWS_HINT = 32


def linear_mode(mode: str | None = None) -> str:
    """The requested mode: ``mode`` if given, else ``$KVTIER_LINEAR``, else ``auto``; checked against LINEAR_MODES."""
    if mode is None:
        mode = os.environ.get("KVTIER_LINEAR", "").strip().lower() or "auto"
        source = "KVTIER_LINEAR"
    else:
        source = "linear"
    if mode not in LINEAR_MODES:
        raise ValueError(f"{source} must be one of {list(LINEAR_MODES)}, got {mode!r}")
    return mode


def packable(dtype: torch.dtype) -> bool:
    """Whether this torch build can reorder and run a ``dtype`` linear through oneDNN on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def packs_by_default(dtype: torch.dtype, device: torch.device) -> bool:
    """``auto``: pack where it is measured faster: bf16 on a CPU with native bf16 matmuls."""
    return device.type == "cpu" and dtype == torch.bfloat16 and cpu_bf16_native() and packable(dtype)


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight reordered once into oneDNN's blocked layout (the only copy kept).

    ``forward(x)``: x (..., in_features) -> (..., out_features), same dtype as the weight.
    """

    def __init__(self, linear: nn.Linear, keep_weight: bool = False) -> None:
        """``keep_weight``: also keep the plain weight as ``.weight`` (free when it is tied to an embedding table,
        which holds it anyway; ``model.lm_head.weight`` then keeps working)."""
        super().__init__()
        w = linear.weight.detach()
        if w.device.type != "cpu" or not packable(w.dtype):
            raise ValueError(f"PackedLinear needs a CPU bf16/fp32 weight oneDNN supports, got {w.dtype} on {w.device}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = w.dtype
        # The row-count hint only tunes the layout oneDNN picks; any row count runs on the result. 32, not 1: as
        # fast at 1-8 rows and faster at 32 (2-core AMX Xeon), and bit-equal to stock F.linear at more row counts
        # (with 1: only up to 32 rows; with 32: every count tried from 1 to 512 but 512 rows of an 896x896 weight).
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"PackedLinear({self.dtype}) got input of dtype {x.dtype}")
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    @property
    def weight_bytes(self) -> int:
        return self.in_features * self.out_features * self.dtype.itemsize

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}, packed=oneDNN")


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The naive path PackedLinear is tested against: stock ``F.linear`` on the plain weight."""
    return F.linear(x, weight, bias)


def pack_linears(model: nn.Module, mode: str | None = None) -> int:
    """Replace the model's CPU ``nn.Linear`` modules by :class:`PackedLinear` as ``mode`` says; returns how many.

    Only exact ``nn.Linear`` instances are replaced (quantized or otherwise specialised subclasses keep their own
    forward). For inference only: packed weights take no gradients.
    """
    mode = linear_mode(mode)
    if mode == "eager":
        return 0
    targets = []
    for mod in model.modules():
        for child_name, child in mod.named_children():
            if type(child) is not nn.Linear:
                continue
            w = child.weight
            ok = (packs_by_default(w.dtype, w.device) if mode == "auto"
                  else w.device.type == "cpu" and packable(w.dtype))
            if ok:
                targets.append((mod, child_name))
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for mod, child_name in targets:
        lin = getattr(mod, child_name)
        setattr(mod, child_name, PackedLinear(lin, keep_weight=id(lin.weight) in tables))
    if targets:
        log.info("packed %d linear layers for oneDNN (linear=%s)", len(targets), mode)
    return len(targets)


def packed_count(model: nn.Module) -> int:
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def step_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear's weight and bias (packed or not) and every other
    parameter except embedding tables, of which a step reads a few rows (a table tied to the output head is read
    whole, as that head's weight). Each tensor is counted once."""
    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for m in model.modules():
        if isinstance(m, PackedLinear):
            total += m.weight_bytes
            add(m.bias)
        elif isinstance(m, nn.Linear):
            add(m.weight)
            add(m.bias)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if id(p) not in tables:
            add(p)
    return total
