"""OpenAI Batch files in and out (issue 27 items 1-2): request lines -> records -> result lines.

The batch file is written from the OpenAI Batch API documentation's examples (a chat line with a system
prompt, a completions line, an echo scoring line) plus lines that must be refused. The end-to-end runs use the
default model and check every result line against parquet results of the same prompts written as our own
records, field by field; the bodies are parsed with the `openai` package's response models."""

from __future__ import annotations

import json
from dataclasses import asdict

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.errors import ApcscoreError
from apcscore.io.openai_batch import to_record
from apcscore.io.openai_batch_output import LineWriter
from apcscore.io.reader import load_dataset
from apcscore.io.writer import ResultsWriter

runner = CliRunner()

SYSTEM = "You are a helpful assistant."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello world!"}]
PROMPT = "The capital of France is"
SCORED = "The capital of France is Paris."


def line(cid: str, url: str, body: dict) -> dict:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def batch_lines() -> list[dict]:
    chat, comp = "/v1/chat/completions", "/v1/completions"
    return [
        line("request-1", chat, {"model": "smollm2-135m", "messages": CHAT, "max_tokens": 8}),
        line("request-2", chat, {"model": "smollm2-135m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is 2+2?"}]}], "max_completion_tokens": 6, "logprobs": True,
            "top_logprobs": 2, "user": "u1", "stream": False, "frequency_penalty": 0}),
        line("request-3", comp, {"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 5, "logprobs": 3,
                                   "prompt_logprobs": 1}),
        line("score-1", comp, {"model": "smollm2-135m", "prompt": SCORED, "max_tokens": 0, "echo": True,
                               "logprobs": 2}),
        line("bad-1", chat, {"model": "smollm2-135m", "messages": CHAT, "presence_penalty": 0.5}),
        line("request-1", comp, {"model": "smollm2-135m", "prompt": "duplicate", "max_tokens": 2}),
    ]


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def convert(body: dict, url: str = "/v1/completions", command: str = "generate", names=frozenset({"m"})):
    return to_record(line("c", url, body), command, max_logprobs=20, model_names=names)


# ---------------------------------------------------------------- request lines -> records (no model)

def test_body_fields_map_onto_records_and_unsupported_ones_are_refused() -> None:
    ok = convert({"model": "m", "prompt": "Hi", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                  "seed": 7, "stop": ["\n"], "n": 1, "logprobs": 2, "metadata": {"a": "b"}})
    assert not ok.problems and ok.record == {"prompt": "Hi", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9,
                                             "top_k": 4, "seed": 7, "stop": ["\n"]}
    assert ok.line.logprobs == 2 and ok.line.prompt_logprobs is None and ok.line.endpoint == "completions"
    chat = convert({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4, "logprobs": True,
                    "top_logprobs": 3, "prompt_logprobs": 1}, url="/v1/chat/completions")
    assert not chat.problems and chat.record["max_tokens"] == 4 and chat.line.logprobs == 3
    assert chat.line.prompt_logprobs == 1 and chat.line.vllm_prompt_logprobs
    assert convert({"prompt": [1, 2, 3]}).record == {"prompt_token_ids": [1, 2, 3]}
    assert convert({"prompt": ["one"]}).record == {"prompt": "one"}
    refused = {
        "frequency_penalty": ({"prompt": "x", "frequency_penalty": 0.1}, "would change the result"),
        "n": ({"prompt": "x", "n": 2}, "'n' = 2 would change the result"),
        "logit_bias": ({"prompt": "x", "logit_bias": {"1": 5}}, "'logit_bias'"),
        "tools": ({"prompt": "x", "tools": [{"type": "function"}]}, "'tools'"),
        "best_of": ({"prompt": "x", "best_of": 3}, "'best_of'"),
        "suffix": ({"prompt": "x", "suffix": "end"}, "'suffix'"),
        "unknown": ({"prompt": "x", "mirostat": 1}, "body field 'mirostat' is not supported"),
        "prompts": ({"prompt": ["a", "b"]}, "holds 2 prompts"),
        "model": ({"prompt": "x", "model": "gpt-4o"}, "the body's model 'gpt-4o' is not this run's model"),
        "cap": ({"prompt": "x", "logprobs": 21}, "above the cap max_logprobs = 20"),
        "stream": ({"prompt": "x", "stream": True}, "'stream' = true: a batch answers each request whole"),
    }
    for name, (body, message) in refused.items():
        problems = convert(body).problems
        assert any(message in p for p in problems), (name, problems)
    top_only = convert({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2},
                       url="/v1/chat/completions")
    assert any("needs 'logprobs': true" in p for p in top_only.problems)
    assert not convert({"prompt": "x", "model": "gpt-4o"}, names=None).problems  # --ignore-body-model
    assert convert({"max_tokens": 3}, url="/v1/chat/completions").problems == [
        "a chat request needs 'messages' (a list of {\"role\", \"content\"} objects)"]
    assert convert({"max_tokens": 3}).record is None
    named = convert({"messages": [{"role": "user", "content": "Hi", "name": "ann", "tool_calls": None}]},
                    url="/v1/chat/completions")
    assert named.problems == ["'messages' item 0 has 'name', which apcscore does not give the chat template (it "
                              "reads role and content) — remove it"]
    assert to_record([1, 2], "generate", max_logprobs=20, model_names=None).problems == [
        "the line is a list, not a JSON object (a request line is {'custom_id', 'method', 'url', 'body'})"]
    assert any("'url' \"/v1/embeddings\" is not an endpoint" in p
               for p in to_record(line("c", "/v1/embeddings", {}), "generate", max_logprobs=20,
                                  model_names=None).problems)
    generating = convert({"prompt": "x", "max_tokens": 3}, command="score")
    assert any("score answers only scoring requests" in p for p in generating.problems)
    scoring = convert({"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 4}, command="score")
    assert not scoring.problems and scoring.record == {"prompt": "x"} and scoring.line.prompt_logprobs == 4


def test_the_reader_detects_request_lines_and_names_file_and_line(tmp_path, write_jsonl) -> None:
    data = write_jsonl(tmp_path / "b.jsonl", batch_lines())
    with pytest.raises(ApcscoreError) as refused:
        load_dataset(data, "generate", model_names=frozenset({"smollm2-135m"}))
    text = str(refused.value)
    assert "2 of 6 records are invalid" in text
    assert "b.jsonl:5: body field 'presence_penalty' = 0.5 would change the result" in text
    assert "b.jsonl:6: duplicate custom_id 'request-1': line 1 has the same custom_id" in text
    loaded = load_dataset(data, "generate", skip_invalid=True, model_names=frozenset({"smollm2-135m"}))
    assert loaded.format == "openai-batch" and [r.id for r in loaded.records] == ["request-1", "request-2",
                                                                                  "request-3", "score-1"]
    assert [r.kind for r in loaded.records] == ["messages", "messages", "prompt", "prompt"]
    assert loaded.records[1].fields["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert [(r.index, r.id) for r in loaded.invalid] == [(4, "bad-1"), (5, "request-1")]
    # our own records are not request lines; --input-format openai-batch says so per line
    ours = write_jsonl(tmp_path / "o.jsonl", [{"prompt": "Hi"}])
    assert load_dataset(ours, "generate").format == "apcscore"
    with pytest.raises(ApcscoreError, match=r"o.jsonl:1: 'custom_id' must be a non-empty string"):
        load_dataset(ours, "generate", input_format="openai-batch")
    # a line without a custom_id is refused for that alone, though its stand-in id (its line number, 2) is one a
    # request gave: the user never wrote that custom_id twice
    first = batch_lines()[0]
    no_id = write_jsonl(tmp_path / "n.jsonl", [{**first, "custom_id": "2"}, {k: v for k, v in first.items()
                                                                              if k != "custom_id"}])
    with pytest.raises(ApcscoreError) as refused:
        load_dataset(no_id, "generate", model_names=frozenset({"smollm2-135m"}))
    assert "n.jsonl:2: 'custom_id' must be a non-empty string, got null" in str(refused.value)
    assert "duplicate" not in str(refused.value)


def test_an_invalid_lines_stand_in_id_never_takes_a_valid_custom_id(tmp_path, write_jsonl) -> None:
    """Issue 46, item 3: line 2's `"custom_id": ""` made its error row "2", and line 3's valid custom_id "2" then
    shared it: under --skip-invalid line 3 never ran and compare refused the file for duplicate ids."""
    first = batch_lines()[0]
    data = write_jsonl(tmp_path / "b.jsonl", [{**first, "custom_id": "a"}, {**first, "custom_id": ""},
                                              {**first, "custom_id": "2"}])
    loaded = load_dataset(data, "generate", skip_invalid=True, model_names=frozenset({"smollm2-135m"}))
    assert [(r.line, r.id) for r in loaded.records] == [(1, "a"), (3, "2")]
    assert [(r.line, r.id) for r in loaded.invalid] == [(2, "#line2")]
    assert "b.jsonl:2: 'custom_id' must be a non-empty string" in loaded.invalid[0].message


def test_an_empty_prompt_or_messages_list_is_called_empty(tmp_path, write_jsonl) -> None:
    """Issue 46, item 13: `"prompt": []` and `"messages": []` were refused as "got a list"."""
    data = write_jsonl(tmp_path / "b.jsonl", [line("p", "/v1/completions", {"prompt": []}),
                                              line("m", "/v1/chat/completions", {"messages": []})])
    loaded = load_dataset(data, "generate", skip_invalid=True)
    prompt, messages = (r.message for r in loaded.invalid)
    assert "b.jsonl:1: 'prompt' must be a string or a list of token ids, got an empty list" in prompt
    assert "b.jsonl:2: 'messages' must be a non-empty list" in messages and "got an empty list" in messages


def test_a_resumed_partial_is_written_as_result_lines_atomically(tmp_path, write_jsonl) -> None:
    """The writer's partial is the parquet one, so --resume works for result lines too; <out> appears only
    complete (written under a temporary name inside the partial, then renamed)."""
    from apcscore.jobs.generate import GenerateJob
    from apcscore.options.commands import GenerateOptions

    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    data = load_dataset(write_jsonl(tmp_path / "b.jsonl", [line(f"c{i}", "/v1/completions", {"prompt": f"p{i}"})
                                                           for i in range(3)]), "generate")
    schema = GenerateJob(None, 100, GenerateOptions()).output_schema()
    out = tmp_path / "out.jsonl"

    def row(i):
        return {"id": f"c{i}", "status": "ok", "error": None, "completion": f"t{i}", "completion_token_ids": [i],
                "finish_reason": "length", "num_prompt_tokens": 2, "num_cached_tokens": 0}

    first = ResultsWriter(out, schema, {"m": 1}, num_rows=3)
    first.add(2, row(2))
    first.flush()  # an interrupt: the finished row is on disk, <out> does not exist
    first.release()  # that run ended: its lock on the partial went with it
    assert not out.exists() and first.partial_path.is_dir()
    second = ResultsWriter(out, schema, {"m": 1}, num_rows=3, resume=True)
    assert second.done_indices == {2}
    for i in (1, 0):
        second.add(i, row(i))
    second.lines = LineWriter(Tok(), "m", 0, {r.index: r.fields for r in data.records}, set()).line
    second.close()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["c0", "c1", "c2"]
    assert [x["response"]["body"]["choices"][0]["text"] for x in lines] == ["t0", "t1", "t2"]
    assert not second.partial_path.exists()


def test_refusals_before_the_model_loads(tmp_path, write_jsonl) -> None:
    batch = write_jsonl(tmp_path / "b.jsonl", batch_lines()[:4])
    ours = write_jsonl(tmp_path / "o.jsonl", [{"prompt": "Hi"}])
    other = write_jsonl(tmp_path / "m.jsonl", [line("a", "/v1/completions", {"model": "gpt-4o", "prompt": "Hi"})])
    cases = [
        (("generate", other, "--out", tmp_path / "x.jsonl"), "m.jsonl:1: the body's model 'gpt-4o' is not this "
         "run's model (HuggingFaceTB/SmolLM2-135M-Instruct / SmolLM2-135M-Instruct / smollm2-135m)"),
        (("generate", other, "--ignore-body-model", "--logprobs", 1), "--logprobs does not apply"),  # model passed
        (("generate", ours, "--out", tmp_path / "x.jsonl"), "--output-format openai-batch writes the result lines"),
        (("generate", batch, "--out", tmp_path / "x.jsonl", "--shard", "0/2"), "--shard writes shard files"),
        (("generate", batch, "--logprobs", 2), "--logprobs does not apply to OpenAI Batch request lines"),
        (("generate", batch, "--output-format", "csv"), "--output-format must be one of parquet, openai-batch"),
        (("score", batch, "--input-format", "x"), "--input-format must be one of auto, apcscore, openai-batch"),
        (("generate", batch, "--model", "smollm2-135m", "--out", tmp_path / "y.jsonl", "--max-logprobs", 1),
         "b.jsonl:2: 'top_logprobs' 2 is above the cap max_logprobs = 1"),
    ]
    for args, message in cases:
        res = run(*args)
        assert res.exit_code == 2, (args, res.output)
        assert message in " ".join(res.output.split()), (args, res.output)
        assert not (tmp_path / "x.jsonl").exists() and not (tmp_path / "y.jsonl").exists()


# ---------------------------------------------------------------- end to end with the default model

def ours_of(lines: list[dict]) -> list[dict]:
    """The same prompts as our own generate records."""
    records = [{"id": "request-1", "messages": CHAT, "max_tokens": 8},
               {"id": "request-2", "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 6},
               {"id": "request-3", "prompt": PROMPT, "max_tokens": 5},
               {"id": "score-1", "prompt": SCORED, "max_tokens": 0}]
    return records


@pytest.fixture(scope="module")
def runs(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("openai_batch")
    batch = tmp / "batch.jsonl"
    batch.write_text("".join(json.dumps(x) + "\n" for x in batch_lines()), encoding="utf-8")
    ours = tmp / "ours.jsonl"
    ours.write_text("".join(json.dumps(x) + "\n" for x in ours_of(batch_lines())), encoding="utf-8")
    out = {"lines": tmp / "out.jsonl", "parquet": tmp / "ours.parquet", "score": tmp / "score.jsonl",
           "score_parquet": tmp / "score.parquet"}
    res = run("generate", batch, "--skip-invalid", "--out", out["lines"], "-q")
    assert res.exit_code == 0, res.output
    res = run("generate", ours, "--logprobs", 3, "--prompt-logprobs", 2, "--out", out["parquet"], "-q")
    assert res.exit_code == 0, res.output
    res = run("score", batch, "--skip-invalid", "--out", out["score"], "-q")
    assert res.exit_code == 0, res.output
    res = run("score", batch, "--skip-invalid", "--out", out["score_parquet"], "-q")
    assert res.exit_code == 0, res.output
    read = lambda p: [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines()]  # noqa: E731
    return {"lines": read(out["lines"]), "score": read(out["score"]),
            "parquet": {r["id"]: r for r in pq.read_table(out["parquet"]).to_pylist()},
            "score_parquet": pq.read_table(out["score_parquet"]).to_pylist()}


@pytest.mark.slow
def test_result_lines_are_in_input_order_with_error_lines(runs) -> None:
    lines = runs["lines"]
    assert [x["custom_id"] for x in lines] == [x["custom_id"] for x in batch_lines()]
    for x in lines:
        assert set(x) == {"id", "custom_id", "response", "error"} and x["id"].startswith("batch_req_")
    ok, errors = lines[:4], lines[4:]
    for x in ok:
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert x["response"]["request_id"].startswith("req_")
    for x in errors:
        assert x["response"] is None and set(x["error"]) == {"code", "message"}
        assert x["error"]["code"] == "invalid_request_error"
    assert "batch.jsonl:5: body field 'presence_penalty' = 0.5" in errors[0]["error"]["message"]
    assert "batch.jsonl:6: duplicate custom_id 'request-1'" in errors[1]["error"]["message"]
    # a line's ids are its own, even where a custom_id repeats (line 6 repeats line 1's), and another run of
    # the file (score's) gives the same ones
    assert len({x["id"] for x in lines}) == len(lines)
    assert [x["id"] for x in lines] == [x["id"] for x in runs["score"]]


@pytest.mark.slow
def test_result_lines_equal_the_parquet_results_of_the_same_prompts(runs) -> None:
    lines, ref = {x["custom_id"]: x for x in runs["lines"][:4]}, runs["parquet"]
    for cid, x in lines.items():
        body, row = x["response"]["body"], ref[cid]
        choice = body["choices"][0]
        assert body["model"] == "smollm2-135m" and body["created"] > 0
        assert choice["finish_reason"] == row["finish_reason"]
        n_completion = len(row["completion_token_ids"])
        assert body["usage"] == {"prompt_tokens": row["num_prompt_tokens"], "completion_tokens": n_completion,
                                 "total_tokens": row["num_prompt_tokens"] + n_completion,
                                 "prompt_tokens_details": {"cached_tokens": row["num_cached_tokens"]}}
        if body["object"] == "chat.completion":
            assert body["id"].startswith("chatcmpl-") and choice["message"] == {
                "role": "assistant", "content": row["completion"], "refusal": None}
        else:
            assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert lines["request-1"]["response"]["body"]["choices"][0]["logprobs"] is None
    # chat logprobs: one entry per generated token, top_logprobs = the body's 2 of the parquet's 3
    content = lines["request-2"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    row = ref["request-2"]
    assert [c["logprob"] for c in content] == pytest.approx(row["completion_logprobs"], abs=0)
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in content] == [t[:2] for t in
                                                                            row["completion_top_logprobs"]]
    assert all(bytes(c["bytes"]).decode() == c["token"] for c in content)
    assert "".join(c["token"] for c in content) == row["completion"]
    # completions logprobs: the legacy object
    lp = lines["request-3"]["response"]["body"]["choices"][0]["logprobs"]
    row = ref["request-3"]
    assert lp["token_logprobs"] == row["completion_logprobs"] and "".join(lp["tokens"]) == row["completion"]
    assert lp["text_offset"][0] == 0 and all(len(top) in (3, 4) for top in lp["top_logprobs"])
    # vLLM's prompt_logprobs on the choice: per prompt token {id: {logprob, rank, decoded_token}}, the first null
    plp = lines["request-3"]["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(row["token_ids"])
    for pos in range(1, len(plp)):
        own = plp[pos][str(row["token_ids"][pos])]
        assert own["logprob"] == row["token_logprobs"][pos] and own["rank"] == row["token_ranks"][pos]
        assert plp[pos][str(row["top_ids"][pos][0])]["logprob"] == row["top_logprobs"][pos][0]
    assert "prompt_logprobs" not in lines["request-1"]["response"]["body"]["choices"][0]
    # the echo scoring line: the prompt's own logprobs, first null, as the parquet's prompt columns
    score = lines["score-1"]["response"]["body"]["choices"][0]
    row = ref["score-1"]
    assert score["text"] == SCORED and score["finish_reason"] == "length"
    assert score["logprobs"]["token_logprobs"] == row["token_logprobs"]
    assert score["logprobs"]["token_logprobs"][0] is None and score["logprobs"]["top_logprobs"][0] is None
    assert [sorted(t.values(), reverse=True)[:2] for t in score["logprobs"]["top_logprobs"][1:]] == \
        [t[:2] for t in row["top_logprobs"][1:]]


@pytest.mark.slow
def test_score_answers_the_echo_line_as_generate_does(runs) -> None:
    score = runs["score"]
    assert [x["custom_id"] for x in score] == [x["custom_id"] for x in batch_lines()]
    assert [x["error"] is None for x in score] == [False, False, False, True, False, False]
    assert "score answers only scoring requests" in score[0]["error"]["message"]
    ours, theirs = score[3]["response"]["body"], runs["lines"][3]["response"]["body"]
    assert ours["choices"][0]["logprobs"] == theirs["choices"][0]["logprobs"]
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    row = runs["score_parquet"][3]  # the same run written as parquet (the default)
    assert row["id"] == "score-1" and row["token_logprobs"] == ours["choices"][0]["logprobs"]["token_logprobs"]
    assert ours["usage"]["prompt_tokens"] == row["num_tokens"] and ours["usage"]["completion_tokens"] == 0


@pytest.mark.slow
def test_every_body_parses_as_the_openai_response_models(runs) -> None:
    openai = pytest.importorskip("openai")
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    for x in runs["lines"] + runs["score"]:
        if x["response"] is None:
            continue
        body = json.loads(json.dumps(x["response"]["body"]))
        if body["object"] == "chat.completion":
            assert ChatCompletion.model_validate(body).choices[0].message.role == "assistant"
            continue
        lp = body["choices"][0]["logprobs"]
        if lp is not None and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            # the API (and vLLM) send null for the first echoed token, which the SDK's types declare as float:
            # check that position here and the rest through the model
            assert lp["top_logprobs"][0] is None
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[key] = lp[key][1:]
        parsed = Completion.model_validate(body)
        assert parsed.object == "text_completion" and parsed.usage.total_tokens >= parsed.usage.prompt_tokens
    assert openai.__version__


@pytest.mark.slow
def test_sigint_then_resume_writes_the_lines_of_an_uninterrupted_run(tmp_path, write_jsonl, tiny_model_dir) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    data = write_jsonl(tmp_path / "b.jsonl", [
        line(f"s{i}", "/v1/completions", {"prompt": " ".join(words[j % 12] for j in range(i % 37 + 3)),
                                          "max_tokens": 0, "echo": True, "logprobs": 2}) for i in range(400)])
    common = ["score", data, "--model", tiny_model_dir("llama"), "--quiet"]

    def apcscore(*args):
        return subprocess.Popen([sys.executable, "-m", "apcscore", *map(str, args)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))

    out = tmp_path / "interrupted.jsonl"
    partial = tmp_path / "interrupted.jsonl.partial"
    proc = apcscore(*common, "--max-num-seqs", 1, "--max-batch-tokens", 16, "--out", out)
    deadline = time.time() + 120
    while not (partial / "run.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert not out.exists() and partial.is_dir() and any(partial.glob("part-*.parquet"))
    proc = apcscore(*common, "--out", out, "--resume")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    ref = tmp_path / "uninterrupted.jsonl"
    proc = apcscore(*common, "--out", ref)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output

    def lines(path):
        found = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]
        for x in found:
            x["response"]["body"].pop("created")  # the run's start: the sessions started at other times
        return found
    resumed, reference = lines(out), lines(ref)
    assert [x["custom_id"] for x in resumed] == [f"s{i}" for i in range(400)]
    assert resumed == reference and not partial.exists()


# ---------------------------------------------------------------- issue 42: fidelity against OpenAI and vLLM

class Tok:
    """A tokenizer stand-in: token i reads as the letter chr(97 + i % 26)."""

    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def result_line(body: dict, row: dict, url: str = "/v1/completions", command: str = "generate") -> dict:
    """The result line LineWriter writes for `row`, the row of the request `body`."""
    converted = convert(body, url=url, command=command)
    assert not converted.problems, converted.problems
    fields = {**converted.record, "openai": asdict(converted.line)}
    return json.loads(LineWriter(Tok(), "m", 0, {0: fields}, set()).line(0, {"id": "c", **row}))


def test_non_finite_logprobs_are_written_as_vllms_finite_stand_in() -> None:
    """Issue 42 item 12: a NaN or ±inf logprob crashed the final write (strict JSON), on every --resume too."""
    nan, inf = float("nan"), float("inf")
    row = {"status": "ok", "completion": "bc", "completion_token_ids": [1, 2], "finish_reason": "length",
           "num_prompt_tokens": 2, "token_ids": [0, 1], "token_logprobs": [None, -inf], "token_ranks": [None, 9],
           "top_ids": [None, [3]], "top_logprobs": [None, [nan]], "completion_logprobs": [nan, -inf],
           "completion_top_ids": [[1], [2]], "completion_top_logprobs": [[inf], [-inf]]}
    x = result_line({"prompt": "ab", "echo": True, "logprobs": 1, "max_tokens": 2}, row)
    lp = x["response"]["body"]["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [None, -9999.0, -9999.0, -9999.0]
    assert lp["top_logprobs"][1:] == [{"d": -9999.0, "b": -9999.0}, {"b": -9999.0}, {"c": -9999.0}]
    chat = result_line({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 1},
                       row, url="/v1/chat/completions")
    content = chat["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-9999.0, -9999.0]
    assert [c["top_logprobs"][0]["logprob"] for c in content] == [-9999.0, -9999.0]


def test_a_line_without_custom_id_claims_no_id_and_its_result_line_has_none(tmp_path, write_jsonl) -> None:
    """Issue 42 item 13: a line without a custom_id claimed its line number, so a later line whose custom_id is
    that number was refused as a duplicate, and both error lines carried it."""
    first = line("x", "/v1/completions", {"prompt": "Hi"})
    anonymous = {k: v for k, v in first.items() if k != "custom_id"}
    data = write_jsonl(tmp_path / "b.jsonl", [anonymous, {**first, "custom_id": "1"}, "{not json",
                                              {**first, "custom_id": "3"}])
    loaded = load_dataset(data, "generate", skip_invalid=True, input_format="openai-batch")
    assert [r.id for r in loaded.records] == ["1", "3"]
    assert [(r.index, r.line) for r in loaded.invalid] == [(0, 1), (2, 3)]
    assert "duplicate" not in " ".join(r.message for r in loaded.invalid)
    assert loaded.no_custom_id == {0, 2}
    # a first line that does not parse claims nothing either, once the next line shows the file is request lines
    unparsed = write_jsonl(tmp_path / "u.jsonl", ["{not json", {**first, "custom_id": "1"}])
    loaded = load_dataset(unparsed, "generate", skip_invalid=True)
    assert [r.id for r in loaded.records] == ["1"] and loaded.no_custom_id == {0}
    writer = LineWriter(Tok(), "m", 0, {1: {**loaded.records[0].fields}}, {0}, loaded.no_custom_id)
    error = json.loads(writer.line(0, {"id": "1", "status": "error", "error": "u.jsonl:1: bad"}))
    assert error["custom_id"] is None and error["error"]["code"] == "invalid_request_error"


def test_text_parts_of_a_message_are_joined_with_a_newline_as_vllm_joins_them() -> None:
    """Issue 42 item 14: the parts were joined with "" (vLLM: "\\n")."""
    parts = [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]
    chat = convert({"messages": [{"role": "user", "content": parts}]}, url="/v1/chat/completions")
    assert not chat.problems and chat.record["messages"] == [{"role": "user", "content": "First part.\nSecond part."}]


def scored_row(n_completion: int = 1) -> dict:
    """A generate row of prompt [0, 1, 2] with prompt and completion logprobs (top-3 everywhere)."""
    top = [[5, 6, 7], [-0.5, -1.5, -2.5]]
    return {"status": "ok", "completion": "d" * n_completion, "completion_token_ids": [3] * n_completion,
            "finish_reason": "length", "num_prompt_tokens": 3, "token_ids": [0, 1, 2],
            "token_logprobs": [None, -1.0, -2.0], "token_ranks": [None, 2, 4], "top_ids": [None, top[0], top[0]],
            "top_logprobs": [None, top[1], top[1]], "completion_logprobs": [-0.25] * n_completion,
            "completion_top_ids": [top[0]] * n_completion, "completion_top_logprobs": [top[1]] * n_completion}


def test_vllm_prompt_logprobs_go_where_vllm_writes_them() -> None:
    """Issue 42 item 15: a chat response's prompt_logprobs went on the choice (vLLM: on the response), and a
    completions body with only prompt_logprobs got an empty logprobs object instead of null."""
    chat = result_line({"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1}, scored_row(),
                       url="/v1/chat/completions")["response"]["body"]
    assert "prompt_logprobs" not in chat["choices"][0] and chat["choices"][0]["logprobs"] is None
    assert chat["prompt_logprobs"][0] is None and set(chat["prompt_logprobs"][1]) == {"5", "1"}
    comp = result_line({"prompt": "abc", "prompt_logprobs": 1}, scored_row())["response"]["body"]
    assert "prompt_logprobs" not in comp and comp["choices"][0]["logprobs"] is None
    assert comp["choices"][0]["prompt_logprobs"][2] == {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "f"},
                                                        "2": {"logprob": -2.0, "rank": 4, "decoded_token": "c"}}
    echo_only = result_line({"prompt": "abc", "echo": True, "prompt_logprobs": 1}, scored_row())
    assert echo_only["response"]["body"]["choices"][0]["logprobs"] is None


def test_top_k_minus_one_and_the_developer_role_are_read_not_refused(tmp_path, write_jsonl) -> None:
    """Issue 42 item 16: `top_k: -1` (the API's "off") and a `developer` message were refused per line."""
    data = write_jsonl(tmp_path / "b.jsonl", [
        line("a", "/v1/completions", {"prompt": "Hi", "top_k": -1}),
        line("b", "/v1/chat/completions", {"messages": [{"role": "developer", "content": "Be brief."},
                                                        {"role": "user", "content": "Hi"}], "top_k": 3}),
        line("c", "/v1/completions", {"prompt": "Hi", "top_k": -2})])
    loaded = load_dataset(data, "generate", skip_invalid=True)
    assert [r.id for r in loaded.records] == ["a", "b"]
    assert loaded.records[0].fields["top_k"] == 0  # off, whatever --top-k says
    assert loaded.records[1].fields["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "'top_k' must be an integer >= 0, got -2" in loaded.invalid[0].message


def test_echoed_tokens_top_logprobs_follow_the_bodys_logprobs() -> None:
    """Issue 42 item 17: echoed tokens' top_logprobs used max(prompt_logprobs, logprobs), not `logprobs`."""
    body = result_line({"prompt": "abc", "echo": True, "logprobs": 1, "prompt_logprobs": 2, "max_tokens": 1},
                       scored_row())["response"]["body"]
    lp, plp = body["choices"][0]["logprobs"], body["choices"][0]["prompt_logprobs"]
    assert lp["top_logprobs"] == [None, {"f": -0.5, "b": -1.0}, {"f": -0.5, "c": -2.0}, {"f": -0.5, "d": -0.25}]
    assert [sorted(map(int, p)) for p in plp[1:]] == [[1, 5, 6], [2, 5, 6]]  # vLLM's: its own top-2
    zero = result_line({"prompt": "abc", "prompt_logprobs": 0}, scored_row())["response"]["body"]["choices"][0]
    assert zero["prompt_logprobs"] == [None, {"1": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}},
                                       {"2": {"logprob": -2.0, "rank": 4, "decoded_token": "c"}}]


@pytest.mark.slow
def test_a_run_says_once_which_lines_take_our_defaults(tmp_path, write_jsonl, tiny_model_dir) -> None:
    """Issue 42 item 18: a body without max_tokens was cut at 16 tokens and one without temperature was greedy,
    silently; the run now says so once (our defaults stay: bounded and reproducible)."""
    data = write_jsonl(tmp_path / "b.jsonl", [
        line("a", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
        line("b", "/v1/completions", {"prompt": "Hi", "temperature": 0.5, "max_tokens": 1}),
        line("c", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})])
    res = run("generate", data, "--model", tiny_model_dir("llama"), "--out", tmp_path / "o.jsonl", "-q")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert text.count("note:") == 1
    assert ("note: 2 of 3 request lines give no temperature: they use --temperature 0 (greedy) (the API's default: "
            "1) — set them in the bodies or on the command line") in text
    both = write_jsonl(tmp_path / "c.jsonl", [line("a", "/v1/completions", {"prompt": "Hi"})])
    res = run("generate", both, "--model", tiny_model_dir("llama"), "--out", tmp_path / "p.jsonl", "-q",
              "--max-tokens", 1, "--temperature", 0.7)
    assert res.exit_code == 0, res.output
    assert ("note: 1 of 1 request lines give no max_tokens: they stop at --max-tokens 1 (the API's chat default: "
            "until the context ends); 1 of 1 request lines give no temperature: they use --temperature 0.7 (the API's "
            "default: 1)") in " ".join(res.output.split())


def test_errors_out_writes_the_error_lines_to_a_file_of_their_own(tmp_path, write_jsonl, tiny_model_dir) -> None:
    """Issue 42 item 19: OpenAI splits successes and failures into an output and an error file; --errors-out FILE
    does, one file stays the default."""
    lines = [line("a", "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0}),
             line("b", "/v1/completions", {"prompt": "Hi", "presence_penalty": 1}),
             line("c", "/v1/completions", {"prompt": "Ho", "max_tokens": 1, "temperature": 0})]
    data = write_jsonl(tmp_path / "b.jsonl", lines)
    model = tiny_model_dir("llama")
    out, errors = tmp_path / "o.jsonl", tmp_path / "sub" / "e.jsonl"
    res = run("generate", data, "--model", model, "--skip-invalid", "--out", out, "--errors-out", errors)
    assert res.exit_code == 0, res.output
    assert "error lines: 1 in" in res.output
    answered = [json.loads(x) for x in out.read_text().splitlines()]
    failed = [json.loads(x) for x in errors.read_text().splitlines()]
    assert [x["custom_id"] for x in answered] == ["a", "c"] and all(x["error"] is None for x in answered)
    assert [x["custom_id"] for x in failed] == ["b"] and failed[0]["response"] is None
    one = tmp_path / "one.jsonl"  # the default: one file, in input order
    assert run("generate", data, "--model", model, "--skip-invalid", "--out", one, "-q").exit_code == 0
    assert [json.loads(x)["custom_id"] for x in one.read_text().splitlines()] == ["a", "b", "c"]
    cases = [(("--errors-out", errors), f"--errors-out {errors} exists — pass --overwrite to replace it"),
             (("--errors-out", data), "is the dataset itself"),
             (("--errors-out", tmp_path / "new.jsonl", "--out", tmp_path / "new.jsonl"), "is --out itself"),
             (("--errors-out", tmp_path / "x.jsonl", "--out", tmp_path / "x.parquet"),
              "--errors-out writes the error lines of an OpenAI Batch result file apart from its answers, so it "
              "needs --output-format openai-batch")]
    for args, message in cases:
        res = run("generate", data, "--model", model, "--skip-invalid", "--out", tmp_path / "n.jsonl", *args)
        assert res.exit_code == 2 and message in " ".join(res.output.split()), (args, res.output)


def test_vllm_rank_at_ties_follows_vllm_from_the_stored_top_k() -> None:
    """Issue 53, item 9: vLLM's rank is the number of logprobs >= the token's (ties take the worst), and its dict
    holds K entries exactly when that rank is <= K; ours (1 + the number strictly greater: ties share the best)
    went into vLLM's shape. A prompt token (2) tied bitwise with two others (5, 6: lower ids, so first in our top-K)."""
    row = {**scored_row(), "token_logprobs": [None, -0.5, -1.5], "token_ranks": [None, 1, 2],
           "top_ids": [None, [0, 1, 3], [5, 6, 2]], "top_logprobs": [None, [-0.5, -0.5, -2.0], [-1.0, -1.5, -1.5]]}
    row["token_ids"] = [9, 1, 2]
    plp = result_line({"prompt": [9, 1, 2], "echo": True, "max_tokens": 0, "prompt_logprobs": 1}, row,
                      command="score")["response"]["body"]["choices"][0]["prompt_logprobs"]
    # position 1: token 1 ties token 0, which our top-K puts first: vLLM's rank 2 (> K = 1: K + 1 entries)
    assert plp[1] == {"1": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},
                      "0": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}
    assert list(plp[1]) == ["1", "0"]  # vLLM's order: the prompt's token first, then the top-K
    # position 2: token 2 ties 6 (both below 5): ours 2, vLLM's 3
    assert plp[2]["2"]["rank"] == 3 and plp[2]["5"]["rank"] == 1 and len(plp[2]) == 2
    two = result_line({"prompt": [9, 1, 2], "echo": True, "max_tokens": 0, "prompt_logprobs": 2}, row,
                      command="score")["response"]["body"]["choices"][0]["prompt_logprobs"]
    assert two[1] == {"1": {"logprob": -0.5, "rank": 2, "decoded_token": "b"},  # in the top-2: its place
                      "0": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}
    assert {t: e["rank"] for t, e in two[2].items()} == {"2": 3, "5": 1, "6": 2}  # rank 3 > K = 2: 3 entries
    from apcscore.io.openai_batch_output import vllm_rank

    assert vllm_rank(7, -3.0, 4, [1, 2], [-1.0, -2.0]) == 7  # no tie seen: ours
    assert vllm_rank(1, float("nan"), 4, [1], [-1.0]) == 1 and vllm_rank(None, -1.0, 4, [], []) is None


def test_vllm_shape_ranks_of_bitwise_ties_from_the_engine(tmp_path, write_jsonl, tiny_model_dir) -> None:
    """Issue 53, item 9, through the engine: the tiny model's head rows of two tokens X < Y are made the row of the
    top token T after A, so T, X and Y have bitwise-equal logits there. The result line (vLLM's shape) gives T
    vLLM's rank 3 (two logprobs >= its own besides itself) beside X at 1 and Y at 2; the parquet file of the same
    line keeps ours, 1 (nothing is strictly greater)."""
    import shutil

    from safetensors.torch import load_file, save_file

    a = 1000
    probe = write_jsonl(tmp_path / "probe.jsonl", [{"prompt_token_ids": [a, a]}])
    res = run("score", probe, "--model", tiny_model_dir("llama"), "--prompt-logprobs", "1", "--out",
              tmp_path / "probe.parquet", "-q")
    assert res.exit_code == 0, res.output
    top = pq.read_table(tmp_path / "probe.parquet").to_pylist()[0]["top_ids"][1][0]  # T: the argmax after A
    assert top >= 4
    x, y = top // 3, top // 2
    model = tmp_path / "tied"
    shutil.copytree(tiny_model_dir("llama"), model)
    weights = load_file(model / "model.safetensors")
    head = weights["lm_head.weight"].clone()
    head[x], head[y] = head[top], head[top]
    save_file({**weights, "lm_head.weight": head}, model / "model.safetensors", metadata={"format": "pt"})
    data = write_jsonl(tmp_path / "b.jsonl", [line("s", "/v1/completions", {
        "prompt": [a, top], "echo": True, "max_tokens": 0, "prompt_logprobs": 2})])
    for out in (tmp_path / "o.jsonl", tmp_path / "o.parquet"):
        res = run("score", data, "--model", model, "--out", out, "-q")
        assert res.exit_code == 0, res.output
    body = json.loads((tmp_path / "o.jsonl").read_text())["response"]["body"]
    plp = body["choices"][0]["prompt_logprobs"][1]
    assert {int(t): e["rank"] for t, e in plp.items()} == {top: 3, x: 1, y: 2}
    assert len({e["logprob"] for e in plp.values()}) == 1  # the three logprobs are bitwise equal
    row = pq.read_table(tmp_path / "o.parquet").to_pylist()[0]
    assert row["token_ranks"][1] == 1 and row["top_ids"][1] == [x, y]
