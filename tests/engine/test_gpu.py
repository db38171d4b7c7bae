"""Tests that need a CUDA device: marked `gpu`, skipped without one (and under TRITON_INTERPRET=1).

Run them on the GPU machine through scripts/gpu_check.sh (`pytest -m "gpu or triton"`). What they check:

- CUDA-graph decode: replaying a captured graph is bitwise the eager forward of the same padded batch (fp32
  and bf16), close to the unpadded eager step (fp32: 1e-4), and an engine with graphs generates what an engine
  without them does (fp32: same tokens, logprobs within 1e-4). A replayed step does no host-device sync.
- The Triton engine against the torch engine in bf16 (long prompts, chunked prefill, cached prefixes): both
  are measured against the torch engine in fp32; the Triton error may be at most 1.5x the torch-bf16 error
  + 0.005 (mean |delta logprob|) and 2x + 0.05 (max); greedy tokens equal up to bf16 near-ties (top-2 gap
  below 0.1 in the torch-bf16 run).
- Kernels in bf16 on a Llama-3.2-1B head layout (32 query heads, 8 KV heads, head_dim 64, block 16, contexts
  up to 2048): paged attention within 3e-2 of the torch backend; fused logprobs over a 128256 vocabulary:
  ranks equal, logprobs within 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore import EngineConfig, Request, SamplingParams
from apcscore.attention.metadata import AttentionMetadata, set_attention_metadata
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine
from apcscore.engine.cuda_graphs import DecodeGraphRunner, decode_inputs
from apcscore.engine.step import Sequence
from apcscore.kernels._checks import interpreting
from portable_models import VOCAB_SIZE, tiny_dir  # noqa: F401  (fixture)

DEVICE = "cuda"  # a module constant so that a CPU dry run of the helpers can swap it

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or interpreting(),
                       reason="needs a CUDA device (and TRITON_INTERPRET unset)"),
]


def cuda_engine(model_dir, dtype: str = "float32", backend: str = "triton", graphs: bool = True,
                **overrides) -> Engine:
    cfg = dict(device=DEVICE, dtype=dtype, num_kv_blocks=512, block_size=16, max_batch_tokens=512,
               max_num_seqs=8, attention_backend=backend, use_cuda_graphs=graphs)
    cfg.update(overrides)
    return load_native_engine(str(model_dir), EngineConfig(**cfg))


def prompts(lengths: list[int], seed: int, prefix: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB_SIZE, (prefix,), generator=g).tolist()
    return [shared + torch.randint(0, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def prefilled(engine: Engine, lengths: list[int]) -> list[Sequence]:
    """Sequences whose first length - 1 tokens are in the KV cache (eager prefill): ready to decode one."""
    seqs = []
    for i, p in enumerate(prompts(lengths, seed=5)):
        seq = Sequence(Request(i, p), i)
        assert engine.block_manager.allocate(seq, len(p))
        engine.runner.execute([(seq, len(p) - 1)])
        seq.num_computed_tokens = len(p) - 1
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_is_bitwise_the_eager_padded_forward(tiny_dir, dtype: str) -> None:
    engine = cuda_engine(tiny_dir("llama"), dtype)
    graphs = engine.runner.cuda_graphs
    assert isinstance(graphs, DecodeGraphRunner) and sorted(graphs.graphs) == graphs.sizes == [1, 2, 4, 8]
    seqs = prefilled(engine, [5, 17, 33, 70, 9, 129])
    for n in (1, 3, 6):  # padded to 1, 4, 8
        batch = [(s, 1) for s in seqs[:n]]
        inp = decode_inputs(batch, engine.config.block_size)
        eager = graphs.forward_inputs(inp, eager=True).clone()
        replayed = graphs.forward_inputs(inp).clone()
        assert torch.equal(eager, replayed), n
        if dtype == "float32":  # the unpadded eager step: other GEMM shapes, so only close
            input_ids, positions, meta = engine.runner._stage(engine.runner._step_inputs(batch))
            with torch.inference_mode(), set_attention_metadata(meta):
                ref = engine.model(input_ids, positions)[:n]
            torch.testing.assert_close(replayed, ref, atol=1e-4, rtol=1e-4)
    assert graphs.num_replays == 3


def test_replayed_decode_does_no_host_sync(tiny_dir) -> None:
    engine = cuda_engine(tiny_dir("llama"))
    graphs = engine.runner.cuda_graphs
    batch = [(s, 1) for s in prefilled(engine, [7, 20, 41])]
    graphs.forward(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = graphs.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape[0] == 3 and graphs.num_replays == 2


def generate(engine: Engine, ps: list[list[int]], max_tokens: list[int], logprobs: int | None = 2) -> dict:
    return {o.request_id: o for o in engine.run(
        Request(i, p, sampling=SamplingParams(max_tokens=m, logprobs=logprobs, ignore_eos=True))
        for i, (p, m) in enumerate(zip(ps, max_tokens)))}


def test_engine_with_cuda_graphs_generates_what_eager_does(tiny_dir) -> None:
    model_dir = tiny_dir("llama")
    ps = prompts([3, 10, 30, 5, 60, 18], seed=1, prefix=40)
    max_tokens = [8, 24, 12, 20, 16, 4]  # decode batches shrink 6 -> 1: sizes 8, 4, 2, 1 all replay
    ref = generate(cuda_engine(model_dir, graphs=False), ps, max_tokens)
    engine = cuda_engine(model_dir)
    got = generate(engine, ps, max_tokens)
    assert engine.runner.cuda_graphs.num_replays >= 15  # ~22 decode-only steps
    for i in ref:
        assert got[i].output_token_ids == ref[i].output_token_ids
        assert np.abs(got[i].output_logprobs.token_logprobs - ref[i].output_logprobs.token_logprobs).max() < 1e-4


def score(engine: Engine, ps: list[list[int]], k: int = 5) -> list:
    outs = {o.request_id: o for o in engine.run(Request(i, p, prompt_logprobs=k) for i, p in enumerate(ps))}
    return [outs[i].prompt_logprobs for i in range(len(ps))]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_engine_matches_torch_engine_in_bf16(tiny_dir, arch: str) -> None:
    model_dir = tiny_dir(arch)
    ps = prompts([64, 300, 700, 1500], seed=2)
    gen_ps = prompts([5, 40, 77, 130], seed=3, prefix=256)
    fp32 = score(cuda_engine(model_dir, "float32", "torch", graphs=False), ps)
    torch_bf16 = cuda_engine(model_dir, "bfloat16", "torch", graphs=False)
    triton_bf16 = cuda_engine(model_dir, "bfloat16", "triton")
    a, b = score(torch_bf16, ps), score(triton_bf16, ps)
    ref = np.concatenate([x.token_logprobs for x in fp32])
    err_torch = np.abs(np.concatenate([x.token_logprobs for x in a]) - ref)
    err_triton = np.abs(np.concatenate([x.token_logprobs for x in b]) - ref)
    assert err_triton.mean() <= 1.5 * err_torch.mean() + 0.005, (err_triton.mean(), err_torch.mean())
    assert err_triton.max() <= 2 * err_torch.max() + 0.05, (err_triton.max(), err_torch.max())
    top1 = np.concatenate([x.top_ids[:, 0] for x in fp32])
    agree_torch = (np.concatenate([x.top_ids[:, 0] for x in a]) == top1).mean()
    agree_triton = (np.concatenate([x.top_ids[:, 0] for x in b]) == top1).mean()
    assert agree_triton >= agree_torch - 0.02
    max_tokens = [16] * len(gen_ps)
    ga, gb = generate(torch_bf16, gen_ps, max_tokens), generate(triton_bf16, gen_ps, max_tokens)
    for outs in (ga, gb):  # the first request computes the shared prefix, the others read it from the cache
        assert sorted(o.num_cached_tokens for o in outs.values()) == [0, 256, 256, 256]
    for i in ga:
        assert gb[i].error is None and len(gb[i].output_token_ids) == 16
        top = ga[i].output_logprobs.top_logprobs  # [16, 2]
        for t, (x, y) in enumerate(zip(ga[i].output_token_ids, gb[i].output_token_ids)):
            if x != y:  # allowed only at a bf16 near-tie; after it the continuations legitimately differ
                assert top[t, 0] - top[t, 1] < 0.1, (i, t)
                break


def paged_batch(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, seed: int = 0):
    """specs: (cached, new) per sequence. Returns query, key, value, k_cache, v_cache, meta (random blocks)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    dev = DEVICE
    need = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(need) + 4
    order = torch.randperm(num_blocks, generator=g, device=dev).tolist()
    tables = torch.zeros(len(specs), max(need), dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, device=dev).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g, device=dev).to(dtype)
    slots, cu, lens, used = [], [0], [], 0
    for i, ((c, n), m) in enumerate(zip(specs, need)):
        blocks = order[used:used + m]
        used += m
        tables[i, :m] = torch.tensor(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        cu.append(cu[-1] + n)
        lens.append(c + n)
    t = cu[-1]
    q = torch.randn(t, num_heads, head_dim, generator=g, device=dev).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g, device=dev).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g, device=dev).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev), block_tables=tables.to(dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), cu_seqlens_q_list=cu, seq_lens_list=lens,
        block_size=block_size)
    return q, k, v, k_cache, v_cache, meta


def test_paged_attention_bf16_on_a_llama_1b_layout() -> None:
    from apcscore.attention.torch_backend import TorchAttentionBackend
    from apcscore.attention.triton_backend import TritonAttentionBackend

    specs = [(0, 300), (1000, 1), (517, 64), (2047, 1), (0, 1), (31, 17)]  # prefill, decode, chunk, ...
    q, k, v, kc, vc, meta = paged_batch(specs, 32, 8, 64, 16, torch.bfloat16)
    kc2, vc2 = kc.clone(), vc.clone()
    scale = 64 ** -0.5
    ref = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, scale)
    out = TritonAttentionBackend().forward(q, k, v, kc2, vc2, meta, scale)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # store_kv: the same bits
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=0)


def test_fused_logprobs_bf16_on_a_llama_vocabulary() -> None:
    from apcscore.kernels.logprobs import token_logprobs
    from apcscore.kernels.logprobs_torch import token_logprobs_torch

    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = (3 * torch.randn(64, 128256, generator=g, device=DEVICE)).to(torch.bfloat16)
    targets = torch.randint(0, 128256, (64,), generator=g, device=DEVICE)
    got = token_logprobs(logits, targets, 5)
    ref = token_logprobs_torch(logits, targets, 5)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=0)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    torch.testing.assert_close(got[3], ref[3], atol=1e-4, rtol=0)


def test_kv_pool_leaves_room_for_the_largest_step(tiny_dir) -> None:
    """The pool sized from the profile of the largest step (engine/kv_cache.py): that step then runs inside
    fraction x total, its peak within 5% of the profiled one."""
    torch.cuda.empty_cache()
    fraction = 0.05  # 7 GB of an H200: 0.3 would be 10M blocks, ~10 s of host bookkeeping in BlockManager
    engine = cuda_engine(tiny_dir("llama"), dtype="bfloat16", num_kv_blocks=None, max_batch_tokens=2048,
                         logprobs_chunk_size=2048, kv_cache_memory_fraction=fraction, graphs=False)
    _, total = torch.cuda.mem_get_info()
    pool = engine.block_manager.num_blocks * engine.config.block_size  # tokens
    assert pool > 2048
    torch.cuda.reset_peak_memory_stats()
    (out,) = engine.run([Request(0, prompts([2048], seed=9)[0], prompt_logprobs=engine.config.max_logprobs)])
    assert out.error is None
    assert torch.cuda.max_memory_allocated() <= fraction * total * 1.05


def test_without_batch_invariance_the_lm_head_is_cublas_writing_fp32(tiny_dir) -> None:
    """`--no-batch-invariant` on CUDA multiplies the LM head with cuBLAS (the invariance tax compares against
    that), still writing fp32 logits from the fp32 accumulator; with invariance it is the Triton matmul."""
    from apcscore.kernels.matmul import invariant_linear
    from apcscore.kernels.matmul_torch import library_logits

    library = cuda_engine(tiny_dir("llama"), dtype="bfloat16", graphs=False, batch_invariant=False)
    linear, head, rows_dtype = library.runner.model.logits_product()
    assert linear is library_logits and head.dtype == rows_dtype == torch.bfloat16
    invariant = cuda_engine(tiny_dir("llama"), dtype="bfloat16", graphs=False)
    assert invariant.runner.model.logits_product()[0].func is invariant_linear  # functools.partial
    g = torch.Generator(device=DEVICE).manual_seed(3)
    x = torch.randn(37, head.shape[1], generator=g, device=DEVICE).to(torch.bfloat16)
    exact = x.double() @ head.double().t()
    out = torch.full((64, head.shape[0]), float("nan"), device=DEVICE)
    for logits in (library_logits(x, head), library_logits(x, head, out=out)):
        assert logits.dtype == torch.float32 and logits.shape == (37, head.shape[0])
        # fp32 from the accumulator: far closer than bf16 logits (2^-8 relative) would be
        assert (logits.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    assert torch.equal(out[:37], library_logits(x, head)) and out[37:].isnan().all()
