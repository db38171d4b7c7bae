"""CUDA graphs for decode steps (docs/gpu.md, "CUDA graphs for decode"): the model forward is captured once per
batch size and replayed. A decode-only batch of n sequences is padded up to the next captured size bs >= n; larger
batches, prefill and mixed batches run eagerly. Inputs live in static device buffers that every graph reads:

    tokens        [3, max_bs] int64: input_ids, positions, slot_mapping
    lens          [2, lens_stride(max_bs)] int32: cu_seqlens_q (row 0, max_bs + 1 used), seq_lens (row 1)
    block_tables  [max_bs, max_blocks_per_seq] int32

A padding row has slot -1 (nothing stored) and its padding sequence is empty (q_len 0, seq_len 0: the
AttentionMetadata contract), so the Triton kernels skip it without reading the cache. Every device-side length comes
from these buffers: the Triton paged attention computes its grid from tensor shapes only (bs tokens, bs sequences)
and reads cu_seqlens_q / seq_lens on the device, so one capture serves every step of that size. The torch backend
reads Python lists (cu_seqlens_q_list, seq_lens_list) and syncs in store_kv, so it is never captured; the same
padded path runs it eagerly (CPU tests).

Decode groups (Triton backend: sequences sharing prefix blocks, attention/decode_groups.py) live in two more
static buffers, sized to the captured batch: `group_table` [max_bs // 2, 2 + block_q] (a graph of bs rows reads
its first bs // 2 rows: the most groups of >= 2 members; a row with 0 members is an empty group whose programs
return at once) and `grouped` [max_bs] (today's kernel skips a grouped sequence). So the grouping of a step
changes only buffer contents, never the captured launches.

Step inputs are built like an eager step's (apcscore.engine.step_inputs) and travel host -> device in one
non-blocking copy from pinned memory: a replayed step has no host-device synchronisation until the caller reads
the sampled tokens.
"""

from __future__ import annotations

import bisect
from typing import Callable

import numpy as np
import torch

from apcscore.attention.decode_groups import DecodeGroups, group_shape, pack_decode_groups, plan_decode_groups
from apcscore.attention.metadata import AttentionMetadata, set_attention_metadata
from apcscore.config import EngineConfig
from apcscore.engine.step import ScheduledBatch, StepInputs
from apcscore.engine.step_inputs import build_step_inputs
from apcscore.models.llama import LlamaDecoder

DEFAULT_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES) -> list[int]:
    """The batch sizes to capture: those of `sizes` up to max_num_seqs, plus max_num_seqs itself, so that
    every decode batch the scheduler can form has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    chosen = sorted({s for s in sizes if 1 <= s <= max_num_seqs})
    if not chosen or chosen[-1] < max_num_seqs:
        chosen.append(max_num_seqs)
    return chosen


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest of the sorted `sizes` that holds n sequences, or None when n is above them all."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if n >= 1 and i < len(sizes) else None


def decode_inputs(batch: ScheduledBatch, block_size: int, rope_offset: int = 0) -> StepInputs | None:
    """The inputs of a batch whose every sequence computes one token (build_step_inputs, as the eager
    model runner builds them, unpadded), or None for an empty, prefill or mixed batch."""
    if not batch or any(n != 1 for _, n in batch):
        return None
    return build_step_inputs(batch, block_size, rope_offset=rope_offset)


def lens_stride(max_bs: int) -> int:
    """Row length of the `lens` buffer: room for max_bs + 1 entries, rounded up to 16 bytes so that the
    seq_lens row is as aligned as a fresh allocation (Triton specialises kernels on pointer alignment)."""
    return -(-(max_bs + 1) // 4) * 4


def pad_decode_inputs(inp: StepInputs, max_bs: int) -> tuple[np.ndarray, np.ndarray]:
    """Host images of the static `tokens` [3, max_bs] and `lens` [2, lens_stride(max_bs)] buffers for these
    inputs: rows past n are padding (token 0, position 0, slot -1; an empty sequence: cu stays at n, seq_len 0)."""
    n = inp.num_seqs
    if n > max_bs:
        raise ValueError(f"{n} sequences do not fit buffers of {max_bs}")
    tokens = np.zeros((3, max_bs), dtype=np.int64)
    tokens[2] = -1
    tokens[0, :n], tokens[1, :n], tokens[2, :n] = inp.input_ids, inp.positions, inp.slot_mapping
    lens = np.zeros((2, lens_stride(max_bs)), dtype=np.int32)
    lens[0, :n + 1] = np.arange(n + 1)
    lens[0, n + 1:max_bs + 1] = n
    lens[1, :n] = inp.seq_lens
    return tokens, lens


class DecodeGraphRunner:
    """Runs the model forward of decode-only batches on static buffers padded to a captured size.

    On CUDA with `capture=True`, each size's forward is a captured CUDA graph (one shared memory pool) and a
    step is a replay; otherwise (CPU, tests) the same padded forward runs eagerly. Capture after the KV cache
    is attached to the model's layers: the graphs hold its addresses. to_device: the model runner's
    (`ModelRunner.to_device`), which brings a step's host inputs to the device for the static buffers.
    """

    def __init__(self, model: LlamaDecoder, block_size: int, max_num_seqs: int, device: torch.device,
                 to_device: Callable[..., list[torch.Tensor]], sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES,
                 capture: bool = True) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.sizes = capture_sizes(max_num_seqs, sizes)
        self.max_bs = max_bs = self.sizes[-1]
        self.max_blocks = -(-model.max_positions // block_size)
        self.tokens = torch.zeros(3, max_bs, dtype=torch.int64, device=self.device)
        self.tokens[2] = -1
        self.lens = torch.zeros(2, lens_stride(max_bs), dtype=torch.int32, device=self.device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=self.device)
        self.group_shape = group_shape(model.layers[0].self_attn)  # None: no group buffers (torch backend)
        if self.group_shape is not None:
            block_m, _, group = self.group_shape
            self.group_table = torch.zeros(max(1, max_bs // 2), 2 + block_m // group, dtype=torch.int32,
                                           device=self.device)
            self.grouped = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bs, hidden], written by each replay
        self.num_replays = 0
        self.num_eager = 0
        self.to_device = to_device
        if capture:
            self.capture()

    @classmethod
    def for_model(cls, model: LlamaDecoder, config: EngineConfig, device: torch.device,
                  to_device: Callable[..., list[torch.Tensor]]) -> "DecodeGraphRunner | None":
        """A capturing runner of config's block_size and max_num_seqs (the largest decode batch), or None when the
        model's attention backend cannot be captured (not Triton)."""
        if getattr(model.layers[0].self_attn.attention_backend, "name", None) != "triton":
            return None
        return cls(model, config.block_size, config.max_num_seqs, device, to_device)

    def _meta(self, bs: int, inp: StepInputs | None) -> AttentionMetadata:
        """Metadata of a bs-row step over the static buffers. The Python lists (read by the torch backend
        only, never by a captured graph) describe `inp`, or padding only when inp is None (capture)."""
        n = inp.num_seqs if inp is not None else 0
        seq_lens = (inp.seq_lens.tolist() if inp is not None else []) + [0] * (bs - n)
        groups = None
        if self.group_shape is not None and bs >= 2:  # the buffers' contents say which groups there are
            groups = DecodeGroups(self.group_table[:bs // 2], self.grouped[:bs], *self.group_shape)
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :bs], block_tables=self.block_tables[:bs],
            cu_seqlens_q=self.lens[0, :bs + 1], seq_lens=self.lens[1, :bs],
            cu_seqlens_q_list=[min(i, n) for i in range(bs + 1)], seq_lens_list=seq_lens,
            block_size=self.block_size, decode_groups=groups,
        )

    def _forward(self, bs: int, meta: AttentionMetadata) -> torch.Tensor:
        with set_attention_metadata(meta):
            return self.model(self.tokens[0, :bs], self.tokens[1, :bs])  # [bs, hidden]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, all in one memory pool (only one replays at a time). Run by
        the constructor, while the buffers hold padding only."""
        pool = None
        torch.cuda.synchronize(self.device)
        for bs in reversed(self.sizes):
            meta = self._meta(bs, None)  # (padding only: nothing is stored or read)
            side = torch.cuda.Stream(self.device)  # warm-up (Triton compiles, cuBLAS picks) off the capture
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._forward(bs, meta)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs, meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)

    def _load(self, inp: StepInputs) -> None:
        """Copy the step's inputs into the static buffers (one non-blocking copy from pinned memory on CUDA,
        then on-device copies: no sync)."""
        tokens, lens = pad_decode_inputs(inp, self.max_bs)
        n, width = inp.block_tables.shape
        arrays, buffers = [tokens, lens, inp.block_tables], [self.tokens, self.lens, self.block_tables[:n, :width]]
        if self.group_shape is not None:  # this step's groups
            block_m, block_n, group = self.group_shape
            groups = plan_decode_groups(inp.cu_seqlens_q, inp.seq_lens, inp.block_tables, self.block_size, block_n,
                                        block_m // group)
            table, grouped = pack_decode_groups(groups, self.max_bs, block_m // group, self.group_table.shape[0])
            arrays += [table, grouped]
            buffers += [self.group_table, self.grouped]
        for dst, src in zip(buffers, self.to_device(*arrays)):
            dst.copy_(src)

    def forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Final hidden states [n, hidden] of a decode-only batch of a padded size, or None: run it eagerly."""
        inp = decode_inputs(batch, self.block_size, self.model.long_rope_after or 0)
        return None if inp is None else self.forward_inputs(inp)

    @torch.inference_mode()
    def forward_inputs(self, inp: StepInputs, eager: bool = False) -> torch.Tensor | None:
        """Hidden states [n, hidden] of prepared inputs (eager=True: the padded forward without the graph)."""
        n = inp.num_seqs
        bs = padded_size(n, self.sizes)
        if bs is None or inp.block_tables.shape[1] > self.max_blocks:
            return None
        self._load(inp)
        if bs in self.graphs and not eager:
            self.graphs[bs].replay()
            self.num_replays += 1
            return self.outputs[bs][:n]
        self.num_eager += 1
        return self._forward(bs, self._meta(bs, inp))[:n]
