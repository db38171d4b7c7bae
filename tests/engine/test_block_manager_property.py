"""Property-based test: random allocate / append / free / cache-hit sequences keep the KV cache manager consistent.

After every step: ref counts never negative and equal to the live sequences' references, no block both free
and in use, the free count consistent, every cached hash pointing at a block holding exactly those tokens.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_manager import Seq, check_invariants  # the minimal sequence the manager needs; its checker

from apcscore.engine.block_manager import BlockManager


# Small alphabets and shared stems make prefix hits frequent.
stems = st.sampled_from([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5], []])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), stems, st.lists(st.integers(0, 3), min_size=1, max_size=12), st.booleans(),
                  st.integers(1, 16)),
        st.tuples(st.just("compute"), st.integers(0, 7), st.integers(1, 16)),
        st.tuples(st.just("append"), st.integers(0, 7), st.integers(0, 3)),
        st.tuples(st.just("free"), st.integers(0, 7)),
        st.tuples(st.just("run"), stems, st.lists(st.integers(0, 3), min_size=1, max_size=6)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans(), steps=ops)
def test_random_operations_keep_invariants(num_blocks, block_size, caching, steps):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    live: list[Seq] = []
    for op in steps:
        if op[0] == "admit":
            _, stem, tail, read, chunk = op
            seq = Seq(stem + tail)
            cached = bm.find_cached_prefix(seq) if read else []
            assert len(cached) * block_size < len(seq.token_ids)  # at least one token left to compute
            for i, b in enumerate(cached):  # a hit hands out blocks holding exactly these tokens
                assert list(bm.contents[b][2]) == seq.token_ids[i * block_size:(i + 1) * block_size]
            n = min(chunk, len(seq.token_ids) - len(cached) * block_size)
            free_before = bm.num_free_blocks
            if bm.allocate(seq, n, cached):
                live.append(seq)
            else:
                assert seq.block_ids == [] and bm.num_free_blocks == free_before  # all or nothing
        elif op[0] == "compute" and live:
            seq = live[op[1] % len(live)]
            n = min(op[2], len(seq.block_ids) * block_size - seq.num_computed_tokens,
                    len(seq.token_ids) - seq.num_computed_tokens)
            seq.num_computed_tokens += max(n, 0)
            bm.cache_full_blocks(seq)
        elif op[0] == "append" and live:
            seq = live[op[1] % len(live)]
            if seq.num_computed_tokens == len(seq.token_ids):  # decode: one new token needs room
                seq.token_ids.append(op[2])
                if not bm.allocate(seq, 1):
                    seq.token_ids.pop()
        elif op[0] == "run":  # a whole request: hit, prefill, publish, free (leaves cached free blocks)
            seq = Seq(op[1] + op[2])
            cached = bm.find_cached_prefix(seq)
            if bm.allocate(seq, len(seq.token_ids) - len(cached) * block_size, cached):
                check_invariants(bm, live + [seq])
                seq.num_computed_tokens = len(seq.token_ids)
                bm.cache_full_blocks(seq)
                check_invariants(bm, live + [seq])
                bm.free(seq)
        elif op[0] == "free" and live:
            seq = live.pop(op[1] % len(live))
            bm.free(seq)
            assert seq.block_ids == []
        check_invariants(bm, live)
        assert bm.num_free_blocks + len({b for s in live for b in s.block_ids}) == num_blocks
        for s in live:
            assert len(s.block_ids) * block_size >= s.num_computed_tokens
    for seq in live:
        bm.free(seq)
    check_invariants(bm, [])
    assert bm.num_free_blocks == num_blocks
