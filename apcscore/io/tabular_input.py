"""Datasets beyond JSONL: parquet, CSV and `datasets.save_to_disk` directories, and `--columns` renaming.

Rows are read with pyarrow (parquet, CSV) or `datasets.load_from_disk` (a saved Dataset directory) as plain
Python values and then go through the same record checks as JSONL lines (`io/reader.py`); messages name the
file and the row (`FILE:row N`, rows counted from 1 after any CSV header). As in JSONL, a null cell counts as
an absent field (tables fill missing values with null).

CSV cells are text (README.md, "Datasets"): every column is read as a string, and only the fields the record
schema declares as numbers are converted (CSV_NUMBERS); a list field can be written as a JSON list in its cell;
only an empty cell is null (`NA`, `null` are the strings they read). How a CSV is parsed: `_csv_rows`.

`--columns prompt=text,id=doc_id` gives a record field (left) the column it is read from (right).
"""

from __future__ import annotations

import hashlib
import csv
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from apcscore.config import RECORD_NUMBERS
from apcscore.errors import ApcscoreError

TABULAR_SUFFIXES = (".parquet", ".csv")
_LIST_FIELDS = ("choices", "prompt_token_ids", "stop", "messages")
CSV_NUMBERS: dict[str, type] = {"answer": int, **RECORD_NUMBERS}  # what a CSV cell of the field is read as
_INT = re.compile(r"[+-]?[0-9]+")


def parse_columns(spec: str | None) -> dict[str, str]:
    """`prompt=text,id=doc_id` -> {"prompt": "text", "id": "doc_id"} (field -> column)."""
    if not spec:
        return {}
    mapping: dict[str, str] = {}
    for part in spec.split(","):
        field, sep, column = (p.strip() for p in part.partition("="))
        if not sep or not field or not column:
            raise ApcscoreError(f"--columns {spec!r}: each entry is FIELD=COLUMN, e.g. prompt=text,id=doc_id "
                                f"(got {part.strip()!r})")
        if field in mapping:
            raise ApcscoreError(f"--columns {spec!r}: field {field!r} is mapped twice")
        mapping[field] = column
    return mapping


def rename(obj: Any, columns: dict[str, str]) -> Any:
    """The record `obj` with each mapped column renamed to its field (other keys kept; non-dicts as they are)."""
    if not columns or not isinstance(obj, dict):
        return obj
    sources = set(columns.values())
    out = {k: v for k, v in obj.items() if k not in sources and k not in columns}
    for field, column in columns.items():
        if column in obj:
            out[field] = obj[column]
    return out


def is_tabular(path: Path) -> bool:
    """A parquet or CSV file, or a `save_to_disk` directory (a Dataset's state.json / dataset_info.json, or a
    DatasetDict's dataset_dict.json)."""
    if path.is_dir():
        return any((path / f).exists() for f in ("state.json", "dataset_info.json", "dataset_dict.json"))
    return path.suffix.lower() in TABULAR_SUFFIXES


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in files:
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
    return sha.hexdigest()


def _table_rows(path: Path) -> list[dict[str, Any]]:
    name = str(path)
    try:
        if path.is_dir():
            import datasets

            data = datasets.load_from_disk(name)
            if isinstance(data, datasets.DatasetDict):
                raise ApcscoreError(f"{name} is a DatasetDict with splits {sorted(data)}; give one split's "
                                    f"directory, e.g. {path / sorted(data)[0]}")
            return data.to_list()
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(name).to_pylist()
        return _csv_rows(path)
    except ApcscoreError:
        raise
    except FileNotFoundError:
        raise ApcscoreError(f"{name} does not exist; check the path of the dataset") from None
    except Exception as exc:  # pyarrow / datasets raise many kinds for unreadable files
        raise ApcscoreError(f"cannot read {name}: {type(exc).__name__}: {exc}") from None


def _csv_header(path: Path) -> list[str]:
    """The header's column names; duplicate names are refused (the file and the column)."""
    with path.open(newline="", encoding="utf-8-sig") as f:
        names = next(csv.reader(f), [])
    first: dict[str, int] = {}  # column name -> its first position
    for position, column in enumerate(names, start=1):
        if column in first:
            raise ApcscoreError(f"{path}: the header names column {column!r} twice (column {position} and column "
                                f"{first[column]}); rename one of them, or remove it")
        first[column] = position
    return names


def _csv_rows(path: Path) -> list[dict[str, Any]]:
    """Every cell a string (CSV_NUMBERS are converted later, by field), only an empty cell null, quoted newlines
    kept, blocks large enough for the largest cell (the whole file, at most 1 GiB: a row may not straddle two)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    names = _csv_header(path)
    block = min(max(path.stat().st_size + 1, 1 << 20), 1 << 30)
    table = pacsv.read_csv(
        str(path),
        read_options=pacsv.ReadOptions(block_size=block),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, null_values=[""],
                                             strings_can_be_null=True, quoted_strings_can_be_null=True))
    return table.to_pylist()


def _number(kind: type, text: str) -> Any:
    """A CSV cell of a numeric field as its number; text that is no such number stays text (the record checks
    then say what the field must be; for a float field, that `inf`, `nan` or `1e400` is not finite)."""
    try:
        if _INT.fullmatch(text.strip()):
            return int(text)
        return float(text) if kind is float else text
    except ValueError:
        return text


def _cell(field: str, value: Any, csv_text: bool) -> Any:
    """A cell holding a JSON list for a list field becomes the list; a CSV cell of a numeric field its number.
    A cell that does not parse as JSON (malformed, or nested too deeply for the parser) stays text: the record
    checks then name the file, row and field (an error row with --skip-invalid), and a `stop` string may start
    with "[" (`[/INST]`)."""
    if not isinstance(value, str):
        return value
    if field in _LIST_FIELDS and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value
    if csv_text and field in CSV_NUMBERS:
        return _number(CSV_NUMBERS[field], value)
    return value


def read_table_records(path: Path, columns: dict[str, str] | None = None
                       ) -> tuple[str, Iterator[tuple[int, dict[str, Any]]]]:
    """(sha256 of the file or directory, (row number from 1, row without null cells) for each row). `columns`
    (field -> column, as --columns) says which field a column's cells are read for."""
    rows = _table_rows(path)
    if not rows:
        raise ApcscoreError(f"{path} has no rows")
    field_of = {column: field for field, column in (columns or {}).items()}
    csv_text = not path.is_dir() and path.suffix.lower() == ".csv"
    return _sha256(path), ((i, {k: _cell(field_of.get(k, k), v, csv_text) for k, v in row.items() if v is not None})
                           for i, row in enumerate(rows, start=1))
