"""int8 symmetric quantization with one scale per (token, kv-head).

The round trip error is at most scale/2 per element (before the final cast to the model dtype);
a token promoted out of T2 keeps that error, since its full-precision values no longer exist.
"""

from __future__ import annotations

import torch


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim.

    Args:
        x: (..., D) float.
    Returns:
        q: (..., D) int8 and scale: (..., 1) float32, with x ~= q * scale.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(..., D) int8, (..., 1) float32 -> (..., D) ``dtype``."""
    return (q.float() * scale).to(dtype)


def int8_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """T2 bytes of one token over all layers: K and V, each D int8 values plus one float32 scale per kv-head."""
    return layers * kv_heads * (head_dim + 4) * 2
