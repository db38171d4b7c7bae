"""KV pool sizing on CUDA from a profile of the largest step (issue 15, item 2), vLLM's rule: the pool gets
fraction x total memory minus the peak of that step (weights included) and memory outside torch. The
arithmetic and the profile step run here on the CPU; the CUDA measurement runs in tests/engine/test_gpu.py."""

from __future__ import annotations

import torch

from apcscore import EngineConfig, Request
from apcscore.engine.loader import load_native_engine
from apcscore.engine import kv_cache
from apcscore.engine.kv_cache import cuda_pool_bytes, default_num_kv_blocks, kv_bytes_per_block, step_lengths

GiB = 2**30


def test_pool_bytes_leave_room_for_the_largest_step() -> None:
    # an 80 GiB card, 0.85 of it for the engine, a 20 GiB peak (weights + largest step), 1 GiB outside torch
    assert cuda_pool_bytes(80 * GiB, 0.85, 20 * GiB, 1 * GiB) == int(0.85 * 80 * GiB) - 21 * GiB
    assert cuda_pool_bytes(24 * GiB, 0.85, 30 * GiB, 0) == 0  # never negative
    assert step_lengths(2048, 4096) == [2048] and step_lengths(5000, 2048) == [2048, 2048, 904]


def test_cuda_pool_size_subtracts_the_profiled_peak(monkeypatch, tiny_model_dir) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir("llama"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 28 * GiB)  # 2 GiB outside torch
    per_block = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    got = default_num_kv_blocks(cfg, 16, torch.bfloat16, torch.device("cuda"), None, profile=lambda: 25 * GiB)
    assert got == (int(0.85 * 80 * GiB) - 25 * GiB - 2 * GiB) // per_block
    # a bigger largest step leaves a smaller pool
    less = default_num_kv_blocks(cfg, 16, torch.bfloat16, torch.device("cuda"), 0.85, profile=lambda: 40 * GiB)
    assert less == (int(0.85 * 80 * GiB) - 42 * GiB) // per_block


def test_largest_step_runs_and_leaves_no_cache(tiny_model_dir) -> None:
    engine = load_native_engine(str(tiny_model_dir("llama")), EngineConfig(device="cpu", num_kv_blocks=64,
                                                                           block_size=4, max_batch_tokens=96))
    model = engine.model
    calls = []

    def logprob_fn(logits, targets, k):
        calls.append((tuple(logits.shape), k))
        return engine.ops.token_logprobs(logits, targets, k)

    kept = [(layer.self_attn.k_cache, layer.self_attn.v_cache) for layer in model.layers]
    kv_cache.run_largest_step(model, max_batch_tokens=96, max_model_len=40, block_size=4, dtype=torch.float32,
                              device=torch.device("cpu"), logits_rows=32, logprob_fn=logprob_fn, k=5)
    assert calls == [((32, engine.info.vocab_size), 5)]
    assert all(layer.self_attn.k_cache.numel() == 0 for layer in model.layers)
    for layer, (k, v) in zip(model.layers, kept):  # the engine's pool goes back; the engine still runs
        layer.self_attn.k_cache, layer.self_attn.v_cache = k, v
    (out,) = engine.run([Request(0, list(range(1, 30)), prompt_logprobs=1)])
    assert out.error is None and len(out.prompt_logprobs) == 28
