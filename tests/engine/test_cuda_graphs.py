"""The decode graph runner's CPU-testable parts: size buckets, decode inputs, padding, and the padded
forward run eagerly inside the engine (the capture itself is tested on CUDA in test_gpu.py).

On the CPU the engine pads every batch to 16 rows (model_runner.MIN_ROWS), so a padded decode of size 16
must give bitwise the engine's own results; smaller sizes change the GEMM row count and only agree to ~1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.engine.cuda_graphs import (DEFAULT_CAPTURE_SIZES, DecodeGraphRunner, capture_sizes, decode_inputs,
                                         pad_decode_inputs, padded_size)
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine
from apcscore.engine.step import Sequence
from apcscore.kernels._checks import interpreting


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert capture_sizes(16, (16,)) == [16]
    assert capture_sizes(4, (16,)) == [4]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_size_is_the_next_captured_size() -> None:
    sizes = capture_sizes(100)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 16, 17, 64, 65, 100)] == [1, 2, 4, 8, 16, 32, 64, 100, 100]
    assert padded_size(101, sizes) is None
    assert padded_size(0, sizes) is None


def make_engine(model_dir, **overrides) -> Engine:
    cfg = dict(device="cpu", dtype="float32", num_kv_blocks=128, block_size=4, max_batch_tokens=64,
               max_num_seqs=16, attention_backend="torch")
    cfg.update(overrides)
    return load_native_engine(str(model_dir), EngineConfig(**cfg))


def attach(engine: Engine, sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES) -> DecodeGraphRunner:
    """Give the engine's model runner a DecodeGraphRunner of `sizes` (on CUDA captured, elsewhere its padded forward
    runs eagerly), built as ModelRunner builds one on CUDA for the Triton backend."""
    runner = engine.runner
    runner.cuda_graphs = DecodeGraphRunner(runner.model, runner.block_size, engine.config.max_num_seqs, runner.device,
                                           runner.to_device, sizes, capture=runner.device.type == "cuda")
    return runner.cuda_graphs


def running_sequences(engine: Engine, lengths: list[int], computed: list[int]) -> list[Sequence]:
    """Sequences with blocks allocated for `lengths` tokens, of which `computed` are in the cache."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i, (n, c) in enumerate(zip(lengths, computed)):
        seq = Sequence(Request(i, torch.randint(0, 1000, (n,), generator=g).tolist()), i)
        assert engine.block_manager.allocate(seq, n)
        seq.num_computed_tokens = c
        seqs.append(seq)
    return seqs


def test_decode_inputs_equal_the_runners_own_preparation(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    seqs = running_sequences(engine, [5, 9, 17], [4, 8, 16])  # block boundaries: positions 4, 8, 16
    batch = [(s, 1) for s in seqs]
    inp = decode_inputs(batch, engine.config.block_size)
    input_ids, positions, meta = engine.runner._stage(engine.runner._step_inputs(batch))
    n = len(seqs)
    assert inp.input_ids.tolist() == input_ids[:n].tolist()
    assert inp.positions.tolist() == positions[:n].tolist()
    assert inp.slot_mapping.tolist() == meta.slot_mapping[:n].tolist()
    assert inp.seq_lens.tolist() == meta.seq_lens.tolist()
    assert np.array_equal(inp.block_tables, meta.block_tables.numpy())
    mixed = [(seqs[0], 1), (seqs[1], 2)]
    assert decode_inputs(mixed, 4) is None
    assert decode_inputs([], 4) is None


def test_padding_rows_are_empty_sequences(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    seqs = running_sequences(engine, [5, 9, 17], [4, 8, 16])
    inp = decode_inputs([(s, 1) for s in seqs], 4)
    tokens, lens = pad_decode_inputs(inp, 8)
    assert tokens.shape == (3, 8) and lens.shape == (2, 12)  # rows of 12 int32: 16-byte aligned
    assert tokens[0].tolist() == [*inp.input_ids, 0, 0, 0, 0, 0]
    assert tokens[1].tolist() == [4, 8, 16, 0, 0, 0, 0, 0]
    assert tokens[2, 3:].tolist() == [-1] * 5  # nothing stored
    assert lens[0, :9].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]  # cu_seqlens_q: padding sequences have q_len 0
    assert lens[1, :8].tolist() == [5, 9, 17, 0, 0, 0, 0, 0]  # seq_lens
    with pytest.raises(ValueError):
        pad_decode_inputs(inp, 2)


def test_only_the_triton_backend_is_captured(tiny_model_dir) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    small = EngineConfig(block_size=4, max_num_seqs=16)
    assert DecodeGraphRunner.for_model(engine.model, small, torch.device("cpu"), engine.runner.to_device) is None
    assert engine.runner.cuda_graphs is None  # on the CPU the model runner never makes one


def generate(engine: Engine, seed: int, n: int = 5, max_tokens: int = 6, logprobs: int | None = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 49152, (8,), generator=g).tolist()
    ps = [shared + torch.randint(0, 49152, (3 + 2 * i,), generator=g).tolist() for i in range(n)]
    return {o.request_id: o for o in engine.run(
        Request(i, p, sampling=SamplingParams(max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True))
        for i, p in enumerate(ps))}


def assert_same_outputs(a: dict, b: dict, tol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].output_token_ids == b[i].output_token_ids
        la, lb = a[i].output_logprobs, b[i].output_logprobs
        if tol == 0.0:
            assert np.array_equal(la.token_logprobs, lb.token_logprobs)
            assert np.array_equal(la.top_ids, lb.top_ids) and np.array_equal(la.top_logprobs, lb.top_logprobs)
        else:
            assert np.abs(la.token_logprobs - lb.token_logprobs).max() < tol


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_decode_in_the_engine_is_bitwise_the_eager_step(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    ref = generate(make_engine(model_dir), seed=1)
    engine = make_engine(model_dir)
    graphs = attach(engine, sizes=(16,))
    got = generate(engine, seed=1)
    assert graphs.sizes == [16] and graphs.num_eager >= 5 and not graphs.graphs
    assert_same_outputs(ref, got)


@pytest.mark.slow
def test_small_padded_sizes_agree_closely(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    ref = generate(make_engine(model_dir), seed=2)
    engine = make_engine(model_dir, max_num_seqs=5)
    graphs = attach(engine)
    assert graphs.sizes == [1, 2, 4, 5]
    assert_same_outputs(ref, generate(engine, seed=2), tol=1e-5)
    assert graphs.num_eager >= 5


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.skipif(not interpreting(), reason="the Triton backend on the CPU needs TRITON_INTERPRET=1")
def test_triton_kernels_skip_padding_sequences(tiny_model_dir) -> None:
    """The padding the graphs use (empty sequences past cu_seqlens_q[-1]) through the Triton kernels."""
    model_dir = tiny_model_dir("llama")
    ref = generate(make_engine(model_dir, attention_backend="triton"), seed=3, n=2, max_tokens=3, logprobs=None)
    engine = make_engine(model_dir, attention_backend="triton")
    graphs = attach(engine, sizes=(16,))
    got = generate(engine, seed=3, n=2, max_tokens=3, logprobs=None)
    assert graphs.num_eager == 2
    assert {i: o.output_token_ids for i, o in got.items()} == {i: o.output_token_ids for i, o in ref.items()}
