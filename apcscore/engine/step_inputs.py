"""One engine step's model inputs: built on the host once, moved to the device in one copy.

`build_step_inputs` turns a scheduled batch into flat host arrays (the eager model runner and the CUDA-graph
decode runner both start from it); `InputStager.to_device` moves a step's arrays to the device. On CUDA that
is one non-blocking copy out of a persistent pinned buffer (two alternating slots, each refilled only once
its previous copy has finished), so preparing a step neither allocates pinned memory nor waits for the GPU.
On the CPU the arrays are used in place (no copy).
"""

from __future__ import annotations


import numpy as np
import torch

from apcscore.engine.step import ScheduledBatch, StepInputs

_ALIGN = 64  # bytes: every array starts 64-byte aligned, as a fresh allocation would (Triton specialises on it)


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


class InputStager:
    """Moves host arrays to `device`: zero-copy on the CPU; on CUDA one non-blocking copy from pinned memory.

    The returned device tensors are fresh (stream-ordered caching allocations): they stay valid while the
    caller holds them, whatever later steps stage.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._slots: list[torch.Tensor] = []  # pinned uint8 buffers, used in turn
        self._events: list[torch.cuda.Event | None] = []
        self._turn = 0

    def _slot(self, nbytes: int) -> int:
        """A pinned buffer of at least nbytes whose last copy has finished (both slots grow together)."""
        if not self._slots or self._slots[0].numel() < nbytes:
            for event in self._events:
                if event is not None:
                    event.synchronize()  # growing (rare): the old buffers may still be read
            size = max(nbytes, 2 * self._slots[0].numel() if self._slots else 1 << 16)
            self._slots = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self._events = [None, None]
        i, self._turn = self._turn, 1 - self._turn
        event = self._events[i]
        if event is not None and not event.query():  # normally long done: the step between read its results
            event.synchronize()
        return i

    def to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The arrays as tensors on the device, in order."""
        if not self._pinned:
            return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-a.nbytes // _ALIGN) * _ALIGN
        i = self._slot(end)
        host = self._slots[i]
        for a, off in zip(arrays, offsets):
            host[off:off + a.nbytes].numpy().view(a.dtype).reshape(a.shape)[...] = a
        dev = host[:end].to(self.device, non_blocking=True)  # the one copy of the step
        event = self._events[i] = self._events[i] or torch.cuda.Event()
        event.record()
        return [dev[off:off + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape) for a, off in zip(arrays, offsets)]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}[np.dtype(dtype)]
