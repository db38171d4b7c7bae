"""The data of one engine step, in one place: what a request asks (`SamplingParams`, `Request`), what the engine
keeps of it while it runs (`Sequence`), what a step runs (`ScheduledBatch`: the scheduler's; `StepInputs`: the model
runner's flat host arrays; what a step scores goes onto its sequences) and what the caller gets back
(`TokenLogprobs` and `RequestOutput`). Torch-free: the package face imports it.

The attention layer's own input, `AttentionMetadata` (apcscore.attention.metadata), lives below the engine (the
layers of docs/architecture.md); the model runner builds it from `StepInputs`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from apcscore.config import SamplingParams
from apcscore.engine.block_manager import NONE_HASH, variant_root

LONG_ROPE_ROOT = variant_root("long-rope: long frequencies")  # hash_root of a Sequence.rope_long sequence


@dataclass
class Request:
    """One unit of engine work: a prompt, and what to compute for it.

    prompt_logprobs: None = no prompt scoring; 0 = each scored token's own logprob and rank; K > 0 adds the
        top-K alternatives. A request with prompt logprobs never *reads* the prefix cache (a hit has KV but
        no logits), but still writes its full blocks to it.
    score_from: first prompt position that is scored (position 0 never is: it has no context).
    prompt_logprob_ranks: False lets the engine skip counting ranks (a pass over the vocabulary per token) for
        a job that only sums logprobs; ranks then read 0 unless another request of the step needed them.
    sampling: None for a scoring-only request (nothing is generated).
    last_token_alternatives: other tokens to score in place of the last prompt token (which must be scored):
        each gets the logprob, rank and top-K that the last prompt position gives it, in
        `RequestOutput.last_token_alternatives`. Their context is the same, so they are read from the same
        hidden-state row: one forward pass serves one-token continuations of one context (lm-eval's hf groups
        them the same way), bitwise equal to separate requests under the batch-invariance contract.
    """

    request_id: Any
    prompt_token_ids: list[int]
    sampling: SamplingParams | None = None
    prompt_logprobs: int | None = None
    score_from: int = 1
    prompt_logprob_ranks: bool = True
    last_token_alternatives: tuple[int, ...] = ()

    @property
    def max_tokens(self) -> int:
        return 0 if self.sampling is None else self.sampling.max_tokens


@dataclass
class Divergence:
    """The exact divergence from a reference model (`score --reference-model`) at scored rows, as numpy arrays:
    KL(reference || model) over the whole vocabulary, the reference's logprob of the token, delta p
    (p_model(token) - p_ref(token)) and whether the two models' argmaxes agree (kernels/divergence_torch.py)."""

    ref_logprobs: np.ndarray  # [n] float32
    kl: np.ndarray  # [n] float64
    delta_p: np.ndarray  # [n] float64
    top1_agree: np.ndarray  # [n] bool

    @staticmethod
    def concat(parts: list["Divergence"]) -> "Divergence":
        return Divergence(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Divergence)))

    def rows(self, start: int, stop: int) -> "Divergence":
        return Divergence(*(getattr(self, f.name)[start:stop] for f in fields(self)))


@dataclass
class TokenLogprobs:
    """Logprobs of a run of tokens (scored prompt positions, or sampled tokens), as numpy arrays.

    token_ids[i] is the token whose logprob is token_logprobs[i]; rank 1 = the model's argmax.
    top_ids / top_logprobs are [n, K] (K may be 0), sorted by logprob, descending. Scored prompt positions carry
    positions[i], the prompt index of row i; sampled tokens carry None.
    """

    token_ids: np.ndarray  # [n] int64
    token_logprobs: np.ndarray  # [n] float32
    ranks: np.ndarray  # [n] int64
    top_ids: np.ndarray  # [n, K] int64
    top_logprobs: np.ndarray  # [n, K] float32
    divergence: Divergence | None = None  # from the reference model, where the engine has one
    positions: np.ndarray | None = None  # [n] int64: the prompt index of each row (scored prompt positions)

    @staticmethod
    def concat(parts: list["TokenLogprobs"], k: int) -> "TokenLogprobs":
        if not parts:
            return TokenLogprobs(
                np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64),
                np.zeros((0, k), np.int64), np.zeros((0, k), np.float32), positions=np.zeros(0, np.int64),
            )
        divergence = Divergence.concat([p.divergence for p in parts]) \
            if all(p.divergence is not None for p in parts) else None
        positions = np.concatenate([p.positions for p in parts]) \
            if all(p.positions is not None for p in parts) else None
        return TokenLogprobs(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                               ("token_ids", "token_logprobs", "ranks", "top_ids", "top_logprobs")), divergence,
                             positions)

    def __len__(self) -> int:
        return len(self.token_ids)

    def rows(self, start: int, stop: int, k: int | None = None) -> "TokenLogprobs":
        """Rows start..stop-1, their top-K columns cut to k when given."""
        return TokenLogprobs(self.token_ids[start:stop], self.token_logprobs[start:stop], self.ranks[start:stop],
                             self.top_ids[start:stop, :k], self.top_logprobs[start:stop, :k],
                             None if self.divergence is None else self.divergence.rows(start, stop),
                             None if self.positions is None else self.positions[start:stop])


@dataclass
class RequestOutput:
    """What the engine returns for one request, in completion order."""

    request_id: Any
    prompt_token_ids: list[int]
    prompt_logprobs: TokenLogprobs | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    output_logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # stop | length | error
    num_cached_tokens: int = 0
    error: str | None = None
    last_token_alternatives: TokenLogprobs | None = None  # the request's alternatives, in its order


def request_problem(request: Request, max_len: int, vocab: int, max_logprobs: int) -> str | None:
    """Why this request cannot run on a model of context max_len and vocabulary vocab, or None (the checks
    every model path shares; the native engine adds its KV pool's)."""
    n = len(request.prompt_token_ids)
    if n == 0:
        return "the prompt has no tokens"
    if n > max_len:
        return (f"the prompt has {n} tokens, more than the model's context of {max_len} tokens — shorten it, "
                f"or pass --truncate left to drop its oldest tokens")
    bad = [t for t in (*request.prompt_token_ids, *request.last_token_alternatives) if not 0 <= t < vocab]
    if bad:
        return f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
    k = request.prompt_logprobs
    if request.last_token_alternatives and (k is None or not 1 <= request.score_from <= n - 1):
        return "last_token_alternatives need prompt logprobs that score the last prompt token"
    if k is not None and k > max_logprobs:
        return f"prompt_logprobs {k} is above max_logprobs {max_logprobs}"
    if request.sampling is not None:
        problems = request.sampling.problems()
        if problems:
            return "; ".join(problems)
        if request.sampling.logprobs is not None and request.sampling.logprobs > max_logprobs:
            return f"logprobs {request.sampling.logprobs} is above max_logprobs {max_logprobs}"
    return None


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
        self.prompt_logprob_parts: list[TokenLogprobs] = []
        self.alternative_logprobs: TokenLogprobs | None = None  # of request.last_token_alternatives, once scored
        self.output_logprob_parts: list[TokenLogprobs] = []
        self.output_text: str | None = None  # set when a stop string cut the completion
        self.generator: Any = None  # torch.Generator of a sampled request, made by the sampler
        self.detokenizer: Any = None  # IncrementalDetokenizer of a request with stop strings, made by the engine
        # exact reuse, score store: the stored final hidden state [H] of the last row of the last block read at
        # admission (its target is the first prefilled token); scored in the admission step, then dropped
        self.boundary_hidden: Any = None
        # and the final hidden states [H] of the block-ending positions a step computed (block index -> host tensor),
        # captured by the model runner for the entries it writes, published after the step, then dropped
        self.block_hidden: dict[int, Any] | None = None
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


# The work of one step, the scheduler's: (sequence, number of new tokens to compute) in batch order
ScheduledBatch = list[tuple[Sequence, int]]


@dataclass
class StepInputs:
    """Flat host arrays of one step: B sequences, T token rows (rows past cu_seqlens_q[-1] are padding);
    engine/step_inputs.build_step_inputs makes them from a ScheduledBatch."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64: rotary-table rows = positions (+ rope_offset for a long-rope sequence)
    slot_mapping: np.ndarray  # [T] int64, -1 on padding rows (nothing stored)
    cu_seqlens_q: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32: context length including this step's tokens
    block_tables: np.ndarray  # [B, max_blocks] int32, rows padded with 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

