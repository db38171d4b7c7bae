"""`apcscore show`: one record of a real result file (a tiny random Llama, `score --prompt-logprobs 3`, `generate
--logprobs 2`), its tokens, and a position's rank and top-K as the parquet stores them; and its clear errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.io.token_text import token_texts

RECORDS = [
    {"id": "q", "context": "The sky is", "choices": [" blue", " green"], "answer": 0},  # no per-token logprobs
    {"id": "one", "prompt_token_ids": [5]},  # per-token logprobs, none of them scored: [null]
    {"id": "capital", "prompt": "The capital of France is Paris. [bold]Berlin[/bold] is in Germany."},
    {"id": "code", "prompt": "def add(a, b):\n    return a + b\n"},
]


@pytest.fixture(scope="module")
def files(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Result files of one tiny model: score (K = 3), generate with and without --logprobs, perplexity."""
    tmp = tmp_path_factory.mktemp("show")
    model = str(tiny_model_dir("llama"))
    data = tmp / "score.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "g", "prompt": "Hello there, my"}) + "\n")
    texts = tmp / "texts.jsonl"
    texts.write_text(json.dumps({"id": "t", "text": "Some text to score."}) + "\n")
    runs = {"score": ["score", data, "--prompt-logprobs", "3"],
            "generate_lp": ["generate", prompts, "--logprobs", "2", "--max-tokens", "5"],
            "generate": ["generate", prompts, "--max-tokens", "3"],
            "perplexity": ["perplexity", texts]}
    out = {}
    for name, args in runs.items():
        out[name] = tmp / f"{name}.parquet"
        r = CliRunner().invoke(app, [*map(str, args), "--model", model, "--device", "cpu", "--out", str(out[name]),
                                     "--quiet"])
        assert r.exit_code == 0, r.output
    return out


def show(*args: str | Path):
    return CliRunner().invoke(app, ["show", *map(str, args)], env={"COLUMNS": "200"})


def row(path: Path, rid: str) -> dict:
    return next(r for r in pq.read_table(path).to_pylist() if r["id"] == rid)


def tokenizer(path: Path):
    from apcscore.models.loading import load_tokenizer

    return load_tokenizer(Path(json.loads(pq.read_schema(path).metadata[b"apcscore"])["model"]["path"]))


@pytest.mark.slow
def test_a_position_shows_the_parquets_rank_and_top_k(files) -> None:
    path = files["score"]
    r = show(path, "--id", "capital", "--position", "5")
    assert r.exit_code == 0, r.output
    rec = row(path, "capital")
    pieces = token_texts(tokenizer(path), rec["token_ids"]).pieces
    out = r.stdout
    assert "".join(pieces) in out.replace("↵\n", "\n")  # every token, in order: the record's text
    assert "[bold]Berlin[/bold]" in out  # printed as text, not read as Rich markup
    head = (f"position 5: {json.dumps(pieces[5])} (id {rec['token_ids'][5]}), logprob "
            f"{rec['token_logprobs'][5]:.4f}, rank {rec['token_ranks'][5]}")
    assert head in out
    tok = tokenizer(path)
    lines = [line for line in out.splitlines() if re.match(r"│ [123] ", line)]
    assert len(lines) == 3
    for k, (line, tid, lp) in enumerate(zip(lines, rec["top_ids"][5], rec["top_logprobs"][5]), 1):
        cells = [c.strip() for c in line.strip("│").split("│")]
        assert cells == [str(k), json.dumps(token_texts(tok, [tid]).pieces[0], ensure_ascii=False), str(tid),
                         f"{lp:.4f}"]


def test_without_an_id_the_first_record_with_token_logprobs(files) -> None:
    path = files["score"]
    r = show(path)
    assert r.exit_code == 0, r.output
    assert "record 'capital' (row 3 of 4 — the first record with per-token logprobs" in r.stdout
    rec = row(path, "capital")
    worst = min((lp, i) for i, lp in enumerate(rec["token_logprobs"]) if lp is not None)
    assert re.search(rf"│ {worst[1]} +│ .* │ {rec['token_ids'][worst[1]]} +│ {worst[0]:.4f} ", r.stdout)
    code = show(path, "--id", "code")
    assert code.exit_code == 0 and "return a + b" in code.stdout and "↵" in code.stdout
    one = show(path, "--id", "one")  # a one-token prompt: said so, not an empty table of "0 least likely"
    assert one.exit_code == 0 and "no position of this record is scored" in one.stdout, one.output
    assert "least likely" not in one.stdout


def test_completion_tokens_of_a_generate_run(files) -> None:
    path = files["generate_lp"]
    r = show(path, "--position", "1")
    assert r.exit_code == 0, r.output
    rec = row(path, "g")
    assert "5 completion tokens" in r.stdout
    assert (f"(id {rec['completion_token_ids'][1]}), logprob {rec['completion_logprobs'][1]:.4f}, rank "
            f"{rec['completion_ranks'][1]}") in r.stdout
    assert f"{rec['completion_top_logprobs'][1][1]:.4f}" in r.stdout


def test_a_moved_file_shows_ids_until_given_the_tokenizer(files, tmp_path) -> None:
    t = pq.read_table(files["score"])
    meta = json.loads(t.schema.metadata[b"apcscore"])
    model = meta["model"]["path"]
    meta["model"]["path"] = meta["tokenizer"]["name_or_path"] = str(tmp_path / "gone")
    moved = tmp_path / "moved.parquet"
    pq.write_table(t.replace_schema_metadata({b"apcscore": json.dumps(meta)}), moved)
    r = show(moved, "--id", "code")
    ids = row(moved, "code")["token_ids"]
    assert r.exit_code == 0 and "".join(f"⟨{i}⟩" for i in ids[:4]) in r.stdout
    assert "note: tokens are shown as ids: the tokenizer folder" in " ".join(r.stderr.split())
    r = show(moved, "--id", "code", "--tokenizer", model)
    assert r.exit_code == 0 and "return a + b" in r.stdout


@pytest.mark.parametrize("case, args, message", [
    ("missing file", ["{tmp}/none.parquet"], "none.parquet does not exist"),
    ("a directory", ["{tmp}"], "is a directory — give a parquet file"),
    ("not parquet", ["{tmp}/x.jsonl"], "is not a parquet file"),
    ("not apcscore output", ["{tmp}/plain.parquet"], "is not apcscore output"),
    ("unknown id", ["{score}", "--id", "nope"], ("no record with id 'nope' in ", "score.parquet (4 records: 'q', "
                                                 "'one', 'capital', 'code')")),
    ("position out of range", ["{score}", "--id", "code", "--position", "99"],
     "--position 99 is out of range: record 'code' has 13 prompt tokens (positions 0 to 12)"),
    ("position 0", ["{score}", "--id", "code", "--position", "0"],
     "--position 0: the first prompt token has no context, so no logprob; choose 1 to 12"),
    ("a record without token logprobs", ["{score}", "--id", "q"],
     "record 'q' has no per-token logprobs (a continuation or multiple-choice record stores per-record figures "
     "only)"),
    ("generate without logprobs", ["{generate}"], "has no per-token logprobs (written by `apcscore generate` without "
                                                  "them): generate with --logprobs K"),
    ("perplexity without logprobs", ["{perplexity}"], "run perplexity with --prompt-logprobs K"),
    ("--completion of a score file", ["{score}", "--completion"], ("--completion: ", "score.parquet has no "
                                                                   "completion logprobs")),
    ("no record with token logprobs", ["{tmp}/choices.parquet"], "no record of "),
    ("--tokenizer not a tokenizer", ["{score}", "--tokenizer", "{tmp}"], "--tokenizer"),
    # issue 46, item 13: a file was said to be a folder that does not exist; an eval's requests.parquet "not
    # apcscore output"
    ("--tokenizer a file", ["{score}", "--tokenizer", "{tmp}/x.jsonl"], ("x.jsonl is a file — give the "
                                                                        "tokenizer's folder",)),
    ("an eval's requests.parquet", ["{tmp}/requests.parquet"], "holds the requests of an `apcscore eval` run"),
])
def test_clear_errors(files, tmp_path, case, args, message) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    (tmp_path / "x.jsonl").write_text("{}\n")
    pq.write_table(pa.table({"id": ["a"]}), tmp_path / "plain.parquet")
    pq.write_table(pa.table({"task": ["t"]}).replace_schema_metadata({b"apcscore": json.dumps({"command": "eval"})}),
                   tmp_path / "requests.parquet")
    scored = pq.read_table(files["score"])  # its multiple-choice record alone
    pq.write_table(scored.filter(pc.equal(scored["id"], "q")), tmp_path / "choices.parquet")
    where = {"tmp": tmp_path, **files}
    r = show(*(a.format(**where) for a in args))
    assert r.exit_code == 2, (case, r.output)
    err = " ".join(r.stderr.split())
    parts = message if isinstance(message, tuple) else (message,)
    assert (err.startswith("error: ") and all(m in err for m in parts) and err.count("error:") == 1
            and "Traceback" not in r.output), (case, err)
