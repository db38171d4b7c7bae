"""Decode groups: decode sequences of one step that share their first KV blocks (prefix-cache hits).

The Triton backend runs a group's sequences in one program per KV head (kernels/paged_decode_shared.py): the key
tiles wholly inside the shared prefix are read once for the whole group. Which sequences group together changes
which kernel computes a row, never its bits (docs/architecture.md, "Shared-prefix decode"), so the plan may
depend on the batch. It is made on the host from the step's host arrays (no device read) once per step.

Off unless `APCSCORE_DECODE_GROUPS=1`: the row-independence the bits rest on (docs/architecture.md) and the
speed against today's kernel are still to be measured on a GPU (the GPU check's exactness part turns it on and
checks both); until then the engine runs today's kernel for every sequence, as before.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class DecodeGroups:
    """A step's decode groups as the kernels read them, with the tile shape they were planned for.

    table [G, 2 + block_q] int32, one row per group: member count, shared key tiles, then the members' sequence
    indices (padded with 0). grouped [B] int32: 1 for a sequence some group computes (today's kernel skips it).
    A row with member count 0 is an empty group (CUDA-graph padding): its programs return at once.
    """

    table: torch.Tensor
    grouped: torch.Tensor
    block_m: int  # the tile config the groups were planned for: a layer with another one ignores them
    block_n: int
    group: int  # query heads per KV head


def plan_decode_groups(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
                       block_n: int, block_q: int) -> list[tuple[list[int], int]]:
    """(members, shared key tiles) of each decode group of a step; sequences in no group are left out.

    Decode sequences (q_len 1) are sorted by their block ids, so that the sequences sharing the longest
    prefixes sit side by side; a run of neighbours each sharing at least one whole key tile with the next forms
    a group (cut into groups of at most block_q members). A group's shared tiles: the whole BLOCK_N tiles inside
    its members' common block prefix and before every member's last position (its new token, which its own block
    holds), i.e. floor(min(common_blocks * block_size, min seq_len - 1) / block_n). Groups need >= 2 members and
    >= 1 shared tile.
    """
    if block_q < 2:
        return []
    cu = np.asarray(cu_seqlens_q)
    lens = np.asarray(seq_lens).astype(np.int64)
    cand = np.flatnonzero((np.diff(cu) == 1) & (lens - 1 >= block_n))  # decodes with a whole tile before the query
    if len(cand) < 2:
        return []
    nblocks = -(-lens[cand] // block_size)
    rows = np.asarray(block_tables)[cand, :int(nblocks.max())]
    # lexicographic order of the block lists (rows are 0-padded past a sequence's blocks: a shared prefix of valid
    # blocks still makes one contiguous run); ties keep the batch order (lexsort is stable)
    order = np.lexsort(rows.T[::-1])
    rows, nblocks, last = rows[order], nblocks[order], lens[cand][order] - 1
    differ = rows[1:] != rows[:-1]  # [n - 1, W]
    first = np.where(differ.any(1), differ.argmax(1), rows.shape[1])
    common = np.minimum(first, np.minimum(nblocks[1:], nblocks[:-1]))  # neighbours' common blocks
    # shared keys of neighbours i, i + 1 (before both last positions); a run's = the minimum over its neighbours
    shared = np.minimum(common * block_size, np.minimum(last[1:], last[:-1]))
    groups: list[tuple[list[int], int]] = []
    start = 0
    for i in range(len(order)):
        if i + 1 < len(order) and shared[i] >= block_n:
            continue  # the run goes on
        for lo in range(start, i + 1, block_q):  # the run [start, i]: groups of at most block_q
            hi = min(lo + block_q, i + 1)
            if hi - lo >= 2:
                groups.append(([int(x) for x in cand[order[lo:hi]]], int(shared[lo:hi - 1].min()) // block_n))
        start = i + 1
    return groups


def pack_decode_groups(groups: list[tuple[list[int], int]], num_seqs: int, block_q: int,
                       num_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host images of DecodeGroups.table [num_rows or G, 2 + block_q] and .grouped [num_seqs] (int32)."""
    rows = len(groups) if num_rows is None else num_rows
    if rows < len(groups):
        raise ValueError(f"{len(groups)} decode groups do not fit {rows} rows")
    table = np.zeros((rows, 2 + block_q), dtype=np.int32)
    grouped = np.zeros(num_seqs, dtype=np.int32)
    for g, (members, tiles) in enumerate(groups):
        if not 2 <= len(members) <= block_q or tiles < 1:
            raise ValueError(f"decode group {g}: {len(members)} members (want 2..{block_q}), {tiles} shared tiles")
        table[g, 0], table[g, 1] = len(members), tiles
        table[g, 2:2 + len(members)] = members
        grouped[members] = 1
    return table, grouped


GroupShape = tuple[int, int, int]  # (block_m, block_n, group): the Triton attention tiles of a model


SWITCH = "APCSCORE_DECODE_GROUPS"  # "1": plan decode groups (the Triton backend); anything else: off


def group_shape(attention: Any) -> GroupShape | None:
    """The tile shape decode groups are planned for, from a model's (first) attention module: tile_config's
    (block_m, block_n) and its query heads per KV head; None when grouping is off (the default: SWITCH) or its
    backend is not Triton (the torch backend never reads groups, and its steps are built exactly as before)."""
    if os.environ.get(SWITCH) != "1":
        return None
    if getattr(getattr(attention, "attention_backend", None), "name", None) != "triton":
        return None
    from apcscore.kernels.paged_attention import tile_config  # Triton: imported only for the Triton backend

    group = attention.num_heads // attention.num_kv_heads
    block_m, block_n, _ = tile_config(attention.head_dim, group)
    return block_m, block_n, group


def step_decode_groups(cu_seqlens_q: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
                       shape: GroupShape) -> tuple[np.ndarray, np.ndarray] | None:
    """Host images of a step's DecodeGroups (table, grouped), or None when no decode sequences group."""
    block_m, block_n, group = shape
    block_q = block_m // group
    groups = plan_decode_groups(cu_seqlens_q, seq_lens, block_tables, block_size, block_n, block_q)
    return pack_decode_groups(groups, len(seq_lens), block_q) if groups else None
