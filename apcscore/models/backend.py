"""The compute backend a model runs on, chosen in one place: attention, RMSNorm and logprobs.

"torch" runs anywhere (the CPU engine, and CUDA as a reference); "triton" runs the Triton kernels of
apcscore.kernels on CUDA (and on the CPU under TRITON_INTERPRET=1 in tests). The backends' modules are
imported only when one is selected, so choosing "torch" never imports Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class Backend:
    """What a model computes with.

    name: "torch" | "triton".
    attention: the attention backend: forward(query, key, value, k_cache, v_cache, meta, scale) -> out
        (write-then-read over the paged KV cache; apcscore.attention), optionally allocate_kv_cache(...).
    rms_norm: (x, weight, eps, residual=None) -> out, or (out, new residual) when residual is given.
    token_logprobs: (logits [N, V], targets [N], k, ranks=True) -> logprobs, ranks, top ids, top logprobs.
    """

    name: str
    attention: Any
    rms_norm: Callable[..., Any]
    token_logprobs: Callable[..., tuple[Any, ...]]


def select_backend(name: str, device_type: str = "cpu") -> Backend:
    """The backend called `name`; "auto" is triton on CUDA (device_type "cuda") and torch elsewhere."""
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        from apcscore.attention.torch_backend import TorchAttentionBackend
        from apcscore.kernels.logprobs_ref import token_logprobs_torch
        from apcscore.kernels.rmsnorm_ref import rms_norm_torch

        return Backend("torch", TorchAttentionBackend(), rms_norm_torch, token_logprobs_torch)
    if name == "triton":
        from apcscore.attention.triton_backend import TritonAttentionBackend
        from apcscore.kernels.logprobs import token_logprobs
        from apcscore.kernels.rmsnorm import rms_norm

        return Backend("triton", TritonAttentionBackend(), rms_norm, token_logprobs)
    raise ValueError(f"unknown backend {name!r}; one of auto, {', '.join(BACKENDS)}")
