"""`score` with continuation and multiple-choice records: lm-eval's tokenization, loglikelihoods against
transformers on the real default model (within 1e-3; measured ~1e-5), `is_greedy`, accuracy, and the CLI.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from apcscore import EngineConfig
from apcscore.cli import app
from apcscore.engine import Engine
from apcscore.engine.loader import load_native_engine
from apcscore.errors import ApcscoreError
from apcscore.engine.step import Request
from apcscore.jobs.loglikelihood import (choice_columns, continuation_request, continuation_score, encode_pair,
                                         mean_stderr, prefix_token_id)
from apcscore.io.schemas import Record
from apcscore.options.commands import ScoreOptions
from apcscore.jobs.score import ScoreJob


def enc(tok, text):
    return tok(text, add_special_tokens=False).input_ids


# ---- tokenization, like lm-eval's HFLM._encode_pair ----------------------------------------------------
def test_trailing_whitespace_of_the_context_moves_to_the_continuation(default_tokenizer):
    tok = default_tokenizer
    ctx, cont = encode_pair(tok, "The capital of France is ", "Paris", 1)
    assert ctx == enc(tok, "The capital of France is")
    assert cont == enc(tok, "The capital of France is Paris")[len(ctx):]
    assert tok.decode(cont) == " Paris"
    # the same pair written with the space on the continuation side tokenizes the same
    assert encode_pair(tok, "The capital of France is", " Paris", 1) == (ctx, cont)


def test_the_pair_is_encoded_once_and_split_at_the_context_length(default_tokenizer):
    tok = default_tokenizer
    # "Hello" + "world" encodes as one word: the continuation is the tail of the joint encoding
    ctx, cont = encode_pair(tok, "Hello", "world", 1)
    whole = enc(tok, "Helloworld")
    assert ctx == enc(tok, "Hello") and cont == whole[len(ctx):]
    assert ctx + cont != whole  # lm-eval feeds context tokens + tail, not the joint encoding


def test_an_empty_context_is_conditioned_on_the_prefix_token(default_tokenizer):
    tok = default_tokenizer
    assert encode_pair(tok, "", "Once upon a time", 7) == ([7], enc(tok, "Once upon a time"))
    assert encode_pair(tok, "  ", "Once", 7) == ([7], enc(tok, "  Once"))  # only whitespace: empty too
    req = continuation_request(tok, "", "Once upon a time", 7, 0)
    assert req.prompt_token_ids == [7] + enc(tok, "Once upon a time") and req.score_from == 1


def test_a_continuation_without_tokens_of_its_own_is_an_error(default_tokenizer):
    with pytest.raises(ApcscoreError, match="has no tokens of its own"):
        continuation_request(default_tokenizer, "The end", "ing", 1, 0)  # "The ending" is 2 tokens, like "The end"


def test_prefix_token_is_bos_else_eos():
    assert prefix_token_id(SimpleNamespace(bos_token_id=5, eos_token_id=9)) == 5
    assert prefix_token_id(SimpleNamespace(bos_token_id=None, eos_token_id=9)) == 9
    with pytest.raises(ApcscoreError, match="neither a BOS nor an EOS"):
        prefix_token_id(SimpleNamespace(bos_token_id=None, eos_token_id=None))


# ---- multiple-choice arithmetic ------------------------------------------------------------------------
def test_choice_columns_acc_and_acc_norm():
    cols = choice_columns([-4.0, -3.0, -5.0], ["aa", "b", "ccccc"], answer=0)
    assert cols["choice_logprobs_norm"] == [-2.0, -3.0, -1.0]
    assert (cols["pred"], cols["pred_norm"]) == (1, 2)  # the length normalisation changes the prediction
    assert (cols["correct"], cols["correct_norm"], cols["answer"]) == (False, False, 0)
    cols = choice_columns([-2.0, -2.0], ["x", "y"], answer=0)  # ties go to the first choice (numpy.argmax)
    assert cols["pred"] == cols["pred_norm"] == 0 and cols["correct"] and cols["correct_norm"]


def test_mean_stderr_is_lm_evals():
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    mean, err = mean_stderr(values)
    assert mean == pytest.approx(np.mean(values))
    assert err == pytest.approx(np.std(values, ddof=1) / math.sqrt(len(values)))
    assert math.isnan(mean_stderr([1.0])[1]) and math.isnan(mean_stderr([])[0])


# ---- the real default model against transformers -------------------------------------------------------
@pytest.fixture(scope="module")
def engine() -> Engine:
    return load_native_engine("smollm2-135m", EngineConfig(device="cpu", dtype="float32", max_batch_tokens=2048,
                                                           num_kv_blocks=256))


def run_score(engine, records: list[Record], k: int = 0) -> tuple[list[dict], ScoreJob]:
    """Rows of `records` through the score job, every request of every record in one engine run."""
    job = ScoreJob(engine.tokenizer, engine.info.max_model_len, ScoreOptions(prompt_logprobs=k))
    requests, counts, plans = [], [], []
    for record in records:
        reqs, plan = job.requests(record)
        counts.append(len(reqs))
        plans.append(plan)
        for j, req in enumerate(reqs):
            req.request_id = (record.index, j)
            requests.append(req)
    outputs = {}
    for out in engine.run(requests):
        assert out.error is None, out.error
        outputs[out.request_id] = out
    rows = [job.row(p, [outputs[(p.record.index, j)] for j in range(n)]) for p, n in zip(plans, counts)]
    for row in rows:
        job.observe(row)
    return rows, job


def reference(hf, context_ids: list[int], cont_ids: list[int]) -> tuple[float, bool]:
    """lm-eval's loglikelihood of a continuation on transformers: (sum of logprobs, is greedy)."""
    ids = context_ids + cont_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0].float(), -1)[-len(cont_ids):]  # [C, V]
    target = torch.tensor(cont_ids)
    return float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())


def greedy_continuation(hf, tok, context: str, n: int) -> str:
    """A continuation string that is the model's own greedy choice for `n` tokens after `context`."""
    ids = enc(tok, context)
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, len(ids):].tolist()
    text = tok.decode(new)
    assert encode_pair(tok, context, text, 1) == (ids, new), "the greedy tokens do not survive decode + encode"
    return text


def test_continuations_and_choices_equal_transformers(engine, hf_default_model, default_tokenizer):
    tok, hf = default_tokenizer, hf_default_model
    greedy = greedy_continuation(hf, tok, "The capital of France is", 3)
    continuations = [
        ("The capital of France is", greedy),  # built to be greedy
        ("The capital of France is", " a banana"),  # built not to be
        ("Water boils at 100 degrees ", "Celsius at sea level."),  # trailing space moves over
        ("", "Once upon a time"),  # empty context: the BOS token
    ]
    questions = [
        ("Question: What color is the sky on a clear day?\nAnswer:", [" blue", " green", " red"], 0),
        ("Question: How many legs does a spider have?\nAnswer: ", ["six", "eight", "ten", "four"], 1),
    ]
    records = [Record(i, i + 1, str(i), "continuation", {"context": c, "continuation": x})
               for i, (c, x) in enumerate(continuations)]
    records += [Record(len(records) + i, 0, f"q{i}", "choices", {"context": c, "choices": ch, "answer": a})
                for i, (c, ch, a) in enumerate(questions)]
    records.append(Record(len(records), 0, "p", "prompt", {"prompt": "Plain prompts still score as before."}))
    rows, job = run_score(engine, records, k=2)

    for (context, cont), row in zip(continuations, rows):
        ctx_ids, cont_ids = encode_pair(tok, context, cont, tok.bos_token_id)
        ref_lp, ref_greedy = reference(hf, ctx_ids, cont_ids)
        assert row["continuation_num_tokens"] == row["num_scored"] == len(cont_ids)
        assert row["num_tokens"] == len(ctx_ids) + len(cont_ids) and row["token_ids"] == ctx_ids + cont_ids
        assert abs(row["continuation_logprob"] - ref_lp) < 1e-3, (context, cont)
        assert row["sum_logprob"] == row["continuation_logprob"]
        assert row["is_greedy"] == ref_greedy
        assert row["token_logprobs"][:len(ctx_ids)] == [None] * len(ctx_ids)
        assert row.get("choice_logprobs") is None and row.get("pred") is None  # a missing key is written as null
    assert rows[0]["is_greedy"] is True and rows[1]["is_greedy"] is False
    assert rows[0]["continuation_num_tokens"] == 3

    for (context, choices, answer), row in zip(questions, rows[len(continuations):]):
        refs = [reference(hf, *encode_pair(tok, context, c, tok.bos_token_id))[0] for c in choices]
        assert np.abs(np.array(row["choice_logprobs"]) - refs).max() < 1e-3
        norm = np.array(refs) / [len(c) for c in choices]
        assert row["pred"] == int(np.argmax(refs)) and row["pred_norm"] == int(np.argmax(norm))
        assert row["correct"] == (row["pred"] == answer) and row["answer"] == answer
        assert row.get("sum_logprob") is None and row.get("token_ids") is None
        assert row.get("continuation_logprob") is None
    assert rows[-1].get("continuation_logprob") is None and rows[-1]["num_scored"] == rows[-1]["num_tokens"] - 1

    summary = dict(job.summary())
    correct = [float(r["correct"]) for r in rows[len(continuations):-1]]
    mean, err = mean_stderr(correct)
    assert summary["accuracy"] == f"{mean:.4f} ± {err:.4f} (2 questions)"
    assert summary["continuations"].startswith("4 (") and summary["scored tokens"] == str(rows[-1]["num_scored"])


# ---- the command line (tiny random model: the plumbing, not the numbers) --------------------------------
SCORE_COLUMN_TYPES = {
    "continuation_logprob": pa.float64(), "continuation_num_tokens": pa.int64(), "is_greedy": pa.bool_(),
    "choice_logprobs": pa.list_(pa.float64()), "choice_logprobs_norm": pa.list_(pa.float64()),
    "pred": pa.int64(), "pred_norm": pa.int64(), "correct": pa.bool_(), "correct_norm": pa.bool_(),
    "answer": pa.int64(),
}


def test_score_command_mixes_record_kinds_in_one_schema(tmp_path, write_jsonl, tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    records = [
        {"id": "p", "prompt": "A plain prompt."},
        {"id": "c", "context": "The sky is", "continuation": " blue"},
        {"id": "m", "context": "Pick one:", "choices": [" yes", " no", " maybe"], "answer": 2},
        {"id": "bad", "context": "Pick one:", "choices": [" yes", " no"], "answer": 2},
        {"id": "neither", "context": "Only a context"},
    ]
    data = write_jsonl(tmp_path / "mixed.jsonl", records)
    out = tmp_path / "scores.parquet"
    args = ["score", str(data), "--model", model, "--out", str(out), "--device", "cpu"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output  # validation names file and line, and nothing runs
    assert f"{data}:4:" in res.output and "'answer' 2 is not an index into the 2 choices" in res.output
    assert f"{data}:5:" in res.output and not out.exists()

    res = CliRunner().invoke(app, args + ["--skip-invalid"])
    assert res.exit_code == 0, res.output
    table = pq.read_table(out)
    for name, typ in SCORE_COLUMN_TYPES.items():
        assert table.schema.field(name).type == typ, name
    rows = {r["id"]: r for r in table.to_pylist()}
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "ok", "error", "error"]
    assert rows["p"]["continuation_logprob"] is None and rows["p"]["pred"] is None
    c = rows["c"]
    assert c["continuation_num_tokens"] == 1 and isinstance(c["is_greedy"], bool)
    assert math.isclose(c["continuation_logprob"], c["token_logprobs"][-1], abs_tol=1e-6)
    m = rows["m"]
    assert len(m["choice_logprobs"]) == 3 and m["answer"] == 2 and m["correct"] == (m["pred"] == 2)
    assert m["choice_logprobs_norm"] == pytest.approx([lp / len(ch) for lp, ch in
                                                      zip(m["choice_logprobs"], [" yes", " no", " maybe"])])
    assert "accuracy" in res.output and "acc_norm" in res.output and "(1 question)" in res.output


# ---- is_greedy with tied logits: lm-eval's argmax (the first of the tied maxima) ---------------------------
def test_is_greedy_with_tied_logits_is_lm_evals_argmax(tiny_model_dir, default_tokenizer):
    """All logits tied (a zero vocabulary projection): every token has rank 1, but lm-eval's
    `logits.argmax(-1) == tokens` holds for token 0 only, the first maximum."""
    engine = load_native_engine(str(tiny_model_dir("llama")), EngineConfig(device="cpu", dtype="float32",
                                                                           num_kv_blocks=64, block_size=4))
    with torch.no_grad():
        engine.model.lm_head_weight.zero_()
    tok = default_tokenizer
    context = "The capital of France is"
    cont = enc(tok, context + " Paris")[len(enc(tok, context)):]
    assert min(cont) > 0
    records = [Record(0, 1, "paris", "continuation", {"context": context, "continuation": " Paris"})]
    for k in (0, 2):
        rows, _ = run_score(engine, records, k=k)
        row = rows[0]
        assert row["token_ranks"][-len(cont):] == [1] * len(cont)  # tied with the maximum: rank 1
        assert row["is_greedy"] is False  # but not the argmax
        assert all(len(t) == k for t in row["top_ids"][-len(cont):])  # top-K as asked (0: none)
    # a continuation of token 0 (the first of the tied maxima) is greedy
    outs = list(engine.run([Request("zero", [5, 0, 0], prompt_logprobs=1, score_from=1),
                            Request("nine", [5, 0, 9], prompt_logprobs=1, score_from=1)]))
    got = {o.request_id: continuation_score(o).is_greedy for o in outs}
    assert got == {"zero": True, "nine": False}
