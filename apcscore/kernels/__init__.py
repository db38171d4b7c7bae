"""Triton kernels for CUDA (also run on the CPU under TRITON_INTERPRET=1 in tests).

Each kernel has a Python wrapper that checks shapes, dtypes, strides and devices and raises ValueError:
store_kv (paged cache write), paged_attention (prefill and decode, batch-invariant), rms_norm (optionally
fused with the residual add) and token_logprobs (fused over the vocabulary; token_logprobs_torch is the
torch reference the CPU engine uses).
"""

from apcscore.kernels.logprobs import token_logprobs, token_logprobs_torch
from apcscore.kernels.paged_attention import paged_attention
from apcscore.kernels.rmsnorm import rms_norm
from apcscore.kernels.store_kv import store_kv

__all__ = ["paged_attention", "rms_norm", "store_kv", "token_logprobs", "token_logprobs_torch"]
