"""Continuous batching under a token budget: chunked prefill, decode, preemption by recompute.

Each step schedules running sequences first (their next prefill chunk or one decode token), then admits
waiting ones while the budget, the sequence cap and the KV pool allow. When blocks run out, the most
recently admitted running sequence is preempted: its blocks are freed and it is prefilled again later.
Deterministic: the same inputs and config give the same schedule.

Prefix caching (docs/architecture.md, "The prefix-caching rule"; docs/decisions.md, "Exact reuse"): only
sequences without prompt logprobs read the cache, and with `--exact-reuse` scoring ones too (`_cached_prefix`);
every sequence writes its full blocks. A reading sequence whose next uncached block is being prefilled right now by
another sequence waits a step instead of computing it twice, so prompts that share a prefix and arrive together
still hit.
"""

from __future__ import annotations

from collections import deque

from apcscore.config import EngineConfig
from apcscore.engine.block_manager import BlockManager
from apcscore.engine.score_store import ScoreStore, prompt_blocks, writes_entry_for
from apcscore.engine.step import ScheduledBatch, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, config: EngineConfig, store: ScoreStore | None = None) -> None:
        """Reads config's max_batch_tokens (the step's token budget), max_num_seqs (the running sequences' cap)
        and exact_reuse; store: exact reuse's score store, if kept."""
        self.bm = block_manager
        self.max_batch_tokens = config.max_batch_tokens
        self.max_num_seqs = config.max_num_seqs
        self.exact_reuse = config.exact_reuse  # scoring sequences read the cache before their first scored position
        self.store = store  # exact reuse's score store: scoring sequences also read blocks they score
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._pending: dict[bytes, Sequence] = {}  # block digest -> sequence computing that block now

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # ---- scheduling ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch: ScheduledBatch = []
        preempted = False
        budget = self.max_batch_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.bm.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                self.bm.stats.preemptions += 1
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            batch.append((seq, n))
            budget -= n
            i += 1

        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting.popleft()
            cached, limit, context = self._cached_prefix(seq)
            reads = limit != 0
            if reads and self._next_block_pending(seq, len(cached), limit, context):
                skipped.append(seq)
                continue
            n = min(seq.num_tokens - len(cached) * self.bm.block_size, budget)
            if not self.bm.allocate(seq, n, cached):
                self.waiting.appendleft(seq)
                break
            served = self.store.serve(seq, len(cached), context, self.bm.block_size) if context is not None else 0
            if seq.num_cached_tokens is None:  # first admission: this is the request's hit
                seq.num_cached_tokens = seq.num_computed_tokens
                if reads and self.bm.enable_prefix_caching:
                    self.bm.stats.queried_tokens += seq.prompt_len
                    self.bm.stats.hit_tokens += seq.num_computed_tokens
                    self.bm.stats.score_store_hits += served
                elif not seq.reads_prefix_cache and self.bm.enable_prefix_caching:
                    self.bm.stats.reusable_tokens += self._reusable_tokens(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._mark_pending(seq)
            batch.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], int | None, int | None]:
        """What seq takes from the cache at admission: its cached blocks; how many leading blocks it may wait for
        while another sequence computes them (None = any, 0 = it reads nothing); and, for a scoring sequence that
        reads the score store, its context blocks (`Sequence.reusable_blocks`: beyond them each block it reads
        needs a covering store entry), else None."""
        if seq.reads_prefix_cache:
            return self.bm.find_cached_prefix(seq, False), None, None
        if not self.exact_reuse:
            return [], 0, None
        bs = self.bm.block_size
        context = seq.reusable_blocks(bs)
        if self.store is None:
            return self.bm.find_cached_prefix(seq, False, context), context, None
        cached = self.bm.find_cached_prefix(seq, False, prompt_blocks(seq, bs))  # never its output's blocks
        return cached[:self.store.usable_blocks(seq, len(cached), context, bs)], None, context

    def _next_block_pending(self, seq: Sequence, num_cached_blocks: int, limit: int | None,
                            context: int | None) -> bool:
        """Whether seq's next block is being computed by another sequence that will make it readable for seq."""
        hashes = seq.block_hashes  # filled by find_cached_prefix
        readable = (seq.num_tokens - 1) // self.bm.block_size if seq.reads_prefix_cache else \
            prompt_blocks(seq, self.bm.block_size)  # a scoring sequence reads inside its prompt only
        end = min(len(hashes), readable, len(hashes) if limit is None else limit)
        if num_cached_blocks >= end:
            return False
        owner = self._pending.get(hashes[num_cached_blocks])
        if owner is None or owner is seq:
            return False
        if context is None or num_cached_blocks < context:
            return True
        # beyond its context seq needs the block's store entry: worth waiting only for an owner that writes one
        return writes_entry_for(owner, seq, num_cached_blocks, self.bm.block_size)

    def _reusable_tokens(self, seq: Sequence) -> int:
        """Recompute mode: the tokens exact reuse would have taken from the cache (cached or pending blocks)."""
        limit = seq.reusable_blocks(self.bm.block_size)
        hashes = self.bm.update_block_hashes(seq)
        n = len(self.bm.find_cached_prefix(seq, False, limit))
        while n < min(limit, len(hashes)) and self._pending.get(hashes[n], seq) is not seq:
            n += 1
        return n * self.bm.block_size

    def _mark_pending(self, seq: Sequence) -> None:
        if not self.bm.enable_prefix_caching:
            return
        hashes = self.bm.update_block_hashes(seq)
        for i in range(seq.num_computed_tokens // self.bm.block_size, len(hashes)):
            self._pending.setdefault(hashes[i], seq)

    def _unmark_pending(self, seq: Sequence, upto_block: int | None = None) -> None:
        for h in seq.block_hashes[:upto_block]:  # (upto_block None: all of them)
            if self._pending.get(h) is seq:
                del self._pending[h]

    def _preempt(self, seq: Sequence) -> None:
        self._unmark_pending(seq)
        self.bm.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def switch_to_long_rope(self, seq: Sequence) -> None:
        """Long-rope (apcscore.models.phi3): running seq has just grown past the model's original context, so every
        position is recomputed with the long frequencies, as transformers' generate() does. Like a preemption:
        its blocks are freed and it is prefilled again (first in line), under its long-rope digests, for its KV
        only: its prompt logprobs were computed over the prompt alone, short, and stay."""
        self.running.remove(seq)
        seq.kv_only = True
        self._preempt(seq)
        seq.use_long_rope()  # (after _preempt: its pending marks are under the short digests)

    # ---- after the step ------------------------------------------------------------------------
    def finish_step(self, batch: ScheduledBatch) -> None:
        """Account the computed tokens and publish newly full blocks to the prefix cache."""
        for seq, n in batch:
            seq.num_computed_tokens += n
            seq.boundary_hidden = None  # scored by this step's runner
            self.bm.cache_full_blocks(seq)
            self._unmark_pending(seq, seq.num_computed_tokens // self.bm.block_size)

    def abort_all(self) -> int:
        """Drop every running and waiting sequence (a run its consumer left before the end) and free their blocks;
        the number dropped. Full blocks they computed stay in the prefix cache, as a finished sequence's do (their
        KV and any score-store entry were complete when they were registered)."""
        dropped = [*self.running, *self.waiting]
        for seq in dropped:
            self.bm.free(seq)  # (a waiting sequence holds no blocks)
            seq.status = SequenceStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        self._pending.clear()  # every entry named one of them
        return len(dropped)

    def finish(self, seq: Sequence) -> None:
        """Retire a sequence: free its blocks (they stay cached until evicted)."""
        seq.status = SequenceStatus.FINISHED
        self._unmark_pending(seq)
        self.bm.free(seq)
        self.running.remove(seq)
