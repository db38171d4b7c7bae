"""The engine's public types: a request (a prompt and what to compute for it), its output, and the checks
every model path applies to a request before it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from apcscore.engine.sampling_params import SamplingParams


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
        return Divergence(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                            ("ref_logprobs", "kl", "delta_p", "top1_agree")))

    def rows(self, start: int, stop: int) -> "Divergence":
        return Divergence(self.ref_logprobs[start:stop], self.kl[start:stop], self.delta_p[start:stop],
                          self.top1_agree[start:stop])


@dataclass
class TokenLogprobs:
    """Logprobs of a run of tokens (scored prompt positions, or sampled tokens), as numpy arrays.

    token_ids[i] is the token whose logprob is token_logprobs[i]; rank 1 = the model's argmax.
    top_ids / top_logprobs are [n, K] (K may be 0), sorted by logprob, descending.
    """

    token_ids: np.ndarray  # [n] int64
    token_logprobs: np.ndarray  # [n] float32
    ranks: np.ndarray  # [n] int64
    top_ids: np.ndarray  # [n, K] int64
    top_logprobs: np.ndarray  # [n, K] float32
    divergence: Divergence | None = None  # from the reference model, where the engine has one

    @staticmethod
    def concat(parts: list["TokenLogprobs"], k: int) -> "TokenLogprobs":
        if not parts:
            return TokenLogprobs(
                np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64),
                np.zeros((0, k), np.int64), np.zeros((0, k), np.float32),
            )
        divergence = Divergence.concat([p.divergence for p in parts]) \
            if all(p.divergence is not None for p in parts) else None
        return TokenLogprobs(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                               ("token_ids", "token_logprobs", "ranks", "top_ids", "top_logprobs")), divergence)

    def __len__(self) -> int:
        return len(self.token_ids)

    def rows(self, start: int, stop: int, k: int | None = None) -> "TokenLogprobs":
        """Rows start..stop-1, their top-K columns cut to k when given."""
        return TokenLogprobs(self.token_ids[start:stop], self.token_logprobs[start:stop], self.ranks[start:stop],
                             self.top_ids[start:stop, :k], self.top_logprobs[start:stop, :k],
                             None if self.divergence is None else self.divergence.rows(start, stop))


@dataclass
class PromptLogprobs(TokenLogprobs):
    """TokenLogprobs of the scored prompt positions; positions[i] is the prompt index of row i."""

    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass
class RequestOutput:
    """What the engine returns for one request, in completion order."""

    request_id: Any
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
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
