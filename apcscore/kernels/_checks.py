"""Argument checks shared by the kernel wrappers: every problem is a ValueError that names the argument."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_tensors(kernel: str, **tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device usable by Triton."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{kernel}: all tensors must be on one device, got {listed}")
    if first.type != "cuda" and not interpreting():
        raise ValueError(f"{kernel}: Triton kernels need CUDA tensors, got {first}; "
                         "on a CPU set TRITON_INTERPRET=1 (tests only) or use the torch implementation")


def check_shape(kernel: str, name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{kernel}: {name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def check_dtype(kernel: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{kernel}: {name} must have dtype in {allowed}, got {t.dtype}")


def check_float_input(kernel: str, name: str, t: torch.Tensor, ndim: int) -> None:
    """t has ndim dimensions, a dtype of FLOAT_DTYPES and a contiguous last dimension."""
    check_shape(kernel, name, t, ndim)
    check_dtype(kernel, name, t, FLOAT_DTYPES)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{kernel}: the last dimension of {name} must be contiguous (stride 1), "
                         f"got strides {t.stride()}; pass {name}.contiguous()")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
