"""KV cache manager: hashing, hits, partial blocks, ref counts, LRU eviction, stats (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pytest

from apcscore.engine.block_manager import NONE_HASH, BlockManager, hash_block


@dataclass
class Seq:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0


def run_prefill(bm: BlockManager, tokens: list[int], read_cache: bool = True) -> tuple[Seq, int]:
    """Admit a sequence, 'compute' its whole prompt, publish its blocks; returns it and its hit tokens."""
    seq = Seq(list(tokens))
    cached = bm.find_cached_prefix(seq) if read_cache else []
    assert bm.allocate(seq, len(tokens) - len(cached) * bm.block_size, cached)
    hit = seq.num_computed_tokens
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    return seq, hit


def check_invariants(bm: BlockManager, live_seqs: Sequence[Any] = ()) -> None:
    """Assert the manager's internal consistency; with `live_seqs` (every sequence holding blocks), also that the
    ref counts are their references."""
    refs = [0] * bm.num_blocks
    for seq in live_seqs:
        for b in seq.block_ids:
            refs[b] += 1
    for b, count in enumerate(bm.ref_counts):
        assert count >= 0, f"negative ref count on block {b}"
        assert (b in bm.free_queue) == (count == 0), f"block {b} free/in-use mismatch"
        if live_seqs:
            assert count == refs[b], f"ref count of block {b} is off"
    for h, b in bm.cached.items():
        digest, parent, tokens = bm.contents[b]
        assert digest == h, f"cached hash points at block {b} with another hash"
        assert len(tokens) == bm.block_size
        assert hash_block(parent, tokens) == h
    assert sum(c is not None for c in bm.contents) == len(bm.cached)
    assert len(bm.free_queue) + sum(c > 0 for c in bm.ref_counts) == bm.num_blocks


def test_hash_chain_depends_on_parent_and_tokens():
    h1 = hash_block(NONE_HASH, [1, 2, 3, 4])
    assert h1 == hash_block(NONE_HASH, (1, 2, 3, 4))
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(NONE_HASH, [5, 6, 7, 8])


def test_shared_prefix_hits_full_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    a, hit_a = run_prefill(bm, list(range(10)))  # 2 full blocks + 2 tokens
    assert hit_a == 0
    assert len(bm.cached) == 2  # the partial third block is never cached
    b, hit_b = run_prefill(bm, list(range(8)) + [99, 98, 97])
    assert hit_b == 8
    assert b.block_ids[:2] == a.block_ids[:2]  # the same physical blocks, shared
    assert bm.ref_counts[a.block_ids[0]] == 2
    assert bm.stats.queried_tokens == 21 and bm.stats.hit_tokens == 8
    check_invariants(bm, [a, b])


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prefill(bm, list(range(8)))
    seq = Seq(list(range(8)))
    assert len(bm.find_cached_prefix(seq)) == 1  # 8 tokens cached, but the last must be recomputed


def test_different_prefix_misses_even_with_equal_later_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prefill(bm, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    _, hit = run_prefill(bm, [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hit == 0


def test_hash_collision_is_caught_by_token_check(monkeypatch):
    bm = BlockManager(num_blocks=16, block_size=2)
    run_prefill(bm, [1, 2, 3])
    # forge a collision: make the other content's hash point at the cached block
    other = Seq([7, 8, 9])
    bm.update_block_hashes(other)
    bm.cached[other.block_hashes[0]] = next(iter(bm.cached.values()))
    assert bm.find_cached_prefix(other) == []


def test_hash_is_a_sha256_chain():
    h1 = hash_block(NONE_HASH, [1, 2])
    assert isinstance(h1, bytes) and len(h1) == 32
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(NONE_HASH, [9, 9]), [3, 4])
    assert hash_block(NONE_HASH, [1, 2]) != hash_block(NONE_HASH, [1 + 2**32, 2])  # ids are not truncated


def test_hash_collision_with_the_wrong_parent_is_refused(monkeypatch):
    """A hash that ignores the parent makes block [3, 4] after [5, 6] collide with block [3, 4] at position 0.
    Its tokens match, so only the parent check stops a hit that would hand out KV computed at other positions."""
    import hashlib

    import apcscore.engine.block_manager as module

    monkeypatch.setattr(module, "hash_block", lambda parent, tokens: hashlib.sha256(bytes(tokens)).digest())
    bm = BlockManager(num_blocks=16, block_size=2)
    first, _ = run_prefill(bm, [3, 4, 1])  # caches [3, 4] at position 0
    run_prefill(bm, [5, 6, 9])  # caches [5, 6] at position 0
    probe = Seq([5, 6, 3, 4, 1])
    hit = bm.find_cached_prefix(probe)
    assert probe.block_hashes[1] in bm.cached and bm.cached[probe.block_hashes[1]] == first.block_ids[0]
    assert len(hit) == 1, "[3, 4] at position 2 must not hit the block cached at position 0"


def test_free_keeps_content_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, _ = run_prefill(bm, [1, 2, 3, 4, 5])  # 3 blocks, 2 full ones cached
    bm.free(a)
    check_invariants(bm, [])
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    b, hit = run_prefill(bm, [1, 2, 3, 4, 6])  # hit on the freed, still cached blocks
    assert hit == 4
    bm.free(b)
    # a sequence of unrelated tokens needing every block evicts all cached hashes
    c, hit = run_prefill(bm, [9, 9, 8, 8, 7, 7, 6])
    assert hit == 0
    assert all(c is None or bm.cached.get(c[0]) == i for i, c in enumerate(bm.contents))
    assert set(bm.cached.values()) <= set(c.block_ids)


def test_lru_evicts_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, _ = run_prefill(bm, [1, 1, 2])
    b, _ = run_prefill(bm, [3, 3, 4])
    check_invariants(bm, [a, b])
    bm.free(a)  # a's blocks become free first ...
    bm.free(b)  # ... then b's
    run_prefill(bm, [5, 5, 6, 6, 7, 7, 8])  # 4 blocks: 2 never used, then a's two (freed first)
    seq_a, seq_b = Seq([1, 1, 2]), Seq([3, 3, 4])
    assert bm.find_cached_prefix(seq_b, record_stats=False) != []  # b survived
    assert bm.find_cached_prefix(seq_a, record_stats=False) == []  # a was evicted


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = Seq(list(range(20)))
    assert not bm.allocate(seq, 20)  # needs 5 blocks
    assert seq.block_ids == [] and bm.num_free_blocks == 3
    assert bm.allocate(seq, 12)
    assert len(seq.block_ids) == 3 and bm.num_free_blocks == 0
    check_invariants(bm, [seq])


def test_decode_appends_blocks_only_at_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Seq(list(range(4)))
    assert bm.allocate(seq, 4)
    seq.num_computed_tokens = 4
    seq.token_ids.append(100)
    assert bm.allocate(seq, 1) and len(seq.block_ids) == 2
    for t in range(3):
        seq.num_computed_tokens += 1
        seq.token_ids.append(101 + t)
        assert bm.allocate(seq, 1) and len(seq.block_ids) == 2
    check_invariants(bm, [seq])


def test_duplicate_content_is_not_cached_twice():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, _ = run_prefill(bm, [1, 2, 3], read_cache=False)
    b, _ = run_prefill(bm, [1, 2, 3], read_cache=False)  # a scoring request: computes its own copy
    assert a.block_ids[0] != b.block_ids[0]
    assert len(bm.cached) == 1 and bm.cached[a.block_hashes[0]] == a.block_ids[0]
    bm.free(a)
    bm.free(b)
    check_invariants(bm, [])


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_prefill(bm, [1, 2, 3])
    _, hit = run_prefill(bm, [1, 2, 3])
    assert hit == 0 and bm.cached == {}


def test_double_free_is_detected():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq, _ = run_prefill(bm, [1, 2, 3])
    ids = list(seq.block_ids)
    bm.free(seq)
    seq.block_ids = ids
    with pytest.raises(AssertionError):
        bm.free(seq)
