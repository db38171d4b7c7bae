"""The fixed-order CPU attention kernel (apcscore.kernels.cpu_attention): the torch ops' bits in one call per layer.

paged_attention runs the kernel where it supports the call; its result must equal, bit for bit, the torch ops it
replaces (the per-chunk, batched-chunk and decode paths of attention/torch_prefill.py and torch_decode.py) under
every instruction set this CPU runs and any thread count, for any mix of decode rows, prefill chunks and cached
prefixes; and a row's bits must not depend on what else is in the call.
"""

from __future__ import annotations

import pytest
import torch

from apcscore.attention import torch_backend as tb
from apcscore.attention.metadata import AttentionMetadata
from apcscore.kernels import cpu_attention
from apcscore.kernels.cpu_library import SIMD_SETTINGS, available, library

pytestmark = pytest.mark.skipif(not available(), reason="the fixed-order CPU kernels need a C compiler")

# (items (q_len, seq_len), Hq, Hkv, head_dim, block_size): decode rows, short and long chunks, cached prefixes,
# partial last tiles, groups of 1, 3, 4 and 64, head_dim 128 (two fma chain blocks), 80 (not a multiple of 64), 16
CASES = [
    ([(1, 100)], 9, 3, 64, 16),
    ([(100, 100)], 9, 3, 64, 16),
    ([(30, 200), (1, 77), (64, 64), (65, 300), (1, 1), (2, 2)], 9, 3, 64, 16),
    ([(5, 130), (1, 129), (128, 128)], 8, 2, 128, 32),
    ([(33, 90), (1, 45), (17, 17)], 4, 4, 80, 16),
    ([(200, 700), (7, 1000)] + [(1, 500 + 37 * i) for i in range(6)], 9, 3, 64, 16),
    ([(3, 40), (1, 70)], 64, 1, 16, 16),  # a group larger than a unit's rows (one KV head for 64 query heads)
]


def levels() -> list[str]:
    best = library().apc_simd_level()
    return [name for name, level in SIMD_SETTINGS.items() if level <= best]


def setup(items, hq, hkv, d, bs, dtype, seed=0):
    """Random caches in the backend's heads-major layout (shuffled blocks), queries, and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // bs) for _, s in items) + 2
    k, v = tb.allocate_kv_cache(1, num_blocks, bs, hkv, d, lambda shape: torch.zeros(shape, dtype=dtype))[0]
    k.copy_(torch.randn(num_blocks, bs, hkv, d, generator=g))
    v.copy_(torch.randn(num_blocks, bs, hkv, d, generator=g))
    k[0], v[0] = float("nan"), float("nan")  # never in a table: a read of it would show
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = []
    for _, seq_len in items:
        n = -(-seq_len // bs)
        tables.append(perm[:n])
        perm = perm[n:]
    meta = AttentionMetadata.for_attention(items, tables, bs)
    query = torch.randn(sum(q for q, _ in items) + 3, hq, d, generator=g).to(dtype)  # 3 padding rows
    return query, k, v, meta


def attend(query, k, v, meta, fused: bool, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(cpu_attention, "supported", lambda *args: False)
        meta.plans.clear()
        return tb.paged_attention(query, k, v, meta)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32 if x.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_torch_ops_bits(case, dtype, monkeypatch) -> None:
    query, k, v, meta = setup(*case, dtype)
    assert cpu_attention.supported(query, k, v, None, None)
    want = attend(query, k, v, meta, False, monkeypatch)
    for level in levels():
        for threads in (1, 2):
            monkeypatch.setenv("APCSCORE_SIMD", level)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                got = attend(query, k, v, meta, True, monkeypatch)
            finally:
                torch.set_num_threads(before)
            assert torch.equal(bits(got), bits(want)), (level, threads)


def test_fp16_caches_and_a_row_alone_equal_the_row_in_a_batch(monkeypatch) -> None:
    items = [(30, 200), (1, 77), (64, 64), (1, 130)]
    query, k, v, meta = setup(items, 9, 3, 64, 16, torch.float16)
    together = attend(query, k, v, meta, True, monkeypatch)
    assert torch.equal(bits(together), bits(attend(query, k, v, meta, False, monkeypatch)))
    cu = meta.cu_seqlens_q_list
    for i, (q_len, seq_len) in enumerate(items):
        alone = AttentionMetadata.for_attention([(q_len, seq_len)], [meta.block_tables[i].tolist()], 16)
        got = attend(query[cu[i]:cu[i + 1]], k, v, alone, True, monkeypatch)
        assert torch.equal(bits(got), bits(together[cu[i]:cu[i + 1]])), i


def test_close_to_float64_attention(monkeypatch) -> None:
    """Accuracy: within 2e-6 of float64 softmax(q k^T / sqrt(d)) v on unit-normal data (the float32 torch ops'
    error is of the same size)."""
    items = [(50, 300), (1, 129)]
    query, k, v, meta = setup(items, 9, 3, 64, 16, torch.float32)
    got = attend(query, k, v, meta, True, monkeypatch)
    cu = meta.cu_seqlens_q_list
    for i, (q_len, seq_len) in enumerate(items):
        slots = torch.cat([torch.arange(b * 16, b * 16 + 16) for b in meta.block_tables[i].tolist()])[:seq_len]
        keys = k.reshape(-1, 3, 64)[slots].double().repeat_interleave(3, dim=1)  # [L, Hq, D]
        values = v.reshape(-1, 3, 64)[slots].double().repeat_interleave(3, dim=1)
        q = query[cu[i]:cu[i + 1]].double()  # [Q, Hq, D]
        scores = torch.einsum("qhd,lhd->hql", q, keys) / 8.0
        pos = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, None, :] > pos[None, :, None], float("-inf"))
        ref = torch.einsum("hql,lhd->qhd", scores.softmax(-1), values)
        assert (got[cu[i]:cu[i + 1]].double() - ref).abs().max() < 2e-6


@pytest.mark.parametrize("window,softcap,head_dim", [(32, None, 64), (None, 50.0, 64), (None, None, 72)])
def test_the_torch_ops_run_what_the_kernel_does_not_cover(window, softcap, head_dim) -> None:
    query, k, v, _ = setup([(4, 40)], 4, 2, head_dim, 16, torch.float32)
    assert not cpu_attention.supported(query, k, v, window, softcap)
