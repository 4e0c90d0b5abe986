"""The fused SiLU x product (kvtier.step.mlp) against torch's two ops: per call, through the model, and its guard."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import generate, prompt_ids
from torch import nn

import kvtier
from kvtier.models import random_model
from kvtier.step import FusedMLP, fuse_mlps, fused_mlp_count, prepare_step, silu_mul_reference
from kvtier.step import mlp as mlp_mod
from kvtier.step.direct import direct_step, rows_logits

needs_kernel = pytest.mark.skipif(mlp_mod._kernel() is None, reason="the step kernel could not be built here")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, a NaN anywhere it is a NaN in both (its payload bits may differ)."""
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a.view(torch.int16) == b.view(torch.int16)) | both_nan).all())


@needs_kernel
def test_every_bf16_gate_value_gives_torchs_result():
    """All 65,536 bf16 bit patterns of the gate (zeros, subnormals, infinities, NaNs) against random, tiny (the
    product underflows to float32 subnormals) and huge (it overflows) up values: torch's ``F.silu(g) * u``."""
    g = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    gen = torch.Generator().manual_seed(0)
    for scale in (1.0, 1e-30, 1e30):
        u = (torch.randn(256, 256, generator=gen) * scale).to(torch.bfloat16)
        got = mlp_mod.silu_mul(g, u)
        assert got.is_contiguous() and _same(got, silu_mul_reference(g, u))


@needs_kernel
@pytest.mark.parametrize("width", [4864, 100, 17, 1])
@pytest.mark.parametrize("rows", [1, 7, 33, 600])
def test_column_halves_of_one_product_and_other_layouts(width, rows):
    """The gate and up halves of one fused (rows, 2W) product (rows of stride 2W; the vector loop's tail for W not
    a multiple of 16; enough rows to split over the threads), a 3-D packed-step shape, and contiguous inputs."""
    gen = torch.Generator().manual_seed(width * 1000 + rows)
    gu = (torch.randn(1, rows, 2 * width, generator=gen) * 4).to(torch.bfloat16)
    g, u = gu.split([width, width], dim=-1)
    got = mlp_mod.silu_mul(g, u)
    assert got.shape == (1, rows, width) and got.is_contiguous()
    assert _same(got, silu_mul_reference(g, u))
    assert _same(mlp_mod.silu_mul(g[0].contiguous(), u[0].contiguous()), silu_mul_reference(g[0], u[0]))
    assert _same(mlp_mod.silu_mul(g[0, 0], u[0, 0]), silu_mul_reference(g[0, 0], u[0, 0]))  # 1-D


@needs_kernel
def test_inputs_the_kernel_does_not_take_get_the_reference():
    """float32, mixed dtypes, a strided last dim, rows of no one stride, and inputs that want a gradient: the
    reference's result and dtype."""
    gen = torch.Generator().manual_seed(2)
    g, u = torch.randn(4, 64, generator=gen), torch.randn(4, 64, generator=gen)
    assert torch.equal(mlp_mod.silu_mul(g, u), silu_mul_reference(g, u))
    mixed = mlp_mod.silu_mul(g.to(torch.bfloat16), u)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, silu_mul_reference(g.to(torch.bfloat16), u))
    b = torch.randn(4, 128, generator=gen).to(torch.bfloat16)
    assert _same(mlp_mod.silu_mul(b[:, ::2], b[:, 1::2]), silu_mul_reference(b[:, ::2], b[:, 1::2]))
    odd = torch.randn(3, 5, 64, generator=gen).to(torch.bfloat16).transpose(0, 1)  # (5, 3, 64): not one row stride
    assert _same(mlp_mod.silu_mul(odd, odd), silu_mul_reference(odd, odd))
    gp = nn.Parameter(g.to(torch.bfloat16))
    y = mlp_mod.silu_mul(gp, u.to(torch.bfloat16))
    y.float().sum().backward()
    assert gp.grad is not None


def test_the_table_is_refused_where_torchs_paths_disagree(monkeypatch):
    """The guard can fail: a SiLU whose strided (scalar) pass rounds one value differently gives no table, and then
    nothing is fused and silu_mul is the reference."""
    real = F.silu

    def skewed(x):
        y = real(x)
        if not x.is_contiguous():
            y = y.clone()
            y[1000] = -y[1000] if y[1000] != 0 else torch.tensor(1.0, dtype=y.dtype)
        return y

    mlp_mod.silu_table.cache_clear()
    monkeypatch.setattr(mlp_mod.F, "silu", skewed)
    try:
        assert mlp_mod.silu_table() is None and mlp_mod._kernel() is None
        model = random_model("tiny-qwen2", dtype=torch.bfloat16)
        assert fuse_mlps(model, "packed") == 0
    finally:
        monkeypatch.setattr(mlp_mod.F, "silu", real)
        mlp_mod.silu_table.cache_clear()
    if mlp_mod._module() is not None:
        assert mlp_mod.silu_table() is not None  # torch's own SiLU: one table for both paths here


class _GeluMLP(nn.Module):
    """The Llama form with another activation: must keep its own forward."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, nn.GELU()

    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


@needs_kernel
def test_only_bf16_silu_llama_form_mlps_are_replaced_and_eager_replaces_none():
    model = random_model("tiny-qwen2", dtype=torch.bfloat16)
    model.model.layers[0].mlp = other = _GeluMLP(model.model.layers[0].mlp)
    assert fuse_mlps(copy.deepcopy(model), "eager") == 0
    assert fuse_mlps(random_model("tiny-qwen2", dtype=torch.float32), "packed") == 0  # the kernel takes bf16 only
    gate = model.model.layers[1].mlp.gate_proj
    n = fuse_mlps(model, "auto")
    assert n == model.config.num_hidden_layers - 1 == fused_mlp_count(model)
    assert model.model.layers[0].mlp is other
    fused = model.model.layers[1].mlp
    assert isinstance(fused, FusedMLP) and fused.gate_proj is gate and "was Qwen2MLP" in repr(fused)
    assert fuse_mlps(model, "auto") == 0  # already fused
    assert "layers.1.mlp.gate_proj.weight" in "".join(model.state_dict())  # the same parameter names


@needs_kernel
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-llama", "tiny-qwen3"])
def test_the_prepared_model_with_fused_mlps_generates_the_unfused_logits_bit_for_bit(preset):
    """bf16, packed linears and fused norms either way: fusing the MLPs changes no logit of a 48-token greedy
    generation (full and tiered), and a packed step through kvtier.step.direct equals both."""
    fast = random_model(preset, dtype=torch.bfloat16)
    linears, norms, mlps = prepare_step(fast, "packed")
    assert mlps == fast.config.num_hidden_layers
    ids = prompt_ids(batch=2, length=12, seed=5, vocab=fast.config.vocab_size)
    prompts = [ids[0].tolist(), ids[1, :7].tolist()]
    policies = (("full", {}), ("tiered", dict(hbm_ratio=0.3, evict_ratio=0.0, retier_interval=8, recent_window=4)))

    def run(model, step):
        gens = [generate(model, policy, ids, new_tokens=48, **params)[:2] for policy, params in policies]
        return gens, rows_logits(model, step, [kvtier.make_cache("full", model) for _ in prompts], prompts)

    step = direct_step(fast)
    assert step is not None
    fused = run(fast, step)
    for layer in fast.model.layers:  # the same packed projections, then torch's SiLU and product
        m = layer.mlp
        layer.mlp = _StockMLP()
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            setattr(layer.mlp, name, getattr(m, name))
    assert fused_mlp_count(fast) == 0
    stock = run(fast, None)
    for (seq_a, lg_a), (seq_b, lg_b) in zip(fused[0], stock[0]):
        assert torch.equal(seq_a, seq_b) and torch.equal(lg_a, lg_b)
    assert torch.equal(fused[1], stock[1])


class _StockMLP(nn.Module):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_load_model_fuses_bf16_mlps_unless_eager():
    m, _ = kvtier.load_model("random:tiny-qwen2", device="cpu", dtype="bf16", linear="eager")
    assert fused_mlp_count(m) == 0
    m, _ = kvtier.load_model("random:tiny-qwen2", device="cpu", dtype="bf16", linear="packed")
    assert fused_mlp_count(m) == (m.config.num_hidden_layers if mlp_mod._kernel() is not None else 0)


def test_a_model_with_nothing_to_fuse_never_asks_for_the_kernel(monkeypatch):
    """The kernel (a compile on first use) and the SiLU table are asked for only when a module would be replaced:
    a float32 model's MLPs and a model without Llama-form norms (a CUDA model's, too) never pay for them."""
    from kvtier.step import fuse_norms
    from kvtier.step import norm as norm_mod

    monkeypatch.setattr(mlp_mod, "_kernel", lambda: pytest.fail("the MLP kernel was asked for"))
    monkeypatch.setattr(norm_mod, "_module", lambda: pytest.fail("the norm kernel was asked for"))
    assert fuse_mlps(random_model("tiny-qwen2", dtype=torch.float32), "packed") == 0
    assert fuse_norms(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), "packed") == 0
