"""Paged attention on CUDA through the Triton kernels: store the new K/V, then attend (write-then-read)."""

from __future__ import annotations

import torch

from apcscore.attention.decode_groups import DecodeGroups
from apcscore.attention.metadata import AttentionMetadata
from apcscore.kernels.paged_attention import paged_attention, tile_config
from apcscore.kernels.paged_decode_shared import shared_prefix_decode
from apcscore.kernels.store_kv import store_kv


def _planned_for(groups: DecodeGroups, query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the groups were planned for this layer's tiles (its head_dim and query heads per KV head)."""
    group = query.shape[1] // k_cache.shape[2]
    return group == groups.group and tile_config(query.shape[2], group)[:2] == (groups.block_m, groups.block_n)


class TritonAttentionBackend:
    """Same interface and semantics as TorchAttentionBackend, built from the Triton kernels."""

    name = "triton"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D] (rows past cu_seqlens_q[-1] not written).

        window (a query at p sees keys > p - window) and softcap (scores -> tanh(s / c) * c before masking):
        Gemma's sliding-window and soft-capped layers, as in TorchAttentionBackend; None: plain causal.
        meta.decode_groups (decode sequences sharing prefix blocks) run in the shared-prefix kernel, the other
        sequences in paged_attention: the same bits either way. Sliding-window layers run paged_attention alone.
        """
        if k_cache.shape[1] != meta.block_size:
            raise ValueError(f"paged_attention: the cache has block_size {k_cache.shape[1]} but meta says "
                             f"{meta.block_size}")
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        groups = meta.decode_groups if window is None else None  # windowed layers: no groups
        if groups is not None and not _planned_for(groups, query, k_cache):
            groups = None
        out = paged_attention(query, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale,
                              window=window, softcap=softcap, skip=groups.grouped if groups is not None else None)
        if groups is not None:
            shared_prefix_decode(query, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                                 groups.table, out, scale, softcap=softcap)
        return out
