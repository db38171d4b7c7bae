"""Jobs are pure: built from a tokenizer and a context length (no engine), they turn a record into requests and
a plan, and the plan and the outputs into a row, keeping nothing per record. Outputs here are made up."""

from __future__ import annotations

import numpy as np
import pytest

from apcscore.engine.step import Request, RequestOutput, TokenLogprobs
from apcscore.errors import ApcscoreError
from apcscore.io.schemas import Record
from apcscore.jobs.generate import GenerateJob
from apcscore.options.commands import GenerateOptions, PerplexityOptions, ScoreOptions
from apcscore.jobs.perplexity import PerplexityJob
from apcscore.jobs.registry import JOBS, job_class
from apcscore.jobs.score import ScoreJob

MAX_LEN = 16
LONG = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen")


def fake_output(req: Request, logprob: float = -0.5) -> RequestOutput:
    """An output scoring every token of `req` from score_from at `logprob`, each its own argmax; alternatives of
    the last token at -2.0, behind the prompt's own last token."""
    ids = np.asarray(req.prompt_token_ids, dtype=np.int64)
    pos = np.arange(req.score_from, len(ids), dtype=np.int64)
    k = req.prompt_logprobs or 0
    top = np.repeat(ids[pos][:, None], k, axis=1)
    lps = TokenLogprobs(token_ids=ids[pos], token_logprobs=np.full(len(pos), logprob, np.float32),
                        ranks=np.ones(len(pos), np.int64), top_ids=top,
                        top_logprobs=np.full(top.shape, logprob, np.float32), positions=pos)
    alts = None
    if req.last_token_alternatives:
        a = np.asarray(req.last_token_alternatives, dtype=np.int64)
        alts = TokenLogprobs(token_ids=a, token_logprobs=np.full(len(a), -2.0, np.float32),
                             ranks=np.full(len(a), 2, np.int64), top_ids=np.full((len(a), k), ids[-1]),
                             top_logprobs=np.full((len(a), k), logprob, np.float32))
    return RequestOutput(req.request_id, list(req.prompt_token_ids), prompt_logprobs=lps,
                         last_token_alternatives=alts)


def test_the_registry_names_every_command():
    assert JOBS == {"score": ScoreJob, "generate": GenerateJob, "perplexity": PerplexityJob}
    assert all(job_class(name) is cls and cls.command == name for name, cls in JOBS.items())
    with pytest.raises(ValueError):
        job_class("merge")


def test_a_score_job_truncates_and_keeps_the_count_in_the_plan(default_tokenizer):
    job = ScoreJob(default_tokenizer, MAX_LEN, ScoreOptions(prompt_logprobs=0, truncate="left"))
    assert not hasattr(job, "engine") and job.prefix_id is not None
    ids = list(default_tokenizer(LONG).input_ids)
    assert len(ids) > MAX_LEN
    record = Record(3, 4, "long", "prompt", {"prompt": LONG})
    state = dict(vars(job))
    (req,), plan = job.requests(record)
    assert job.requests(record) == ([req], plan) and vars(job) == state  # nothing kept per record
    assert req.prompt_token_ids == ids[-MAX_LEN:] and plan.record is record
    assert plan.num_truncated_tokens == len(ids) - MAX_LEN
    row = job.finish_row(job.row(plan, [fake_output(req)]), plan)
    assert row["status"] == "ok" and row["id"] == "long"
    assert (row["num_tokens"], row["num_scored"]) == (MAX_LEN, MAX_LEN - 1)
    assert row["sum_logprob"] == pytest.approx(-0.5 * (MAX_LEN - 1))
    assert row["num_truncated_tokens"] == len(ids) - MAX_LEN
    # error rows carry no count: refused by the engine (a plan), or no requests / invalid (no plan)
    assert job.finish_row(job.error_row("long", "refused"), plan)["num_truncated_tokens"] is None
    assert job.finish_row(job.error_row("bad", "invalid"))["num_truncated_tokens"] is None
    strict = ScoreJob(default_tokenizer, MAX_LEN, ScoreOptions(prompt_logprobs=0))
    with pytest.raises(ApcscoreError, match="--truncate left"):
        strict.requests(record)
    assert "num_truncated_tokens" not in strict.finish_row(strict.error_row("long", "too long"))


def test_a_choices_plan_says_which_request_scores_each_choice(default_tokenizer):
    job = ScoreJob(default_tokenizer, MAX_LEN, ScoreOptions(prompt_logprobs=0, truncate="left"))
    choices = [" Paris", " London", " the city of Paris"]
    record = Record(0, 1, "q", "choices", {"context": "The capital of France is", "choices": choices, "answer": 0})
    reqs, plan = job.requests(record)
    assert len(plan.choices) == 3 and len(reqs) <= 3 and plan.num_truncated_tokens == 0
    row = job.finish_row(job.row(plan, [fake_output(r) for r in reqs]), plan)
    assert row["pred"] == 0 and row["correct"] and row["choice_logprobs"][0] == pytest.approx(-0.5)
    assert row["num_truncated_tokens"] == 0


def test_a_perplexity_plan_carries_its_windows(default_tokenizer):
    job = PerplexityJob(default_tokenizer, MAX_LEN, PerplexityOptions(window=8, prompt_logprobs=0))
    with pytest.raises(ApcscoreError, match="--window 15 or less"):
        PerplexityJob(default_tokenizer, MAX_LEN, PerplexityOptions(window=MAX_LEN))
    n = len(default_tokenizer(LONG, add_special_tokens=False).input_ids)
    reqs, plan = job.requests(Record(0, 1, "t", "text", {"text": LONG}))
    assert len(reqs) == len(plan.windows) > 1 and len(plan.sequence) == n + 1
    row = job.row(plan, [fake_output(r) for r in reqs])
    assert (row["num_tokens"], row["num_windows"]) == (n, len(reqs))
    assert row["sum_logprob"] == pytest.approx(-0.5 * n) and row["token_ids"] == list(plan.sequence)


def test_a_generate_job_leaves_room_to_generate(default_tokenizer):
    job = GenerateJob(default_tokenizer, MAX_LEN, GenerateOptions(max_tokens=4, truncate="left"))
    ids = list(default_tokenizer(LONG).input_ids)
    (req,), plan = job.requests(Record(0, 1, "g", "prompt", {"prompt": LONG}))
    assert req.prompt_token_ids == ids[-(MAX_LEN - 4):] and plan.num_truncated_tokens == len(ids) - MAX_LEN + 4
    out = RequestOutput(None, req.prompt_token_ids, output_token_ids=[5, 6], output_text="ab", finish_reason="stop")
    row = job.finish_row(job.row(plan, [out]), plan)
    assert (row["completion"], row["finish_reason"], row["num_prompt_tokens"]) == ("ab", "stop", MAX_LEN - 4)
    assert row["num_truncated_tokens"] == len(ids) - MAX_LEN + 4
