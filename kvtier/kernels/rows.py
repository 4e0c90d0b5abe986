"""Small per-row ops of the decode extension: each row's first maximum (serve's greedy pick) and each row's new K/V written into its own cache, one call for all rows."""

from __future__ import annotations

import torch

from .build import decode_module


def append_rows(k: torch.Tensor, v: torch.Tensor, idx: list[int], dst_ks: list[torch.Tensor],
                dst_vs: list[torch.Tensor], cols: list[int]) -> None:
    """Write row ``i``'s new token ``k[:, idx[i]]`` / ``v[:, idx[i]]`` ((H, M, D), last dim contiguous) into column
    ``cols[i]`` of ``dst_ks[i]`` / ``dst_vs[i]`` ((1, H, C_i, D), the same dtype), for every row in one call: what
    ``dst[:, :, col] = k[:, idx]`` per row does, without two dispatches per row and layer."""
    mod = decode_module()
    if mod is None:
        raise RuntimeError("the fused CPU decode kernel is not available (see the log for why)")
    mod.append_rows(k, v, list(idx), dst_ks, dst_vs, list(cols))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum: ``x`` (R, V) float32 or bfloat16 on the CPU -> (R,) int64, what
    ``x.float().argmax(dim=-1)`` gives (a NaN counts as the maximum) in one pass over ``x``, rows in parallel, without
    a float32 copy: serve's greedy pick. Falls back to that expression (its reference) where the kernel is not
    built."""
    mod = decode_module()
    if mod is None or x.device.type != "cpu" or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        return x.float().argmax(dim=-1)
    return mod.argmax_rows(x if x.stride(-1) == 1 else x.contiguous())
