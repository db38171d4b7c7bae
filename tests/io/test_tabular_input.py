"""Datasets beyond JSONL: parquet, CSV and save_to_disk directories read into the same records; --columns."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.errors import ApcscoreError
from apcscore.io.reader import load_dataset
from apcscore.io.tabular_input import parse_columns, rename

ROWS = [
    {"id": "a", "context": "The capital of France is", "choices": ["Paris", "Rome"], "answer": 0},
    {"id": "b", "context": "Two plus two is", "choices": ["four", "five", "six"], "answer": 0},
    {"id": "c", "prompt": "Hello there"},
]


def _table(rows: list[dict]) -> pa.Table:
    """rows as a table with every key of any row (pyarrow's from_pylist takes the first row's keys only)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])


def _fields(data) -> list[tuple]:
    return [(r.id, r.kind, r.fields) for r in data.records]


@pytest.fixture
def jsonl(tmp_path, write_jsonl):
    return load_dataset(write_jsonl(tmp_path / "d.jsonl", ROWS), "score")


def test_parquet_equals_jsonl(tmp_path, jsonl):
    path = tmp_path / "d.parquet"
    pq.write_table(_table(ROWS), path)  # missing keys become nulls: absent again
    data = load_dataset(path, "score")
    assert _fields(data) == _fields(jsonl)
    assert len(data.sha256) == 64


def test_csv_with_json_list_cells_equals_jsonl(tmp_path, jsonl):
    path = tmp_path / "d.csv"
    table = _table([{**r, "choices": json.dumps(r["choices"]) if "choices" in r else None}
                                  for r in ROWS])
    pacsv.write_csv(table, path)
    assert _fields(load_dataset(path, "score")) == _fields(jsonl)


def test_save_to_disk_directory_equals_jsonl(tmp_path, jsonl):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(_table(ROWS).to_pylist())
    ds.save_to_disk(str(tmp_path / "saved"))
    assert _fields(load_dataset(tmp_path / "saved", "score")) == _fields(jsonl)
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ApcscoreError, match="DatasetDict"):
        load_dataset(tmp_path / "dd", "score")


def test_columns_map_fields(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"doc_id": 7, "body": "Some text."}, {"doc_id": 8, "body": "More."}]), path)
    data = load_dataset(path, "perplexity", columns=parse_columns("text=body,id=doc_id"))
    assert [(r.id, r.fields["text"]) for r in data.records] == [("7", "Some text."), ("8", "More.")]
    assert parse_columns("prompt=text, id=doc_id") == {"prompt": "text", "id": "doc_id"}
    assert rename({"text": "x", "other": 1}, {"prompt": "text"}) == {"prompt": "x", "other": 1}
    for bad in ("prompt", "=text", "prompt=a,prompt=b"):
        with pytest.raises(ApcscoreError, match="--columns"):
            parse_columns(bad)


def test_errors_name_file_and_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "fine"}, {"text": None}, {"text": "also fine"}]), path)
    with pytest.raises(ApcscoreError, match=rf"{path}:row 2: ") as err:
        load_dataset(path, "perplexity")
    assert "1 of 3 records are invalid" in str(err.value)
    data = load_dataset(path, "perplexity", skip_invalid=True, limit=2)
    assert [r.line for r in data.records] == [1] and [r.line for r in data.invalid] == [2]
    with pytest.raises(ApcscoreError, match="cannot read"):
        (tmp_path / "broken.parquet").write_bytes(b"not parquet")
        load_dataset(tmp_path / "broken.parquet", "perplexity")


def test_a_cell_nested_too_deeply_is_an_error_row_not_a_traceback(tmp_path):
    """Issue 53, item 7: a list field's cell of 100,000 `[` raised RecursionError from the JSON parser, a traceback.
    It stays text, as a cell that is not JSON does: the record checks name the file, row and field (exit 2, or an
    error row with --skip-invalid); in `stop` such text is a stop string like any other."""
    deep = "[" * 100_000
    csv_path = tmp_path / "deep.csv"
    csv_path.write_text(f'id,prompt_token_ids\na,"[1, 2]"\nb,{deep}\n', encoding="utf-8")
    parquet_path = tmp_path / "deep.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt_token_ids": ["[1, 2]", deep]}), parquet_path)
    for path in (csv_path, parquet_path):
        with pytest.raises(ApcscoreError, match=rf"{path}:row 2: 'prompt_token_ids' must be a list of token ids") as e:
            load_dataset(path, "score")
        assert e.value.exit_code == 2 and "1 of 2 records are invalid" in str(e.value)
        data = load_dataset(path, "score", skip_invalid=True)
        assert [r.id for r in data.records] == ["a"] and [(r.id, r.line) for r in data.invalid] == [("b", 2)]
    pq.write_table(pa.table({"prompt": ["x"], "stop": [deep]}), tmp_path / "stop.parquet")
    (record,) = load_dataset(tmp_path / "stop.parquet", "generate").records
    assert record.fields["stop"] == deep


def test_perplexity_command_reads_csv_with_columns(tmp_path, tiny_model_dir):
    path = tmp_path / "texts.csv"
    pacsv.write_csv(pa.Table.from_pylist([{"name": "one", "body": "A short text to score."},
                                          {"name": "two", "body": "Another one, a bit longer than that."}]), path)
    out = tmp_path / "ppl.parquet"
    result = CliRunner().invoke(app, ["perplexity", str(path), "--columns", "text=body,id=name", "--model",
                                      str(tiny_model_dir("llama")), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column("id").to_pylist() == ["one", "two"]
    assert table.column("status").to_pylist() == ["ok", "ok"]


# ---- CSV cells are text (issue 24) -------------------------------------------------------------------------
def _write_csv(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_cells_are_strings_unless_the_schema_says_number(tmp_path, write_jsonl):
    rows = [{"id": "007", "prompt": "0042", "max_tokens": 3, "temperature": 0.5, "seed": -2},
            {"id": "1e3", "prompt": "3.0", "top_p": 1, "top_k": 0}]
    path = _write_csv(tmp_path / "g.csv", "id,prompt,max_tokens,temperature,seed,top_p,top_k\n"
                                         "007,0042,3,0.5,-2,,\n1e3,3.0,,,,1,0\n")
    got = load_dataset(path, "generate")
    assert _fields(got) == _fields(load_dataset(write_jsonl(tmp_path / "g.jsonl", rows), "generate"))
    assert [r.id for r in got.records] == ["007", "1e3"]
    # a number field whose cell is no number is refused by the record checks, naming the row
    bad = _write_csv(tmp_path / "bad.csv", "context,choices,answer\nQ,\"[\"\"a\"\",\"\"b\"\"]\",first\n")
    with pytest.raises(ApcscoreError, match=rf"{bad}:row 1: 'answer' must be an integer index"):
        load_dataset(bad, "score")
    # --columns: the cells of the column read for `answer` are numbers
    mapped = _write_csv(tmp_path / "m.csv", "q,opts,label\nQ,\"[\"\"a\"\",\"\"b\"\"]\",1\n")
    rec = load_dataset(mapped, "score", columns=parse_columns("context=q,choices=opts,answer=label")).records[0]
    assert rec.fields == {"context": "Q", "choices": ["a", "b"], "answer": 1}


def test_csv_only_an_empty_cell_is_null(tmp_path):
    path = _write_csv(tmp_path / "na.csv", 'id,context,continuation\nNA,N/A,null\nNaN,"",NA\n,x,nan\n')
    data = load_dataset(path, "score", skip_invalid=True)
    assert [(r.id, r.fields) for r in data.records] == [
        ("NA", {"context": "N/A", "continuation": "null"}),
        ("3", {"context": "x", "continuation": "nan"}),  # an empty id cell: the row number
    ]
    (empty,) = data.invalid  # an empty cell (quoted or not) is an absent field
    assert empty.id == "NaN" and "needs 'context'" in empty.message


def test_csv_duplicate_header_is_refused_with_file_and_column(tmp_path):
    path = _write_csv(tmp_path / "dup.csv", "id,prompt,prompt\n1,a,b\n")
    with pytest.raises(ApcscoreError) as err:
        load_dataset(path, "score")
    assert str(path) in str(err.value) and "'prompt' twice" in str(err.value) and "column 3" in str(err.value)


def test_csv_cell_larger_than_a_block(tmp_path):
    big = "x" * (3 << 20)  # 3 MiB: pyarrow's default block is 1 MiB
    path = _write_csv(tmp_path / "big.csv", f"id,text\nsmall,a text\nbig,{big}\n")
    data = load_dataset(path, "perplexity")
    assert [(r.id, r.fields["text"]) for r in data.records] == [("small", "a text"), ("big", big)]


def test_csv_quoted_newlines_in_a_large_file(tmp_path):
    texts = [f"line one {i}\nline two, with a comma\n\"quoted\"" for i in range(40_000)]  # ~2.5 MiB: blocks
    path = tmp_path / "lines.csv"
    with path.open("w", encoding="utf-8", newline="") as f:
        f.write("id,text\n")
        for i, t in enumerate(texts):
            f.write(f"r{i},\"{t.replace(chr(34), chr(34) * 2)}\"\n")
    data = load_dataset(path, "perplexity")
    assert data.num_records == len(texts) and not data.invalid
    assert [r.fields["text"] for r in data.records] == texts
    assert [r.id for r in data.records] == [f"r{i}" for i in range(len(texts))]
