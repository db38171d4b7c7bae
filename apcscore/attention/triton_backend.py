"""Paged attention on CUDA through the Triton kernels: store the new K/V, then attend (write-then-read)."""

from __future__ import annotations

import torch

from apcscore.attention.metadata import AttentionMetadata
from apcscore.kernels.paged_attention import paged_attention
from apcscore.kernels.store_kv import store_kv


class TritonAttentionBackend:
    """Same interface and semantics as TorchAttentionBackend, built from the Triton kernels."""

    name = "triton"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D] (rows past cu_seqlens_q[-1] not written).

        window (a query at p sees keys > p - window) and softcap (scores -> tanh(s / c) * c before masking):
        Gemma's sliding-window and soft-capped layers, as in TorchAttentionBackend; None: plain causal.
        """
        if k_cache.shape[1] != meta.block_size:
            raise ValueError(f"paged_attention: the cache has block_size {k_cache.shape[1]} but meta says "
                             f"{meta.block_size}")
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(query, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale,
                               window=window, softcap=softcap)
