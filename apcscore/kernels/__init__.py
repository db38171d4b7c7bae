"""Compute kernels: Triton kernels for CUDA (also run on the CPU under TRITON_INTERPRET=1 in tests), each
with its torch twin beside it (`<kernel>_torch.py`: the path the CPU engine runs, and the kernel's reference).
Kernels are leaves: they import nothing from apcscore but each other.

Each Triton kernel has a Python wrapper that checks shapes, dtypes, strides and devices and raises
ValueError: store_kv (paged cache write), paged_attention (prefill and decode, batch-invariant), rms_norm
(optionally fused with the residual add), token_logprobs (fused over the vocabulary) and invariant_linear
(matmul: a batch-invariant linear). The torch twins, rms_norm_torch (rmsnorm_torch.py), token_logprobs_torch
(logprobs_torch.py), invariant_linear_torch (matmul_torch.py), rotary_torch and silu_mul_torch, import no Triton.

Names are imported lazily (`from apcscore.kernels import rms_norm` loads only that kernel's module), so
importing one module of this package does not pull in Triton for the others. paged_attention and store_kv
are imported from their modules (apcscore.kernels.paged_attention, apcscore.kernels.store_kv): a lazy name
equal to a submodule's would turn into the submodule once anything imported it (so rotary_torch and
silu_mul_torch, the names of their modules too, are imported from those modules).
"""

from __future__ import annotations

import importlib

_MODULES = {
    "rms_norm": "rmsnorm",
    "rms_norm_torch": "rmsnorm_torch",
    "token_logprobs": "logprobs",
    "token_logprobs_torch": "logprobs_torch",
    "invariant_linear": "matmul",
    "invariant_linear_torch": "matmul_torch",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'apcscore.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"apcscore.kernels.{module}"), name)
