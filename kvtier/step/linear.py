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

On CPUs with AMX, bf16 weights whose sizes are multiples of 32 are packed into kvtier's own AMX tiles instead
(:class:`AmxWeight`, ``kvtier/kernels/csrc/step_cpu.cpp``): one sequential stream of 16 x 32 tiles that ``amx_linear`` multiplies
with TDPBF16PS, summing each output in K order, one 32-wide slice after another — the order oneDNN's AMX kernel
sums in at decode row counts, so at 1-32 rows the products are oneDNN's bit for bit (and a row's result never
depends on the rows beside it, at any count). It streams the weights at the memory's pace without oneDNN's per-call
argument handling: the 0.5B model's whole direct step 56.4 -> 45.2 ms at one row, 60.1 -> 51.6 at 8, 79.9 -> 67.5
at 32 (2-core AMX Xeon, alternating in one process); a 738-token packed prefill 495 -> 529 ms (its gate/up product
runs slower than oneDNN's from ~128 rows; ``benchmarks/results/amx_linear_2026-12-06_xeon_amx/``).
``KVTIER_LINEAR_KERNEL=onednn`` keeps oneDNN's layout everywhere.

Pack on the thread that will multiply: weights reordered on one thread and multiplied on another ran ~1.5x slower
(measured, not root-caused), which is why ``kvtier serve``'s engine packs on its own thread.

Modes (``linear=`` of :func:`kvtier.load_model`, the ``KVTIER_LINEAR`` variable, ``kvtier --linear``):
``auto`` packs bf16 models on CPUs with native bf16 (AVX512-BF16 / AMX), where it is measured faster, and leaves
everything else eager; ``packed`` packs every CPU ``nn.Linear`` in bf16 or fp32 (for measuring); ``eager`` packs
nothing: today's stock path, bit for bit.

Sibling projections of one input are packed as one weight (:class:`FusedLinear`): an attention's q/k/v and an MLP's
gate/up. One oneDNN call then reads them all, and each module returns its columns of the result: 4 matmul calls a
layer instead of 7, fewer and wider multiplies (the 0.5B model in bf16 on a 2-core AMX Xeon, serve's whole rows step
at 512 tokens: 58.5 -> 55.9 ms at 1 row, 109.3 -> 104.5 ms at 32; ``benchmarks/probes/linear_fuse_ab.py``, results in
``benchmarks/results/linear_fuse_2026-12-04_xeon_amx/``). At decode row counts (1-33 rows
measured) the fused product is the separate products bit for bit; at some prefill row counts oneDNN blocks the
wider weight differently and they agree to rounding (tests/step/test_linear.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..env import SWITCHES, choice
from ..kernels.cpu import cpu_bf16_native
from ..kernels.build import step_module as step_kernels

log = logging.getLogger(__name__)

LINEAR_MODES = SWITCHES["KVTIER_LINEAR"].choices  # auto, packed, eager
PACK_ROWS_HINT = 32


def linear_mode(mode: str | None = None) -> str:
    """The requested mode: ``mode`` if given, else ``$KVTIER_LINEAR``, else ``auto``; checked against LINEAR_MODES."""
    if mode is None:
        return choice("KVTIER_LINEAR")
    if mode not in LINEAR_MODES:
        raise ValueError(f"linear must be one of {list(LINEAR_MODES)}, got {mode!r}")
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


class AmxWeight:
    """A bf16 weight (out, in) packed into AMX tiles by ``kvtier/kernels/csrc/step_cpu.cpp``'s ``amx_pack`` (``tiles``: (out * in,)),
    multiplied by its ``amx_linear`` (``run``)."""

    __slots__ = ("tiles", "out_features", "in_features", "run")

    def __init__(self, tiles: torch.Tensor, out_features: int, in_features: int, run) -> None:
        self.tiles, self.out_features, self.in_features, self.run = tiles, out_features, in_features, run


LINEAR_KERNELS = SWITCHES["KVTIER_LINEAR_KERNEL"].choices  # auto, onednn


def _amx_module():
    """The step extension when its AMX projections run here and ``$KVTIER_LINEAR_KERNEL`` (``auto``, ``onednn``)
    does not turn them off, else None."""
    if choice("KVTIER_LINEAR_KERNEL") == "onednn":
        return None
    mod = step_kernels()
    return mod if mod is not None and mod.amx_linear_available() else None


def amx_packs(w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`_pack` gives ``w`` (out, in) kvtier's AMX tiles: bf16 (and its bias, if any) on a CPU whose
    AMX the kernel uses, both sizes multiples of 32."""
    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and w.shape[0] % 32 == 0
            and w.shape[1] % 32 == 0 and (bias is None or bias.dtype == torch.bfloat16)
            and _amx_module() is not None)


def _pack(w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | AmxWeight:
    """``w`` (out, in) packed once for :func:`_run_packed` (with ``bias``): kvtier's AMX tiles where
    :func:`amx_packs`, else oneDNN's blocked layout for ``mkldnn._linear_pointwise``."""
    if amx_packs(w, bias):
        mod = _amx_module()
        return AmxWeight(mod.amx_pack(w.detach()), w.shape[0], w.shape[1], mod.amx_linear)
    # The row-count hint only tunes the layout oneDNN picks; any row count runs on the result. 32, not 1: as fast
    # at 1-8 rows and faster at 32 (2-core AMX Xeon), and bit-equal to stock F.linear at more row counts (with 1:
    # only up to 32 rows; with 32: every count tried from 1 to 512 but 512 rows of an 896x896 weight).
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS_HINT)


# A prefill-sized input is multiplied in pieces of at most CHUNK_ROWS rows where the weight is at most CHUNK_MAX_OUT
# wide. Measured on a 2-core AMX Xeon (bf16, weights packed for 32 rows): oneDNN runs a window of row counts at
# about half speed — per row, the 0.5B model's down projection (896 x 4864) 3.7-4.6 us up to 736 rows and from 1500
# on, 7.6-8.5 us at 738-1280; its q/k/v (1152 x 896) and o (896 x 896) alike from ~512-736 to ~1100-1280 rows —
# while pieces of <= 384 rows run at the fast rate and give the same floats as the whole call (each row's sum runs
# in one order either way; checked at 256-738 rows). Past the window the whole call is the faster again (pieces
# re-read the weight), and the wide MLP gate/up product (9728 x 896) has no such window: neither is cut.
# A packed prefill of seven prompts (738 tokens): 575 -> 487 ms, logits bit for bit the same
# (benchmarks/results/prefill_chunks_2026-12-06_xeon_amx/).
CHUNK_ROWS = 384
CHUNK_MIN_ROWS = 449  # from here on: pieces of at least 225 rows (smaller ones run slower per row)
CHUNK_MAX_ROWS = 1280
CHUNK_MAX_OUT = 4096


_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)


def _kind(packed) -> str:
    return "AMX tiles" if type(packed) is AmxWeight else "oneDNN" if packed.is_mkldnn else "none (cast: F.linear)"


def _run_packed(x: torch.Tensor, packed: torch.Tensor | AmxWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) -> (..., out) through the packed weight (out, in): AMX tiles, one kernel call; oneDNN's layout,
    one oneDNN call, or for CHUNK_MIN_ROWS to CHUNK_MAX_ROWS rows and a weight of at most CHUNK_MAX_OUT outputs,
    one per piece of at most CHUNK_ROWS rows (pieces as equal as may be); a plain (strided) weight, stock
    ``F.linear`` (a module cast to a dtype or device that cannot be packed)."""
    if type(packed) is AmxWeight:
        return packed.run(x, packed.tiles, packed.out_features, _NO_BIAS if bias is None else bias)
    if not packed.is_mkldnn:
        return F.linear(x, packed, bias)
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not CHUNK_MIN_ROWS <= rows <= CHUNK_MAX_ROWS or packed.size(0) > CHUNK_MAX_OUT:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    n = -(-rows // CHUNK_ROWS)
    step = -(-rows // n)
    flat = x.view(rows, x.shape[-1])
    out = torch.cat([torch.ops.mkldnn._linear_pointwise(flat[a : a + step], packed, bias, "none", [], "")
                     for a in range(0, rows, step)])
    return out.view(*x.shape[:-1], out.shape[-1])


def _packed_form(p) -> bool:
    """Whether ``p`` is a packed weight (AMX tiles or oneDNN's layout, both on the CPU), not a plain one."""
    return type(p) is AmxWeight or p.is_mkldnn


def _unpack(packed: torch.Tensor | AmxWeight, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The plain weight (out, in) back from its packed form, exactly: the identity (in, in) multiplied through it
    (each output is one product by 1 and sums of zeros, exact in any accumulation order) and transposed."""
    if not _packed_form(packed):
        return packed
    eye = torch.eye(in_features, dtype=dtype)
    return _run_packed(eye, packed, None).t().contiguous()


def _repack(w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | AmxWeight:
    """``w`` packed where its dtype and device pack (:func:`_pack`), else ``w`` itself, run by stock F.linear."""
    return _pack(w, bias) if w.device.type == "cpu" and packable(w.dtype) else w


def _cast_changes(fn, packed: torch.Tensor | AmxWeight, dtype: torch.dtype) -> bool:
    """Whether ``Module._apply``'s ``fn`` (``.to``, ``.float()``, ``.bfloat16()``, ``.cuda()``, ...) changes the
    dtype or the device of the ``dtype`` weight ``packed`` holds (a packed form lives on the CPU)."""
    probe = fn(torch.zeros(1, dtype=dtype))
    where = torch.device("cpu") if _packed_form(packed) else packed.device
    return (probe.dtype, probe.device) != (dtype, where)


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
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.packed = _pack(w, self.bias)
        if keep_weight:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"PackedLinear({self.dtype}) got input of dtype {x.dtype}")
        return _run_packed(x, self.packed, self.bias)

    def _apply(self, fn, recurse: bool = True):
        """A cast of the model (``.float()``, ``.bfloat16()``, ``.to(dtype)``, ``.to(device)``) reaches the packed
        weight too: it is unpacked exactly, cast, and packed again where the new dtype packs on a CPU, else kept
        plain and run by stock F.linear."""
        super()._apply(fn, recurse)  # the bias (and a kept weight)
        if _cast_changes(fn, self.packed, self.dtype):
            w = fn(_unpack(self.packed, self.in_features, self.dtype))
            self.packed, self.dtype = _repack(w, self.bias), w.dtype
        return self

    @property
    def weight_bytes(self) -> int:
        return self.in_features * self.out_features * self.dtype.itemsize

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.dtype}, packed={_kind(self.packed)}")


# Sibling projections that models call on one input, one after the other (Llama-style attention and MLP names).
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return None


class _Fused:
    """The packed weight of sibling projections, stacked by output rows, and the last input's product.

    The first member called on an input ``x`` multiplies it by the stacked weight; the others, called on the same
    tensor (the same object, not modified in place since), take their columns of that product instead of
    multiplying again. A member called on anything else multiplies anew: always the right result, only slower."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        w = torch.cat([lin.weight.detach() for lin in linears])
        self.bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
        self.packed = _pack(w, self.bias)
        self.dtype, self.in_features = w.dtype, w.shape[1]
        self.bounds, start = [], 0
        for lin in linears:
            self.bounds.append((start, start + lin.out_features))
            start += lin.out_features
        self._x = self._y = self._version = None
        self._served: set[int] = set()

    def cast(self, fn) -> None:
        """Follow a cast of the model (see :meth:`PackedLinear._apply`); the members share this object, so the
        first member's cast does it and the others find it done."""
        if not _cast_changes(fn, self.packed, self.dtype):
            return
        w = fn(_unpack(self.packed, self.in_features, self.dtype))
        self.bias = None if self.bias is None else fn(self.bias)
        self.packed, self.dtype = _repack(w, self.bias), w.dtype
        self._x = self._y = None

    def columns(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Member ``i``'s output for ``x`` (..., in) -> (..., out_i): a view of the stacked product's columns."""
        if self._x is x and i not in self._served and _version(x) == self._version:
            y = self._y
            self._served.add(i)
        else:
            y = _run_packed(x, self.packed, self.bias)
            self._x, self._y, self._version, self._served = x, y, _version(x), {i}
        if len(self._served) == len(self.bounds):  # every member served: hold nothing between calls
            self._x = self._y = None
        a, b = self.bounds[i]
        return y[..., a:b]


class FusedLinear(nn.Module):
    """One of sibling projections packed together (:class:`_Fused`): ``forward(x)`` (..., in_features) ->
    (..., out_features), a column view of the one product of ``x`` with the stacked weight."""

    def __init__(self, fused: _Fused, index: int, linear: nn.Linear) -> None:
        super().__init__()
        self.fused, self.index = fused, index  # a plain attribute: the stacked weight is not a submodule
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"FusedLinear({self.dtype}) got input of dtype {x.dtype}")
        return self.fused.columns(x, self.index)

    def _apply(self, fn, recurse: bool = True):
        """A cast of the model reaches the stacked weight (:meth:`_Fused.cast`, done once for the members)."""
        super()._apply(fn, recurse)
        self.fused.cast(fn)
        self.dtype = self.fused.dtype
        return self

    @property
    def weight_bytes(self) -> int:  # this member's rows of the stacked weight
        return self.in_features * self.out_features * self.dtype.itemsize

    @property
    def bias_bytes(self) -> int:
        return 0 if self.fused.bias is None else self.out_features * self.dtype.itemsize

    def extra_repr(self) -> str:
        a, b = self.fused.bounds[self.index]
        return (f"in_features={self.in_features}, out_features={self.out_features}, rows {a}:{b} of a stacked "
                f"weight, bias={self.fused.bias is not None}, dtype={self.dtype}, packed={_kind(self.fused.packed)}")


def _fusable(parent: nn.Module, names: tuple[str, ...], packs) -> list[nn.Linear] | None:
    """The linears ``parent.<names>`` when they can share one packed weight: plain ``nn.Linear`` each, packed by
    this mode, one input size and dtype, all with a bias or none (a zero bias would turn -0.0 into +0.0)."""
    lins = [getattr(parent, n, None) for n in names]
    if not all(type(lin) is nn.Linear and packs(lin.weight) for lin in lins):
        return None
    first = lins[0]
    if any(lin.in_features != first.in_features or lin.weight.dtype != first.weight.dtype
           or (lin.bias is None) != (first.bias is None) for lin in lins):
        return None
    return lins


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The naive path PackedLinear is tested against: stock ``F.linear`` on the plain weight."""
    return F.linear(x, weight, bias)


def pack_linears(model: nn.Module, mode: str | None = None, fuse: bool = True) -> int:
    """Replace the model's CPU ``nn.Linear`` modules by :class:`PackedLinear` as ``mode`` says, and (``fuse``)
    sibling projections of one input (:data:`FUSE_GROUPS`) by :class:`FusedLinear` members of one packed weight;
    returns how many linears were replaced.

    Only exact ``nn.Linear`` instances are replaced (quantized or otherwise specialised subclasses keep their own
    forward); a group with a weight tied to an embedding table is not fused. For inference only: packed weights
    take no gradients.
    """
    mode = linear_mode(mode)
    if mode == "eager":
        return 0

    def packs(w: torch.Tensor) -> bool:
        return (packs_by_default(w.dtype, w.device) if mode == "auto"
                else w.device.type == "cpu" and packable(w.dtype))

    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    groups, targets = [], []
    for mod in model.modules():
        grouped = set()
        if fuse:
            for names in FUSE_GROUPS:
                lins = _fusable(mod, names, packs)
                if lins is not None and not any(id(lin.weight) in tables for lin in lins):
                    groups.append((mod, names, lins))
                    grouped.update(names)
        for child_name, child in mod.named_children():
            if type(child) is nn.Linear and child_name not in grouped and packs(child.weight):
                targets.append((mod, child_name))
    for mod, names, lins in groups:
        fused = _Fused(lins)
        for i, (name, lin) in enumerate(zip(names, lins)):
            setattr(mod, name, FusedLinear(fused, i, lin))
    for mod, child_name in targets:
        lin = getattr(mod, child_name)
        setattr(mod, child_name, PackedLinear(lin, keep_weight=id(lin.weight) in tables))
    n = len(targets) + sum(len(names) for _, names, _ in groups)
    if n:
        from .malloc import keep_freed_memory

        keep_freed_memory()  # kvtier owns this process's CPU step now: its prefills stop page-faulting (malloc.py)
        log.info("packed %d linear layers for oneDNN (linear=%s; %d sibling groups share one weight each)", n, mode,
                 len(groups))
    return n


def packed_count(model: nn.Module) -> int:
    """Linears running on packed weights (a fused group's members each count; one a cast left plain does not)."""
    return sum(_packed_form(m.packed if isinstance(m, PackedLinear) else m.fused.packed)
               for m in model.modules() if isinstance(m, (PackedLinear, FusedLinear)))


def amx_count(model: nn.Module) -> int:
    """Of those, the linears running on kvtier's AMX tiles."""
    return sum(type(m.packed if isinstance(m, PackedLinear) else m.fused.packed) is AmxWeight
               for m in model.modules() if isinstance(m, (PackedLinear, FusedLinear)))


def expert_weights(model: nn.Module) -> tuple[int, int, int]:
    """A mixture of experts' routed weights: ``(bytes, experts, experts per token)`` — the parameters under a module
    named ``experts`` whose first dimension is the expert count (gpt-oss's stacked expert matrices and biases, or
    one module per expert); ``(0, 0, 0)`` for a dense model."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    e = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    k = getattr(cfg, "num_experts_per_tok", None) or 0
    if not e or not k:
        return 0, 0, 0
    total = 0
    for name, p in model.named_parameters():
        parts = name.split(".")
        if "experts" in parts[:-1] and (p.dim() >= 1 and p.shape[0] == e or parts[parts.index("experts") + 1].isdigit()):
            total += p.numel() * p.element_size()
    return total, int(e), int(k)


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
        elif isinstance(m, FusedLinear):
            total += m.weight_bytes + m.bias_bytes
        elif isinstance(m, nn.Linear):
            add(m.weight)
            add(m.bias)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if id(p) not in tables:
            add(p)
    return total
