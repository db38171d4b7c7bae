"""KV cache manager: a pool of fixed-size blocks with automatic prefix caching. Torch-free.

Prefix caching hashes each *full* block as a SHA-256 chain (parent digest, block token ids; vLLM's since
CVE-2025-25183: with --exact-reuse a false hit would silently change scores), and a hit also compares the block's
stored token ids and parent digest (docs/decisions.md, "Block hashes"; other roots: `variant_root`). A lookup walks a
sequence's chain from the start and stops at the first miss. Blocks carry ref counts (`ref_counts`). A freed block
keeps its hash and content, and sits in an LRU free queue: it can still be hit until it is handed out again, at
which point its hash is evicted. Partial blocks are never cached.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Callable, Protocol, Sequence as Seq

from apcscore.engine.counters import EngineCounters


class BlockSequence(Protocol):
    """What the manager needs of a sequence (the engine's Sequence satisfies it). A sequence may also carry
    `hash_root` (bytes): the parent digest of its first block, NONE_HASH when absent (see variant_root)."""

    token_ids: list[int]
    block_ids: list[int]
    block_hashes: list[bytes]
    num_computed_tokens: int


NONE_HASH = bytes(32)  # parent digest of the first block


def variant_root(name: str) -> bytes:
    """The first block's parent digest for sequences whose KV is computed another way than the default for the same
    tokens (e.g. Phi-3 long-rope's long frequencies): their chains never meet the default one's or each other's."""
    return hashlib.sha256(b"apcscore KV variant: " + name.encode()).digest()


def _root(seq: BlockSequence) -> bytes:
    return getattr(seq, "hash_root", NONE_HASH)


def hash_block(parent_hash: bytes, token_ids: Seq[int]) -> bytes:
    """SHA-256 digest of one full block: its parent's digest, then its token ids as little-endian int64."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


class BlockManager:
    """Hands out KV blocks to sequences and finds cached prefixes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks  # sequences holding each block
        # per block registered in the prefix cache (full, computed): its (digest, parent digest, token ids); else None
        self.contents: list[tuple[bytes, bytes, tuple[int, ...]] | None] = [None] * num_blocks
        # Blocks with ref_count 0, least recently freed first. Cached ones among them can still be hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block digest -> block id
        self.stats = EngineCounters()  # the prefix cache's fields; an engine's whole tally (Engine.stats)
        self._num_registered: dict[int, int] = {}  # id(seq) -> leading blocks already registered
        self.on_evict: Callable[[bytes], None] | None = None  # called with a digest leaving the cache (score store)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out (free ones, cached or not)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, seq: BlockSequence) -> list[bytes]:
        """Extend seq.block_hashes to cover every full block of seq.token_ids; returns them."""
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // bs):
            parent = hashes[i - 1] if i else _root(seq)
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def find_cached_prefix(self, seq: BlockSequence, record_stats: bool = True,
                           max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of seq (full blocks only, at most `max_blocks` of them).

        At least one token is always left to compute, since the last position's logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = self.update_block_hashes(seq)
        max_blocks = min((len(seq.token_ids) - 1) // bs, len(hashes) if max_blocks is None else max_blocks)
        hit: list[int] = []
        parent = _root(seq)
        for i in range(min(max_blocks, len(hashes))):
            block_id = self.cached.get(hashes[i])
            if block_id is None:
                break
            if self.contents[block_id] != (hashes[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])):
                break  # hash collision: never hand out KV of other tokens
            hit.append(block_id)
            parent = hashes[i]
        if record_stats:
            self.stats.queried_tokens += len(seq.token_ids)
            self.stats.hit_tokens += len(hit) * bs
        return hit

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, seq: BlockSequence, num_new_tokens: int, cached_blocks: Seq[int] = ()) -> bool:
        """Give seq the blocks to hold `num_new_tokens` more tokens, after taking `cached_blocks`.

        `cached_blocks` (from find_cached_prefix) are only passed for a sequence with no blocks yet; their
        tokens count as computed. All or nothing: returns False and changes nothing when blocks run out.
        """
        reclaimed_from_free = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if self._num_new_blocks(seq, num_new_tokens, cached_blocks) > self.num_free_blocks - reclaimed_from_free:
            return False
        if cached_blocks:
            assert not seq.block_ids, "cached blocks are taken at admission only"
            for block_id in cached_blocks:
                if self.ref_counts[block_id] == 0:
                    del self.free_queue[block_id]
                self.ref_counts[block_id] += 1
                seq.block_ids.append(block_id)
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
            self._num_registered[id(seq)] = len(cached_blocks)
        for _ in range(self._num_new_blocks(seq, num_new_tokens, ())):
            seq.block_ids.append(self._pop_free_block())
        return True

    def _num_new_blocks(self, seq: BlockSequence, num_new_tokens: int, cached_blocks: Seq[int]) -> int:
        have = len(seq.block_ids) + len(cached_blocks)
        computed = max(seq.num_computed_tokens, len(cached_blocks) * self.block_size)
        return max(0, self.blocks_needed(computed + num_new_tokens) - have)

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed
        content = self.contents[block_id]
        if content is not None:  # evict: its content is about to be overwritten
            del self.cached[content[0]]
            if self.on_evict is not None:
                self.on_evict(content[0])
            self.contents[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def cache_full_blocks(self, seq: BlockSequence) -> None:
        """Register the blocks of seq that became full and computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, len(seq.token_ids)) // bs
        start = self._num_registered.get(id(seq), 0)
        if num_full <= start:
            return
        hashes = self.update_block_hashes(seq)
        for i in range(start, num_full):
            block_id = seq.block_ids[i]
            if self.contents[block_id] is None and hashes[i] not in self.cached:
                parent = hashes[i - 1] if i else _root(seq)
                self.contents[block_id] = (hashes[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
                self.cached[hashes[i]] = block_id
            # else: the same content is cached in another block already; this copy stays private
        self._num_registered[id(seq)] = num_full

    def free(self, seq: BlockSequence) -> None:
        """Drop seq's references. Its tail blocks are freed first, so they are evicted first."""
        for block_id in reversed(seq.block_ids):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
        seq.block_ids = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(id(seq), None)

