"""`--resume` tells the truth (issue 16 item 7) and a resumed sampled generation equals an uninterrupted one
(issue 15 item 4). The interrupt is a real SIGINT, sent from inside the run after a few rows were added."""

from __future__ import annotations

import json
import os
import re
import signal

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.io.writer import ResultsWriter

runner = CliRunner()


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture
def interrupt_after(monkeypatch):
    """interrupt_after(n): the next run gets SIGINT once n rows were added (the runner stops after the step)."""
    def arm(n: int) -> None:
        original = ResultsWriter.add
        count = {"rows": 0}

        def add(self, index, row):
            original(self, index, row)
            count["rows"] += 1
            if count["rows"] == n:
                os.kill(os.getpid(), signal.SIGINT)
        monkeypatch.setattr(ResultsWriter, "add", add)
    return arm


def meta(path) -> dict:
    return json.loads(pq.read_table(path).schema.metadata[b"apcscore"])


def records(n: int) -> list[dict]:
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    return [{"id": f"r{i}", "prompt": " ".join(words[j % 8] for j in range(i % 7 + 3))} for i in range(n)]


@pytest.mark.slow
def test_resumed_summary_and_metadata_cover_the_whole_file(tmp_path, write_jsonl, tiny, interrupt_after, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", records(12))
    out = tmp_path / "o.parquet"
    common = ["score", data, "--model", tiny, "--out", out, "--max-num-seqs", 1, "--max-batch-tokens", 16]
    interrupt_after(4)
    res = run(*common)
    assert res.exit_code == 130, res.output
    monkeypatch.undo()
    # the same dataset by another spelling of its path is the same dataset (content hash)
    monkeypatch.chdir(tmp_path)
    res = run("score", "./d.jsonl", "--model", tiny, "--out", out, "--max-num-seqs", 1, "--max-batch-tokens", 16,
              "--resume")
    assert res.exit_code == 0, res.output
    assert "12 written (12 ok, 0 error)" in res.output, res.output  # not only this session's rows
    assert re.search(r"sessions\s*│\s*2 \(resumed", res.output), res.output
    ref = tmp_path / "ref.parquet"
    res_ref = run("score", data, "--model", tiny, "--out", ref)
    assert res_ref.exit_code == 0
    ppl = [line for line in res.output.splitlines() if "perplexity" in line]
    assert ppl and ppl == [line for line in res_ref.output.splitlines() if "perplexity" in line]
    m = meta(out)
    assert m["sessions"] == 2 and m["resumed"] is True and meta(ref)["sessions"] == 1
    assert m["timings"]["prompt_tokens"] >= meta(ref)["timings"]["prompt_tokens"]  # both sessions added up
    assert os.path.isabs(m["dataset"]["path"])


@pytest.mark.slow
def test_resume_says_when_there_is_nothing_to_resume_and_refuses_a_changed_dataset(
        tmp_path, write_jsonl, tiny, interrupt_after, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", records(6))
    out = tmp_path / "o.parquet"
    res = run("score", data, "--model", tiny, "--out", out, "--resume", "-q")
    assert res.exit_code == 0 and "nothing to resume" in " ".join(res.output.split())
    out2 = tmp_path / "o2.parquet"
    interrupt_after(2)
    assert run("score", data, "--model", tiny, "--out", out2, "--max-num-seqs", 1, "-q").exit_code == 130
    monkeypatch.undo()
    write_jsonl(data, records(6)[::-1])  # same path, other content
    res = run("score", data, "--model", tiny, "--out", out2, "--resume", "-q")
    assert res.exit_code == 2 and "dataset" in res.output


@pytest.mark.slow
def test_interrupted_and_resumed_sampled_generation_equals_an_uninterrupted_one(
        tmp_path, write_jsonl, tiny, interrupt_after, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", records(10))
    common = ["generate", data, "--model", tiny, "--temperature", 0.8, "--top-p", 0.95, "--max-tokens", 6,
              "--seed", 3, "-q"]
    ref, out = tmp_path / "ref.parquet", tmp_path / "o.parquet"
    assert run(*common, "--out", ref).exit_code == 0
    interrupt_after(4)
    assert run(*common, "--out", out, "--max-num-seqs", 2).exit_code == 130
    monkeypatch.undo()
    # a changed seed or dtype is refused, as other settings are
    for change in (["--seed", 4], ["--dtype", "bfloat16"]):
        args = [a for a in common if a not in ("--seed", 3)] + (["--seed", 3] if change[0] != "--seed" else [])
        res = run(*args, *change, "--out", out, "--resume")
        assert res.exit_code == 2 and "cannot resume" in res.output, res.output
    assert run(*common, "--out", out, "--resume").exit_code == 0
    a, b = pq.read_table(ref), pq.read_table(out)
    assert a.equals(b)  # bitwise, every column
    # the seed of a record follows its place in the dataset: --limit and other records do not change it
    lim = tmp_path / "lim.parquet"
    assert run(*common, "--out", lim, "--limit", 3).exit_code == 0
    assert pq.read_table(lim).to_pylist() == a.slice(0, 3).to_pylist()


class Killed(BaseException):
    """A session ended outright (SIGKILL): nothing after it runs, no final metadata is written."""


@pytest.mark.slow
def test_a_killed_sessions_tokens_count_in_the_resumed_run(tmp_path, write_jsonl, tiny, monkeypatch):
    """Issue 46, item 14: after SIGKILL and --resume, "tokens prefilled" left out the killed session's tokens (its
    timings were written only when a session ended). They are kept in the partial as the run goes."""
    from apcscore.io.result_tables import read_run_metadata

    data = write_jsonl(tmp_path / "d.jsonl", records(12))
    out = tmp_path / "o.parquet"
    common = ["score", data, "--model", tiny, "--out", out, "--max-num-seqs", 1, "--max-batch-tokens", 16]
    original = ResultsWriter.add

    def add(self, index, row):
        original(self, index, row)
        if len(self.done_indices) == 6:
            self.flush()  # as the writer does within a second
            raise Killed()
    monkeypatch.setattr(ResultsWriter, "add", add)
    with pytest.raises(Killed):
        run(*common)
    monkeypatch.undo()
    killed = read_run_metadata(tmp_path / "o.parquet.partial")["timings"]  # the killed session's, so far
    assert killed["prompt_tokens"] > 0
    res = run(*common, "--resume")
    assert res.exit_code == 0, res.output
    total = meta(out)["timings"]
    ref = tmp_path / "ref.parquet"
    assert run("score", data, "--model", tiny, "--out", ref).exit_code == 0
    assert total["prompt_tokens"] > killed["prompt_tokens"]
    assert total["prompt_tokens"] >= meta(ref)["timings"]["prompt_tokens"]  # both sessions added up
