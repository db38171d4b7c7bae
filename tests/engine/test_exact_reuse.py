"""Exact reuse (issue 13): scoring requests read cached KV before their first scored position, and every output
column is bitwise what a full recompute returns (`np.array_equal`, no tolerance), across budgets, shuffled
order, forced preemption and a tiny KV pool that evicts mid-run. Reuse must also really happen (hit counts),
or the comparisons would test nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from apcscore import Engine, EngineConfig, Request, SamplingParams
from apcscore.engine.loader import load_native_engine
from apcscore.errors import ApcscoreError
from tests.engine.test_block_manager import check_invariants
from tests.engine.test_invariance import assert_same, run

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
    return load_native_engine(model, EngineConfig(**{**base, **overrides}))


@pytest.fixture(scope="module")
def reference(model: str) -> dict:
    """Full recompute, each request alone in a fresh engine."""
    want = {}
    for r in fewshot_requests():
        want.update(run(engine(model), [r]))
    return want


@pytest.mark.slow
def test_reuse_equals_recompute_and_hits(model: str, reference: dict) -> None:
    eng = engine(model, exact_reuse=True)
    assert_same(run(eng, fewshot_requests()), reference, "exact reuse")
    pc = eng.block_manager.stats
    # 6 questions x 3 choices read the 9 full blocks of the shared prefix (computed once) and their context
    assert pc.hit_tokens >= (6 * 3 - 1) * 144, pc
    assert eng.stats.prompt_tokens < sum(len(r.prompt_token_ids) for r in fewshot_requests()) - 17 * 144


@pytest.mark.slow
def test_recompute_counts_what_reuse_would_save(model: str, reference: dict) -> None:
    eng = engine(model)
    assert_same(run(eng, fewshot_requests()), reference, "recompute")
    pc = eng.block_manager.stats
    assert pc.hit_tokens == 0 and pc.queried_tokens == 0
    reused = engine(model, exact_reuse=True)
    run(reused, fewshot_requests())
    assert pc.reusable_tokens == reused.block_manager.stats.hit_tokens > 0


@pytest.mark.slow
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
    check_invariants(eng.block_manager)


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
    with pytest.raises(ApcscoreError, match="exact_reuse needs batch invariance"):  # EngineConfig names its fields
        EngineConfig(exact_reuse=True, batch_invariant=False)
    with pytest.raises(ApcscoreError, match="enable_prefix_caching=False"):
        EngineConfig(exact_reuse=True, enable_prefix_caching=False)


@pytest.mark.slow
def test_a_crafted_hash_collision_is_refused(model: str, reference: dict, monkeypatch) -> None:
    """Every block hashes alike: hits must still check tokens and parent, so the results stay exact."""
    from apcscore.engine import block_manager

    monkeypatch.setattr(block_manager, "hash_block", lambda parent, tokens: b"\0" * 32)
    eng = engine(model, exact_reuse=True)
    assert_same(run(eng, fewshot_requests()), reference, "colliding hashes")


# ---- the command line: every record kind, every column ------------------------------------------------------
FEWSHOT = ("The following are multiple choice questions about everyday facts. Answer with the right option. "
           "Question: What colour is the sky on a clear day? Answer: blue. Question: How many legs has a cat? "
           "Answer: four. Question: What do bees make? Answer: honey.\n\n")


def score_records() -> list[dict]:
    recs: list[dict] = []
    for i, q in enumerate(["What is frozen water?", "Which animal barks?", "What do we breathe?"]):
        recs.append({"id": f"mc{i}", "context": FEWSHOT + f"Question: {q} Answer:",
                     "choices": [" ice", " a dog", " air", " the moon"], "answer": i})
        recs.append({"id": f"cont{i}", "context": FEWSHOT + f"Question: {q} Answer:", "continuation": " ice"})
    recs.append({"id": "prompt", "prompt": FEWSHOT + "A plain prompt, scored at every position."})
    recs.append({"id": "ids", "prompt_token_ids": list(range(100, 150))})
    return recs


def cli_run(model: str, tmp_path, command: str, records: list[dict], write_jsonl, *flags: str,
            name: str | None = None) -> tuple:
    import json

    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from apcscore.cli import app

    data = write_jsonl(tmp_path / f"{command}.jsonl", records)
    out = tmp_path / f"{name or command + '-'.join(flags).replace('/', '_')}.parquet"
    res = CliRunner().invoke(app, [command, str(data), "--model", model, "--out", str(out), "--device", "cpu",
                                   "--num-kv-blocks", "256", *flags])
    if res.exit_code != 0 or not out.exists():
        return res, None, None
    table = pq.read_table(out)
    return res, table, json.loads(table.schema.metadata[b"apcscore"])


RUN_COLUMNS = {"num_cached_tokens"}  # generate's count of prompt tokens read from the cache: what reuse changes


def assert_tables_equal(a, b) -> None:
    """Every result column (not the run's own cache counts: RUN_COLUMNS), value for value (floats compared by
    their bits through Arrow)."""
    assert a.schema.names == b.schema.names
    for name in a.schema.names:
        if name not in RUN_COLUMNS:
            assert a.column(name).equals(b.column(name)), f"column {name} differs"


@pytest.mark.slow
@pytest.mark.parametrize("command,flags", [("score", ("--prompt-logprobs", "3")),
                                           ("perplexity", ("--window", "40", "--stride", "17",
                                                           "--prompt-logprobs", "2")),
                                           ("generate", ("--prompt-logprobs", "2", "--max-tokens", "3"))])
def test_cli_exact_reuse_writes_the_recompute_file(model: str, tmp_path, write_jsonl, command: str,
                                                   flags: tuple) -> None:
    if command == "score":
        records = score_records()
    else:
        records = [{"id": f"t{i}", "prompt" if command == "generate" else "text": FEWSHOT * 2 + tail}
                   for i, tail in enumerate(["Once upon a time.", "The end of the story came soon.", "Again."])]
    res, want, meta = cli_run(model, tmp_path, command, records, write_jsonl, *flags)
    assert res.exit_code == 0, res.output
    reusable = meta["timings"]["prefix_cache"]["reusable_tokens"]
    res, got, meta2 = cli_run(model, tmp_path, command, records, write_jsonl, *flags, "--exact-reuse",
                              "--max-batch-tokens", "100")
    assert res.exit_code == 0, res.output
    assert_tables_equal(got, want)
    assert meta2["engine"]["exact_reuse"] is True
    if command == "score":  # the contexts share a few-shot prefix: reuse happened, and was announced
        assert reusable > 0 and "--exact-reuse would have served" in cli_run(
            model, tmp_path, command, records, write_jsonl, *flags, "--overwrite")[0].output
        assert meta2["timings"]["prefix_cache"]["hit_tokens"] > 0
        assert meta2["timings"]["prompt_tokens"] < meta["timings"]["prompt_tokens"]


def test_cli_refuses_exact_reuse_without_batch_invariance(model: str, tmp_path, write_jsonl) -> None:
    res, _, _ = cli_run(model, tmp_path, "score", score_records(), write_jsonl, "--exact-reuse",
                        "--no-batch-invariant")
    assert res.exit_code == 2 and "--exact-reuse needs batch invariance" in res.output
    res, _, _ = cli_run(model, tmp_path, "score", score_records(), write_jsonl, "--verify-reuse", "0.5")
    assert res.exit_code == 2 and "pass --exact-reuse too" in res.output


@pytest.mark.slow
def test_verify_reuse_passes_and_catches_a_wrong_reuse(model: str, tmp_path, write_jsonl, monkeypatch) -> None:
    res, _, meta = cli_run(model, tmp_path, "score", score_records(), write_jsonl, "--exact-reuse",
                           "--verify-reuse", "1")
    assert res.exit_code == 0, res.output
    report = meta["verify_reuse"]
    assert report["mismatches"] == [] and report["records"] == len(score_records())
    # a reuse that takes one block too many skips positions it must score: the verification must fail the run
    from apcscore.engine.step import Sequence

    right = Sequence.reusable_blocks
    monkeypatch.setattr(Sequence, "reusable_blocks", lambda self, bs: right(self, bs) + 1)
    res, _, _ = cli_run(model, tmp_path, "score", score_records(), write_jsonl, "--exact-reuse",
                        "--verify-reuse", "1", "--overwrite")
    assert res.exit_code == 1, res.output
    # the full-prompt record reads the few-shot prefix's first block, whose positions it must score
    assert "differ from full recompute" in res.output and "prompt (request 0): prompt_positions" in res.output


def test_verify_reuse_catches_wrong_last_token_alternatives(model: str, tmp_path, write_jsonl,
                                                            monkeypatch) -> None:
    """A reuse bug that touches only the last-token alternatives (the one-token choices after the first of a
    multiple-choice record) must fail the run too."""
    import numpy as np

    from apcscore.engine.model_runner import ModelRunner
    from apcscore.run.verify import ReuseVerifier

    verifying = []
    right_check, right_score = ReuseVerifier.check, ModelRunner._score_prompts

    def check(self, engine):
        verifying.append(True)
        return right_check(self, engine)

    def score_prompts(self, batch, hidden, *reference):  # (reference: the reference model's hidden states)
        out, alternatives = right_score(self, batch, hidden, *reference)
        if not verifying:  # the reuse run only: its alternatives' logprobs are off by one ulp
            for _, alt in alternatives:
                alt.token_logprobs = np.nextafter(alt.token_logprobs, np.float32(0))
        return out, alternatives

    monkeypatch.setattr(ReuseVerifier, "check", check)
    monkeypatch.setattr(ModelRunner, "_score_prompts", score_prompts)
    res, _, _ = cli_run(model, tmp_path, "score", score_records(), write_jsonl, "--exact-reuse",
                        "--verify-reuse", "1")
    assert verifying and res.exit_code == 1, res.output
    assert "differ from full recompute" in res.output and "alternatives_token_logprobs" in res.output
    assert "prompt_token_logprobs" not in res.output  # only the alternatives were touched


@pytest.mark.slow
def test_interrupted_exact_reuse_run_resumes_to_the_recompute_file(model: str, tmp_path, write_jsonl,
                                                                   monkeypatch) -> None:
    import os
    import signal

    from apcscore.jobs.base import Job

    records = [{**r, "id": f"{r['id']}-{k}"} for k in range(3) for r in score_records()]
    res, want, _ = cli_run(model, tmp_path, "score", records, write_jsonl, "--prompt-logprobs", "2")
    assert res.exit_code == 0, res.output
    finish, seen = Job.finish_row, []

    def interrupting(self, row, plan=None):  # SIGINT to ourselves after the 7th row: the run stops after the step
        seen.append(row["id"])
        if len(seen) == 7:
            os.kill(os.getpid(), signal.SIGINT)
        return finish(self, row, plan)

    monkeypatch.setattr(Job, "finish_row", interrupting)
    flags = ("--prompt-logprobs", "2", "--exact-reuse", "--max-num-seqs", "2", "--max-batch-tokens", "64")
    res, _, _ = cli_run(model, tmp_path, "score", records, write_jsonl, *flags, name="resumed")
    assert res.exit_code == 130, res.output
    monkeypatch.setattr(Job, "finish_row", finish)
    res, got, meta = cli_run(model, tmp_path, "score", records, write_jsonl, *flags, "--resume", name="resumed")
    assert res.exit_code == 0, res.output
    assert meta["sessions"] == 2 and 7 <= len(seen) < len(records)
    assert_tables_equal(got, want)


@pytest.mark.slow
def test_a_shared_prefix_is_computed_once_wherever_its_questions_sit(model: str) -> None:
    """Questions behind one 160-token prefix, scattered among unrelated prompts in a file far longer than the
    look-ahead (max_num_seqs 2: 8 waiting requests): the prefix's 10 blocks are prefilled once."""
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, 49152, 160).tolist()
    reqs: list[Request] = []
    for i in range(40):
        if i % 5 == 2:
            ctx = prefix + rng.integers(3, 49152, 7).tolist()
            reqs.append(Request(("q", i), ctx + [42, 43], prompt_logprobs=0, score_from=len(ctx)))
        else:
            reqs.append(Request(("x", i), rng.integers(3, 49152, 30).tolist(), prompt_logprobs=0))
    eng = engine(model, exact_reuse=True, max_num_seqs=2)
    got = run(eng, reqs)
    questions = sum(1 for r in reqs if r.request_id[0] == "q")
    assert eng.stats.prompt_tokens == sum(len(r.prompt_token_ids) for r in reqs) - (questions - 1) * 160
    assert_same(got, run(engine(model), reqs), "scattered")


# not marked `triton`: scripts/gpu_check.py selects those, and this test needs the default model's tokenizer
@pytest.mark.slow
def test_exact_reuse_with_the_triton_backend(model: str) -> None:
    """The Triton attention kernel reads its keys in the same fixed tiles: reuse is bitwise there too (runs under
    TRITON_INTERPRET=1 on a CPU, or on CUDA)."""
    import torch

    from apcscore.kernels._checks import interpreting

    if not interpreting() and not torch.cuda.is_available():
        pytest.skip("the Triton backend needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
    rng = np.random.default_rng(8)
    prefix = rng.integers(3, 49152, 12).tolist()
    reqs = [Request(i, prefix + rng.integers(3, 49152, 3).tolist() + [11 + i, 12], prompt_logprobs=2, score_from=15)
            for i in range(3)]

    def triton(**kw) -> Engine:
        return load_native_engine(model, EngineConfig(device=device, dtype="float32", num_kv_blocks=64, block_size=4,
                                                      max_batch_tokens=8, attention_backend="triton",
                                                      use_cuda_graphs=False, **kw))

    reused = triton(exact_reuse=True)
    assert_same(run(reused, reqs), run(triton(), reqs), "triton")
    assert reused.block_manager.stats.hit_tokens == 2 * 12
