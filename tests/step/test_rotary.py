"""kvtier.step.rotary: the fused bf16 rotary embedding equals transformers' apply_rotary_pos_emb bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from kvtier.step import rotary as rotary_mod
from kvtier.step.rotary import fused_rotary


def _inputs(hq, hk, n, d, layout, seed=0, scale=4.0, b=1, per_row=False):
    g = torch.Generator().manual_seed(seed)

    def proj(h):  # what a projection's output viewed per head gives: (B, N, H, D) -> (B, H, N, D) transposed
        x = (torch.randn(b, n, h, d, generator=g) * scale).bfloat16()
        return x.transpose(1, 2) if layout == "projected" else x.transpose(1, 2).contiguous()

    pos = torch.arange(7, 7 + n, dtype=torch.float32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([pos[:, None] * inv[None]] * 2, dim=-1)[None]  # (1, N, D), as the rotary modules build it
    if per_row:  # (B, N, D): each row at its own positions (left padding)
        emb = torch.cat([emb + 3 * i for i in range(b)])
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    if layout == "sliced":  # column slices of one fused q/k/v product (B, N, (Hq + 2 Hk) D), viewed per head
        y = (torch.randn(b, n, (hq + 2 * hk) * d, generator=g) * scale).bfloat16()
        q, k = y[..., : hq * d], y[..., hq * d : (hq + hk) * d]
        return q.view(b, n, hq, d).transpose(1, 2), k.view(b, n, hk, d).transpose(1, 2), cos, sin
    return proj(hq), proj(hk), cos, sin


@pytest.mark.parametrize("hq,hk,n,d,b,per_row", [(14, 2, 1, 64, 1, False), (14, 2, 37, 64, 1, False),
                                                 (8, 8, 5, 128, 1, False), (4, 2, 300, 32, 1, False),
                                                 (2, 1, 3, 8, 1, False), (14, 2, 1, 64, 5, False),
                                                 (4, 2, 9, 32, 3, False), (4, 2, 9, 32, 3, True)])
@pytest.mark.parametrize("layout", ["projected", "contiguous", "sliced"])
def test_fused_rotary_equals_the_models_function_bit_for_bit(hq, hk, n, d, b, per_row, layout):
    """One row or a batch (a batch decode step: B rows, one token each, one position shared or each its own)."""
    rot = fused_rotary(apply_rotary_pos_emb)
    assert rot is not apply_rotary_pos_emb, "the step kernel did not build"
    for seed in range(3):
        q, k, cos, sin = _inputs(hq, hk, n, d, layout, seed, scale=[0.02, 4.0, 300.0][seed], b=b, per_row=per_row)
        want, got = apply_rotary_pos_emb(q, k, cos, sin), rot(q, k, cos, sin)
        for w, x in zip(want, got):
            assert x.shape == w.shape and x.dtype == torch.bfloat16 and torch.equal(x, w)
            # laid out as torch lays its result out (a size-1 dim's stride means nothing)
            assert [st for st, sz in zip(x.stride(), x.shape) if sz > 1] == \
                [st for st, sz in zip(w.stride(), w.shape) if sz > 1]


def test_what_the_kernel_does_not_take_goes_to_the_models_function(monkeypatch):
    calls = []

    def ref(q, k, cos, sin):
        calls.append(q.dtype)
        return apply_rotary_pos_emb(q, k, cos, sin)

    rot = fused_rotary(ref)
    q, k, cos, sin = _inputs(4, 2, 5, 16, "projected")
    rot(q.float(), k.float(), cos.float(), sin.float())  # float32: the model's function
    rot(q, k, torch.cat([cos, cos]), torch.cat([sin, sin]))  # one row, two rows' positions: broadcast by torch
    assert calls == [torch.float32, torch.bfloat16]
    monkeypatch.setattr(rotary_mod, "_module", lambda: None)  # no kernel built: the function itself
    assert fused_rotary(ref) is ref
