"""Loglikelihood of a continuation and multiple-choice scoring, the way lm-evaluation-harness does it, for the score
job's `continuation` and `choices` records: lm-eval's tokenization of a context and continuation (`encode_pair`),
`is_greedy`, `acc` and `acc_norm` as docs/eval_jobs.md describes them.

`is_greedy` is lm-eval's `logits.argmax(-1) == tokens`: with tied top logits only the lowest token id is greedy
(a rank of 1, which ties share, is not enough); the request asks for at least the top-1 id, whose ties the engine
orders by token id (`apcscore.kernels.logprobs_torch.top_k`). Choices whose tokens differ only in the last one
share a request (`group_by_last_token`). Ties of `pred` go to the first choice (`numpy.argmax`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from apcscore.engine import numerics
from apcscore.engine.step import TokenLogprobs, Request, RequestOutput
from apcscore.errors import ApcscoreError

# Per-record columns of continuation and multiple-choice rows; null on rows of other kinds.
LOGLIKELIHOOD_FIELDS = [
    pa.field("continuation_logprob", pa.float64()),
    pa.field("continuation_num_tokens", pa.int64()),
    pa.field("is_greedy", pa.bool_()),
    pa.field("choice_logprobs", pa.list_(pa.float64())),
    pa.field("choice_logprobs_norm", pa.list_(pa.float64())),
    pa.field("pred", pa.int64()),
    pa.field("pred_norm", pa.int64()),
    pa.field("correct", pa.bool_()),
    pa.field("correct_norm", pa.bool_()),
    pa.field("answer", pa.int64()),
]


def prefix_token_id(tokenizer) -> int:
    """The token that conditions an empty context and starts a rolling-window sequence: BOS, else EOS."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ApcscoreError("the model's tokenizer has neither a BOS nor an EOS token, so an empty context (and the "
                        "first token of a perplexity text) has nothing to be conditioned on; use a model whose "
                        "tokenizer defines one of them")


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens (lm-eval's `tok_encode` for causal models)."""
    return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []


def encode_pair(tokenizer, context: str, continuation: str, prefix_id: int) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval splits them; see the module docstring."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    if not context:
        return [prefix_id], encode(tokenizer, continuation)
    context_ids = encode(tokenizer, context)
    whole = encode(tokenizer, context + continuation)
    return context_ids, whole[len(context_ids):]


def continuation_request(tokenizer, context: str, continuation: str, prefix_id: int, k: int) -> Request:
    """The scoring request of `continuation` after `context`: its tokens are scored, with top-max(`k`, 1) (the
    top-1 id decides `is_greedy`; `trim_top` drops it again where k is 0)."""
    context_ids, cont_ids = encode_pair(tokenizer, context, continuation, prefix_id)
    if not cont_ids:
        raise ApcscoreError(f"the continuation {continuation[:40]!r} has no tokens of its own: tokenized together "
                            "with the context it merges into the context's last token (end the context at a "
                            "token boundary, e.g. before a space)")
    return Request(None, context_ids + cont_ids, prompt_logprobs=max(k, 1), score_from=len(context_ids))


def group_by_last_token(requests: list[Request]) -> tuple[list[Request], list[int]]:
    """Merge scoring requests whose prompts differ only in their last token (same score_from): the first of
    each group keeps its prompt and takes the others' last tokens as `last_token_alternatives`, so one
    forward pass serves one-token answer choices of a context (lm-eval's hf groups them alike). Returns the
    merged requests (request_id None) and, per input request, the index of the merged request that scores
    it (read it with `continuation_score(out, last_token=its last token)`). Bitwise the same scores as the
    separate requests: alternatives are rows of the same hidden state (see `Request`)."""
    merged: list[Request] = []
    where: dict[tuple[tuple[int, ...], int], int] = {}
    owner: list[int] = []
    for r in requests:
        key = (tuple(r.prompt_token_ids[:-1]), r.score_from)
        if key not in where:
            where[key] = len(merged)
            merged.append(Request(None, list(r.prompt_token_ids), prompt_logprobs=r.prompt_logprobs,
                                  score_from=r.score_from, prompt_logprob_ranks=r.prompt_logprob_ranks))
        owner.append(where[key])
        first = merged[owner[-1]]
        last = r.prompt_token_ids[-1]
        if last != first.prompt_token_ids[-1] and last not in first.last_token_alternatives:
            first.last_token_alternatives += (last,)
        first.prompt_logprobs = max(first.prompt_logprobs or 0, r.prompt_logprobs or 0)
    return merged, owner


@dataclass(frozen=True)
class ContinuationScore:
    """The loglikelihood of one continuation."""

    logprob: float  # sum over its tokens (float64)
    num_tokens: int
    is_greedy: bool  # every token is the argmax (lm-eval: the first of tied maxima)


def continuation_score(out: RequestOutput, last_token: int | None = None) -> ContinuationScore:
    """Score of the continuation request `out` (scored from the continuation's first token); with last_token,
    of the continuation that ends in that token instead, one of the request's `last_token_alternatives`."""
    lps = out.prompt_logprobs
    if lps is None:
        raise ValueError("a continuation request must ask for prompt logprobs")
    if lps.top_ids.shape[1] == 0:
        raise ValueError("a continuation request must ask for at least the top-1 logprob")
    ids, logprobs, top1 = lps.token_ids, lps.token_logprobs, lps.top_ids[:, 0]
    if last_token is not None and last_token != ids[-1]:
        alts = out.last_token_alternatives
        i = int(np.flatnonzero(alts.token_ids == last_token)[0])  # the request must have listed it
        ids, logprobs, top1 = (np.concatenate([a[:-1], b[i:i + 1]]) for a, b in (
            (ids, alts.token_ids), (logprobs, alts.token_logprobs), (top1, alts.top_ids[:, 0])))
    return ContinuationScore(numerics.exact_sum(logprobs), len(ids), bool(np.all(top1 == ids)))


def trim_top(lps: TokenLogprobs | None, k: int) -> TokenLogprobs | None:
    """`lps` with its top-K columns cut to k (the continuation request asked for at least 1)."""
    if lps is None or lps.top_ids.shape[1] <= k:
        return lps
    return dataclasses.replace(lps, top_ids=lps.top_ids[:, :k], top_logprobs=lps.top_logprobs[:, :k])


def choice_columns(logprobs: list[float], choices: list[str], answer: int) -> dict:
    """The multiple-choice columns of a record from its choices' loglikelihoods."""
    lls = np.asarray(logprobs, dtype=np.float64)
    norm = lls / np.asarray([len(c) for c in choices], dtype=np.float64)
    pred, pred_norm = int(np.argmax(lls)), int(np.argmax(norm))
    return {"choice_logprobs": lls.tolist(), "choice_logprobs_norm": norm.tolist(), "pred": pred,
            "pred_norm": pred_norm, "correct": pred == answer, "correct_norm": pred_norm == answer,
            "answer": answer}


def mean_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error, sample standard deviation / sqrt(n) (lm-eval's `mean_stderr`)."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n == 1:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)
