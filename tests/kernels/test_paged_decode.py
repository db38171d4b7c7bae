"""Decode attention on the CPU reads the paged cache through the block tables (issue 44, item 3): no gathered
copy of the keys and values, and the same bits as the gathering path on every micro-kernel."""

from __future__ import annotations

import pytest
import torch

from apcscore.attention import torch_backend as tb
from apcscore.attention import torch_decode
from apcscore.attention.metadata import AttentionMetadata
from apcscore.kernels.cpu_gemm import fixed_order_bmm, paged_bmm, simd_level

BS = 16
pytestmark = pytest.mark.skipif(not torch_decode.paged_decode(torch.device("cpu")),
                                reason="the fixed-order CPU kernel does not build here")


def batch(lens: list[int], shared_blocks: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    """Caches with NaN in block 0 (in no table), block tables (a shared prefix, then shuffled own blocks)."""
    g = torch.Generator().manual_seed(seed)
    own = [-(-n // BS) - shared_blocks for n in lens]
    num_blocks = 1 + shared_blocks + sum(own)
    perm = (torch.randperm(num_blocks - 1 - shared_blocks, generator=g) + 1 + shared_blocks).tolist()
    tables, p = [], 0
    for n_own in own:
        tables.append(list(range(1, shared_blocks + 1)) + perm[p:p + n_own])
        p += n_own
    k, v = tb.allocate_kv_cache(1, num_blocks, BS, hkv, d, lambda shape: torch.zeros(shape, dtype=dtype))[0]
    k.copy_(torch.randn(k.shape, generator=g))
    v.copy_(torch.randn(v.shape, generator=g))
    k[0], v[0] = float("nan"), float("nan")
    return k, v, AttentionMetadata.for_attention([(1, n) for n in lens], tables, BS)


CASES = [  # lens, shared blocks, Hkv, D, dtype, window, softcap
    ([37, 200, 129, 64, 1], 0, 3, 64, torch.float32, None, None),
    ([320 + 4 + (i * 7) % 21 for i in range(12)], 20, 3, 64, torch.float32, None, None),  # shared tiles
    ([300, 301, 450], 18, 2, 40, torch.bfloat16, None, None),  # head_dim not a multiple of 16, bf16 cache
    ([90, 260, 17], 0, 3, 64, torch.float16, 50, 30.0),  # windowed, soft-capped, fp16 cache
]


@pytest.mark.parametrize("simd", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_decode_equals_the_gathering_path(monkeypatch, simd, case):
    lens, shared, hkv, d, dtype, window, softcap = CASES[case]
    monkeypatch.setenv("APCSCORE_SIMD", simd)
    k, v, meta = batch(lens, shared, hkv, d, dtype, seed=case)
    q = torch.randn(len(lens), hkv * 3, d, generator=torch.Generator().manual_seed(9))
    scale = d ** -0.5

    def no_gather(*args, **kwargs):
        raise AssertionError("the paged decode path gathered the cache")

    monkeypatch.setattr(torch_decode, "gather", no_gather)
    paged = tb.paged_attention(q, k, v, meta, scale, window=window, softcap=softcap)
    monkeypatch.undo()
    monkeypatch.setenv("APCSCORE_SIMD", simd)
    monkeypatch.setattr(torch_decode, "paged_decode", lambda device: False)
    meta.plans.clear()
    gathered = tb.paged_attention(q, k, v, meta, scale, window=window, softcap=softcap)
    assert not paged.isnan().any()
    assert torch.equal(paged, gathered)


def test_paged_bmm_equals_the_bmm_of_the_gathered_rows():
    """The kernel alone, keys and values, past-the-end positions reading position 0, on each micro-kernel."""
    k, _, meta = batch([70, 33, 129], 0, 2, 64, torch.float32, seed=4)
    tables, lens = meta.block_tables, meta.seq_lens.to(torch.int32)
    first, num_keys = 64, 128  # keys [64, 192): past the end for all three sequences somewhere
    pos = torch.arange(first, first + num_keys)
    pos = torch.where(pos[None, :] < lens[:, None], pos[None, :], 0)  # [S, L]
    slots = tables.long().gather(1, pos // BS) * BS + pos % BS
    rows = k.flatten(0, 1)[slots].permute(2, 0, 1, 3)  # [H, S, L, D]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 64, generator=g)
    p = torch.randn(2, 3, 2, 5, 64, generator=g)  # two tiles of 64 keys
    for simd in (0, 1, 2):
        want = fixed_order_bmm(q, rows, simd=simd)
        assert torch.equal(paged_bmm(q, k, tables, lens, first, num_keys, simd=simd), want)
        tiles_v = rows.unflatten(2, (2, 64)).transpose(-1, -2)  # [H, S, T, D, tile]
        want = fixed_order_bmm(p.flatten(0, 1), tiles_v.flatten(0, 1), simd=simd).view(2, 3, 2, 5, 64)
        assert torch.equal(paged_bmm(p, k, tables, lens, first, simd=simd), want)
    assert simd_level() in ("avx512-fma", "avx2-fma", "scalar-fma")


def test_paged_bmm_refuses_operands_that_do_not_fit():
    k, _, meta = batch([40], 0, 2, 64, torch.float32, seed=2)
    q = torch.randn(2, 1, 3, 64)
    with pytest.raises(ValueError, match="do not fit"):
        paged_bmm(q, k, meta.block_tables.long(), meta.seq_lens.to(torch.int32), 0, 64)  # int64 tables
    with pytest.raises(ValueError, match="do not fit"):
        paged_bmm(torch.randn(3, 1, 3, 64), k, meta.block_tables, meta.seq_lens.to(torch.int32), 0, 64)  # heads
