"""The engine's per-request state (`Sequence`): tokens, blocks, progress and collected results."""

from __future__ import annotations

import enum
from typing import Any

from apcscore.engine.block_manager import NONE_HASH, variant_root
from apcscore.engine.request import PromptLogprobs, Request, TokenLogprobs

LONG_ROPE_ROOT = variant_root("long-rope: long frequencies")  # hash_root of a Sequence.rope_long sequence


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """The engine's state of one request: its tokens, blocks, progress and collected results."""

    def __init__(self, request: Request, arrival: int, long_rope_after: int | None = None) -> None:
        """long_rope_after: the model's long-rope threshold (LlamaDecoder.long_rope_after): a longer prompt is
        rotated with the long frequencies from the start."""
        self.request = request
        self.arrival = arrival  # admission order; ties broken deterministically
        self.prompt_len = len(request.prompt_token_ids)
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # SHA-256 chain digest of each full block of token_ids, computed lazily
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.prompt_logprob_parts: list[PromptLogprobs] = []
        self.alternative_logprobs: TokenLogprobs | None = None  # of request.last_token_alternatives, once scored
        self.output_logprob_parts: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.output_text: str | None = None  # set when a stop string cut the completion
        self.generator: Any = None  # torch.Generator of a sampled request, made by the sampler
        self.detokenizer: Any = None  # IncrementalDetokenizer of a request with stop strings, made by the engine
        # exact reuse, score store: the stored final hidden state [H] of the last row of the last block read at
        # admission (its target is the first prefilled token); scored in the admission step, then dropped
        self.boundary_hidden: Any = None
        # long-rope models (apcscore.models.phi3): whether this sequence is rotated with the long frequencies at
        # every position, which changes its KV, hence its blocks' digests (hash_root: their first parent)
        self.rope_long = False
        self.hash_root = NONE_HASH
        self.kv_only = False  # re-prefilled for its KV only (a long-rope switch): its prompt is already scored
        if long_rope_after is not None and self.prompt_len > long_rope_after:
            self.use_long_rope()

    @property
    def request_id(self) -> Any:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill computes prompt logprobs (not once they are all done: kv_only)."""
        return self.request.prompt_logprobs is not None and not self.kv_only

    @property
    def reads_prefix_cache(self) -> bool:
        """Design rule: a sequence that computes prompt logprobs never reads the prefix cache, unless the engine
        runs with exact reuse (then `reusable_blocks` says how much of it it may read)."""
        return not self.scores_prompt

    def use_long_rope(self) -> None:
        """From now on every position is rotated with the long-rope frequencies; the block digests follow."""
        self.rope_long = True
        self.hash_root = LONG_ROPE_ROOT
        self.block_hashes = []

    def reusable_blocks(self, block_size: int) -> int:
        """Exact reuse: the full blocks lying entirely before position score_from - 1, the first row whose logits
        are needed; their KV (bitwise what a fresh prefill writes) is all a scoring request may take from the cache."""
        return max(0, min(self.request.score_from - 1, self.prompt_len - 1)) // block_size

    def reset_for_recompute(self) -> None:
        """Preemption: drop the KV; prompt (and output so far) are prefilled again later."""
        self.num_computed_tokens = 0
        self.block_ids = []
        if not self.kv_only:  # (kv_only: the prompt was scored before, and is not scored again)
            self.prompt_logprob_parts = []
            self.alternative_logprobs = None
        self.boundary_hidden = None
        self.status = SequenceStatus.WAITING
