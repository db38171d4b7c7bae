"""Decode groups in the engine (issue 45, item 2): generations that share a cached prefix, decoded together in the
shared-prefix kernel, are bitwise the same prompts generated one at a time (no group).

Runs on the CPU under TRITON_INTERPRET=1 or on CUDA; skipped otherwise. The tiny model's head_dim 16 gives
paged_attention's (64, 64) tiles: a 70-token prefix in blocks of 16 shares 4 cached blocks, one whole key tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.attention import triton_backend
from apcscore.attention.decode_groups import SWITCH
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine
from tests.engine.test_cuda_graphs import attach
from triton_device import DEVICE, TRITON_MARKS  # noqa: E402
from portable_models import tiny_dir  # noqa: F401  (fixture)


pytestmark = TRITON_MARKS


def make_engine(model_dir) -> Engine:
    return load_native_engine(str(model_dir), EngineConfig(
        device=DEVICE, dtype="float32", num_kv_blocks=64, block_size=16, max_batch_tokens=128, max_num_seqs=16,
        attention_backend="triton", use_cuda_graphs=False))


def prompts(seed: int, n: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 1000, (70,), generator=g).tolist()
    return prefix, [prefix + torch.randint(0, 1000, (1 + 3 * i,), generator=g).tolist() for i in range(n)]


def generate(engine: Engine, ps: list[list[int]], first: int = 0) -> dict:
    return {o.request_id - first: o for o in engine.run(
        Request(first + i, p, sampling=SamplingParams(max_tokens=4, logprobs=2, ignore_eos=True))
        for i, p in enumerate(ps))}


@pytest.mark.slow  # ~40 s under the interpreter
def test_grouped_generations_are_bitwise_one_at_a_time(tiny_dir, monkeypatch) -> None:
    monkeypatch.setenv(SWITCH, "1")
    model_dir = tiny_dir("llama")
    prefix, ps = prompts(seed=5, n=3)
    alone_engine = make_engine(model_dir)
    alone = {}
    for i, p in enumerate(ps):
        alone[i] = generate(alone_engine, [p], first=i)[0]  # one sequence a step: never a group

    launched: list[int] = []  # groups with members per launch of the shared-prefix kernel
    original = triton_backend.shared_prefix_decode

    def counting(*args, **kwargs):
        launched.append(int((args[6][:, 0] > 0).sum()))
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "shared_prefix_decode", counting)
    for graphs in (False, True):  # the eager step, then the CUDA-graph runner's padded step (eager on the CPU)
        engine = make_engine(model_dir)
        generate(engine, [prefix], first=100)  # the prefix's blocks in the cache: the prompts below hit them
        runner = attach(engine, sizes=(16,)) if graphs else None
        launched.clear()
        together = generate(engine, ps)
        assert launched and max(launched) == 1, launched  # the three decodes ran as one group
        if runner is not None:
            assert runner.num_eager + runner.num_replays >= 3
        for i in range(len(ps)):
            a, b = alone[i], together[i]
            assert b.output_token_ids == a.output_token_ids
            assert np.array_equal(b.output_logprobs.token_logprobs, a.output_logprobs.token_logprobs)
            assert np.array_equal(b.output_logprobs.top_logprobs, a.output_logprobs.top_logprobs)


def test_only_the_triton_backend_plans_groups_and_only_when_asked(tiny_dir, monkeypatch) -> None:
    """Off by default (the engine runs today's kernel until a GPU has measured the groups); switched on, the torch
    backend's steps are still built as before (no plan, no extra arrays), and the Triton backend's plan is for its
    tiles: the tiny model's head_dim 16 and 2 query heads per KV head give tile_config's (64, 64)."""
    model_dir = tiny_dir("llama")
    monkeypatch.delenv(SWITCH, raising=False)
    assert make_engine(model_dir).runner.decode_group_shape is None
    monkeypatch.setenv(SWITCH, "1")
    torch_engine = load_native_engine(str(model_dir), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=16,
                                                                   attention_backend="torch"))
    assert torch_engine.runner.decode_group_shape is None
    assert make_engine(model_dir).runner.decode_group_shape == (64, 64, 2)
