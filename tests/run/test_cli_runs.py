"""Runs at the edges (issue 16): no crash in the summary, tiny temperatures, markup in data and paths, runs where
every record failed, `--truncate left` only where a prompt does not fit, nulls instead of NaN, the report's
Markdown, and part files that reach the disk while a run goes."""

from __future__ import annotations

import pytest

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
from typer.testing import CliRunner

from apcscore.cli import app

runner = CliRunner()


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.mark.slow
def test_max_tokens_0_among_others_and_tiny_temperatures_do_not_crash(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "zero", "prompt": "Hello there", "max_tokens": 0},
        {"id": "tiny", "prompt": "Hello there", "temperature": 1e-300},
        {"id": "plain", "prompt": "Hello there"},
    ])
    out, greedy = tmp_path / "o.parquet", tmp_path / "g.parquet"
    res = run("generate", data, "--model", tiny, "--temperature", 1e-40, "--max-tokens", 4, "--out", out)
    assert res.exit_code == 0, res.output
    assert "finish reasons" in res.output and "length: 3" in res.output  # the summary did not die on None
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert rows["zero"]["finish_reason"] == "length" and rows["zero"]["completion_token_ids"] == []
    assert run("generate", data, "--model", tiny, "--max-tokens", 4, "--out", greedy, "-q").exit_code == 0
    ref = {r["id"]: r for r in pq.read_table(greedy).to_pylist()}
    # a temperature below 1e-5 samples greedily (it would overflow the logits to inf)
    assert rows["tiny"]["completion_token_ids"] == ref["tiny"]["completion_token_ids"]
    assert rows["plain"]["completion_token_ids"] == ref["plain"]["completion_token_ids"]
    assert not (tmp_path / "o.parquet.partial").exists()


def test_markup_in_ids_fields_and_paths_is_printed_as_text(tmp_path, write_jsonl, tiny):
    folder = tmp_path / "runs [/x] [bold]"
    data = write_jsonl(folder / "d.jsonl", [{"id": "[/INST]", "prompt": "Hi there", "[/meta]": 1},
                                            {"id": "[red]", "prompt_token_ids": list(range(1, 2100))}])
    out = folder / "o [/y].parquet"
    res = run("score", data, "--model", tiny, "--out", out)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "unknown field '[/meta]' ignored" in text
    assert "o [/y].parquet" in text  # the output path in the summary, brackets and all
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["[/INST]", "[red]"] and rows[1]["status"] == "error"


def test_a_run_where_every_record_failed_exits_1(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt_token_ids": list(range(1, 2100))}] * 2)
    out = tmp_path / "o.parquet"
    res = run("score", data, "--model", tiny, "--out", out, "-q")
    assert res.exit_code == 1 and "every record failed (2 of 2 rows are errors)" in " ".join(res.output.split())
    assert pq.read_table(out).num_rows == 2  # still one row per record


@pytest.mark.slow
def test_truncate_left_cuts_only_what_does_not_fit(tmp_path, write_jsonl, tiny):
    context = " ".join(["alpha beta gamma delta"] * 700)  # ~2,800 tokens, the tiny model's context is 2048
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "cont", "context": context, "continuation": " epsilon zeta"},
        {"id": "mc", "context": context, "choices": [" yes", " no"], "answer": 0},
    ])
    out = tmp_path / "o.parquet"
    res = run("score", data, "--model", tiny, "--out", out, "-q")
    assert res.exit_code == 1, res.output  # both too long: error rows that name the option
    assert all("--truncate left" in r["error"] for r in pq.read_table(out).to_pylist())
    res = run("score", data, "--model", tiny, "--out", out, "-q", "--truncate", "left", "--overwrite")
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert rows["cont"]["status"] == "ok" and rows["cont"]["num_tokens"] == 2048
    assert rows["cont"]["num_truncated_tokens"] > 600 and rows["cont"]["continuation_num_tokens"] >= 2
    assert rows["mc"]["status"] == "ok" and rows["mc"]["num_truncated_tokens"] > 600
    meta = json.loads(pq.read_table(out).schema.metadata[b"apcscore"])
    assert meta["job"]["truncate"] == "left" and os.path.isabs(meta["dataset"]["path"])
    # generate: a prompt that leaves less than max_tokens of the context keeps its newest tokens too (issue 46,
    # item 14: it stayed whole, so a shorter prompt got fewer new tokens than a longer, truncated one)
    gen = write_jsonl(tmp_path / "g.jsonl", [{"id": "short", "prompt_token_ids": [5, 6, 7, 8, 9], "max_tokens": 62}])
    cfg = tmp_path / "c.toml"
    cfg.write_text("max_model_len = 64\n")  # a short context, so that 5 + 62 tokens do not fit
    res = run("generate", gen, "--model", tiny, "--out", tmp_path / "g.parquet", "-q", "--truncate", "left",
              "--config", cfg)
    assert res.exit_code == 0, res.output
    row = pq.read_table(tmp_path / "g.parquet").to_pylist()[0]
    assert row["num_prompt_tokens"] == 2 and row["num_truncated_tokens"] == 3


def test_one_token_prompt_is_null_not_nan_and_one_question_has_no_nan(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "one", "prompt_token_ids": [5]},
                                              {"id": "q", "context": "Is it", "choices": [" yes", " no"], "answer": 0}])
    out = tmp_path / "o.parquet"
    res = run("score", data, "--model", tiny, "--out", out)
    assert res.exit_code == 0, res.output
    assert "nan" not in res.output.lower() and "1 question" in res.output
    row = pq.read_table(out).to_pylist()[0]
    assert row["num_scored"] == 0 and row["mean_nll"] is None and row["perplexity"] is None


@pytest.mark.slow
def test_markdown_report_renders_every_table(tmp_path, write_jsonl, tiny):
    from markdown_it import MarkdownIt

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a|b", "prompt": "One two three four five six"},
                                              {"id": "c", "prompt": "Seven eight nine ten"}])
    outs = []
    for dtype in ("float32", "bfloat16"):
        outs.append(tmp_path / f"{dtype}.parquet")
        assert run("score", data, "--model", tiny, "--dtype", dtype, "--prompt-logprobs", 3, "--out", outs[-1],
                   "-q").exit_code == 0
    md = tmp_path / "r.md"
    res = run("compare", *outs, "--report-md", md)
    assert res.exit_code == 0, res.output
    tokens = MarkdownIt("commonmark").enable("table").parse(md.read_text())
    tables = heads = 0
    for i, tok in enumerate(tokens):
        if tok.type == "table_open":
            tables += 1
            cells: list[list[str]] = []
            for t in tokens[i + 1:]:
                if t.type == "table_close":
                    break
                if t.type == "tr_open":
                    cells.append([])
                elif t.type == "inline" and cells:
                    cells[-1].append(t.content)
            assert len({len(row) for row in cells}) == 1, cells  # every row as wide as the header
            if "max |d logprob|" in cells[0]:
                heads += 1
                assert len(cells[0]) == 7 and any("a|b" in row for row in cells)
    assert tables >= 4 and heads == 1


@pytest.mark.slow
def test_part_files_reach_the_disk_while_the_run_goes(tmp_path, write_jsonl, tiny):
    """A SIGKILL keeps the rows finished more than ~1 s earlier (the writer's time bound, checked every step)."""
    records = [{"id": "first", "prompt": "a b", "max_tokens": 1}]
    # "long0" must still be generating 1 s after "first" is done, or both land in the first part: 1,000 tokens took
    # ~2 s here (2 ms a step), about 1 s on a CPU twice as fast; 2,000 (the tiny model's context is 2,048) doubles that
    records += [{"id": f"long{i}", "prompt": "c d", "max_tokens": 2000} for i in range(40)]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    out = tmp_path / "o.parquet"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "apcscore", "generate", str(data), "--model", tiny, "--out",
                             str(out), "-q", "--max-num-seqs", "1", "--no-prefix-caching"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 60
        parts: list = []
        while time.time() < deadline and proc.poll() is None and not parts:
            parts = list((tmp_path / "o.parquet.partial").glob("part-*.parquet"))
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before the check: make it longer"
        assert parts, "no part file while the run went on"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        kept = [r["id"] for p in parts for r in pq.read_table(p).to_pylist()]
        assert kept == ["first"]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_run_that_fails_before_its_first_row_leaves_no_partial(tmp_path, write_jsonl, tiny, monkeypatch):
    from apcscore.engine.engine import Engine

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    monkeypatch.setattr(Engine, "run", broken)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    res = run("score", data, "--model", tiny, "--out", tmp_path / "o.parquet", "-q")
    assert isinstance(res.exception, RuntimeError)
    assert not (tmp_path / "o.parquet.partial").exists()  # the next run is not blocked
