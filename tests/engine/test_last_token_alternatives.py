"""Last-token alternatives (issue 14): one request scores several one-token continuations of one context from
the same hidden-state row. Each alternative's logprob, rank and top-K must be bitwise what a separate request
ending in that token returns (`np.array_equal`), under recompute and exact reuse, any budget, shuffled order
and preemption; the transformers fallback agrees within 1e-5."""

from __future__ import annotations

import random

import numpy as np
import pytest

from apcscore import EngineConfig, Request, SamplingParams, load_engine
from apcscore.engine.step import request_problem
from apcscore.jobs.loglikelihood import continuation_score
from tests.engine.test_exact_reuse import engine, model  # noqa: F401  (the tiny Llama fixture and engine set-up)

K = 3
PREFIX_LEN = 70


def questions(seed: int = 11, count: int = 5) -> list[tuple[list[int], list[list[int]]]]:
    """(context, continuations) per question: a shared 70-token prefix plus 3..30 question tokens; four
    continuations, one-token ones and two-token ones that share their first token (same scored rows but the
    last)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 49152, PREFIX_LEN).tolist()
    out = []
    for _ in range(count):
        context = prefix + rng.integers(3, 49152, int(rng.integers(3, 30))).tolist()
        first = int(rng.integers(3, 49152))
        choices = [[int(t)] for t in rng.choice(np.arange(3, 49152), 3, replace=False)]
        out.append((context, choices + [[first, int(rng.integers(3, 49152))], [first, choices[0][0]]]))
    return out


def separate_requests() -> list[Request]:
    return [Request((q, c), ctx + cont, prompt_logprobs=K, score_from=len(ctx))
            for q, (ctx, conts) in enumerate(questions()) for c, cont in enumerate(conts)]


def grouped_requests() -> list[Request]:
    """One request per (question, continuation length): the first continuation, the rest as alternatives."""
    reqs = []
    for q, (ctx, conts) in enumerate(questions()):
        for length in (1, 2):
            group = [c for c in conts if len(c) == length]
            reqs.append(Request((q, length), ctx + group[0], prompt_logprobs=K, score_from=len(ctx),
                                last_token_alternatives=tuple(c[-1] for c in group[1:])))
    return reqs


def per_choice(outputs: list) -> dict:
    """Each continuation's columns (ids, logprobs, ranks, top ids, top logprobs), keyed like separate_requests."""
    got = {}
    for out in outputs:
        assert out.error is None, out.error
        q, length = out.request_id
        p, alt = out.prompt_logprobs, out.last_token_alternatives
        conts = questions()[q][1]
        alt_ids = list(alt.token_ids)
        for c, cont in enumerate(conts):
            if len(cont) != length:
                continue
            if cont[-1] == p.token_ids[-1] and c == next(i for i, x in enumerate(conts) if len(x) == length):
                got[(q, c)] = (p.token_ids, p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs)
            else:
                i = alt_ids.index(cont[-1])
                got[(q, c)] = tuple(np.concatenate([a[:-1], b[i:i + 1]]) for a, b in zip(
                    (p.token_ids, p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs),
                    (alt.token_ids, alt.token_logprobs, alt.ranks, alt.top_ids, alt.top_logprobs)))
    return got


def columns(out) -> tuple:
    p = out.prompt_logprobs
    return p.token_ids, p.token_logprobs, p.ranks, p.top_ids, p.top_logprobs


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key in want:
        for name, a, b in zip(("ids", "logprobs", "ranks", "top_ids", "top_logprobs"), got[key], want[key]):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{what}: {key} {name}"


@pytest.fixture(scope="module")
def reference(model: str) -> dict:
    """Every continuation as its own request, each alone in a fresh engine."""
    return {r.request_id: columns(next(iter(engine(model).run([r])))) for r in separate_requests()}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [{}, {"exact_reuse": True}, {"max_batch_tokens": 7},
                                       {"exact_reuse": True, "max_batch_tokens": 57}],
                         ids=["recompute", "exact-reuse", "budget-7", "exact-reuse-budget-57"])
def test_alternatives_equal_separate_requests(model: str, reference: dict, overrides: dict) -> None:
    eng = engine(model, **overrides)
    assert_bitwise(per_choice(list(eng.run(grouped_requests()))), reference, str(overrides))
    # the point of it: each context is computed once per continuation length, not once per continuation
    separate = sum(len(r.prompt_token_ids) for r in separate_requests())
    assert eng.stats.prompt_tokens <= sum(len(r.prompt_token_ids) for r in grouped_requests()) < 0.5 * separate


@pytest.mark.slow
def test_alternatives_shuffled_warm_and_preempted(model: str, reference: dict) -> None:
    reqs = grouped_requests()
    random.Random(2).shuffle(reqs)
    eng = engine(model, exact_reuse=True, max_num_seqs=3)
    assert_bitwise(per_choice(list(eng.run(reqs))), reference, "shuffled")
    assert_bitwise(per_choice(list(eng.run(reqs[::-1]))), reference, "warm cache, reversed")
    # a pool too small for all: scoring requests that also decode hold blocks and get preempted
    decoding = [Request(r.request_id, r.prompt_token_ids, prompt_logprobs=K, score_from=r.score_from,
                        last_token_alternatives=r.last_token_alternatives,
                        sampling=SamplingParams(max_tokens=16, ignore_eos=True)) for r in grouped_requests()]
    small = engine(model, exact_reuse=True, num_kv_blocks=10, max_batch_tokens=128)
    assert_bitwise(per_choice(list(small.run(decoding))), reference, "preemption")
    assert small.stats.preemptions > 0, "the small pool did not preempt: the scenario tests nothing"


def test_continuation_score_of_an_alternative(model: str) -> None:
    """The lm-eval backend's reading: the sum and the greedy flag of the continuation ending in each token."""
    ctx, conts = questions()[0]
    greedy_out = next(iter(engine(model).run([Request("g", ctx + [5], prompt_logprobs=1, score_from=len(ctx))])))
    top1 = int(greedy_out.prompt_logprobs.top_ids[-1, 0])
    alternatives = (conts[1][0], top1)
    out = next(iter(engine(model).run([Request("a", ctx + conts[0], prompt_logprobs=1, score_from=len(ctx),
                                               last_token_alternatives=alternatives)])))
    for token in (conts[0][0], *alternatives):
        alone = next(iter(engine(model).run([Request("s", ctx + [token], prompt_logprobs=1,
                                                     score_from=len(ctx))])))
        assert continuation_score(out, last_token=token) == continuation_score(alone)
    assert continuation_score(out, last_token=top1).is_greedy
    assert not continuation_score(out, last_token=conts[1][0]).is_greedy or conts[1][0] == top1


def test_alternatives_need_the_last_token_scored() -> None:
    ok = Request(0, [1, 2, 3], prompt_logprobs=0, score_from=2, last_token_alternatives=(4,))
    assert request_problem(ok, 100, 10, 5) is None
    for bad in (Request(0, [1, 2, 3], last_token_alternatives=(4,)),
                Request(0, [1, 2, 3], prompt_logprobs=0, score_from=3, last_token_alternatives=(4,))):
        assert "last_token_alternatives need prompt logprobs" in request_problem(bad, 100, 10, 5)
    assert "outside the vocabulary" in request_problem(
        Request(0, [1, 2, 3], prompt_logprobs=0, last_token_alternatives=(10,)), 100, 10, 5)


def test_the_transformers_fallback_scores_alternatives(tiny_model_dir) -> None:
    eng = load_engine(str(tiny_model_dir("gpt2")), EngineConfig(device="cpu", dtype="float32"))
    vocab = eng.info.vocab_size
    rng = np.random.default_rng(1)
    ctx = rng.integers(0, vocab, 20).tolist()
    alts = (7, 11, 7 + 1)
    out = next(iter(eng.run([Request("a", ctx + [3], prompt_logprobs=2, score_from=len(ctx) - 2,
                                     last_token_alternatives=alts)])))
    assert out.prompt_logprobs.positions.tolist() == [18, 19, 20]
    for i, token in enumerate(alts):
        alone = next(iter(eng.run([Request("s", ctx + [token], prompt_logprobs=2, score_from=len(ctx))])))
        a = out.last_token_alternatives
        assert a.token_ids[i] == token and a.ranks[i] == alone.prompt_logprobs.ranks[-1]
        np.testing.assert_allclose(a.token_logprobs[i], alone.prompt_logprobs.token_logprobs[-1], atol=1e-5)
        np.testing.assert_array_equal(a.top_ids[i], alone.prompt_logprobs.top_ids[-1])
