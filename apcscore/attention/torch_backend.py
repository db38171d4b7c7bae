"""Paged attention in plain torch: runs anywhere (CPU, CUDA), the reference for the Triton kernels.

Write-then-read: the new K/V are stored into the paged cache first, then each query reads *all* keys of
its sequence, cached or new, back from the cache, in fixed-size tiles counted from position 0. The
softmax is reduced tile by tile in that fixed order, so a query's result does not depend on how its
prompt was chunked, what was cached before, or what else is in the batch.

Layout: the cache is indexed as [num_blocks, block_size, num_kv_heads, head_dim] like the Triton kernels'
caches, but the pool this backend asks for (`allocate_kv_cache`) lies in memory heads-major,
[num_kv_heads, num_blocks * block_size, head_dim]: gathering a sequence's keys with one index then gives
[Hkv, L, D], the layout the batched matmuls read, with no transposing copy. Any other layout also works
(it is copied to heads-major first: fine for tests, slow for an engine).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from apcscore.attention.metadata import AttentionMetadata
from apcscore.attention.torch_decode import attend_decode
from apcscore.attention.torch_prefill import attend_prefill, attend_prefill_batched, batched_prefill_groups
from apcscore.kernels import cpu_attention


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      allocate: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D] over heads-major memory.

    allocate(shape) returns the zeroed pool (the model runner's allocator).
    """
    pool = allocate((2, num_layers, num_kv_heads, num_blocks, block_size, head_dim))
    return [(pool[0, i].permute(1, 2, 0, 3), pool[1, i].permute(1, 2, 0, 3)) for i in range(num_layers)]


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into the paged cache.

    key, value: [T, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [T] (-1 rows are skipped).
    """
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    for new, cache in ((key, k_cache), (value, v_cache)):  # the cache as [num_blocks * block_size, Hkv, D]
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, new.to(cache.dtype))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float | None = None, window: int | None = None, softcap: float | None = None
                    ) -> torch.Tensor:
    """Causal attention of every query over its sequence's keys in the paged cache.

    query: [T, num_heads, head_dim] -> out: [T, num_heads, head_dim]. Every real row is written by one of the
    two paths, so only the padding rows past cu_seqlens_q[-1] are zeroed (a few rows), not the whole output.
    Grouped-query heads: query head h reads kv head h // (num_heads // num_kv_heads).
    Decode rows (one query per sequence) of all sequences are computed together in one batched call; short
    prefill chunks in batches of similar size, long ones on their own (torch_prefill.py). Either way a
    query's keys are reduced in the same fixed tiles.
    window: a query at position p sees only keys > p - window (sliding-window layers; transformers' rule), the
    others masked inside the same fixed tiles (a wholly masked tile changes no row's state: tiles.tiled_softmax).
    softcap: scores become tanh(scores / softcap) * softcap before masking (Gemma 2's attention soft-capping).
    On the CPU, where apcscore.kernels.cpu_attention supports the call, every row is computed in one call of that
    kernel instead: the same operations in the same order per row, so the same bits, without the per-tile torch ops.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[2])
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    out[cu[-1]:].zero_()  # padding rows: dropped by the caller, zero so that no stale memory flows on
    if cpu_attention.supported(query, k_cache, v_cache, window, softcap):
        cpu_attention.attention(query, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, scale,
                                out)
        return out
    decode = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    if decode:
        attend_decode(query, k_cache, v_cache, meta, decode, scale, out, window, softcap)
    batches, alone = batched_prefill_groups(meta, query.shape[1] // k_cache.shape[2], query.device)
    for seqs in batches:
        attend_prefill_batched(query, k_cache, v_cache, meta, seqs, scale, out, window, softcap)
    for i in alone:
        attend_prefill(query, k_cache, v_cache, meta, i, scale, out, window, softcap)
    return out


class TorchAttentionBackend:
    """Store-then-read paged attention built from torch ops."""

    name = "torch"
    allocate_kv_cache = staticmethod(allocate_kv_cache)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]; window, softcap: see paged_attention."""
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(query, k_cache, v_cache, meta, scale, window, softcap)
