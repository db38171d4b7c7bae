"""Exact reuse (issue 13): scoring requests read cached KV before their first scored position, and every output
column is bitwise what a full recompute returns (`np.array_equal`, no tolerance), across budgets, shuffled
order, forced preemption and a tiny KV pool that evicts mid-run. Reuse must also really happen (hit counts),
or the comparisons would test nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from apcscore import Engine, EngineConfig, Request, SamplingParams
from apcscore.errors import ApcscoreError
from tests.test_invariance import assert_same, run

K = 3


def fewshot_requests(seed: int = 5, questions: int = 6, choices: int = 3) -> list[Request]:
    """A few-shot multiple-choice workload in token ids: one shared 150-token prefix, then per question a
    context of 5..40 tokens and per choice a continuation of 1..9 tokens scored from the end of the context."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 49152, 150).tolist()
    out = []
    for q in range(questions):
        context = prefix + rng.integers(3, 49152, int(rng.integers(5, 40))).tolist()
        for c in range(choices):
            cont = rng.integers(3, 49152, int(rng.integers(1, 10))).tolist()
            out.append(Request((q, c), context + cont, prompt_logprobs=K, score_from=len(context)))
    # full-prompt scoring and a prefix-only prompt ride along: they may read nothing (score_from 1)
    out.append(Request("full", prefix + [7, 8, 9], prompt_logprobs=K))
    out.append(Request("short", prefix[:20] + [5], prompt_logprobs=0, score_from=20))
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def engine(model: str, **overrides) -> Engine:
    base = dict(device="cpu", dtype="float32", max_batch_tokens=2048, max_num_seqs=16, num_kv_blocks=512)
    return Engine.from_model(model, EngineConfig(**{**base, **overrides}))


@pytest.fixture(scope="module")
def reference(model: str) -> dict:
    """Full recompute, each request alone in a fresh engine."""
    want = {}
    for r in fewshot_requests():
        want.update(run(engine(model), [r]))
    return want


def test_reuse_equals_recompute_and_hits(model: str, reference: dict) -> None:
    eng = engine(model, exact_reuse=True)
    assert_same(run(eng, fewshot_requests()), reference, "exact reuse")
    pc = eng.block_manager.stats
    # 6 questions x 3 choices read the 9 full blocks of the shared prefix (computed once) and their context
    assert pc.hit_tokens >= (6 * 3 - 1) * 144, pc
    assert eng.stats.prompt_tokens < sum(len(r.prompt_token_ids) for r in fewshot_requests()) - 17 * 144


def test_recompute_counts_what_reuse_would_save(model: str, reference: dict) -> None:
    eng = engine(model)
    assert_same(run(eng, fewshot_requests()), reference, "recompute")
    pc = eng.block_manager.stats
    assert pc.hit_tokens == 0 and pc.queried_tokens == 0
    reused = engine(model, exact_reuse=True)
    run(reused, fewshot_requests())
    assert pc.reusable_tokens == reused.block_manager.stats.hit_tokens > 0


@pytest.mark.parametrize("budget", [1, 7, 16, 57, 100, 257, 4096])
def test_reuse_across_budgets(model: str, reference: dict, budget: int) -> None:
    small = {(0, 0), (0, 1), (1, 0), (1, 1), "short"}  # a one-token budget is one step per token
    reqs = [r for r in fewshot_requests() if budget >= 16 or r.request_id in small]
    eng = engine(model, exact_reuse=True, max_batch_tokens=budget)
    assert_same(run(eng, reqs), {r.request_id: reference[r.request_id] for r in reqs}, f"budget {budget}")
    assert eng.block_manager.stats.hit_tokens > 0


def test_reuse_shuffled_and_warm(model: str, reference: dict) -> None:
    reqs = fewshot_requests()
    random.Random(3).shuffle(reqs)
    eng = engine(model, exact_reuse=True, max_num_seqs=3)
    assert_same(run(eng, reqs), reference, "shuffled")
    assert_same(run(eng, reqs[::-1]), reference, "warm cache, reversed")


def test_reuse_under_preemption_and_eviction(model: str, reference: dict) -> None:
    """A pool of 24 blocks: scoring requests also decode a few tokens so they hold blocks; the engine must
    preempt, and cached prefix blocks are evicted and recomputed mid-run."""
    reqs = [Request(r.request_id, r.prompt_token_ids, prompt_logprobs=r.prompt_logprobs, score_from=r.score_from,
                    sampling=SamplingParams(max_tokens=8, ignore_eos=True)) for r in fewshot_requests()]
    eng = engine(model, exact_reuse=True, num_kv_blocks=24, max_batch_tokens=256)
    got = {o.request_id: o for o in eng.run(reqs)}
    assert_same({k: (o.prompt_logprobs.token_ids, o.prompt_logprobs.token_logprobs, o.prompt_logprobs.ranks,
                     o.prompt_logprobs.top_ids, o.prompt_logprobs.top_logprobs, o.prompt_logprobs.positions)
                 for k, o in got.items()}, reference, "preemption")
    assert eng.stats.preemptions > 0, "the tiny pool did not preempt: the scenario tests nothing"
    assert eng.block_manager.stats.hit_tokens > 0
    eng.block_manager.check_invariants()


def test_followers_wait_for_a_prefix_being_computed(model: str) -> None:
    """Every request arrives at once; the shared prefix is prefilled by one, the rest wait and hit."""
    reqs = fewshot_requests()
    eng = engine(model, exact_reuse=True)
    run(eng, reqs)
    scored = [r for r in reqs if r.score_from > 150]
    computed = eng.stats.prompt_tokens
    # the 144 tokens of the prefix's 9 full blocks are prefilled once, not once per question
    assert computed <= sum(len(r.prompt_token_ids) for r in reqs) - (len(scored) - 1) * 144


def test_exact_reuse_needs_batch_invariance() -> None:
    with pytest.raises(ApcscoreError, match="--exact-reuse needs batch invariance"):
        EngineConfig(exact_reuse=True, batch_invariant=False)
    with pytest.raises(ApcscoreError, match="--no-prefix-caching"):
        EngineConfig(exact_reuse=True, enable_prefix_caching=False)


def test_a_crafted_hash_collision_is_refused(model: str, reference: dict, monkeypatch) -> None:
    """Every block hashes alike: hits must still check tokens and parent, so the results stay exact."""
    from apcscore.engine import block_manager

    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: b"\0" * 32)
    eng = engine(model, exact_reuse=True)
    assert_same(run(eng, fewshot_requests()), reference, "colliding hashes")
