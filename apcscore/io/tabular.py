"""Datasets beyond JSONL: parquet, CSV and `datasets.save_to_disk` directories, and `--columns` renaming.

Rows are read with pyarrow (parquet, CSV) or `datasets.load_from_disk` (a saved Dataset directory) as plain
Python values and then go through the same record checks as JSONL lines (`io/reader.py`); messages name the
file and the row (`FILE:row N`, rows counted from 1 after any CSV header). As in JSONL, a null cell counts as
an absent field (tables fill missing values with null), and so does an empty CSV cell. CSV cells are text or numbers as pyarrow infers them
per column; a list column (`choices`, `prompt_token_ids`) can be written as a JSON list in its cell.

`--columns prompt=text,id=doc_id` gives a record field (left) the column it is read from (right).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from apcscore.errors import ApcscoreError

TABULAR_SUFFIXES = (".parquet", ".csv")
_LIST_FIELDS = ("choices", "prompt_token_ids", "stop", "messages")


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
        import pyarrow.csv as pacsv

        # an empty cell is null, so absent: CSV cannot tell an empty string from a missing value
        return pacsv.read_csv(name, convert_options=pacsv.ConvertOptions(strings_can_be_null=True)).to_pylist()
    except ApcscoreError:
        raise
    except FileNotFoundError:
        raise ApcscoreError(f"{name} does not exist; check the path of the dataset") from None
    except Exception as exc:  # pyarrow / datasets raise many kinds for unreadable files
        raise ApcscoreError(f"cannot read {name}: {type(exc).__name__}: {exc}") from None


def _cell(key: str, value: Any) -> Any:
    """A CSV cell holding a JSON list for a list field becomes the list."""
    if key in _LIST_FIELDS and isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def read_table_records(path: Path) -> tuple[str, Iterator[tuple[int, dict[str, Any]]]]:
    """(sha256 of the file or directory, (row number from 1, row without null cells) for each row)."""
    rows = _table_rows(path)
    if not rows:
        raise ApcscoreError(f"{path} has no rows")
    return _sha256(path), ((i, {k: _cell(k, v) for k, v in row.items() if v is not None})
                           for i, row in enumerate(rows, start=1))
