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
from dataclasses import dataclass
from typing import Any

import torch

from apcscore.attention.metadata import AttentionMetadata
from apcscore.attention.products import products as _products

KV_TILE = 64  # keys per tile; the last tile is padded to full size, so every reduction has one shape
# Query rows of every attention product come in multiples of this. With the fixed-order CPU kernel (_products)
# the row count cannot change a row's bits; the tiles remain for torch.matmul (CUDA, or no C compiler), where a
# GEMM may round a row by the shape of its call
QUERY_ROW_TILE = 16


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      allocate: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, Hkv, D] over heads-major memory.

    allocate(shape) returns the zeroed pool (the model runner's allocator).
    """
    pool = allocate((2, num_layers, num_kv_heads, num_blocks, block_size, head_dim))
    return [(pool[0, i].permute(1, 2, 0, 3), pool[1, i].permute(1, 2, 0, 3)) for i in range(num_layers)]


def _heads_major(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, D] cache -> [Hkv * num_slots, D] (a view for this backend's own pools)."""
    return cache.permute(2, 0, 1, 3).reshape(-1, cache.shape[3])


def _pad_slots(slots: torch.Tensor, length: int) -> torch.Tensor:
    """`slots` [L] padded to `length` with the sequence's own first slot.

    Padding keys are masked (probability exactly 0), but their values are still multiplied: 0 * NaN would be
    NaN. Reading the sequence's own position 0 there adds no new way to get NaN (a NaN at a real position
    spoils the result anyway), whatever the rest of the pool holds, and needs no zeroing pass.
    """
    return torch.nn.functional.pad(slots, (0, length - slots.shape[0]), value=int(slots[0]))


def _head_rows(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rows of `_heads_major(cache)` for `slots` (any shape S): [Hkv * prod(S)] int64, head-major."""
    num_slots = cache.shape[0] * cache.shape[1]
    heads = torch.arange(cache.shape[2], device=slots.device)[:, None] * num_slots
    return (heads + slots.reshape(1, -1)).flatten()


def _gather(cache: torch.Tensor, rows: torch.Tensor, *shape: int) -> torch.Tensor:
    """[Hkv, *shape, D] in fp32: the cache entries at `rows` (from _head_rows)."""
    return _heads_major(cache).index_select(0, rows).view(cache.shape[2], *shape, cache.shape[3]).float()


def _slots(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[length] int64 cache slots of a sequence's first `length` positions (its block table covers them)."""
    blocks = table[:-(-length // block_size)].long()
    return (blocks[:, None] * block_size + torch.arange(block_size, device=table.device)).flatten()[:length]


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


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float | None = None, window: int | None = None, softcap: float | None = None
                    ) -> torch.Tensor:
    """Causal attention of every query over its sequence's keys in the paged cache.

    query: [T, num_heads, head_dim] -> out: [T, num_heads, head_dim]. Every real row is written by one of the
    two paths, so only the padding rows past cu_seqlens_q[-1] are zeroed (a few rows), not the whole output.
    Grouped-query heads: query head h reads kv head h // (num_heads // num_kv_heads).
    Decode rows (one query per sequence) of all sequences are computed together in one batched call;
    each prefill chunk on its own. Either way a query's keys are reduced in the same fixed tiles.
    window: a query at position p sees only keys > p - window (sliding-window layers; transformers' rule): the
    others are masked to -inf inside the same fixed tiles, and a row's running max stays -inf (its state
    exactly the initial one) until its first visible tile, so the bits do not depend on the batch either.
    softcap: scores become tanh(scores / softcap) * softcap before masking (Gemma 2's attention soft-capping).
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[2])
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    out = torch.empty_like(query)
    out[cu[-1]:].zero_()  # padding rows: dropped by the caller, zero so that no stale memory flows on
    decode = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1]
    if decode:
        _attend_decode(query, k_cache, v_cache, meta, decode, scale, out, window, softcap)
    for i in range(len(lens)):
        if cu[i + 1] - cu[i] > 1:
            _attend_prefill(query, k_cache, v_cache, meta, i, scale, out, window, softcap)
    return out


def _attend_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    i: int, scale: float, out: torch.Tensor, window: int | None = None,
                    softcap: float | None = None) -> None:
    """Attention of one sequence's prefill chunk, skipping the work the causal mask would zero.

    Query rows are ordered by position, so for each key tile only the rows that can see some key of it are
    multiplied (rounded out to whole QUERY_ROW_TILE blocks), and only tiles that cross the diagonal are
    masked. Skipped rows would have had their running state left exactly unchanged: the bits are the same.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    hkv = k_cache.shape[2]
    group = num_heads // hkv
    start, end = meta.cu_seqlens_q_list[i], meta.cu_seqlens_q_list[i + 1]
    seq_len = meta.seq_lens_list[i]
    q_len = end - start
    padded = -(-seq_len // KV_TILE) * KV_TILE
    rows = meta.plans.get(("prefill", i))
    if rows is None:
        slots = _pad_slots(_slots(meta.block_tables[i], seq_len, k_cache.shape[1]), padded)
        rows = meta.plans[("prefill", i)] = _head_rows(slots, k_cache)
    k = _gather(k_cache, rows, padded)  # [Hkv, padded, D]
    v = _gather(v_cache, rows, padded)
    # position-major rows: row j * G + g is query position j of the group's head g
    q = query[start:end].view(q_len, hkv, group, head_dim).permute(1, 0, 2, 3).reshape(
        hkv, q_len * group, head_dim).float()
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).repeat_interleave(group)
    num_real = q.shape[1]
    num_pad = max(QUERY_ROW_TILE, -(-num_real // QUERY_ROW_TILE) * QUERY_ROW_TILE) - num_real
    if num_pad:
        q = torch.nn.functional.pad(q, (0, 0, 0, num_pad))
        q_pos = torch.nn.functional.pad(q_pos, (0, num_pad), value=seq_len - 1)
    q = q * scale
    n_rows = q.shape[1]
    m = torch.full((hkv, n_rows), float("-inf"), device=query.device)  # running max
    s = torch.zeros(hkv, n_rows, device=query.device)  # running sum of exp
    acc = torch.zeros_like(q)  # [Hkv, R, D]
    first = seq_len - q_len
    # tiles wholly before every row's window are skipped: they would leave each row's state as it was
    for t0 in range(max(0, first - window + 1) // KV_TILE * KV_TILE if window else 0, seq_len, KV_TILE):
        t1 = t0 + KV_TILE
        r0 = group * max(0, t0 - first)  # rows < r0 see no key here
        r0 = min(r0 - r0 % QUERY_ROW_TILE, n_rows - QUERY_ROW_TILE)  # whole row tiles (n_rows is a multiple)
        scores = _products(q[:, r0:], k[:, t0:t1])  # [Hkv, R - r0, tile]
        if softcap:
            scores.div_(softcap).tanh_().mul_(softcap)
        # rows [r0, r_end) have a position below t1 - 1: they cannot see every key of the tile (the padding
        # rows sit at seq_len - 1, after the real ones); the rows after them see it all, unmasked
        r_end = group * min(max(t1 - 1 - first, 0), q_len) + (n_rows - num_real) * (seq_len < t1)
        if window and t0 + window <= seq_len - 1:  # some rows have keys of this tile outside their window
            r_end = n_rows
        if r_end > r0:
            mask = meta.plans.get(("mask", i, t0, window))
            if mask is None:  # the same in every layer
                k_pos = torch.arange(t0, t1, device=query.device)
                mask = k_pos[None, None, :] > q_pos[None, r0:r_end, None]
                if window:
                    mask |= k_pos[None, None, :] <= q_pos[None, r0:r_end, None] - window
                meta.plans[("mask", i, t0, window)] = mask
            scores[:, :r_end - r0].masked_fill_(mask, float("-inf"))
        m_old, s_old, acc_old = m[:, r0:], s[:, r0:], acc[:, r0:]  # views: updated in place
        m_new = torch.maximum(m_old, scores.amax(-1))
        m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0) if window else m_new  # no -inf - -inf = NaN
        alpha = torch.exp(m_old - m_sub)
        p = scores.sub_(m_sub[..., None]).exp_()
        s_old.mul_(alpha).add_(p.sum(-1))
        acc_old.mul_(alpha[..., None]).add_(_products(p, v[:, t0:t1].transpose(1, 2)))
        m_old.copy_(m_new)
    o = (acc / s[..., None])[:, :num_real]  # [Hkv, q_len * G, D]
    out[start:end] = o.view(hkv, q_len, group, head_dim).permute(1, 0, 2, 3).reshape(
        q_len, num_heads, head_dim).to(query.dtype)


@dataclass
class _DecodePlan:
    """What the decode rows of one step read, worked out once per step and reused by every layer."""

    rows: list[int]  # the query row of each decoding sequence
    seq_lens: list[int]
    tail_start: int  # keys [0, tail_start) are the tiles every sequence shares (the same blocks)
    shared_rows: torch.Tensor | None  # _head_rows of those keys, or None when there are none
    tail_rows: torch.Tensor  # _head_rows of each sequence's keys [tail_start, padded) (see _pad_slots)
    past_end: torch.Tensor  # [B, L'] True past a sequence's end: the mask of its single query


def _decode_plan(meta: AttentionMetadata, seqs: list[int], cache: torch.Tensor, window: int | None) -> _DecodePlan:
    device, block_size = meta.block_tables.device, cache.shape[1]
    cu, lens = meta.cu_seqlens_q_list, meta.seq_lens_list
    seq_lens = [lens[i] for i in seqs]
    max_len, min_len = max(seq_lens), min(seq_lens)
    padded_len = -(-max_len // KV_TILE) * KV_TILE
    num_blocks = -(-padded_len // block_size)
    tables = meta.block_tables[seqs].long()  # [B, max_blocks]
    if tables.shape[1] < num_blocks:
        tables = torch.nn.functional.pad(tables, (0, num_blocks - tables.shape[1]))
    tables = tables[:, :num_blocks]
    # tiles every sequence shares: below every query position, the same blocks in every table
    shared_tiles = 0
    if len(seqs) > 1 and not window:  # (a windowed layer masks per query: no shared tiles)
        same = (tables == tables[:1]).all(dim=0).tolist()
        shared_blocks = same.index(False) if False in same else len(same)
        shared_tiles = min(shared_blocks * block_size, min_len - 1) // KV_TILE
    first = shared_tiles * KV_TILE
    slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)  # [B, padded]
    k_pos = torch.arange(first, padded_len, device=device)  # [L']
    ends = torch.tensor(seq_lens, device=device)[:, None]
    past_end = k_pos[None, :] >= ends  # [B, L']
    tail_rows = _head_rows(torch.where(past_end, slots[:, :1], slots[:, first:padded_len]), cache)
    if window:  # the query sits at ends - 1: keys <= ends - 1 - window are outside its window
        past_end = past_end | (k_pos[None, :] <= ends - 1 - window)
    return _DecodePlan(rows=[cu[i] for i in seqs], seq_lens=seq_lens, tail_start=first,
                       shared_rows=_head_rows(slots[0, :first], cache) if shared_tiles else None,
                       tail_rows=tail_rows, past_end=past_end)


def _attend_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   seqs: list[int], scale: float, out: torch.Tensor, window: int | None = None,
                   softcap: float | None = None) -> None:
    """Attention of the single queries of sequences `seqs` in one batch; writes their rows of `out`.

    Key tiles that every sequence shares (the same KV blocks: a prefix-cache hit) are read once and
    multiplied against all sequences' queries together; the rest per sequence. A query's tiles and their
    order are the same either way, so this changes no result, only how often shared keys are read.
    """
    key = ("decode", window) if window else "decode"
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _decode_plan(meta, seqs, k_cache, window)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = len(seqs)

    # queries: [Hkv, B, R, D] (row g < G: query head g of the kv group; rows padded to QUERY_ROW_TILE)
    q = query[plan.rows].view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).float() * scale
    state = None
    if plan.shared_rows is not None:
        k = _gather(k_cache, plan.shared_rows, plan.tail_start)  # [Hkv, Ls, D]
        v = _gather(v_cache, plan.shared_rows, plan.tail_start)
        # only the real rows of every sequence: [Hkv, B*G, D] (a multiple of QUERY_ROW_TILE rows)
        q_all = q.reshape(num_kv_heads, num_seqs * group, head_dim)
        real = q_all.shape[1]
        if real % QUERY_ROW_TILE:
            q_all = torch.nn.functional.pad(q_all, (0, 0, 0, QUERY_ROW_TILE - real % QUERY_ROW_TILE))
        m, s_, acc = (x[:, :real] for x in _tiled_softmax(q_all, k, v, None, 0, plan.tail_start, softcap=softcap))
        # back to [Hkv, B, R, ...]; padding rows start empty (max -inf, sum 0), as before any tile
        pad_rows = -group % QUERY_ROW_TILE
        state = (torch.nn.functional.pad(m.view(num_kv_heads, num_seqs, group), (0, pad_rows), value=float("-inf")),
                 torch.nn.functional.pad(s_.view(num_kv_heads, num_seqs, group), (0, pad_rows)),
                 torch.nn.functional.pad(acc.view(num_kv_heads, num_seqs, group, head_dim), (0, 0, 0, pad_rows)))
    if group % QUERY_ROW_TILE:  # same kernel, same rounding, whatever the batch
        q = torch.nn.functional.pad(q, (0, 0, 0, -group % QUERY_ROW_TILE))

    # the remaining tiles, per sequence: [Hkv, B, L', D]
    k = _gather(k_cache, plan.tail_rows, *plan.past_end.shape)
    v = _gather(v_cache, plan.tail_rows, *plan.past_end.shape)
    m, s_, acc = _tiled_softmax(q, k, v, plan.past_end[None, :, None, :], plan.tail_start, max(plan.seq_lens), state,
                                softcap, bool(window))
    res = (acc / s_[..., None])[:, :, :group]  # [Hkv, B, G, D]
    out[plan.rows] = res.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def _tiled_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, start: int,
                   end: int, state: tuple[torch.Tensor, ...] | None = None, softcap: float | None = None,
                   windowed: bool = False) -> tuple[torch.Tensor, ...]:
    """Online softmax over the fixed key tiles [start, end) (start a multiple of KV_TILE), in fp32.

    q: [..., M, D] (pre-scaled); k, v: [..., Lp, D] holding keys from `start`, Lp a multiple of KV_TILE;
    masked: broadcastable to [..., M, Lp] or None; state: (running max, sum, accumulator) of earlier tiles;
    softcap, windowed: see paged_attention (windowed: a row's first tiles may be wholly masked).
    Returns the new state. A tile fully masked for a row leaves that row's state exactly unchanged, so a
    row's result does not depend on how many tiles its batch needed.

    The per-tile work (scores, tile maxima, exp, sums, P @ V) runs for all tiles in one op each; only the
    running max, sum and accumulator advance tile by tile, in order. That is the arithmetic of a loop over
    tiles (same tile widths and reduction lengths: bitwise equal, checked in tests), with fewer ops.
    """
    num_tiles = -(-(end - start) // KV_TILE)
    length = num_tiles * KV_TILE
    scores = _products(q, k[..., :length, :])  # [..., M, L]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if masked is not None:
        scores = scores.masked_fill(masked[..., :length], float("-inf"))
    scores = scores.unflatten(-1, (num_tiles, KV_TILE))  # [..., M, T, tile]
    tile_max = scores.amax(-1)  # [..., M, T]
    m, s, acc = state if state is not None else (None, None, None)
    maxes = []  # running max after each tile
    for t in range(num_tiles):
        m = tile_max[..., t] if m is None else torch.maximum(m, tile_max[..., t])
        maxes.append(m)
    subs = torch.stack(maxes, -1)  # [..., M, T]
    if windowed:  # a running max still -inf (nothing seen yet) subtracts 0: p = 0, not NaN
        subs = subs.masked_fill(subs == float("-inf"), 0.0)
    p = torch.exp(scores - subs[..., None])  # [..., M, T, tile]
    p_sums = p.sum(-1)  # [..., M, T]
    v_tiles = v[..., :length, :].unflatten(-2, (num_tiles, KV_TILE))  # [..., T, tile, D]
    pv = _products(p.transpose(-2, -3), v_tiles.transpose(-1, -2))  # [..., T, M, D]
    prev = state[0] if state is not None else None
    for t in range(num_tiles):
        if s is None:  # first tile: the same arithmetic as the general step with m = -inf, s = acc = 0
            s, acc = p_sums[..., t], pv[..., t, :, :]
        else:
            alpha = torch.exp(prev - subs[..., t])
            s = s * alpha + p_sums[..., t]
            acc = acc * alpha[..., None] + pv[..., t, :, :]
        prev = maxes[t]
    return m, s, acc


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
