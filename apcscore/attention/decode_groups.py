"""Decode groups: decode sequences of one step that share their first KV blocks (prefix-cache hits).

The Triton backend runs a group's sequences in one program per KV head (kernels/paged_decode_shared.py): the key
tiles wholly inside the shared prefix are read once for the whole group. Which sequences group together changes
which kernel computes a row, never its bits (docs/architecture.md, "Shared-prefix decode"), so the plan may
depend on the batch. It is made on the host from the step's host arrays (no device read) once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    num_groups: int  # groups with members (rows of table past it are empty)

    @property
    def block_q(self) -> int:
        return self.block_m // self.group


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
    lens = np.asarray(seq_lens)
    decode = [i for i in range(len(lens)) if cu[i + 1] - cu[i] == 1 and lens[i] - 1 >= block_n]
    tables = {i: block_tables[i, :-(-int(lens[i]) // block_size)].tolist() for i in decode}
    order = sorted(decode, key=lambda i: (tables[i], i))

    def shared_tiles(members: list[int]) -> int:
        first = tables[members[0]]
        common = min(_common_prefix(first, tables[i]) for i in members[1:])
        tokens = min(common * block_size, min(int(lens[i]) - 1 for i in members))
        return tokens // block_n

    groups: list[tuple[list[int], int]] = []
    run: list[int] = []
    for i in order + [-1]:
        if run and (i < 0 or shared_tiles([run[-1], i]) < 1):  # the run ends: cut it into groups
            for start in range(0, len(run), block_q):
                members = run[start:start + block_q]
                if len(members) >= 2:
                    groups.append((members, shared_tiles(members)))
            run = []
        if i >= 0:
            run.append(i)
    return groups


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
