"""The torch reference of the RMSNorm kernel (apcscore.kernels.rmsnorm), and the path the CPU engine runs.
Imports no Triton."""

from __future__ import annotations

from typing import Any

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> Any:
    """Hugging Face LlamaRMSNorm; with `residual`: x += residual first and also return the new residual."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)
