"""Paged attention in plain torch: runs anywhere (CPU, CUDA), the reference for the Triton kernels.

Write-then-read: the new K/V are stored into the paged cache first, then each query reads *all* keys of
its sequence, cached or new, back from the cache, in fixed-size tiles counted from position 0. The
softmax is reduced tile by tile in that fixed order, so a query's result does not depend on how its
prompt was chunked, what was cached before, or what else is in the batch.
"""

from __future__ import annotations

import math

import torch

from apcscore.attention.metadata import AttentionMetadata

KV_TILE = 128  # keys per tile; the last tile is padded to full size, so every reduction has one shape
MIN_QUERY_ROWS = 16  # CPU GEMMs switch kernels (and rounding) below a few rows: pad small query blocks


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into the paged cache.

    key, value: [T, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [T] (-1 rows are skipped).
    """
    num_tokens = slot_mapping.shape[0]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    valid = slot_mapping[:num_tokens] >= 0
    if bool(valid.all()):
        k_flat.index_copy_(0, slot_mapping, key[:num_tokens].to(k_cache.dtype))
        v_flat.index_copy_(0, slot_mapping, value[:num_tokens].to(v_cache.dtype))
    else:
        slots = slot_mapping[valid]
        k_flat.index_copy_(0, slots, key[:num_tokens][valid].to(k_cache.dtype))
        v_flat.index_copy_(0, slots, value[:num_tokens][valid].to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len keys (or values) of one sequence, [seq_len, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float | None = None) -> torch.Tensor:
    """Causal attention of every query over its sequence's keys in the paged cache.

    query: [T, num_heads, head_dim] -> out: [T, num_heads, head_dim] (padding rows zero).
    Grouped-query heads: query head h reads kv head h // (num_heads // num_kv_heads).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.zeros_like(query)
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        k = gather_kv(k_cache, meta.block_tables[i], seq_len)  # [L, Hkv, D]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len)
        q = query[start:end].view(q_len, num_kv_heads, group, head_dim)  # [q, Hkv, G, D]
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim).float()
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).repeat(group)  # [G*q]
        rows = q.shape[1]
        if rows < MIN_QUERY_ROWS:  # same kernel, same rounding, whatever the chunking
            q = torch.nn.functional.pad(q, (0, 0, 0, MIN_QUERY_ROWS - rows))
            q_pos = torch.nn.functional.pad(q_pos, (0, MIN_QUERY_ROWS - rows), value=seq_len - 1)
        out_seq = _tiled_softmax_attention(q * scale, k.transpose(0, 1).float(), v.transpose(0, 1).float(),
                                           q_pos)[:, :rows]  # [Hkv, G*q, D]
        out[start:end] = out_seq.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(
            q_len, num_heads, head_dim).to(query.dtype)
    return out


def _tiled_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Online softmax over fixed key tiles from position 0, in fp32.

    q: [H, M, D] (pre-scaled), k, v: [H, L, D], q_pos: [M] absolute position of each query row.
    """
    seq_len = k.shape[1]
    m = torch.full(q.shape[:2], float("-inf"), device=q.device)  # running max [H, M]
    s = torch.zeros(q.shape[:2], device=q.device)  # running sum of exp [H, M]
    acc = torch.zeros_like(q)  # [H, M, D]
    last_pos = int(q_pos.max()) if q_pos.numel() else -1
    padded = -(-seq_len // KV_TILE) * KV_TILE
    if padded != seq_len:  # zero keys/values past the end; masked below, so they add exact zeros
        k = torch.nn.functional.pad(k, (0, 0, 0, padded - seq_len))
        v = torch.nn.functional.pad(v, (0, 0, 0, padded - seq_len))
    for t0 in range(0, min(seq_len, last_pos + 1), KV_TILE):
        t1 = t0 + KV_TILE
        scores = q @ k[:, t0:t1].transpose(1, 2)  # [H, M, tile]
        k_pos = torch.arange(t0, t1, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        s = s * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[:, t0:t1]
        m = m_new
    return acc / s[..., None]


class TorchAttentionBackend:
    """Store-then-read paged attention built from torch ops."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]."""
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(query, k_cache, v_cache, meta, scale)
