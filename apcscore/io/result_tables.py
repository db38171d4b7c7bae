"""Parquet and metadata helpers of the results writer: rows -> table, strict JSON metadata, atomic writes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from apcscore.errors import ApcscoreError

METADATA_KEY = b"apcscore"
RUN_FILE = "run.json"


def jsonable(value: Any, nonfinite: float | None = None) -> Any:
    """`value` with non-finite floats replaced by `nonfinite`, tuples by lists (what strict JSON can hold)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else nonfinite
    if isinstance(value, dict):
        return {str(k): jsonable(v, nonfinite) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, nonfinite) for v in value]
    return value


def dumps_metadata(metadata: dict) -> str:
    try:
        return json.dumps(jsonable(metadata), allow_nan=False, ensure_ascii=False)
    except TypeError as e:
        raise TypeError(f"run metadata must be JSON-serializable: {e}") from None


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def records_to_table(rows: list[dict], schema: pa.Schema) -> pa.Table:
    """Rows (dicts keyed by column name; a missing key is null) as a table of `schema`.

    Raises ValueError naming the row and column when a value does not fit its column, and for keys that
    are not columns of the schema.
    """
    names = set(schema.names)
    for i, row in enumerate(rows):
        extra = row.keys() - names
        if extra:
            raise ValueError(f"row {i} has keys that are not columns of the schema: {sorted(extra)}")
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as e:
        for i, row in enumerate(rows):  # find the culprit for the message
            for f in schema:
                try:
                    pa.array([row.get(f.name)], type=f.type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as cell:
                    raise ValueError(f"row {i}, column {f.name!r} ({f.type}): {cell}") from e
        raise ValueError(f"rows do not fit the schema: {e}") from e


def open_result_file(path: str | Path, label: str, reader: str, written_by: str) -> tuple[pq.ParquetFile, dict]:
    """A parquet file apcscore wrote and its run metadata (the JSON object under the key `apcscore`), or an
    ApcscoreError that says what is wrong with it: the one reader of result files (compare, show, merge).

    Messages name the file as `label` (e.g. "baseline file x.parquet") and say what `reader` (e.g. "compare") reads:
    files written by `written_by` (e.g. "apcscore score or perplexity")."""
    path = Path(path)
    if path.is_dir():
        raise ApcscoreError(f"{label} is a directory — give a parquet file written by {written_by}")
    if not path.is_file():
        raise ApcscoreError(f"{label} does not exist")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ApcscoreError(f"{label} is not a parquet file: {e}") from None
    raw = (pf.schema_arrow.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ApcscoreError(f"{label} is not apcscore output: its parquet metadata has no 'apcscore' key; {reader} "
                            f"reads files written by {written_by}")
    try:
        meta = json.loads(raw)
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise ApcscoreError(f"{label} is not apcscore output: its 'apcscore' metadata is not a JSON object")
    return pf, meta


def read_run_metadata(path: str | Path) -> dict:
    """The run metadata (JSON under schema metadata key ``apcscore``) of a results file or partial dir."""
    path = Path(path)
    if path.is_dir():
        run = path / RUN_FILE
        if not run.exists():
            raise ApcscoreError(f"{path} is a directory but not an apcscore partial (no {RUN_FILE})")
        return json.loads(run.read_text(encoding="utf-8"))["metadata"]
    return open_result_file(path, str(path), "this command", "apcscore")[1]
