"""The score store of exact reuse: cached prompt logprobs per KV block, so a request that scores every position
can read a shared prefix too (issue 13, item 3; the design and its tests: docs/decisions.md, "Exact reuse").

An entry is keyed by a full KV block's chain digest and holds, for every position whose *target* lies in that
block (targets j*bs .. (j+1)*bs - 1 of block j; target 0 is never scored), the target's logprob, rank and top-K,
plus the final hidden state (the LM head's input) of the block's last position, whose target is the next block's
first token. The chain digest of block j fixes every token the rows predicting those targets see, so an entry is a
function of its key; batch invariance makes it bitwise what a fresh prefill computes. A reader computes the boundary
row (the last read block's last row) from the stored hidden state through the LM head and prefills the rest.

An entry lives while its digest is cached in the block manager (`BlockManager.on_evict` drops it); entries are
immutable (a better one replaces an old one as a new object) and served only when their K and ranks cover the
request's. Memory: `store_bytes_per_block` per KV block at most, counted in the pool sizing (engine/kv_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from apcscore.engine.step import Request, Sequence, TokenLogprobs

ENTRY_OVERHEAD_BYTES = 1400  # the entry object, four numpy arrays, a torch tensor, the dict slot (measured ~1,350)


@dataclass(frozen=True)
class ScoreEntry:
    """Stored results of the targets of one block (rows in target order) and its last row's hidden state."""

    first_target: int  # prompt position of the first row's target: j * bs, or 1 for block 0
    token_logprobs: np.ndarray  # [r] float32
    ranks: np.ndarray  # [r] int64 (all 0 when has_ranks is False)
    top_ids: np.ndarray  # [r, k] int64
    top_logprobs: np.ndarray  # [r, k] float32
    hidden: Any  # [H] final hidden state of the block's last position (model dtype, host memory)
    has_ranks: bool

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]

    @property
    def nbytes(self) -> int:
        arrays = (self.token_logprobs, self.ranks, self.top_ids, self.top_logprobs)
        return sum(a.nbytes for a in arrays) + int(self.hidden.nbytes) + ENTRY_OVERHEAD_BYTES

    def covers(self, request: Request) -> bool:
        """Whether this entry holds everything `request` asks of these positions."""
        k = request.prompt_logprobs
        return k is not None and self.k >= k and (self.has_ranks or not request.prompt_logprob_ranks)


def store_bytes_per_block(block_size: int, hidden_size: int, hidden_bytes: int, max_logprobs: int) -> int:
    """Upper bound of one entry's memory: block_size rows of logprob (4), rank (8) and K = max_logprobs top ids (8)
    and logprobs (4), one hidden state, and the Python objects around them."""
    return block_size * (4 + 8 + 12 * max_logprobs) + hidden_size * hidden_bytes + ENTRY_OVERHEAD_BYTES


def publishes(request: Request, block: int, block_size: int, prompt_len: int) -> bool:
    """Whether a request's own computation yields the whole entry of its block `block`: it scores every target
    of the block, and the block lies inside the prompt."""
    return (request.prompt_logprobs is not None and (block + 1) * block_size <= prompt_len
            and request.score_from <= max(block * block_size, 1))


def prompt_blocks(seq: Sequence, block_size: int) -> int:
    """The most blocks a scoring sequence reads from the cache: full blocks inside its prompt, its last prompt token
    left to compute (it is scored, with any last-token alternatives, from the row before it)."""
    return (seq.prompt_len - 1) // block_size


def writes_entry_for(writer: Sequence, reader: Sequence, block: int, block_size: int) -> bool:
    """Whether `writer`, computing its block `block`, publishes an entry that covers `reader`'s request."""
    w, r = writer.request, reader.request
    return (writer.scores_prompt and publishes(w, block, block_size, writer.prompt_len)
            and r.prompt_logprobs is not None and w.prompt_logprobs >= r.prompt_logprobs
            and (w.prompt_logprob_ranks or not r.prompt_logprob_ranks))


class ScoreStore:
    """Chain digest -> ScoreEntry, for blocks cached in the block manager."""

    def __init__(self) -> None:
        self.entries: dict[bytes, ScoreEntry] = {}
        self.nbytes = 0

    def put(self, digest: bytes, entry: ScoreEntry) -> None:
        """Store `entry`, unless the stored one already covers as much. When each covers something the other does
        not (a larger K; ranks), the new entry takes the larger K's top-K and the ranked one's ranks: equal bits
        where they overlap (batch invariance; top-K ties by id), and no array is ever written into."""
        old = self.entries.get(digest)
        if old is not None:
            if old.k >= entry.k and (old.has_ranks or not entry.has_ranks):
                return
            top, ranked = (old if old.k >= entry.k else entry), (old if old.has_ranks else entry)
            entry = ScoreEntry(entry.first_target, entry.token_logprobs, ranked.ranks, top.top_ids,
                               top.top_logprobs, entry.hidden, ranked.has_ranks)
        for a in (entry.token_logprobs, entry.ranks, entry.top_ids, entry.top_logprobs):
            a.flags.writeable = False
        self.nbytes += entry.nbytes - (old.nbytes if old is not None else 0)
        self.entries[digest] = entry

    def discard(self, digest: bytes) -> None:
        """The block of `digest` left the cache: its entry goes with it."""
        old = self.entries.pop(digest, None)
        if old is not None:
            self.nbytes -= old.nbytes

    # ---- reading -------------------------------------------------------------------------------
    def usable_blocks(self, seq: Sequence, num_cached: int, context_blocks: int, block_size: int) -> int:
        """How many of seq's `num_cached` leading cached blocks it may read: the first `context_blocks` (before its
        first scored row: their KV is all it needs), then as long as each block's entry covers the request, and
        never past `prompt_blocks` (after a preemption its tokens include its output, which it does not score)."""
        num_cached = min(num_cached, prompt_blocks(seq, block_size))
        m = min(num_cached, context_blocks)
        if m < context_blocks:
            return m
        for j in range(context_blocks, num_cached):
            entry = self.entries.get(seq.block_hashes[j])
            if entry is None or not entry.covers(seq.request):
                break
            m = j + 1
        return m

    def serve(self, seq: Sequence, num_blocks: int, context_blocks: int, block_size: int) -> int:
        """Admission of seq with `num_blocks` cached blocks (from usable_blocks): append the stored results of its
        scored targets in those blocks to seq.prompt_logprob_parts and hand it the boundary row's hidden state
        (seq.boundary_hidden). Returns the number of positions served."""
        if num_blocks <= context_blocks:
            return 0
        if num_blocks > prompt_blocks(seq, block_size):
            raise ValueError(f"serving {num_blocks} blocks past the prompt of {seq.prompt_len} tokens: a bug")
        req = seq.request
        first = max(req.score_from, 1)
        k = req.prompt_logprobs or 0
        parts: list[tuple[np.ndarray, ...]] = []
        for j in range(context_blocks, num_blocks):
            e = self.entries[seq.block_hashes[j]]
            lo = max(first - e.first_target, 0)
            ranks = e.ranks[lo:] if req.prompt_logprob_ranks else np.zeros(len(e.ranks) - lo, np.int64)
            parts.append((e.token_logprobs[lo:], ranks, e.top_ids[lo:, :k], e.top_logprobs[lo:, :k]))
        lps, ranks, top_ids, top_lps = (np.concatenate([p[i] for p in parts]) for i in range(4))
        end = num_blocks * block_size
        positions = np.arange(end - len(lps), end, dtype=np.int64)
        seq.prompt_logprob_parts.append(TokenLogprobs(
            token_ids=np.asarray(seq.token_ids[end - len(lps):end], dtype=np.int64), token_logprobs=lps,
            ranks=ranks, top_ids=top_ids, top_logprobs=top_lps, positions=positions))
        if end < seq.prompt_len:  # the boundary row end - 1 predicts prompt token `end`: scored in the first step
            seq.boundary_hidden = self.entries[seq.block_hashes[num_blocks - 1]].hidden
        return len(lps)

    # ---- writing -------------------------------------------------------------------------------
    def publish(self, seq: Sequence, hidden: dict[int, Any], cached: dict[bytes, int], block_size: int) -> None:
        """After a step: store the entries of seq's blocks that this step completed (`hidden`: block index -> its
        last row's hidden state, captured by the model runner), if their digests are in the cache (`cached`)."""
        req = seq.request
        for j, h in hidden.items():
            digest = seq.block_hashes[j] if j < len(seq.block_hashes) else None
            if digest is None or digest not in cached or not seq.scores_prompt \
                    or not publishes(req, j, block_size, seq.prompt_len):
                continue
            first, end = max(j * block_size, 1), (j + 1) * block_size
            rows = _targets(seq.prompt_logprob_parts, first, end)
            if rows is None:
                continue
            lps, ranks, top_ids, top_lps = rows
            self.put(digest, ScoreEntry(first, lps, ranks, top_ids, top_lps, h, req.prompt_logprob_ranks))


def _targets(parts: list[TokenLogprobs], first: int, end: int) -> tuple[np.ndarray, ...] | None:
    """Copies of the results for targets [first, end) from a sequence's parts (in position order), or None if
    some are missing. Walks from the newest part back: the block just completed is at the end."""
    picked: list[tuple[TokenLogprobs, int, int]] = []
    need_end = end
    for part in reversed(parts):
        if len(part) == 0:
            continue
        p0, p1 = int(part.positions[0]), int(part.positions[-1]) + 1
        if p0 >= need_end:
            continue
        if p1 < need_end:
            return None  # a gap: some targets were not scored
        lo = max(first, p0)
        picked.append((part, lo - p0, need_end - p0))
        need_end = lo
        if need_end == first:
            break
    if need_end != first:
        return None
    picked.reverse()
    return tuple(np.concatenate([getattr(p, f)[a:b] for p, a, b in picked])
                 for f in ("token_logprobs", "ranks", "top_ids", "top_logprobs"))
