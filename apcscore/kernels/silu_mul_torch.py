"""The torch forms of the Llama MLP's `silu(gate) * up` (the references of kernels/silu_mul.py). Imports no Triton.

silu_mul_torch is what the torch backend runs (rowmath.silu, then torch's product: on the CPU the portable SiLU,
on CUDA torch's own kernels); silu_mul_reference spells out the rounding points of torch's CUDA form, with the exp
function left to the caller, so that a test can hold the Triton kernel to them wherever it runs.
"""

from __future__ import annotations

from typing import Callable

import torch

from apcscore.kernels import rowmath


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as two elementwise ops: the SiLU rounded to gate's dtype, then the product rounded again."""
    return rowmath.silu(gate) * up


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor,
                       exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> torch.Tensor:
    """torch's CUDA `F.silu(gate) * up`, rounding point by rounding point, with `exp` (fp32 in, fp32 out) for its
    expf: s = gate / (1 + exp(-gate)) in fp32 (IEEE add and division), rounded to gate's dtype (F.silu's output);
    then s * up in fp32, rounded once to the dtype (the product of two half tensors in float opmath)."""
    h = gate.float()
    s = (h / (1.0 + exp(-h))).to(gate.dtype)
    return (s.float() * up.float()).to(gate.dtype)
