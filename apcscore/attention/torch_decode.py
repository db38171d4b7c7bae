"""Decode rows of the torch attention backend: the single queries of all decoding sequences in one batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from apcscore.attention.metadata import AttentionMetadata
from apcscore.attention.products import PagedCache, fixed_order
from apcscore.attention.tiles import KV_TILE, gather, head_rows, query_row_tile, tiled_softmax

@dataclass
class DecodePlan:
    """What the decode rows of one step read, worked out once per step and reused by every layer."""

    rows: list[int]  # the query row of each decoding sequence
    seq_lens: list[int]
    tail_start: int  # keys [0, tail_start) are the tiles every sequence shares (the same blocks)
    past_end: torch.Tensor  # [B, L'] True past a sequence's end: the mask of its single query
    shared_rows: torch.Tensor | None = None  # head_rows of the shared keys (None: none); both None when paged
    tail_rows: torch.Tensor | None = None  # head_rows of each sequence's keys [tail_start, padded) (see pad_slots)
    # paged (CPU, fixed-order kernel): the products read the cache through these instead of gathered rows
    tables: torch.Tensor | None = None  # [B, max_blocks] int32, contiguous
    seq_lens_t: torch.Tensor | None = None  # [B] int32


paged_decode = fixed_order  # decode reads the cache in place (PagedCache) where the products are the CPU kernel


def decode_plan(meta: AttentionMetadata, seqs: list[int], cache: torch.Tensor, window: int | None) -> DecodePlan:
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
    k_pos = torch.arange(first, padded_len, device=device)  # [L']
    ends = torch.tensor(seq_lens, device=device)[:, None]
    past_end = k_pos[None, :] >= ends  # [B, L']
    # the query's mask: past its end, and (the query sits at ends - 1) keys <= ends - 1 - window outside its window
    mask = past_end | (k_pos[None, :] <= ends - 1 - window) if window else past_end
    if paged_decode(device):
        return DecodePlan(rows=[cu[i] for i in seqs], seq_lens=seq_lens, tail_start=first, past_end=mask,
                          tables=meta.block_tables[seqs].to(torch.int32).contiguous(),
                          seq_lens_t=torch.tensor(seq_lens, dtype=torch.int32))
    slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)  # [B, padded]
    return DecodePlan(rows=[cu[i] for i in seqs], seq_lens=seq_lens, tail_start=first, past_end=mask,
                      shared_rows=head_rows(slots[0, :first], cache) if shared_tiles else None,
                      tail_rows=head_rows(torch.where(past_end, slots[:, :1], slots[:, first:padded_len]), cache))


def attend_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   seqs: list[int], scale: float, out: torch.Tensor, window: int | None = None,
                   softcap: float | None = None) -> None:
    """Attention of the single queries of sequences `seqs` in one batch; writes their rows of `out`.

    Key tiles that every sequence shares (the same KV blocks: a prefix-cache hit) are read once and
    multiplied against all sequences' queries together; the rest per sequence. A query's tiles and their
    order are the same either way, so this changes no result, only how often shared keys are read.
    On the CPU (the fixed-order kernel) keys and values are read in place through the block tables
    (PagedCache), not gathered into a copy in every layer: the same values in the same chains, the same bits.
    """
    key = ("decode", window) if window else "decode"
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = decode_plan(meta, seqs, k_cache, window)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = len(seqs)

    row_tile = query_row_tile(query.device)
    # queries: [Hkv, B, R, D] (row g < G: query head g of the kv group; rows padded to row_tile)
    q = query[plan.rows].view(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).float() * scale
    state = None
    paged = plan.tables is not None
    if plan.tail_start:
        if paged:  # sequence 0's table: the shared blocks are the same in every table
            k, v = (PagedCache(c, plan.tables[:1], plan.seq_lens_t[:1], 0) for c in (k_cache, v_cache))
        else:
            k, v = (gather(c, plan.shared_rows, plan.tail_start) for c in (k_cache, v_cache))  # [Hkv, Ls, D]
        # only the real rows of every sequence: [Hkv, B*G, D] (a multiple of row_tile rows)
        q_all = q.reshape(num_kv_heads, num_seqs * group, head_dim)
        real = q_all.shape[1]
        if real % row_tile:
            q_all = torch.nn.functional.pad(q_all, (0, 0, 0, row_tile - real % row_tile))
        m, s_, acc = (x[:, :real] for x in tiled_softmax(q_all, k, v, None, 0, plan.tail_start, softcap=softcap))
        # back to [Hkv, B, R, ...]; padding rows start empty (max -inf, sum 0), as before any tile
        pad_rows = -group % row_tile
        state = (torch.nn.functional.pad(m.view(num_kv_heads, num_seqs, group), (0, pad_rows), value=float("-inf")),
                 torch.nn.functional.pad(s_.view(num_kv_heads, num_seqs, group), (0, pad_rows)),
                 torch.nn.functional.pad(acc.view(num_kv_heads, num_seqs, group, head_dim), (0, 0, 0, pad_rows)))
    if group % row_tile:  # same kernel, same rounding, whatever the batch
        q = torch.nn.functional.pad(q, (0, 0, 0, -group % row_tile))

    # the remaining tiles, per sequence: [Hkv, B, L', D]
    if paged:
        k, v = (PagedCache(c, plan.tables, plan.seq_lens_t, plan.tail_start) for c in (k_cache, v_cache))
    else:
        k, v = (gather(c, plan.tail_rows, *plan.past_end.shape) for c in (k_cache, v_cache))
    m, s_, acc = tiled_softmax(q, k, v, plan.past_end[None, :, None, :], plan.tail_start, max(plan.seq_lens), state,
                                softcap, bool(window))
    res = (acc / s_[..., None])[:, :, :group]  # [Hkv, B, G, D]
    out[plan.rows] = res.transpose(0, 1).reshape(num_seqs, num_heads, head_dim).to(query.dtype)

