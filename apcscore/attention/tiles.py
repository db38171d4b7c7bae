"""The fixed key tiles of the torch attention backend: where a sequence's keys lie in the paged cache, and the
online softmax over tiles that the prefill and decode paths share (so their bits are the same).

A query's keys are read in tiles of KV_TILE keys counted from position 0, and its softmax is reduced tile by
tile in that order (docs/architecture.md, "Batch invariance", rule 3). Its exps, tile sums and soft-caps are
apcscore.kernels.rowmath's: on the CPU, the same bits on every machine.
"""

from __future__ import annotations

import torch

from apcscore.attention.products import PagedCache, fixed_order, products
from apcscore.kernels import rowmath

KV_TILE = 64  # keys per tile; the last tile is padded to full size, so every reduction has one shape
QUERY_ROW_TILE = 16  # query rows come in multiples of this for torch.matmul, which may round a row by its call's shape


def query_row_tile(device: torch.device) -> int:
    """The multiple the query rows of an attention product are padded to on `device`: 1 where the products are
    the fixed-order CPU kernel, whose row count cannot change a row's bits (a decode step's 3 rows per KV head
    stay 3, not 16), else QUERY_ROW_TILE."""
    return 1 if fixed_order(device) else QUERY_ROW_TILE


def pad_slots(slots: torch.Tensor, length: int) -> torch.Tensor:
    """`slots` [L] padded to `length` with the sequence's own first slot.

    Padding keys are masked (probability exactly 0), but their values are still multiplied: 0 * NaN would be
    NaN. Reading the sequence's own position 0 there adds no new way to get NaN (a NaN at a real position
    spoils the result anyway), whatever the rest of the pool holds, and needs no zeroing pass.
    """
    return torch.nn.functional.pad(slots, (0, length - slots.shape[0]), value=int(slots[0]))


def head_rows(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rows of the cache seen heads-major (see gather) for `slots` (any shape S): [Hkv * prod(S)] int64."""
    num_slots = cache.shape[0] * cache.shape[1]
    heads = torch.arange(cache.shape[2], device=slots.device)[:, None] * num_slots
    return (heads + slots.reshape(1, -1)).flatten()


def gather(cache: torch.Tensor, rows: torch.Tensor, *shape: int) -> torch.Tensor:
    """[Hkv, *shape, D] in fp32: the cache entries at `rows` (from head_rows) of the cache [num_blocks, block_size,
    Hkv, D] seen heads-major, [Hkv * num_slots, D] (a view for this backend's own pools)."""
    heads_major = cache.permute(2, 0, 1, 3).reshape(-1, cache.shape[3])
    return heads_major.index_select(0, rows).view(cache.shape[2], *shape, cache.shape[3]).float()


def sequence_slots(table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[length] int64 cache slots of a sequence's first `length` positions (its block table covers them)."""
    blocks = table[:-(-length // block_size)].long()
    return (blocks[:, None] * block_size + torch.arange(block_size, device=table.device)).flatten()[:length]


def tiled_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: torch.Tensor | None, start: int,
                   end: int, state: tuple[torch.Tensor, ...] | None = None, softcap: float | None = None,
                   windowed: bool = False) -> tuple[torch.Tensor, ...]:
    """Online softmax over the fixed key tiles [start, end) (start a multiple of KV_TILE), in fp32.

    q: [..., M, D] (pre-scaled); k, v: [..., Lp, D] holding keys from `start`, Lp a multiple of KV_TILE, or
    PagedCache (the decode path on the CPU: read in place through the block tables, the same bits);
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
    scores = k.scores(q, length) if isinstance(k, PagedCache) else products(q, k[..., :length, :])  # [..., M, L]
    if softcap:
        scores = rowmath.softcap(scores, softcap)
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
    p = rowmath.exp_(scores - subs[..., None])  # [..., M, T, tile]
    p_sums = rowmath.row_sum(p)  # [..., M, T]
    if isinstance(v, PagedCache):
        pv = v.weighted(p.transpose(-2, -3))  # [..., T, M, D]
    else:
        v_tiles = v[..., :length, :].unflatten(-2, (num_tiles, KV_TILE))  # [..., T, tile, D]
        pv = products(p.transpose(-2, -3), v_tiles.transpose(-1, -2))  # [..., T, M, D]
    prev = state[0] if state is not None else None
    for t in range(num_tiles):
        if s is None:  # first tile: the same arithmetic as the general step with m = -inf, s = acc = 0
            s, acc = p_sums[..., t], pv[..., t, :, :]
        else:
            alpha = rowmath.exp(prev - subs[..., t])
            s = s * alpha + p_sums[..., t]
            acc = acc * alpha[..., None] + pv[..., t, :, :]
        prev = maxes[t]
    return m, s, acc

