"""Rotary position embedding as transformers applies it (the torch reference of kernels/rotary.py, and the path the
torch backend runs). Imports no Triton."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: (-x2, x1) for the halves x1, x2 of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos and sin [T, R] (R <= D, even) -> rotated q, k, new contiguous tensors.

    The first R dimensions of each head become x * cos + rotate_half(x) * sin, each product and the sum rounded to
    the inputs' dtype (transformers' arithmetic); the other D - R (partial rotary, e.g. Phi-4-mini) are kept.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, R]
    r = cos.shape[-1]
    if r == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return (torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1),
            torch.cat([k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1))
