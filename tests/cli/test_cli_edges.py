"""Every kind of bad input or option gets one clear message and the right exit code, never a traceback.

CASES is the table docs/errors.md is made from (`python tests/cli/test_cli_edges.py` prints it): each case runs
the real command line and checks the exit code, a piece of the message, that no traceback was printed and that
nothing was written. Placeholders in the arguments: {data} (the dataset, `records` written as JSONL), {cfg}
(a config file holding `config`), {tmp} (the test's folder), {tiny} (a tiny random-weight model directory).
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from typer.testing import CliRunner

from apcscore.cli import app

OK = [{"id": "a", "prompt": "Hello there"}]


@dataclass
class Case:
    kind: str  # what is wrong, as docs/errors.md lists it
    args: list[str]
    message: str  # a piece of the message the user gets
    records: list = field(default_factory=lambda: list(OK))
    config: str | None = None
    exit_code: int = 2
    env: dict = field(default_factory=dict)


CASES = [
    # ---- sampling options: the checks a record's values get, before anything loads
    Case("--temperature below 0", ["generate", "{data}", "--temperature", "-1"], "--temperature must be a number >= 0"),
    Case("--top-p 0", ["generate", "{data}", "--top-p", "0"], "--top-p must be a number in (0, 1]"),
    Case("--top-p above 1", ["generate", "{data}", "--top-p", "2"], "--top-p must be a number in (0, 1]"),
    Case("--max-tokens below 0", ["generate", "{data}", "--max-tokens", "-1"], "--max-tokens must be an integer >= 0"),
    Case("--top-k below 0", ["generate", "{data}", "--top-k", "-1"], "--top-k must be an integer >= 0"),
    Case("--stop empty string", ["generate", "{data}", "--stop="], "--stop must not be an empty string"),
    Case("a record's temperature below 0", ["generate", "{data}"], "'temperature' must be a number >= 0",
         records=[{"prompt": "x", "temperature": -1}]),
    Case("--logprobs above --max-logprobs", ["generate", "{data}", "--logprobs", "50"], "--max-logprobs 50"),
    Case("--prompt-logprobs above --max-logprobs", ["score", "{data}", "--prompt-logprobs", "21"], "max_logprobs = 20"),
    Case("--prompt-logprobs below 0", ["score", "{data}", "--prompt-logprobs", "-1"], "--prompt-logprobs must be"),
    Case("--truncate other than left", ["score", "{data}", "--truncate", "right"], "--truncate must be 'left'"),
    Case("--resume with --overwrite", ["score", "{data}", "--resume", "--overwrite"], "contradict each other"),
    Case("--limit 0", ["score", "{data}", "--limit", "0"], "--limit"),
    Case("--window 0", ["perplexity", "{data}", "--window", "0"], "--window", records=[{"text": "x"}]),
    # ---- engine options
    Case("--block-size not a power of two", ["score", "{data}", "--block-size", "12"], "power of two"),
    Case("--device unknown", ["score", "{data}", "--device", "tpu"], "--device must be auto, cpu or cuda"),
    Case("--dtype unknown", ["score", "{data}", "--dtype", "float64"], "--dtype must be"),
    Case("--attention-backend unknown", ["score", "{data}", "--attention-backend", "flash"], "--attention-backend"),
    Case("--max-batch-tokens 0", ["score", "{data}", "--max-batch-tokens", "0"], "--max-batch-tokens"),
    Case("--attention-backend triton on a CPU", ["score", "{data}", "--attention-backend", "triton", "--device", "cpu"],
         "needs a CUDA GPU", env={"TRITON_INTERPRET": None}),
    Case("--model unknown alias", ["score", "{data}", "--model", "no-such-model"], "smollm2-135m"),
    Case("--model fake .gguf", ["score", "{data}", "--model", "{tmp}/fake.gguf"], "GGUF"),
    # ---- config file
    Case("config: value of the wrong type (prompt_logprobs)", ["score", "{data}", "--config", "{cfg}"],
         "c.toml:2: prompt_logprobs must be an integer, not \"five\"", config='model = "smollm2-135m"\n'
                                                                             'prompt_logprobs = "five"\n'),
    Case("config: block_size as a string", ["score", "{data}", "--config", "{cfg}"],
         "block_size must be an integer, not \"16\"", config='block_size = "16"\n'),
    Case("config: device as a number", ["score", "{data}", "--config", "{cfg}"], "device must be a string, not 5",
         config="device = 5\n"),
    Case("config: quiet = \"yes\"", ["score", "{data}", "--config", "{cfg}"], "quiet must be true or false",
         config='quiet = "yes"\n'),
    Case("config: another command's option", ["score", "{data}", "--config", "{cfg}"],
         "'max_tokens' is an option of generate, not of score", config="max_tokens = 5\n"),
    Case("config: unknown key", ["score", "{data}", "--config", "{cfg}"], "unknown option 'prompt_logprob'",
         config="prompt_logprob = 2\n"),
    Case("config: not TOML", ["score", "{data}", "--config", "{cfg}"], "not valid TOML", config="a = = 1\n"),
    Case("config: a directory", ["score", "{data}", "--config", "{tmp}"], "is a directory, not a config file"),
    Case("config: missing", ["score", "{data}", "--config", "{tmp}/none.toml"], "config file not found"),
    Case("config: sampling value out of range", ["generate", "{data}", "--config", "{cfg}"],
         "--top-p must be a number in (0, 1]", config="top_p = 0\n"),
    # ---- output location
    Case("--out empty", ["score", "{data}", "--out", ""], "--out is empty"),
    Case("--out -", ["score", "{data}", "--out", "-"], "cannot go to standard output"),
    Case("--out is the dataset", ["score", "{data}", "--out", "{data}", "--overwrite"], "is the dataset itself"),
    Case("--out is a directory", ["score", "{data}", "--out", "{tmp}"], "is a directory"),
    Case("--out under a file", ["score", "{data}", "--out", "{data}/x.parquet"], "is a file, not a folder"),
    Case("--out exists", ["score", "{data}", "--out", "{tmp}/done.parquet"], "pass --overwrite"),
    Case("--resume of a finished run", ["score", "{data}", "--out", "{tmp}/done.parquet", "--resume"],
         "is a finished run"),
    # ---- the dataset
    Case("dataset missing", ["score", "{tmp}/none.jsonl"], "does not exist"),
    Case("dataset is a directory", ["score", "{tmp}"], "is a directory; give a JSONL file"),
    Case("dataset empty", ["score", "{data}"], "has no records", records=[]),
    Case("dataset gzip-compressed", ["score", "{tmp}/d.jsonl.gz"], "gzip-compressed"),
    Case("line not JSON", ["score", "{data}"], "d.jsonl:2: invalid JSON", records=[OK[0], "{not json"]),
    Case("record of no known kind", ["score", "{data}"], "matches no score record kind", records=[{"text": "x"}]),
    Case("duplicate id with markup in it", ["score", "{data}"], "duplicate id '[/INST]'",
         records=[{"id": "[/INST]", "prompt": "a"}, {"id": "[/INST]", "prompt": "b"}]),
    Case("field name with markup in it", ["score", "{data}"], "'[/x]'",
         records=[{"[/x]": 1, "text": "t"}]),
    Case("unknown chat role", ["generate", "{data}"], "has the role \"robot\"",
         records=[{"messages": [{"role": "robot", "content": "hi"}]}]),
    Case("answer outside the choices", ["score", "{data}"], "is not an index into the 2 choices",
         records=[{"context": "c", "choices": ["a", "b"], "answer": 2}]),
    # ---- records the model cannot take (found with its config and tokenizer, before the weights)
    Case("token id outside the vocabulary", ["score", "{data}", "--model", "{tiny}"],
         "d.jsonl:1: 'prompt_token_ids' holds token id 99999", records=[{"prompt_token_ids": [1, 99999]}]),
    Case("empty prompt", ["generate", "{data}", "--model", "{tiny}"], "d.jsonl:1: 'prompt' is empty",
         records=[{"prompt": ""}]),
    Case("empty perplexity text", ["perplexity", "{data}", "--model", "{tiny}"], "d.jsonl:1: 'text' is empty",
         records=[{"text": ""}]),
    Case("--prompt-logprobs above the vocabulary",
         ["score", "{data}", "--model", "{tiny}", "--max-logprobs", "60000", "--prompt-logprobs", "50000"],
         "more than the model's vocabulary of 49152"),
    Case("KV pool larger than memory (--num-kv-blocks)",
         ["score", "{data}", "--model", "{tiny}", "--num-kv-blocks", "100000000000"], "GiB of free host memory"),
    Case("KV pool larger than memory (--block-size)",
         ["score", "{data}", "--model", "{tiny}", "--block-size", "67108864"], "or a smaller --block-size"),
    Case("--window longer than the model's context", ["perplexity", "{data}", "--model", "{tiny}", "--window", "5000"],
         "--window 5000 is too long for the model", records=[{"text": "x"}]),
    # ---- compare
    Case("compare: candidate is a directory", ["compare", "{tmp}/done.parquet", "{tmp}"], "is a directory"),
    Case("compare: file missing", ["compare", "{tmp}/done.parquet", "{tmp}/none.parquet"], "does not exist"),
    Case("compare: not parquet", ["compare", "{tmp}/done.parquet", "{data}"], "is not a parquet file"),
    Case("compare: damaged data page", ["compare", "{tmp}/done.parquet", "{tmp}/damaged.parquet"], "is damaged"),
    Case("compare: infinite threshold", ["compare", "{tmp}/done.parquet", "{tmp}/done.parquet",
                                        "--max-ppl-ratio", "inf"], "must be a finite number > 0"),
    # ---- found by exploratory testing (2026-12-03)
    Case("--max-model-len below 1", ["score", "{data}", "--max-model-len", "-5"], "--max-model-len must be at least 1"),
    Case("--columns to a field no record has", ["score", "{data}", "--columns", "bogus=prompt"],
         "'bogus' is not a field of a score record"),
    Case("--columns from a column no record has", ["score", "{data}", "--columns", "prompt=nope"],
         "d.jsonl has a column 'nope' (its records have 'id', 'prompt')"),
    Case("an unpaired UTF-16 surrogate in a string", ["score", "{data}"],
         "d.jsonl:1: prompt holds an unpaired UTF-16 surrogate escape", records=['{"prompt": "bad \\udc80"}']),
    Case("--out where nothing can be written (/proc)", ["score", "{data}", "--out", "/proc/x.parquet"],
         "--out /proc/x.parquet: "),
    # issue 46, item 12: a parquet file under a name of a data format apcscore reads (read back, it did not decode)
    Case("--out named as CSV", ["score", "{data}", "--out", "{tmp}/r.csv"],
         "r.csv: the results are written as parquet, and a .csv name says CSV"),
    Case("--out named as JSON lines", ["score", "{data}", "--out", "{tmp}/r.ndjson"],
         "r.ndjson: the results are written as parquet, and a .ndjson name says JSON lines"),
    Case("--out named as compressed", ["score", "{data}", "--out", "{tmp}/r.jsonl.gz"],
         "a .gz name says gzip-compressed data (read back as a dataset, the file would not decode) — name it "
         "r.jsonl.parquet"),
    Case("a parquet file read as a dataset under another name", ["score", "{tmp}/done.csv"],
         "done.csv is a parquet file whatever its name says"),
    # issue 46, item 13: the line of a [table], and messages that named options that do not exist
    Case("config: a [table] on line 2", ["score", "{data}", "--config", "{cfg}"],
         "c.toml:2: unknown option 'engine'", config="quiet = true\n[engine]\nblock_size = 16\n"),
    Case("--logprobs-chunk-size 0", ["score", "{data}", "--logprobs-chunk-size", "0"],
         "--logprobs-chunk-size must be at least 1, not 0"),
    Case("--kv-cache-memory-fraction above 0.95", ["score", "{data}", "--kv-cache-memory-fraction", "2"],
         "--kv-cache-memory-fraction must be in (0, 0.95], not 2.0"),
    Case("--tensor-parallel 0", ["score", "{data}", "--tensor-parallel", "0"],
         "error: --tensor-parallel must be at least 1, not 0"),
    # issue 53 item 4: NaN and infinity are errors wherever a number is read (1e400 parses to infinity)
    Case("a record's temperature 1e400 (infinity once parsed)", ["generate", "{data}"],
         "d.jsonl:1: 'temperature' must be a finite number, not infinity",
         records=['{"prompt": "x", "temperature": 1e400}']),
    Case("--temperature inf", ["generate", "{data}", "--temperature", "inf"],
         "--temperature must be a finite number, not infinity"),
    Case("config: an infinite number", ["generate", "{data}", "--config", "{cfg}"],
         "c.toml:1: temperature must be a finite number, not infinity", config="temperature = inf\n"),
    Case("config: NaN", ["score", "{data}", "--config", "{cfg}"],
         "c.toml:1: kv_cache_memory_fraction must be a finite number, not NaN",
         config="kv_cache_memory_fraction = nan\n"),
]


def _done_parquet(path: Path, damaged: Path) -> None:
    """A small apcscore-like result file, and a copy with a damaged data page (its footer intact)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [str(i) for i in range(200)], "status": ["ok"] * 200, "error": [None] * 200,
                      "num_tokens": list(range(200)), "num_scored": list(range(200)),
                      "sum_logprob": [-float(i) for i in range(200)]})
    table = table.replace_schema_metadata({b"apcscore": json.dumps({"command": "score"}).encode()})
    pq.write_table(table, path, compression="NONE")
    data = bytearray(path.read_bytes())
    for i in range(8, 400):  # scramble the first data pages, keep the footer
        data[i] ^= 0x5A
    damaged.write_bytes(bytes(data))


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_bad_input_gets_a_clear_message_and_exit_code(case: Case, tmp_path, write_jsonl, tiny) -> None:
    if case.kind == "dataset empty":
        (tmp_path / "d.jsonl").write_text("\n")
    else:
        write_jsonl(tmp_path / "d.jsonl", case.records)
    (tmp_path / "c.toml").write_text(case.config or "")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 64)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "x"}\n'))
    _done_parquet(tmp_path / "done.parquet", tmp_path / "damaged.parquet")
    shutil.copy(tmp_path / "done.parquet", tmp_path / "done.csv")
    before = set(os.listdir(tmp_path))
    fill = {"data": str(tmp_path / "d.jsonl"), "cfg": str(tmp_path / "c.toml"), "tmp": str(tmp_path), "tiny": tiny}
    args = [a.format(**fill) for a in case.args]
    if args[0] != "compare":
        args += ["--quiet"] + ([] if "--out" in case.args else ["--out", str(tmp_path / "o.parquet")])
    res = CliRunner().invoke(app, args, env={"COLUMNS": "300", **case.env})
    text = " ".join(res.output.split())  # Rich wraps long lines
    assert res.exit_code == case.exit_code, res.output
    assert " ".join(case.message.split()) in text, res.output
    assert "Traceback" not in res.output and not isinstance(res.exception, (KeyError, TypeError, OSError))
    assert set(os.listdir(tmp_path)) == before, "a refused run wrote something"


def errors_table() -> str:
    """docs/errors.md's table: run every case and quote the message it prints."""
    import tempfile

    rows = ["| # | bad input or option | command | exit | what the user reads |", "|---|---|---|---|---|"]
    for i, case in enumerate(CASES, 1):
        with tempfile.TemporaryDirectory() as tmp:
            out = _run_for_doc(case, Path(tmp))
        rows.append(f"| {i} | {case.kind} | `{' '.join(case.args)}` | {case.exit_code} | {out} |")
    return "\n".join(rows)


def _run_for_doc(case: Case, tmp: Path) -> str:
    from conftest import _write_jsonl

    _write_jsonl(tmp / "d.jsonl", case.records) if case.records else (tmp / "d.jsonl").write_text("\n")
    (tmp / "c.toml").write_text(case.config or "")
    (tmp / "fake.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 64)
    (tmp / "d.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "x"}\n'))
    _done_parquet(tmp / "done.parquet", tmp / "damaged.parquet")
    shutil.copy(tmp / "done.parquet", tmp / "done.csv")
    fill = {"data": "d.jsonl", "cfg": "c.toml", "tmp": ".", "tiny": os.environ.get("TINY", "tiny")}
    args = [a.format(**fill) for a in case.args]
    if args[0] != "compare":
        args += ["--quiet"] + ([] if "--out" in case.args else ["--out", "o.parquet"])
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        res = CliRunner().invoke(app, args, env={"COLUMNS": "300", **case.env})
    finally:
        os.chdir(cwd)
    text = " ".join(res.output.split())
    if "Error" in text and "Usage:" in text:  # a click usage error: Typer prints it in a box under the usage lines
        text = text.split("Error", 1)[1].strip(" ─╮╯╰│")
        text = "(Typer's usage lines, then this in a box titled Error) " + " ".join(
            text.replace("│", " ").replace("╰", " ").replace("─", "").split())
    text = text.replace("|", "\\|")
    return (text[:300] + " ...") if len(text) > 300 else text


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    print(errors_table())


def test_a_max_model_len_above_the_models_context_is_said_not_taken(tmp_path, write_jsonl, tiny) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", OK)
    res = CliRunner().invoke(app, ["score", str(data), "--model", tiny, "--max-model-len", "100000", "--out",
                                   str(tmp_path / "o.parquet")], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    assert "--max-model-len 100000 is above the model's context length" in " ".join(res.output.split())
