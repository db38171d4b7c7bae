"""The row ops and transcendental functions every model and attention path computes with: exp, tanh, SiLU, GELU,
sigmoid, softmax, row sums, RMSNorm, LayerNorm, log-sum-exp, and the double functions of tables and per-record
figures.

On CPU tensors they are apcscore's portable construction (apcscore.kernels.cpu_math: fixed-order reductions, no
fused multiply-adds, our own exp/log/tanh/erf/sin/cos), so a result's bits are the same on every CPU, vector
width and thread count. Elsewhere (CUDA, where bits are per GPU model anyway) and where the C library cannot be
built (no compiler: `portable()` is False, and the run metadata says so), torch's own ops, which follow the ISA.
"""

from __future__ import annotations

import functools
import math

import torch

from apcscore.kernels import cpu_math
# portable(): whether the portable CPU math is available here (the C library builds and loads)
from apcscore.kernels.cpu_library import available as portable


def ours(x: torch.Tensor) -> bool:
    """Whether x is computed with the portable construction: a CPU tensor, where the library is available."""
    return x.device.type == "cpu" and portable()


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x), elementwise (fp32 math, x's dtype)."""
    return cpu_math.map_float(cpu_math.OP_EXP, x) if ours(x) else torch.exp(x)


def exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place."""
    return cpu_math.map_float(cpu_math.OP_EXP, x, inplace=True) if ours(x) else x.exp_()


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x), elementwise."""
    return cpu_math.map_float(cpu_math.OP_TANH, x) if ours(x) else torch.tanh(x)


def softcap(x: torch.Tensor, cap: float, inplace: bool = False) -> torch.Tensor:
    """tanh(x / cap) * cap (Gemma 2's soft-capping of attention scores and logits), each step rounded."""
    if inplace:
        x.div_(cap)
        cpu_math.map_float(cpu_math.OP_TANH, x, inplace=True) if ours(x) else x.tanh_()
        return x.mul_(cap)
    return tanh(x / cap) * cap


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), as torch computes it: x / (1 + exp(-x)), in fp32, rounded to x's dtype."""
    return cpu_math.map_float(cpu_math.OP_SILU, x) if ours(x) else torch.nn.functional.silu(x)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), elementwise."""
    return cpu_math.map_float(cpu_math.OP_SIGMOID, x) if ours(x) else torch.sigmoid(x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU: approximate="tanh" is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (torch's operation order);
    "none" is the exact 0.5 x (1 + erf(x / sqrt 2)), erf in double."""
    if not ours(x):
        return torch.nn.functional.gelu(x, approximate=approximate)
    if approximate == "tanh":
        return cpu_math.map_float(cpu_math.OP_GELU_TANH, x)
    h = x.float()
    # the fp32 product, erf in double, rounded once
    erf = cpu_math.map_double(cpu_math.D_ERF, h * math.sqrt(0.5)).float()
    return (h * 0.5 * (1.0 + erf)).to(x.dtype)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sums over the last dimension, fp32 (a fixed order on the CPU: interleaved lanes, a fixed tree)."""
    return cpu_math.row_sums(x) if ours(x) else x.float().sum(-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension, fp32: exp(x - max) / sum."""
    if not ours(x):
        return torch.softmax(x.float(), dim=-1)
    h = x.float()
    e = exp(h - h.amax(-1, keepdim=True))
    return e / row_sum(e)[..., None]


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) over the last dimension, fp64 on the CPU (double sums and log), fp32 elsewhere."""
    return cpu_math.row_logsumexp(x) if ours(x) else torch.logsumexp(x.float(), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             offset: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's LlamaRMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype) (offset: Gemma's
    (offset + weight) in fp32, applied before the cast); with `residual`: x += residual first, and the new residual
    is returned too. On the CPU the mean of squares is a double sum in a fixed order, and 1 / sqrt(mean + eps) is
    taken in double and rounded once."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    if ours(x):
        mean = cpu_math.row_sums_double(h, squares=True) / h.shape[-1]  # [...] fp64
        h = h * (1.0 / torch.sqrt(mean + eps)).float()[..., None]
    else:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        out = (h * (offset + weight.float())).to(x.dtype)
    else:
        out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension: (x - mean) * rsqrt(var + eps) * weight + bias, in fp32, x's dtype out.
    On the CPU the mean and the variance are double sums in a fixed order, each rounded once."""
    if not ours(x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    h = x.float()
    n = h.shape[-1]
    centred = h - (cpu_math.row_sums_double(h) / n).float()[..., None]
    var = cpu_math.row_sums_double(centred, squares=True) / n
    rstd = (1.0 / torch.sqrt(var + eps)).float()[..., None]
    return (centred * rstd * weight.float() + bias.float()).to(x.dtype)


def exp_scalar(value: float) -> float:
    """exp of a Python float, the same bits on every machine where the library is (libm's otherwise)."""
    return cpu_math.scalar(cpu_math.D_EXP, value) if portable() else math.exp(value)


def log_scalar(value: float) -> float:
    """log of a Python float (see exp_scalar)."""
    return cpu_math.scalar(cpu_math.D_LOG, value) if portable() else math.log(value)


def activation(name: str):
    """The MLP activation called `name` in a transformers config (ACT2FN's names), with the portable functions on
    the CPU: silu / swish, gelu (erf), gelu_pytorch_tanh, relu. Other names take transformers' own (ACT2FN),
    whose bits follow the CPU."""
    portable_fns = {"silu": silu, "swish": silu, "gelu": gelu,
                    "gelu_pytorch_tanh": functools.partial(gelu, approximate="tanh"), "relu": torch.relu}
    if name in portable_fns:
        return portable_fns[name]
    from transformers.activations import ACT2FN

    return ACT2FN[name]
