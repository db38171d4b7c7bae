"""One engine step's model inputs, built on the host once: `build_step_inputs` turns a scheduled batch into flat
host arrays (the eager model runner and the CUDA-graph decode runner both start from it; `ModelRunner.to_device`
moves them to the device in one copy).
"""

from __future__ import annotations

import numpy as np

from apcscore.engine.step import ScheduledBatch, StepInputs


def build_step_inputs(batch: ScheduledBatch, block_size: int, num_rows: int | None = None,
                      rope_offset: int = 0) -> StepInputs:
    """The inputs of `batch` (each item: a sequence and how many of its tokens this step computes, from its
    num_computed_tokens on), padded with empty rows up to num_rows when given. rope_offset: added to the
    positions of sequences that use the long rotary table (`Sequence.rope_long`; LlamaDecoder.long_rope_after)."""
    seqs = [seq for seq, _ in batch]
    counts = np.array([n for _, n in batch], dtype=np.int64)  # [B]
    starts = np.array([seq.num_computed_tokens for seq in seqs], dtype=np.int64)  # [B]
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(counts, out=cu[1:])
    total = int(cu[-1])
    rows = total if num_rows is None else num_rows
    if rows < total:
        raise ValueError(f"{total} tokens do not fit {rows} rows")
    tables = np.zeros((len(seqs), max(len(seq.block_ids) for seq in seqs)), dtype=np.int32)
    ids: list[int] = []
    for i, (seq, n) in enumerate(batch):
        tables[i, :len(seq.block_ids)] = seq.block_ids
        ids += seq.token_ids[seq.num_computed_tokens:seq.num_computed_tokens + n]
    owner = np.repeat(np.arange(len(seqs)), counts)  # [total]: the sequence of each row
    positions = np.zeros(rows, dtype=np.int64)
    positions[:total] = np.arange(total) - np.repeat(cu[:-1], counts) + np.repeat(starts, counts)
    slots = np.full(rows, -1, dtype=np.int64)
    real = positions[:total]
    slots[:total] = tables[owner, real // block_size].astype(np.int64) * block_size + real % block_size
    if rope_offset:  # after the slots: they address the cache by the true positions
        long = np.array([seq.rope_long for seq in seqs], dtype=np.int64)  # [B]
        positions[:total] += rope_offset * np.repeat(long, counts)
    input_ids = np.zeros(rows, dtype=np.int64)
    input_ids[:total] = ids
    return StepInputs(input_ids, positions, slots, cu, (starts + counts).astype(np.int32), tables)
