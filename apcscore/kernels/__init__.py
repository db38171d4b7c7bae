"""Compute kernels: Triton kernels for CUDA (also run on the CPU under TRITON_INTERPRET=1 in tests), each
with its torch reference beside it. Kernels are leaves: they import nothing from apcscore but each other.

Each Triton kernel has a Python wrapper that checks shapes, dtypes, strides and devices and raises
ValueError: store_kv (paged cache write), paged_attention (prefill and decode, batch-invariant), rms_norm
(optionally fused with the residual add), token_logprobs (fused over the vocabulary) and invariant_linear
(matmul: a batch-invariant linear). The torch references the CPU engine runs, rms_norm_torch (rmsnorm_ref),
token_logprobs_torch (logprobs_ref) and invariant_linear_torch (matmul_ref), import no Triton.

Names are imported lazily (`from apcscore.kernels import rms_norm` loads only that kernel's module), so
importing one module of this package does not pull in Triton for the others. paged_attention and store_kv
are imported from their modules (apcscore.kernels.paged_attention, apcscore.kernels.store_kv): a lazy name
equal to a submodule's would turn into the submodule once anything imported it.
"""

from __future__ import annotations

import importlib

_MODULES = {
    "rms_norm": "rmsnorm",
    "rms_norm_torch": "rmsnorm_ref",
    "token_logprobs": "logprobs",
    "token_logprobs_torch": "logprobs_ref",
    "invariant_linear": "matmul",
    "invariant_linear_torch": "matmul_ref",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'apcscore.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"apcscore.kernels.{module}"), name)
