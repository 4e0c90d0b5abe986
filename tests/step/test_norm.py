"""The fused RMSNorm (kvtier.step.norm) against the model's own module: per call, through generate, and the switch."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import forced_logits, generate, prompt_ids
from torch import nn

import kvtier
from kvtier.models import random_model
from kvtier.step import FusedRMSNorm, fuse_norms, fused_norm_count, prepare_step, rms_norm_reference
from kvtier.step import norm as norm_mod

needs_kernel = pytest.mark.skipif(norm_mod._module() is None, reason="the step kernel could not be built here")
DTYPES = [torch.float32, torch.bfloat16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the dtype's spacing at max(|a|, |b|) (elementwise)."""
    big = torch.maximum(a.abs(), b.abs()).float()
    spacing = torch.finfo(a.dtype).eps * torch.exp2(torch.floor(torch.log2(big.clamp_min(torch.finfo(a.dtype).tiny))))
    return (a.float() - b.float()).abs() / spacing


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 100, 128, 896])
def test_kernel_rounds_as_the_module_when_the_sum_is_exact(dtype, D):
    """Small-integer rows have a float32 sum of squares that is exact in any order: there the kernel's result is
    the module's bit for bit (the widening, rsqrt, rounding to the dtype and weight product are the same)."""
    g = torch.Generator().manual_seed(D)
    x = torch.randint(-6, 7, (37, D), generator=g).to(dtype) * 0.25
    w = torch.randn(D, generator=g).to(dtype)
    assert torch.equal(norm_mod.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 100, 896])
def test_kernel_agrees_with_the_module_to_its_sum_order(dtype, D):
    """Random rows: only the order of the float32 sum of squares differs (relative error ~sqrt(D) float32 units,
    halved by the square root). In bf16 that moves the normalized row by at most one bf16 unit, almost never
    (measured ~6 per million at D 896; bound 1 in 10,000), which the weight product carries to at most two units of
    the output (measured 2); in float32 by a few units (bound 2 + sqrt(D) / 2; measured 5 at D 64)."""
    g = torch.Generator().manual_seed(D + 1)
    x = (torch.randn(2000, D, generator=g) * 3).to(dtype)
    w = torch.randn(D, generator=g).to(dtype)
    y, ref = norm_mod.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)
    assert y.dtype == ref.dtype == dtype and y.shape == ref.shape
    assert _ulps(y, ref).max().item() <= (2.0 if dtype == torch.bfloat16 else 2 + D**0.5 / 2)
    if dtype == torch.bfloat16:
        assert (y != ref).float().mean().item() <= 1e-4


@needs_kernel
def test_a_row_does_not_depend_on_the_batch_and_shapes_pass_through():
    """Row i of any batch (and thread split) is the row normed alone; 1-, 3- and 4-D and strided inputs work."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 896, generator=g).to(torch.bfloat16)
    w = torch.randn(896, generator=g).to(torch.bfloat16)
    alone = torch.stack([norm_mod.rms_norm(x[i], w, 1e-6) for i in range(40)])
    for rows in (1, 8, 15, 16, 17, 33, 40):
        assert torch.equal(norm_mod.rms_norm(x[:rows], w, 1e-6), alone[:rows])
    assert torch.equal(norm_mod.rms_norm(x.view(5, 8, 896), w, 1e-6), alone.view(5, 8, 896))
    wide = torch.randn(6, 2 * 896, generator=g).to(torch.bfloat16)
    assert torch.equal(norm_mod.rms_norm(wide[:, 896:], w, 1e-6), norm_mod.rms_norm(wide[:, 896:].contiguous(), w, 1e-6))
    heads = torch.randn(2, 3, 4, 64, generator=g)  # Qwen3's per-head q/k norms
    w64 = torch.randn(64, generator=g)
    assert _ulps(norm_mod.rms_norm(heads, w64, 1e-6), rms_norm_reference(heads, w64, 1e-6)).max() <= 6


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_residual_add_and_its_norm_in_one_pass_are_the_two_calls_bit_for_bit(dtype):
    """add_rms_norm(x, y) is (x + y, rms_norm(x + y)) exactly: torch's rounding of the sum, the kernel's norm of the
    rounded row; any row count (the thread split), 3-D packed-step shapes, a non-contiguous y; inputs it does not
    take (mixed dtypes, a gradient wanted) get the two calls."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(896, generator=g).to(dtype)
    for rows in (1, 15, 33, 300):
        x = (torch.randn(1, rows, 896, generator=g) * 4).to(dtype)
        y = (torch.randn(1, rows, 896, generator=g) * 4).to(dtype)
        s, h = norm_mod.add_rms_norm(x, y, w, 1e-6)
        assert torch.equal(s, x + y) and torch.equal(h, norm_mod.rms_norm(x + y, w, 1e-6))
    wide = torch.randn(1, 7, 2 * 896, generator=g).to(dtype)
    x = torch.randn(1, 7, 896, generator=g).to(dtype)
    s, h = norm_mod.add_rms_norm(x, wide[..., 896:], w, 1e-6)
    assert torch.equal(s, x + wide[..., 896:]) and torch.equal(h, norm_mod.rms_norm(s, w, 1e-6))
    s, h = norm_mod.add_rms_norm(x.float(), x.to(torch.bfloat16), w, 1e-6)  # promotes, as the add does
    assert s.dtype == torch.float32 and torch.equal(s, x.float() + x.to(torch.bfloat16))
    xp = nn.Parameter(x.float())
    s, h = norm_mod.add_rms_norm(xp, x.float(), w.float(), 1e-6)
    h.float().sum().backward()
    assert xp.grad is not None


@needs_kernel
def test_inputs_the_kernel_does_not_take_get_the_reference():
    """Mixed dtypes (a float32 weight on bf16 rows promotes, as the module does), float64, and inputs that want a
    gradient take the reference path, with the module's result and dtype."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    mixed = norm_mod.rms_norm(x.to(torch.bfloat16), w, 1e-6)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, rms_norm_reference(x.to(torch.bfloat16), w, 1e-6))
    assert torch.equal(norm_mod.rms_norm(x.double(), w.double(), 1e-6), rms_norm_reference(x.double(), w.double(), 1e-6))
    wp = nn.Parameter(w.clone())
    y = norm_mod.rms_norm(x, wp, 1e-6)
    y.sum().backward()
    assert wp.grad is not None and torch.equal(y.detach(), rms_norm_reference(x, w, 1e-6))


class _GemmaLikeNorm(nn.Module):
    """Not the Llama form (``1 + weight``): must keep its own forward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight.float())).to(
            hidden_states.dtype)


@needs_kernel
def test_only_llama_form_norms_are_replaced_and_eager_replaces_none(qwen2):
    model = copy.deepcopy(qwen2)
    model.model.layers[0].input_layernorm = other = _GemmaLikeNorm(model.config.hidden_size)
    assert fuse_norms(copy.deepcopy(model), "eager") == 0
    weight = model.model.norm.weight
    n = fuse_norms(model, "auto")
    assert n == 2 * model.config.num_hidden_layers - 1 + 1 == fused_norm_count(model)
    assert model.model.layers[0].input_layernorm is other
    assert isinstance(model.model.norm, FusedRMSNorm) and model.model.norm.weight is weight  # the same parameter
    assert "fused (was Qwen2RMSNorm)" in repr(model.model.norm)
    assert fuse_norms(model, "auto") == 0  # already fused: nothing of the form is left


def test_load_model_fuses_unless_eager():
    m, _ = kvtier.load_model("random:tiny-qwen2", device="cpu", dtype="fp32", linear="eager")
    assert fused_norm_count(m) == 0
    m, _ = kvtier.load_model("random:tiny-qwen2", device="cpu", dtype="fp32")
    assert fused_norm_count(m) == (2 * m.config.num_hidden_layers + 1 if norm_mod._module() is not None else 0)


def _pair(preset: str, dtype: torch.dtype):
    eager = random_model(preset, dtype=dtype)
    fast = copy.deepcopy(eager)
    linears, norms, _ = prepare_step(fast, "packed")
    assert norms >= 2 * eager.config.num_hidden_layers + 1
    return eager, fast


TIERED = dict(hbm_ratio=0.3, evict_ratio=0.0, retier_interval=16, recent_window=8, sink_tokens=2)


@needs_kernel
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama", "tiny-qwen3"])
def test_fast_step_greedy_tokens_equal_eager_over_256_steps(preset):
    """Acceptance 1 on random presets in float32: the prepared step (packed linears, fused norms) gives the eager
    model's 256 greedy tokens for full and tiered, logits within 1e-4 (measured <= 2.7e-5 on a 2-core AMX Xeon)."""
    eager, fast = _pair(preset, torch.float32)
    ids = prompt_ids(length=24, seed=7)
    for policy, params in (("full", {}), ("tiered", TIERED)):
        seq_e, log_e, _ = generate(eager, policy, ids, new_tokens=256, **params)
        seq_f, log_f, _ = generate(fast, policy, ids, new_tokens=256, **params)
        assert torch.equal(seq_f, seq_e), f"{preset} {policy}"
        d = (log_f - log_e).abs().max().item()
        print(preset, policy, f"fp32 logits differ by {d:.3g}")
        assert d <= 1e-4, f"{preset} {policy}: logits differ by {d}"


@needs_kernel
def test_fast_step_bf16_teacher_forced_logits_stay_close():
    """In bf16 the packed GEMV and the norm's sum order each move a value by one bf16 unit now and then; teacher
    forced on eager's chain, the fast step's logits stay within 0.1 of eager's (measured 0.035 on a 2-core AMX Xeon)."""
    eager, fast = _pair("tiny-qwen2", torch.bfloat16)
    ids = prompt_ids(length=24, seed=8)
    seq_e, log_e, _ = generate(eager, "full", ids, new_tokens=128)
    n = ids.shape[1]
    forced = forced_logits(fast, kvtier.make_cache("full", fast), seq_e[:, : n + 127], n).float()
    d = (forced - log_e.float()).abs().max().item()
    print(f"bf16 teacher-forced logits differ by {d:.3g}")
    assert d <= 0.1
