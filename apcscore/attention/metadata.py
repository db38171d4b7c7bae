"""Batch metadata of one engine step, scoped by a context manager so every layer can read it."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from apcscore.attention.decode_groups import DecodeGroups


@dataclass
class AttentionMetadata:
    """Where each token of a flattened batch lives in the paged KV cache.

    The batch holds B sequences' new tokens, flattened: sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
    Its context after this step has seq_lens[i] tokens, so its query j sits at position
    seq_lens[i] - q_len_i + j. Rows past cu_seqlens_q[-1] are padding (slot -1): never stored; their attention
    output is dropped by the caller (the torch backend zeroes it, the Triton kernel leaves it unwritten).
    """

    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; -1 = do not store
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    # The same as Python lists, for the torch backend's per-sequence loop (no device sync).
    cu_seqlens_q_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    # Per-step plans a backend derives from the fields above once and reuses in every layer.
    plans: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    # Decode sequences sharing prefix blocks, for the Triton backend (attention/decode_groups.py); None: no
    # groups (always with the torch backend, which ignores the field).
    decode_groups: DecodeGroups | None = None

    @classmethod
    def for_attention(cls, items: list[tuple[int, int]], tables: list[list[int]],
                      block_size: int) -> "AttentionMetadata":
        """Metadata for calling an attention backend directly (benchmarks, tests): items are (q_len, seq_len)
        per sequence, tables their block ids. No slots: the new K/V are taken as already stored."""
        cu = [0, *itertools.accumulate(q_len for q_len, _ in items)]
        lens = [seq_len for _, seq_len in items]
        block_tables = torch.zeros(len(items), max(map(len, tables)), dtype=torch.int32)
        for i, table in enumerate(tables):
            block_tables[i, :len(table)] = torch.tensor(table)
        return cls(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=block_tables,
                   cu_seqlens_q=torch.tensor(cu), seq_lens=torch.tensor(lens),
                   cu_seqlens_q_list=cu, seq_lens_list=lens, block_size=block_size)


_current: AttentionMetadata | None = None


def get_attention_metadata() -> AttentionMetadata:
    if _current is None:
        raise RuntimeError("attention metadata is only set inside an engine step")
    return _current


@contextlib.contextmanager
def set_attention_metadata(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _current
    previous, _current = _current, meta
    try:
        yield meta
    finally:
        _current = previous
