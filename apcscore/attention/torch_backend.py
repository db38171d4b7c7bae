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


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float | None = None) -> torch.Tensor:
    """Causal attention of every query over its sequence's keys in the paged cache.

    query: [T, num_heads, head_dim] -> out: [T, num_heads, head_dim] (padding rows zero).
    Grouped-query heads: query head h reads kv head h // (num_heads // num_kv_heads).
    Decode rows (one query per sequence) of all sequences are computed together in one batched call;
    each prefill chunk on its own. Either way a query's keys are reduced in the same fixed tiles.
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[2])
    out = torch.zeros_like(query)
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    decode = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    if decode:
        _attend_decode(query, k_cache, v_cache, meta, decode, scale, out)
    for i in range(len(lens)):
        if cu[i + 1] - cu[i] > 1:
            _attend_prefill(query, k_cache, v_cache, meta, i, scale, out)
    return out


def _gather_padded(cache: torch.Tensor, table: torch.Tensor, seq_len: int, padded: int) -> torch.Tensor:
    """[Hkv, padded, D] in fp32: one sequence's keys (or values), zeros past seq_len."""
    blocks = table[:-(-seq_len // cache.shape[1])].long()
    out = torch.zeros(cache.shape[2], padded, cache.shape[3], device=cache.device)
    out[:, :seq_len] = cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
    return out


def _attend_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    i: int, scale: float, out: torch.Tensor) -> None:
    """Attention of one sequence's prefill chunk, skipping the work the causal mask would zero.

    Query rows are ordered by position, so for each key tile only the rows that can see some key of it
    (at least MIN_QUERY_ROWS of them) are multiplied, and only tiles that cross the diagonal are masked.
    Skipped rows would have had their running state left exactly unchanged: the bits are the same.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    hkv = k_cache.shape[2]
    group = num_heads // hkv
    start, end = meta.cu_seqlens_q_list[i], meta.cu_seqlens_q_list[i + 1]
    seq_len = meta.seq_lens_list[i]
    q_len = end - start
    padded = -(-seq_len // KV_TILE) * KV_TILE
    k = _gather_padded(k_cache, meta.block_tables[i], seq_len, padded)  # [Hkv, padded, D]
    v = _gather_padded(v_cache, meta.block_tables[i], seq_len, padded)
    # position-major rows: row j * G + g is query position j of the group's head g
    q = query[start:end].view(q_len, hkv, group, head_dim).permute(1, 0, 2, 3).reshape(
        hkv, q_len * group, head_dim).float()
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).repeat_interleave(group)
    rows = q.shape[1]
    if rows < MIN_QUERY_ROWS:
        q = torch.nn.functional.pad(q, (0, 0, 0, MIN_QUERY_ROWS - rows))
        q_pos = torch.nn.functional.pad(q_pos, (0, MIN_QUERY_ROWS - rows), value=seq_len - 1)
    q = q * scale
    n_rows = q.shape[1]
    m = torch.full((hkv, n_rows), float("-inf"), device=query.device)  # running max
    s = torch.zeros(hkv, n_rows, device=query.device)  # running sum of exp
    acc = torch.zeros_like(q)  # [Hkv, R, D]
    first = seq_len - q_len
    for t0 in range(0, seq_len, KV_TILE):
        t1 = t0 + KV_TILE
        r0 = max(0, min(group * max(0, t0 - first), n_rows - MIN_QUERY_ROWS))  # rows < r0 see no key here
        qp = q_pos[r0:]
        scores = q[:, r0:] @ k[:, t0:t1].transpose(1, 2)  # [Hkv, R - r0, tile]
        if t1 - 1 > int(qp[0]) or t1 > seq_len:  # the tile crosses the diagonal or the end
            k_pos = torch.arange(t0, t1, device=query.device)
            scores.masked_fill_(k_pos[None, None, :] > qp[None, :, None], float("-inf"))
        m_old = m[:, r0:]
        m_new = torch.maximum(m_old, scores.amax(-1))
        alpha = torch.exp(m_old - m_new)
        p = scores.sub_(m_new[..., None]).exp_()
        s[:, r0:] = s[:, r0:] * alpha + p.sum(-1)
        acc[:, r0:] = acc[:, r0:] * alpha[..., None] + p @ v[:, t0:t1]
        m[:, r0:] = m_new
    o = (acc / s[..., None])[:, :rows]  # [Hkv, q_len * G, D]
    out[start:end] = o.view(hkv, q_len, group, head_dim).permute(1, 0, 2, 3).reshape(
        q_len, num_heads, head_dim).to(query.dtype)


def _attend_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   seqs: list[int], scale: float, out: torch.Tensor) -> None:
    """Attention of the single queries of sequences `seqs` in one batch; writes their rows of `out`.

    Key tiles that every sequence shares (the same KV blocks: a prefix-cache hit) are read once and
    multiplied against all sequences' queries together; the rest per sequence. A query's tiles and their
    order are the same either way, so this changes no result, only how often shared keys are read.
    """
    device = query.device
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    seq_lens_list = [lens[i] for i in seqs]
    max_len, min_len = max(seq_lens_list), min(seq_lens_list)
    num_seqs = len(seqs)
    padded_len = -(-max_len // KV_TILE) * KV_TILE
    num_blocks = -(-padded_len // block_size)
    tables = meta.block_tables[seqs]  # [B, max_blocks]
    if tables.shape[1] < num_blocks:
        tables = torch.nn.functional.pad(tables, (0, num_blocks - tables.shape[1]))
    tables = tables[:, :num_blocks]

    # queries: [B, Hkv, R, D] (row g < G: query head g of the kv group; rows padded to MIN_QUERY_ROWS)
    rows_idx = [cu[i] for i in seqs]
    q = query[rows_idx].view(num_seqs, num_kv_heads, group, head_dim).float() * scale
    if group < MIN_QUERY_ROWS:  # same kernel, same rounding, whatever the batch
        q = torch.nn.functional.pad(q, (0, 0, 0, MIN_QUERY_ROWS - group))
    num_rows = q.shape[2]

    # tiles every sequence shares: below every query position, the same blocks in every table
    shared_tiles = 0
    if num_seqs > 1:
        same = (tables == tables[:1]).all(dim=0).tolist()
        shared_blocks = same.index(False) if False in same else len(same)
        shared_tiles = min(shared_blocks * block_size, min_len - 1) // KV_TILE
    state = None
    if shared_tiles:
        shared_len = shared_tiles * KV_TILE
        blocks = tables[0, :shared_len // block_size]
        k = k_cache[blocks].flatten(0, 1).transpose(0, 1).float()  # [Hkv, Ls, D]
        v = v_cache[blocks].flatten(0, 1).transpose(0, 1).float()
        # only the real rows of every sequence: [Hkv, B*G, D] (at least MIN_QUERY_ROWS rows)
        q_all = q[:, :, :group].transpose(0, 1).reshape(num_kv_heads, num_seqs * group, head_dim)
        real = q_all.shape[1]
        if real < MIN_QUERY_ROWS:
            q_all = torch.nn.functional.pad(q_all, (0, 0, 0, MIN_QUERY_ROWS - real))
        m, s_, acc = (x[:, :real] for x in _tiled_softmax(q_all, k, v, None, 0, shared_len))
        # back to [B, Hkv, R, ...]; padding rows start empty (max -inf, sum 0), as before any tile
        m = torch.nn.functional.pad(m.view(num_kv_heads, num_seqs, group), (0, num_rows - group),
                                    value=float("-inf")).transpose(0, 1)
        s_ = torch.nn.functional.pad(s_.view(num_kv_heads, num_seqs, group), (0, num_rows - group)).transpose(0, 1)
        acc = torch.nn.functional.pad(acc.view(num_kv_heads, num_seqs, group, head_dim),
                                      (0, 0, 0, num_rows - group)).transpose(0, 1)
        state = (m, s_, acc)

    # the remaining tiles, per sequence: [B, Hkv, L', D] from the first unshared tile
    first = shared_tiles * KV_TILE
    tail_tables = tables[:, first // block_size:]
    k = k_cache[tail_tables].flatten(1, 2)[:, :padded_len - first].permute(0, 2, 1, 3).float()
    v = v_cache[tail_tables].flatten(1, 2)[:, :padded_len - first].permute(0, 2, 1, 3).float()
    seq_lens = torch.tensor(seq_lens_list, device=device)  # [B]
    k_pos = torch.arange(first, padded_len, device=device)  # [L']
    past_end = k_pos[None, :] >= seq_lens[:, None]  # [B, L']: also the causal mask of a decode query
    # slots past a sequence's end hold stale memory: zero them, since 0 * NaN would be NaN (the engine's pool
    # starts zeroed, but this backend is also the reference for pools of any content)
    v = v.masked_fill(past_end[:, None, :, None], 0.0)
    m, s_, acc = _tiled_softmax(q, k, v, past_end[:, None, None, :], first, max_len, state)
    res = (acc / s_[..., None])[:, :, :group]  # [B, Hkv, G, D]
    out[rows_idx] = res.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _tiled_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, start: int,
                   end: int, state: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """Online softmax over the fixed key tiles [start, end) (start a multiple of KV_TILE), in fp32.

    q: [..., M, D] (pre-scaled); k, v: [..., Lp, D] holding keys from `start`, Lp a multiple of KV_TILE;
    masked: broadcastable to [..., M, Lp] or None; state: (running max, sum, accumulator) of earlier tiles.
    Returns the new state. A tile fully masked for a row leaves that row's state exactly unchanged, so a
    row's result does not depend on how many tiles its batch needed.
    """
    m, s, acc = state if state is not None else (None, None, None)
    for t0 in range(start, end, KV_TILE):
        lo, hi = t0 - start, t0 - start + KV_TILE
        scores = q @ k[..., lo:hi, :].transpose(-1, -2)  # [..., M, tile]
        if masked is not None:
            scores = scores.masked_fill(masked[..., lo:hi], float("-inf"))
        tile_max = scores.amax(-1)
        if m is None:  # first tile: the same arithmetic as the general step with m = -inf, s = acc = 0
            m = tile_max
            p = torch.exp(scores - m[..., None])
            s = p.sum(-1)
            acc = p @ v[..., lo:hi, :]
            continue
        m_new = torch.maximum(m, tile_max)
        alpha = torch.exp(m - m_new)
        p = torch.exp(scores - m_new[..., None])
        s = s * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v[..., lo:hi, :]
        m = m_new
    return m, s, acc


class TorchAttentionBackend:
    """Store-then-read paged attention built from torch ops."""

    name = "torch"

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] -> [T, Hq, D]."""
        store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(query, k_cache, v_cache, meta, scale)
