"""Step inputs (apcscore.engine.step_inputs): the flat arrays of a batch, and their trip to the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request
from apcscore.engine.loader import load_native_engine
from apcscore.engine.step import Sequence
from apcscore.engine.step_inputs import build_step_inputs


def sequence(i: int, tokens: list[int], blocks: list[int], computed: int) -> Sequence:
    seq = Sequence(Request(i, tokens), i)
    seq.block_ids = list(blocks)
    seq.num_computed_tokens = computed
    return seq


def test_a_chunk_across_blocks_and_a_decode_row_padded() -> None:
    """Block size 4: sequence 0 computes positions 3..8 (three blocks), sequence 1 its position 4 (a new block)."""
    a = sequence(0, list(range(100, 110)), [7, 2, 5], computed=3)
    b = sequence(1, list(range(200, 205)), [9, 4], computed=4)
    inp = build_step_inputs([(a, 6), (b, 1)], block_size=4, num_rows=16)
    assert inp.input_ids.tolist() == [103, 104, 105, 106, 107, 108, 204] + [0] * 9
    assert inp.positions.tolist() == [3, 4, 5, 6, 7, 8, 4] + [0] * 9
    # slot = block * 4 + offset: position 3 in block 7, 4..7 in block 2, 8 in block 5; b's 4 in block 4
    assert inp.slot_mapping.tolist() == [31, 8, 9, 10, 11, 20, 16] + [-1] * 9
    assert inp.cu_seqlens_q.tolist() == [0, 6, 7]
    assert inp.seq_lens.tolist() == [9, 5]
    assert inp.block_tables.tolist() == [[7, 2, 5], [9, 4, 0]]
    assert (inp.input_ids.dtype, inp.slot_mapping.dtype, inp.cu_seqlens_q.dtype, inp.block_tables.dtype) == (
        np.int64, np.int64, np.int32, np.int32)
    assert int(inp.cu_seqlens_q[-1]) != inp.num_seqs  # not a decode step: a sequence computes more than one token
    decode = build_step_inputs([(b, 1)], block_size=4)
    assert int(decode.cu_seqlens_q[-1]) == decode.num_seqs  # a decode step: one token per sequence
    with pytest.raises(ValueError):
        build_step_inputs([(a, 6), (b, 1)], block_size=4, num_rows=5)


def arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-5, 1 << 40, size=int(rng.integers(1, 40))),
            rng.integers(0, 1 << 30, size=(3, 5)).astype(np.int32),
            np.zeros(0, dtype=np.int64), rng.integers(0, 9, size=7).astype(np.int32)]


def runner_on(model_dir, device: str):
    """A model runner on `device` (ModelRunner.to_device: the step inputs' trip to it)."""
    return load_native_engine(str(model_dir), EngineConfig(device=device, dtype="float32", num_kv_blocks=16,
                                                           block_size=4, use_cuda_graphs=False)).runner


def test_cpu_staging_is_zero_copy(tiny_model_dir) -> None:
    runner = runner_on(tiny_model_dir("llama"), "cpu")
    host = arrays(0)
    staged = runner.to_device(*host)
    for a, t in zip(host, staged):
        assert t.numpy().dtype == a.dtype and np.array_equal(t.numpy(), a)
    assert staged[0].data_ptr() == host[0].ctypes.data


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_keeps_every_step_intact(tiny_model_dir) -> None:
    """Alternating pinned slots, refilled while earlier copies may be in flight: each step's tensors keep
    their values, are 64-byte aligned, and the buffers grow when a step needs more."""
    runner = runner_on(tiny_model_dir("llama"), "cuda")
    kept = []
    for step in range(6):
        host = arrays(step) + ([np.arange(100_000, dtype=np.int64)] if step == 4 else [])  # forces growth
        kept.append((host, runner.to_device(*host)))
    torch.cuda.synchronize()
    for host, staged in kept:
        for a, t in zip(host, staged):
            assert t.device.type == "cuda" and t.data_ptr() % 64 == 0
            assert np.array_equal(t.cpu().numpy(), a)
