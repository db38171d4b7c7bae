"""Bindings of cpu_math.c, apcscore's portable CPU math, for CPU tensors: elementwise exp, tanh, SiLU, sigmoid and
GELU, row sums and row log-sum-exp, and double-precision exp, log, sin, cos and erf.

Their bits are a function of the inputs alone: the same on every CPU (scalar, AVX2, AVX-512; Intel, AMD, ARM),
with any thread count and any torch version (cpu_math.c's header says why). The library is
apcscore.kernels.cpu_library's (both C files in one), so `CpuGemmUnavailable` covers both. Callers go through
apcscore.kernels.rowmath, which runs torch's ops instead on other devices.
"""

from __future__ import annotations

import ctypes

import torch

from apcscore.kernels.cpu_library import forced_simd, library

OP_EXP, OP_TANH, OP_SILU, OP_SIGMOID, OP_GELU_TANH = range(5)  # apc_map_f's op codes
D_EXP, D_LOG, D_SIN, D_COS, D_ERF = range(5)  # apc_map_d's


PARALLEL_MIN_ELEMENTS = 1 << 16  # below this one thread does the work (a parallel region costs more)


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= PARALLEL_MIN_ELEMENTS else 1


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous fp32 rows [R, N] (a copy only where needed)."""
    if x.device.type != "cpu":
        raise ValueError(f"cpu_math: a tensor on {x.device}, not the CPU")
    x = x.float().contiguous()
    return x.view(-1, x.shape[-1]) if x.dim() else x.view(1, 1)


def map_float(op: int, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """op applied to every element of x (any float dtype: computed in fp32, rounded back to x's dtype)."""
    if inplace and x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu":
        src = out = x
    else:
        src = _rows(x)
        out = torch.empty_like(src)
    if src.numel():
        library().apc_map_f(op, src.data_ptr(), out.data_ptr(), src.numel(), forced_simd(), _threads(src.numel()))
    if out is x:
        return x
    out = out.view(x.shape).to(x.dtype)
    return x.copy_(out) if inplace else out


def _per_row(entry: str, x: torch.Tensor, dtype: torch.dtype, *flags: int) -> torch.Tensor:
    """One `dtype` value per row of x's last dimension [...], by the library's `entry` (0 for rows of no entries)."""
    rows = _rows(x)
    out = torch.zeros(rows.shape[0], dtype=dtype)
    if rows.numel():
        getattr(library(), entry)(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.shape[1], *flags,
                                  out.data_ptr(), forced_simd(), _threads(rows.numel()))
    return out.view(x.shape[:-1])


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """The sums of x's last dimension, fp32 [...]: LANES interleaved fp32 partial sums and a fixed tree."""
    return _per_row("apc_row_sums_f", x, torch.float32)


def row_sums_double(x: torch.Tensor, squares: bool = False) -> torch.Tensor:
    """The sums of x's last dimension (of its squares with `squares`), fp64 [...], in double lanes and a fixed
    tree: every square and conversion is exact, so the only roundings are the sums'."""
    return _per_row("apc_row_sums_d", x, torch.float64, 0 if squares else 1)


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(row))) of each row of x [..., N], fp64 [...]: the max, float exps of x - max summed in double
    lanes and a fixed tree, and our double log. All -inf rows give -inf, rows with a NaN give NaN."""
    return _per_row("apc_row_logsumexp", x, torch.float64)


def map_double(fn: int, x: torch.Tensor) -> torch.Tensor:
    """fn (D_EXP, D_LOG, D_SIN, D_COS, D_ERF) of every element, computed and returned in fp64: exp in double
    vectors (apc_exp_d's operations on each lane: its bits), every function split over threads by element."""
    src = x.to(device="cpu", dtype=torch.float64).contiguous()
    out = torch.empty_like(src)
    if src.numel():
        library().apc_map_d(fn, src.data_ptr(), out.data_ptr(), src.numel(), forced_simd(), _threads(src.numel()))
    return out


def scalar(fn: int, value: float) -> float:
    """fn of one Python float (D_EXP, D_LOG, ...), in double: apc_map_d over one element, so the call runs in the
    floating-point environment map_double's does (fp_enter: round to nearest, no flush-to-zero, no
    denormals-are-zero), whatever torch.set_flush_denormal or another library left set (apc_exp_d and friends
    called on their own would compute in the caller's: log(1e-310) -inf under DAZ)."""
    if fn not in (D_EXP, D_LOG, D_SIN, D_COS, D_ERF):
        raise ValueError(f"cpu_math.scalar: function code {fn}, not one of D_EXP .. D_ERF")
    src, out = (ctypes.c_double * 1)(float(value)), (ctypes.c_double * 1)()
    library().apc_map_d(fn, src, out, 1, forced_simd(), 1)
    return out[0]
