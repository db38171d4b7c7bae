"""The ops a model computes with (`Ops`), chosen in one place: linear layers, attention, RMSNorm and logprobs.

The attention backends register here by name (`BACKENDS`, filled by `@backend`): "torch" runs anywhere (the CPU
engine, and CUDA as a reference); "triton" runs the Triton kernels of apcscore.kernels on CUDA (and on the CPU
under TRITON_INTERPRET=1 in tests). A backend's modules are imported only when it is selected, so choosing "torch"
on a CPU never imports Triton.

Linear layers (every projection and the LM head) are batch-invariant by default; which GEMM runs where, and why:
docs/architecture.md, "The batch-invariance contract", item 1 (`select_linear`). Each linear says how it fixes its
order (its `construction`, which the run metadata records) and whether that order is the same on every CPU
(`portable`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable

from apcscore.kernels.rotary_torch import rotary_torch
from apcscore.kernels.silu_mul_torch import silu_mul_torch


@dataclass(frozen=True)
class Ops:
    """What a model computes with.

    name: the backend's name in BACKENDS ("torch" | "triton").
    linear: (x [M, K], weight [N, K], bias=None, out=None) -> [M, N]; `out` (a reused buffer, rows >= M) is
        written when given. Batch-invariant unless batch_invariant is False. It has `construction` (str) and may
        have `portable` (bool, default False): see linear_construction and portable_construction.
    attention: the attention backend: forward(query, key, value, k_cache, v_cache, meta, scale) -> out
        (write-then-read over the paged KV cache; apcscore.attention), optionally allocate_kv_cache(...).
    rms_norm: (x, weight, eps, residual=None) -> out, or (out, new residual) when residual is given.
    token_logprobs: (logits [N, V], targets [N], k, ranks=True) -> logprobs, ranks, top ids, top logprobs.
    rotary: (q [T, Hq, D], k [T, Hkv, D], cos [T, R], sin [T, R]) -> rotated q, k (transformers' arithmetic;
        R < D: partial rotary). The Triton one is one launch with torch's bits (kernels/rotary.py).
    silu_mul: (gate [T, I], up [T, I]) -> silu(gate) * up, the SiLU MLP's activation. The torch one is
        rowmath.silu(gate) * up (the CPU's portable SiLU); the Triton one is one launch with the bits of torch's
        two CUDA kernels (kernels/silu_mul.py).
    """

    name: str
    linear: Callable[..., Any]
    batch_invariant: bool  # asked for; whether it holds on this machine is the engine's probe's to say
    attention: Any
    rms_norm: Callable[..., Any]
    token_logprobs: Callable[..., tuple[Any, ...]]
    rotary: Callable[..., tuple[Any, Any]] = rotary_torch
    silu_mul: Callable[..., Any] = silu_mul_torch


def select_linear(device_type: str, batch_invariant: bool) -> Callable[..., Any]:
    """The linear layer of a device: our fixed-order GEMM on the CPU (torch's GEMM on rows padded to 16 where it
    cannot be built: the engine's start-up probe decides), the Triton matmul on CUDA, the library GEMM without
    batch invariance."""
    from apcscore.kernels.matmul_torch import invariant_linear_torch, plain_linear

    if not batch_invariant:
        return plain_linear
    if device_type == "cuda":
        from apcscore.kernels.matmul import invariant_linear

        return invariant_linear
    try:
        from apcscore.kernels.cpu_gemm import FixedOrderLinear
        from apcscore.kernels.cpu_library import CpuGemmUnavailable, library

        library()  # compiled (once per machine) and loaded now, so a failure is seen here
        return FixedOrderLinear()
    except CpuGemmUnavailable as e:
        warnings.warn(f"the fixed-order CPU GEMM is unavailable ({e}); falling back to torch's GEMM on rows "
                      "padded to 16, whose batch invariance the engine's start-up probe checks", stacklevel=2)
        return invariant_linear_torch


def linear_construction(linear: Callable[..., Any]) -> str:
    """How a linear layer fixes its reduction order, as the run metadata records it: the linear's own word."""
    return linear.construction  # type: ignore[attr-defined]


def portable_construction(linear: Callable[..., Any]) -> bool:
    """Whether a CPU model computing with `linear` gives the same bits on every CPU: a portable linear (our
    fixed-order GEMM), with the portable row math (apcscore.kernels.rowmath), both from the one C library."""
    from apcscore.kernels.rowmath import portable

    return getattr(linear, "portable", False) and portable()


# The attention backends by name: each builds its Ops around the linear layer (make(linear, batch_invariant)).
BACKENDS: dict[str, Callable[[Callable[..., Any], bool], Ops]] = {}


def backend(name: str) -> Callable[[Callable[..., Ops]], Callable[..., Ops]]:
    """Register the decorated `make(linear, batch_invariant) -> Ops` as the attention backend `name`."""
    def register(make: Callable[..., Ops]) -> Callable[..., Ops]:
        BACKENDS[name] = make
        return make
    return register


@backend("torch")
def torch_ops(linear: Callable[..., Any], batch_invariant: bool) -> Ops:
    """torch attention (apcscore.attention.torch_backend), the torch twins of the kernels, the CPU's row math."""
    from apcscore.attention.torch_backend import TorchAttentionBackend
    from apcscore.kernels.logprobs_torch import token_logprobs_torch
    from apcscore.kernels.rowmath import rms_norm

    return Ops("torch", linear, batch_invariant, TorchAttentionBackend(), rms_norm, token_logprobs_torch)


@backend("triton")
def triton_ops(linear: Callable[..., Any], batch_invariant: bool) -> Ops:
    """Triton attention (apcscore.attention.triton_backend) and the Triton kernels of apcscore.kernels."""
    from apcscore.attention.triton_backend import TritonAttentionBackend
    from apcscore.kernels.logprobs import token_logprobs
    from apcscore.kernels.rmsnorm import rms_norm
    from apcscore.kernels.rotary import rotary
    from apcscore.kernels.silu_mul import silu_mul

    return Ops("triton", linear, batch_invariant, TritonAttentionBackend(), rms_norm, token_logprobs, rotary,
               silu_mul)


def select_ops(name: str, device_type: str = "cpu", batch_invariant: bool = True) -> Ops:
    """The ops of the attention backend called `name`; "auto" is triton on CUDA (device_type "cuda") and torch
    elsewhere."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    make = BACKENDS.get(name)
    if make is None:
        raise ValueError(f"unknown backend {name!r}; one of auto, {', '.join(BACKENDS)}")
    return make(select_linear(device_type, batch_invariant), batch_invariant)
