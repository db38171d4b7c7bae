"""The torch attention backend at SmolLM2's shapes (9 query heads, 3 KV heads, head_dim 64): its bitwise rules.

The engine tests check the same on tiny models through the whole engine; these pin the backend itself at the
real model's shapes, where CPU GEMM kernels are the ones the benchmarks run.
"""

from __future__ import annotations

import pytest
import torch

from apcscore.attention import tiles
from apcscore.attention import torch_backend as tb
from apcscore.attention.metadata import AttentionMetadata
from apcscore.attention.products import products
from apcscore.kernels import rowmath

HQ, HKV, D, BS = 9, 3, 64, 16


def meta_for(items: list[tuple[int, int]], tables: list[list[int]]) -> AttentionMetadata:
    return AttentionMetadata.for_attention(items, tables, BS)


def caches(num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random caches in the backend's own heads-major layout, NaN in block 0 (never in a table below)."""
    g = torch.Generator().manual_seed(seed)
    k, v = tb.allocate_kv_cache(1, num_blocks, BS, HKV, D, torch.zeros)[0]
    k.copy_(torch.randn(num_blocks, BS, HKV, D, generator=g))
    v.copy_(torch.randn(num_blocks, BS, HKV, D, generator=g))
    k[0], v[0] = float("nan"), float("nan")
    return k, v


def loop_reference(q, k, v, masked, start, end, state=None):
    """The online softmax written as the plain loop over tiles (what _tiled_softmax batches), with the backend's
    own products (one fma chain per element on the CPU) and its own exp and sums (apcscore.kernels.rowmath: the
    portable ones on the CPU). Not `q @ k.T`: whether MKL's GEMM gives a tile those same bits depends on its code
    path (with MKL_ENABLE_INSTRUCTIONS=AVX2, as on an AMD EPYC, it did not)."""
    m, s, acc = state if state is not None else (None, None, None)
    for t0 in range(start, end, tiles.KV_TILE):
        lo, hi = t0 - start, t0 - start + tiles.KV_TILE
        scores = products(q, k[..., lo:hi, :])
        if masked is not None:
            scores = scores.masked_fill(masked[..., lo:hi], float("-inf"))
        tile_max = scores.amax(-1)
        if m is None:
            m = tile_max
            p = rowmath.exp(scores - m[..., None])
            s, acc = rowmath.row_sum(p), products(p, v[..., lo:hi, :].transpose(-1, -2))
            continue
        m_new = torch.maximum(m, tile_max)
        alpha = rowmath.exp(m - m_new)
        p = rowmath.exp(scores - m_new[..., None])
        s = s * alpha + rowmath.row_sum(p)
        acc = acc * alpha[..., None] + products(p, v[..., lo:hi, :].transpose(-1, -2))
        m = m_new
    return m, s, acc


@pytest.mark.parametrize("q_shape,length", [((3, 96, D), 320), ((3, 32, 16, D), 64), ((3, 32, 16, D), 128),
                                            ((3, 200, D), 512)])
def test_batched_tiles_equal_the_loop_over_tiles(q_shape, length):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(*q_shape, generator=g) * D ** -0.5
    k, v = (torch.randn(*q_shape[:-2], length, D, generator=g) for _ in range(2))
    for masked, end in ((None, length), (None, length - 5), (torch.rand(*q_shape[:-1], length, generator=g) < 0.2,
                                                             length)):
        want = loop_reference(q, k, v, masked, 0, end)
        got = tiles.tiled_softmax(q, k, v, masked, 0, end)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        want = loop_reference(q, k, v, masked, 0, end, want)  # continuing from a state
        got = tiles.tiled_softmax(q, k, v, masked, 0, end, got)
        assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("length", [17, 64, 65, 130, 333, 700])
def test_a_decode_query_equals_the_last_row_of_its_prefill(length):
    """After preemption a sequence is recomputed by prefill: its next token must come out the same."""
    num_blocks = -(-length // BS)
    k, v = caches(num_blocks + 2, length)
    q = torch.randn(length, HQ, D, generator=torch.Generator().manual_seed(1))
    table = list(range(1, num_blocks + 1))
    prefill = tb.paged_attention(q, k, v, meta_for([(length, length)], [table]), D ** -0.5)
    decode = tb.paged_attention(q[-1:], k, v, meta_for([(1, length)], [table]), D ** -0.5)
    assert not prefill.isnan().any()
    assert torch.equal(prefill[-1], decode[0])


def test_decode_with_a_shared_prefix_equals_decode_alone_and_chunks_equal_the_whole():
    prefix_blocks, num_seqs = 20, 12  # a 320-token prefix in the same blocks for every sequence
    lens = [320 + 4 + (i * 7) % 21 for i in range(num_seqs)]
    tables, nxt = [], prefix_blocks + 1
    for n in lens:
        own = -(-n // BS) - prefix_blocks
        tables.append(list(range(1, prefix_blocks + 1)) + list(range(nxt, nxt + own)))
        nxt += own
    k, v = caches(nxt, 7)
    q = torch.randn(num_seqs, HQ, D, generator=torch.Generator().manual_seed(2))
    together = tb.paged_attention(q, k, v, meta_for([(1, n) for n in lens], tables), D ** -0.5)
    for i, n in enumerate(lens):
        alone = tb.paged_attention(q[i:i + 1], k, v, meta_for([(1, n)], [tables[i]]), D ** -0.5)
        assert torch.equal(alone[0], together[i])
    # a prefill in chunks next to other work equals the whole prefill
    n = lens[0]
    qs = torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(3))
    whole = tb.paged_attention(qs, k, v, meta_for([(n, n)], [tables[0]]), D ** -0.5)
    for a, b in ((0, 1), (0, 70), (63, 129), (130, 200), (200, n), (n - 1, n)):
        chunk = torch.cat([q[:3], qs[a:b]])
        got = tb.paged_attention(chunk, k, v, meta_for([(1, lens[1]), (1, lens[2]), (1, lens[3]), (b - a, b)],
                                                       [tables[1], tables[2], tables[3], tables[0]]), D ** -0.5)
        assert torch.equal(got[3:], whole[a:b]), (a, b)


def test_no_zero_fill_of_the_whole_output(monkeypatch) -> None:
    """Each real row is written by the decode or the prefill path, so only the padding rows are zeroed (issue 15,
    item 3): the output is not zero-filled first, and no stale value reaches a real row or a padding row."""
    k, v = caches(8, seed=5)
    q = torch.randn(1 + 1 + 6 + 2, HQ, D, generator=torch.Generator().manual_seed(6))  # decode, decode, prefill, pad
    meta = meta_for([(1, 9), (1, 20), (6, 6)], [[1], [2, 3], [4]])
    want = tb.paged_attention(q, k, v, meta, D ** -0.5)
    real = torch.zeros_like  # the real zeros_like
    filled = []

    def zeros_like(t, *args, **kwargs):
        filled.append(tuple(t.shape))
        return real(t, *args, **kwargs)

    def stale_empty_like(t, *args, **kwargs):
        return torch.full_like(t, float("nan"))

    monkeypatch.setattr(tb.torch, "zeros_like", zeros_like)
    monkeypatch.setattr(tb.torch, "empty_like", stale_empty_like)
    got = tb.paged_attention(q, k, v, meta, D ** -0.5)
    monkeypatch.undo()
    assert tuple(q.shape) not in filled
    assert torch.equal(got, want) and not torch.isnan(got).any()
    assert torch.count_nonzero(got[meta.cu_seqlens_q_list[-1]:]) == 0


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, scale: float,
                    window: int | None, softcap: float | None) -> torch.Tensor:
    """Plain attention (transformers' eager arithmetic) of queries at positions first.. over keys 0..: the
    sliding-window rule `key > query - window` and soft-capping tanh(s / c) * c."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(first, first + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    masked = (k_pos > q_pos) | ((k_pos <= q_pos - window) if window else torch.zeros((), dtype=torch.bool))
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("window,softcap", [(24, None), (64, 5.0), (100, None), (None, 5.0)])
def test_windowed_and_soft_capped_attention(window, softcap):
    """Sliding-window and soft-capped attention (Gemma): equal to plain attention within 1e-5, and bitwise
    the same whatever the chunking, the decode/prefill path and the sequences decoded alongside."""
    length = 333
    num_blocks = -(-length // BS)
    k, v = caches(num_blocks + 2, 11)
    table = list(range(1, num_blocks + 1))
    q = torch.randn(length, HQ, D, generator=torch.Generator().manual_seed(12))
    scale = D ** -0.5
    whole = tb.paged_attention(q, k, v, meta_for([(length, length)], [table]), scale, window, softcap)
    keys = k.reshape(-1, HKV, D)[BS:BS + length]  # the table's blocks are 1.. in order
    values = v.reshape(-1, HKV, D)[BS:BS + length]
    assert (whole - dense_reference(q, keys, values, 0, scale, window, softcap)).abs().max() < 1e-5
    for a, b in ((0, 1), (0, 70), (63, 129), (200, length), (length - 1, length)):  # chunks
        got = tb.paged_attention(q[a:b], k, v, meta_for([(b - a, b)], [table]), scale, window, softcap)
        assert torch.equal(got, whole[a:b]), (a, b)
    for n in (17, 64, 65, 130, length):  # a decode query equals the last row of its prefill, alone or batched
        alone = tb.paged_attention(q[n - 1:n], k, v, meta_for([(1, n)], [table]), scale, window, softcap)
        pair = tb.paged_attention(torch.cat([q[n - 1:n], q[:1]]), k, v,
                                  meta_for([(1, n), (1, length)], [table, table]), scale, window, softcap)
        prefill = tb.paged_attention(q[:n], k, v, meta_for([(n, n)], [table]), scale, window, softcap)
        assert torch.equal(alone[0], prefill[-1]) and torch.equal(pair[0], alone[0]), n


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 5.0), (100, 5.0)])
def test_batched_prefill_chunks_equal_each_chunk_alone(monkeypatch, window, softcap):
    """Short prefill chunks of several sequences run in one batched call (torch_prefill.attend_prefill_batched);
    each chunk's rows must be bitwise those of the chunk run alone (the per-chunk path), whatever the chunks
    beside it: different lengths, chunks that start after a cached prefix, one query past a long prefix."""
    from apcscore.attention import torch_prefill

    chunks = [(40, 40), (12, 300), (2, 65), (64, 133), (63, 63), (5, 5), (31, 700), (65, 300)]  # (q_len, seq_len)
    tables, nxt = [], 1
    for _, n in chunks:
        tables.append(list(range(nxt, nxt + -(-n // BS))))
        nxt += len(tables[-1])
    k, v = caches(nxt, 21)
    q = torch.randn(sum(c[0] for c in chunks) + 3, HQ, D, generator=torch.Generator().manual_seed(22))  # 3 pad rows
    meta = meta_for(chunks, tables)
    batches, alone = torch_prefill.batched_prefill_groups(meta, HQ // HKV, q.device)
    assert alone == [7] and sum(len(b) > 1 for b in batches) >= 3  # the batched path is what runs here
    together = tb.paged_attention(q, k, v, meta, D ** -0.5, window, softcap)
    monkeypatch.setattr(torch_prefill, "MAX_BATCHED_QUERIES", 0)  # every chunk by the per-chunk path
    start = 0
    for (q_len, n), table in zip(chunks, tables):
        single = tb.paged_attention(q[start:start + q_len], k, v, meta_for([(q_len, n)], [table]), D ** -0.5,
                                    window, softcap)
        assert not single.isnan().any()
        assert torch.equal(together[start:start + q_len], single), (q_len, n)
        start += q_len
    assert torch.count_nonzero(together[start:]) == 0
