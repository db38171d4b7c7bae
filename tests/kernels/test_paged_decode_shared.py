"""Shared-prefix decode attention (issue 45, item 2): a decode group's rows are bitwise today's kernel's.

Decode sequences that share their first KV blocks run in one program per KV head (kernels/paged_decode_shared);
each row must get exactly the bits paged_attention gives the sequence run alone. Runs under TRITON_INTERPRET=1
(tests/conftest.py makes the interpreter's tl.dot row-exact, as a GPU's MMA is assumed to be) or on CUDA.
Under the interpreter the bf16 tl.dot multiplies bit patterns (tests/kernels/test_kernels.py): the bf16 cases
still compare the two kernels bitwise, which is what they are for, not attention's values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apcscore.attention.decode_groups import pack_decode_groups, plan_decode_groups
from triton_device import DEVICE, INTERPRET, needs_triton  # noqa: E402
from apcscore.kernels.paged_attention import paged_attention
from apcscore.kernels.paged_decode_shared import shared_prefix_decode




def shared_cache(lens: list[int], shared: list[int], block_size: int, hkv: int, d: int, dtype: torch.dtype,
                 seed: int):
    """K/V caches and block tables: sequence i's first shared[i] blocks are the common blocks 1.., the rest its
    own, shuffled; block 0 (in no table) and every slot past a sequence's end hold NaN."""
    g = torch.Generator().manual_seed(seed)
    common = max(shared)
    own = [-(-n // block_size) - s for n, s in zip(lens, shared)]
    num_blocks = 1 + common + sum(own)
    perm = (torch.randperm(num_blocks - 1 - common, generator=g) + 1 + common).tolist()
    tables, p = [], 0
    for s, n_own in zip(shared, own):
        tables.append(list(range(1, s + 1)) + perm[p:p + n_own])
        p += n_own
    k = torch.full((num_blocks, block_size, hkv, d), float("nan"))
    v = k.clone()
    for table, n in zip(tables, lens):
        for pos in range(n):
            b, o = table[pos // block_size], pos % block_size
            if torch.isnan(k[b, o]).any():  # a shared block is written once
                k[b, o] = torch.randn(hkv, d, generator=g)
                v[b, o] = torch.randn(hkv, d, generator=g)
    width = max(map(len, tables))
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return k.to(dtype), v.to(dtype), bt


def alone(q, k, v, bt, lens, i, scale, tiles, softcap):
    """Today's kernel on sequence i alone: its one decode row [Hq, D]."""
    out = paged_attention(q[i:i + 1].to(DEVICE), k, v, bt[i:i + 1].to(DEVICE),
                          torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                          torch.tensor([lens[i]], dtype=torch.int32, device=DEVICE), scale, softcap=softcap, **tiles)
    return out[0]


CASES = [  # lens, shared blocks, block_size, Hkv, group, D, dtype, tiles (None: tile_config's), softcap
    ([70, 45, 90], [4, 4, 4], 16, 2, 1, 32, torch.float32, dict(block_m=16, block_n=16), None),
    ([100, 101, 64, 77, 120, 33], [3, 3, 3, 2, 3, 0], 32, 1, 4, 32, torch.float32, dict(block_m=16, block_n=16), None),
    ([50, 66, 49, 80], [3, 3, 1, 3], 16, 2, 8, 16, torch.float32, dict(block_m=16, block_n=16), 20.0),
    ([130, 140], [4, 4], 32, 1, 4, 64, torch.float32, None, None),  # the production tiles (64, 64)
    ([40, 41, 60, 90, 35], [2, 2, 2, 2, 2], 16, 2, 4, 32, torch.bfloat16, dict(block_m=16, block_n=16), None),
    ([70, 100, 20], [2, 2, 0], 32, 1, 8, 16, torch.bfloat16, dict(block_m=16, block_n=32), None),
    # one shared tile: all of sequence 0's keys but its last
    ([17, 18], [1, 1], 16, 1, 1, 16, torch.float32, dict(block_m=16, block_n=16), None),
]


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("case", range(len(CASES)))
def test_grouped_decode_is_bitwise_each_sequence_alone(case: int) -> None:
    lens, shared, bs, hkv, group, d, dtype, tiles, softcap = CASES[case]
    k, v, bt = shared_cache(lens, shared, bs, hkv, d, dtype, seed=case)
    k, v = k.to(DEVICE), v.to(DEVICE)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(50 + case)).to(dtype)
    # the interpreter's bf16 dot multiplies bit patterns (scores ~1e9): a tiny scale keeps the softmax from being
    # one-hot there, so that a wrong bit in the running max or sum still shows
    scale = 1e-9 if INTERPRET and dtype == torch.bfloat16 else d ** -0.5
    from apcscore.kernels.paged_attention import tile_config

    block_m, block_n = (tiles["block_m"], tiles["block_n"]) if tiles else tile_config(d, group)[:2]
    cu = np.arange(len(lens) + 1, dtype=np.int32)
    groups = plan_decode_groups(cu, np.array(lens), bt.numpy(), bs, block_n, block_m // group)
    expect_group = sum(1 for s, n in zip(shared, lens) if s * bs >= block_n and n - 1 >= block_n) >= 2
    assert bool(groups) == expect_group, groups
    table, grouped = pack_decode_groups(groups, len(lens), block_m // group)
    dev = dict(dtype=torch.int32, device=DEVICE)
    meta = (bt.to(DEVICE), torch.tensor(cu, **dev), torch.tensor(lens, **dev))
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    paged_attention(q.to(DEVICE), k, v, *meta, scale, softcap=softcap, out=out, skip=torch.tensor(grouped, **dev),
                    **(tiles or {}))
    skipped = torch.tensor(grouped, dtype=torch.bool, device=DEVICE)
    assert out[skipped].isnan().all()  # today's kernel left the grouped sequences' rows alone
    shared_prefix_decode(q.to(DEVICE), k, v, *meta, torch.tensor(table, **dev), out, scale, softcap=softcap,
                         **(tiles or {}))
    for i in range(len(lens)):
        want = alone(q, k, v, bt, lens, i, scale, tiles or {}, softcap)
        assert not want.isnan().any() and not out[i].isnan().any(), i
        assert torch.equal(out[i], want), (i, (out[i].float() - want.float()).abs().max())


def test_plan_groups_by_shared_blocks_and_splits_at_block_q() -> None:
    bs, block_n = 16, 32
    tables = np.array([[1, 2, 3, 9], [1, 2, 3, 10], [1, 2, 4, 11], [5, 6, 7, 12], [1, 2, 3, 13], [5, 6, 7, 14],
                       [8, 0, 0, 0], [1, 2, 3, 15]], dtype=np.int32)
    lens = np.array([60, 61, 50, 64, 63, 60, 3, 62])
    cu = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8])
    groups = plan_decode_groups(cu, lens, tables, bs, block_n, block_q=8)
    assert groups == [([0, 1, 4, 7, 2], 1), ([3, 5], 1)]  # 2 shares blocks 1, 2 (32 keys: one tile) with them
    groups = plan_decode_groups(cu, lens, tables, bs, block_n, block_q=2)  # cut into groups of 2; 2 alone
    assert groups == [([0, 1], 1), ([4, 7], 1), ([3, 5], 1)]
    groups = plan_decode_groups(cu, lens, tables, bs, block_n=64, block_q=8)  # 48 shared keys < one 64-key tile
    assert groups == []
    table, grouped = pack_decode_groups(groups + [([3, 5], 1)], 8, 4, num_rows=3)
    assert table.tolist() == [[2, 1, 3, 5, 0, 0], [0] * 6, [0] * 6] and grouped.tolist() == [0, 0, 0, 1, 0, 1, 0, 0]


def test_plan_leaves_out_prefills_and_keeps_the_last_position_out_of_shared_tiles() -> None:
    tables = np.array([[1, 2, 3], [1, 2, 3], [1, 2, 3]], dtype=np.int32)
    cu = np.array([0, 1, 5, 6])  # sequence 1 is a prefill chunk of 4 tokens
    assert plan_decode_groups(cu, np.array([48, 48, 48]), tables, 16, 16, 8) == [([0, 2], 2)]  # 47 keys: 2 tiles
    assert plan_decode_groups(cu, np.array([33, 48, 48]), tables, 16, 16, 8) == [([0, 2], 2)]
    assert plan_decode_groups(cu, np.array([17, 48, 48]), tables, 16, 16, 8) == [([0, 2], 1)]
    assert plan_decode_groups(cu, np.array([16, 48, 48]), tables, 16, 16, 8) == []  # 15 keys before its token
    assert plan_decode_groups(np.array([0, 1, 2, 3]), np.array([48] * 3), tables, 16, 16, block_q=1) == []
    with pytest.raises(ValueError, match="members"):
        pack_decode_groups([([0], 1)], 3, 4)


@pytest.mark.parametrize("seed", range(20))
def test_plan_groups_are_sound_on_random_batches(seed: int) -> None:
    """Every group: 2..block_q decodes, in one group each, whose first shared_tiles * block_n keys are in the same
    blocks and before each member's last position; and no two sequences left out could have grouped."""
    rng = np.random.default_rng(seed)
    bs, block_n, block_q = int(rng.choice([4, 16, 32])), int(rng.choice([16, 32, 64])), int(rng.integers(2, 9))
    n = int(rng.integers(1, 30))
    prefixes = [rng.integers(1, 1000, 12).tolist() for _ in range(3)]
    lens = rng.integers(1, 300, n)
    tables = np.zeros((n, -(-300 // bs) + 1), np.int32)
    nxt = 1000
    for i, length in enumerate(lens):
        blocks = -(-int(length) // bs)
        take = min(blocks, int(rng.integers(0, 13)))
        own = list(range(nxt, nxt + blocks - take))
        nxt += blocks - take
        tables[i, :blocks] = prefixes[int(rng.integers(0, 3))][:take] + own
    q_lens = rng.choice([1, 1, 1, 3], n)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    groups = plan_decode_groups(cu, lens, tables, bs, block_n, block_q)
    seen: set[int] = set()
    for members, tiles in groups:
        assert 2 <= len(members) <= block_q and tiles >= 1 and not seen & set(members)
        seen |= set(members)
        keys = tiles * block_n
        for i in members:
            assert q_lens[i] == 1 and keys <= lens[i] - 1
            assert tables[i, :-(-keys // bs)].tolist() == tables[members[0], :-(-keys // bs)].tolist()
    left = [i for i in range(n) if i not in seen and q_lens[i] == 1 and lens[i] - 1 >= block_n]
    tile_blocks = -(-block_n // bs)  # a whole first tile is shared when these first blocks are
    for a in left:  # a run leaves at most one decode out (its last cut), and runs share no tile
        for b in left:
            if a < b:
                assert tables[a, :tile_blocks].tolist() != tables[b, :tile_blocks].tolist(), (a, b, groups)
