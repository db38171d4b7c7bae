"""The results writer: rows stream to disk as they finish; the final parquet file is in dataset order.

Layout and crash safety
-----------------------
While a run goes, rows are written to ``<out>.partial/``, a directory of part files::

    results.parquet.partial/
        run.json              this run's metadata and schema (written first, replaced atomically)
        part-000000.parquet   a complete small parquet file: up to `row_group_size` rows sorted by `index`
        part-000001.parquet   ...

A partial holding anything else (io/partial.py's `is_partial_file`) is not ours and is never touched.

Each part file is written under a temporary name and renamed into place, so at any moment (also after
``kill -9``) every ``part-*.parquet`` is complete and readable; a crash loses only the rows still buffered
in memory: a part is written when `row_group_size` rows are buffered or the oldest buffered row is
`max_buffer_seconds` (1 s) old, checked at every `add` and at every `flush_if_due` (the runner calls it after
each engine step), so a crash loses at most about a second of finished rows. A single growing
``ParquetWriter`` file would be unreadable without its footer after a crash, so we do not use one.
Nothing is fsynced: this survives a crash of the process, not of the machine.

`close()` assembles ``<out>`` by a streaming merge of the parts by `index` (io/partial.py's `merged_parts`: memory
follows the out-of-order window, not the dataset), writes it under a temporary name inside the partial directory
(the same file system as ``<out>``), renames it over ``<out>`` with `os.replace` and removes the partial. The final
file has the run's schema (no `index` column), one row per record in dataset order, row groups of `row_group_size`
rows, and the run metadata as strict JSON (a non-finite float, e.g. tokens/s of a zero-second run, as null) under
the schema metadata key ``apcscore``. Its content depends only on the rows and metadata, so a resumed run writes the
same file an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from apcscore.errors import ApcscoreError
from apcscore.io import identity
from apcscore.io.partial import (FINAL_TMP, INDEX_COLUMN, LINES_TMP, PART_GLOB, check_run_file, in_use, is_partial_file,
                                 lock_partial, merged_parts)
from apcscore.io.result_tables import METADATA_KEY, RUN_FILE, dumps_metadata, records_to_table, write_atomic


class ResultsWriter:
    """Collects result rows in completion order and writes the dataset-ordered parquet file on `close`.

    Usage::

        writer = ResultsWriter(out, schema, metadata, resume=resume)
        todo = [r for r in records if r.index not in writer.done_indices]
        for index, row in run(todo):
            writer.add(index, row)
        writer.update_metadata({"timings": ...})
        writer.close()

    An existing `out` is only replaced with `overwrite=True` (and only at `close`, atomically). An existing
    partial needs `resume=True` (continue it) or `overwrite=True` (discard it). With `resume=True`,
    `resume_check(old, new)` must find no difference between the partial's metadata and `metadata` (by default,
    the RESUME view of a run's identity: io/identity.py), and the partial's columns must be the schema's.
    `num_rows`, when given, is the number of rows the final file must have (indices 0..num_rows-1);
    otherwise `close` requires the indices added to be exactly 0..n-1.

    `lines(index, row) -> str`, when set (also after construction), makes the final file JSON lines instead of
    parquet: one line per row, in dataset order (`--output-format openai-batch`); the partial is the same.
    `errors_path`, when set with `lines`, takes the lines of the rows whose status is not "ok" (`--errors-out`,
    OpenAI's error file; always written, empty when no row failed), `<out>` the others.
    """

    _lock: int | None = None  # the partial's lock (io/partial.py), held until it is assembled or removed

    def __init__(self, out_path: str | Path, schema: pa.Schema, metadata: dict, *, overwrite: bool = False,
                 resume: bool = False, row_group_size: int = 256, num_rows: int | None = None,
                 max_buffer_seconds: float = 1.0,
                 resume_check: Callable[[dict, dict], list[str]] = identity.resume_check) -> None:
        if INDEX_COLUMN in schema.names:
            raise ValueError(f"the schema may not have a column named {INDEX_COLUMN!r} (the writer's own)")
        if row_group_size < 1:
            raise ValueError(f"row_group_size must be at least 1, not {row_group_size}")
        self.out_path = Path(out_path)
        self.partial_path = self.out_path.with_name(self.out_path.name + ".partial")
        self.schema = schema
        self.row_group_size = row_group_size
        self.num_rows = num_rows
        self.max_buffer_seconds = max_buffer_seconds
        self._metadata = json.loads(dumps_metadata(metadata))
        self._part_schema = pa.schema([pa.field(INDEX_COLUMN, pa.int64(), nullable=False), *schema])
        self._parts: list[tuple[Path, int]] = []  # (a part file, its smallest index)
        self._buffer: list[tuple[int, dict]] = []
        self._buffer_since = 0.0
        self._flushing = False
        self._closed = False
        self._next_part = 0
        self.done_indices: set[int] = set()
        self.previous_metadata: dict | None = None  # the resumed partial's metadata (None: a fresh run)
        self._resume_check = resume_check
        self.lines: Callable[[int, dict], str] | None = None
        self.errors_path: Path | None = None
        self._before_flush: Callable[[], None] | None = None

        if self.out_path.is_dir():
            raise ApcscoreError(f"--out {self.out_path} is a directory; give a file name such as "
                                f"{self.out_path / 'results.parquet'}")
        if self.out_path.exists() and not overwrite:
            raise ApcscoreError(f"{self.out_path} already exists; pass --overwrite to replace it "
                                "or choose another --out")
        self.notes: list[str] = []  # what a caller should tell the user (a partial discarded on --resume)
        existed = self.partial_path.exists()
        if existed:
            self._check_ours()
        else:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.partial_path.mkdir()
            except FileExistsError:  # another run created it a moment ago
                raise in_use(self.partial_path) from None
        self._lock = lock_partial(self.partial_path)  # a run still writing it: refused before touching it
        try:
            self._open_partial(existed, resume, overwrite)
        except BaseException:
            self.release()
            raise

    def _open_partial(self, existed: bool, resume: bool, overwrite: bool) -> None:
        """Continue (`resume`) or empty (`overwrite`) the locked partial that `existed`, or start a new one."""
        if existed and resume:
            self._resume()
            return
        if existed and not overwrite:
            raise ApcscoreError(f"{self.partial_path} holds an unfinished run; pass --resume to continue it, or "
                                "--overwrite to discard it and start over")
        for child in self.partial_path.iterdir() if existed else ():  # emptied, not removed: the lock is on it
            child.unlink()
        self._write_run_file()

    # ------------------------------------------------------------------ public interface

    def add(self, index: int, row: dict) -> None:
        """Buffer the row of record `index` (rows come in completion order; each index exactly once)."""
        if self._closed:
            raise RuntimeError("add() after close()")
        if not isinstance(index, int) or index < 0 or (self.num_rows is not None and index >= self.num_rows):
            raise ValueError(f"index {index!r} is out of range (0..{self.num_rows})")
        if index in self.done_indices:
            raise ValueError(f"a row for index {index} was already added")
        self.done_indices.add(index)
        if not self._buffer:
            self._buffer_since = time.monotonic()
        self._buffer.append((index, row))
        if len(self._buffer) >= self.row_group_size:
            self.flush()
        else:
            self.flush_if_due()

    def flush_if_due(self) -> None:
        """Flush when the oldest buffered row has waited `max_buffer_seconds` (cheap to call after every step)."""
        if self._buffer and time.monotonic() - self._buffer_since >= self.max_buffer_seconds:
            self.flush()

    def previous_rows(self, columns: list[str]) -> Iterator[dict]:
        """The rows a resumed partial already holds (only `columns` of them), in no particular order."""
        names = [c for c in columns if c in self.schema.names]
        for path, _ in self._parts:
            yield from pq.read_table(path, columns=names).to_pylist()

    def abandon(self) -> None:
        """Remove the partial when it holds no finished row (a run that failed before any), so that it does not
        block the next run; keep it otherwise."""
        if not self._closed and not self.done_indices and self.partial_path.is_dir():
            shutil.rmtree(self.partial_path, ignore_errors=True)
            self.release()

    def release(self) -> None:
        """Let go of the partial's lock (the run is over, however it ended); its files stay as they are."""
        if self._lock is not None:
            os.close(self._lock)
        self._lock = None

    def __del__(self) -> None:  # a writer dropped without closing (as a library user may) gives its lock back
        self.release()

    def before_flush(self, hook: Callable[[], None] | None) -> None:
        """Call `hook()` before each part file is written (the driver keeps the timings so far in run.json)."""
        self._before_flush = hook

    def flush(self) -> None:
        """Write the buffered rows as one part file (safe to call from a signal handler between adds)."""
        if self._flushing or not self._buffer:
            return
        self._flushing = True
        try:
            if self._before_flush is not None:
                self._before_flush()
            buffered, self._buffer = self._buffer, []
            buffered.sort(key=lambda item: item[0])
            rows = [{INDEX_COLUMN: i, **row} for i, row in buffered]
            try:
                table = records_to_table(rows, self._part_schema)
            except ValueError as e:
                for i, _ in buffered:
                    self.done_indices.discard(i)
                raise ValueError(f"results of indices {[i for i, _ in buffered][:10]}...: {e}") from None
            path = self.partial_path / f"part-{self._next_part:06d}.parquet"
            self._next_part += 1
            tmp = path.with_name(path.name + ".tmp")
            pq.write_table(table, tmp)
            os.replace(tmp, path)
            self._parts.append((path, buffered[0][0]))
        finally:
            self._flushing = False

    def update_metadata(self, updates: dict) -> None:
        """Merge `updates` into the run metadata (top-level keys), e.g. timings known only at the end."""
        self._metadata.update(json.loads(dumps_metadata(updates)))
        self._write_run_file()

    def close(self) -> Path:
        """Write the final file (all rows present), atomically, and remove the partial. Returns its path."""
        if self._closed:
            return self.out_path
        self.flush()
        expected = self.num_rows if self.num_rows is not None else len(self.done_indices)
        if len(self.done_indices) != expected or (expected and max(self.done_indices) != expected - 1):
            missing = sorted(set(range(expected)) - self.done_indices)
            self.release()  # the partial is kept for a --resume, which needs its lock
            raise ApcscoreError(
                f"{len(missing)} of {expected} rows are missing (indices {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}); the finished rows are kept in {self.partial_path}: "
                "rerun with --resume to complete it", exit_code=1)
        if self.lines is not None:
            self._write_lines(expected)
            return self.out_path
        tmp = self.partial_path / FINAL_TMP
        schema = self.schema.with_metadata({**(self.schema.metadata or {}),
                                            METADATA_KEY: dumps_metadata(self._metadata).encode()})

        def write() -> None:
            with pq.ParquetWriter(tmp, schema) as writer:
                for chunk in self._merged(expected):
                    writer.write_table(chunk.drop_columns([INDEX_COLUMN]), row_group_size=self.row_group_size)

        self._put_in_place(tmp, write)
        return self.out_path

    # ------------------------------------------------------------------ internals

    def _write_lines(self, total: int) -> None:
        """The final file as JSON lines (`self.lines`), written under a temporary name and renamed into place, so
        `<out>` is complete whenever it exists; then the partial goes. The error lines' temporary is written next
        to `errors_path`: a rename never crosses file systems (`--errors-out` may be on another one than <out>)."""
        assert self.lines is not None
        tmp, errors = self.partial_path / LINES_TMP, self.errors_path
        errors_tmp = errors.with_name(errors.name + ".tmp") if errors is not None else None

        def write() -> None:
            try:
                if errors_tmp is not None:
                    errors_tmp.parent.mkdir(parents=True, exist_ok=True)
                with tmp.open("w", encoding="utf-8") as f, \
                        (errors_tmp.open("w", encoding="utf-8") if errors_tmp else contextlib.nullcontext(f)) as e:
                    for chunk in self._merged(total):
                        for row in chunk.to_pylist():
                            index = row.pop(INDEX_COLUMN)
                            (f if row.get("status") == "ok" else e).write(self.lines(index, row) + "\n")
                if errors is not None and errors_tmp is not None:  # first: <out> existing means the run is complete
                    os.replace(errors_tmp, errors)
            except BaseException:
                if errors_tmp is not None:
                    errors_tmp.unlink(missing_ok=True)
                raise

        self._put_in_place(tmp, write)

    def _put_in_place(self, tmp: Path, write: Any) -> None:
        """`write()` the final file to `tmp`, rename it to `<out>` (complete whenever it exists), drop the
        partial; a failure leaves no temporary file."""
        try:
            write()
            os.replace(tmp, self.out_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        shutil.rmtree(self.partial_path)
        self.release()
        self._closed = True

    def _merged(self, total: int) -> Iterator[pa.Table]:
        """Tables of `row_group_size` consecutive indices, in order, merged from the sorted parts."""
        return merged_parts(self._parts, self._part_schema, total, self.row_group_size, self.partial_path)

    def _write_run_file(self) -> None:
        run = {"metadata": self._metadata, "schema": self.schema.serialize().to_pybytes().hex()}
        write_atomic(self.partial_path / RUN_FILE, json.dumps(run, ensure_ascii=False).encode())

    def _check_ours(self) -> None:
        """Refuse to touch a `.partial` path this writer did not create (anything but a folder of our files)."""
        p = self.partial_path
        if not p.is_dir() or any(not is_partial_file(child.name) for child in p.iterdir()):
            raise ApcscoreError(f"{p} exists but is not an apcscore partial run; move it away "
                                "or choose another --out")

    def _resume(self) -> None:
        old_meta = check_run_file(self.partial_path, self._metadata, self.schema, self._resume_check)
        if old_meta is None:  # the previous run died before writing anything
            leftovers = list(self.partial_path.iterdir())
            for leftover in leftovers:
                leftover.unlink()
            self.notes.append(f"{self.partial_path} had no {RUN_FILE} (its run ended before writing one), so it "
                              f"held no rows" + (f"; its {len(leftovers)} leftover file(s) were removed" if leftovers
                                                 else "") + "; starting a fresh run")
            self._write_run_file()
            return
        self.previous_metadata = old_meta
        for leftover in self.partial_path.glob("*.tmp"):
            leftover.unlink()
        for path in sorted(self.partial_path.glob(PART_GLOB)):
            try:
                table = pq.read_table(path, columns=[INDEX_COLUMN])
            except (pa.ArrowInvalid, OSError) as e:
                raise ApcscoreError(f"cannot resume: {path} is damaged ({e}); pass --overwrite to start over")
            indices = table.column(INDEX_COLUMN).to_pylist()
            if not indices:
                continue
            if self.num_rows is not None and indices[-1] >= self.num_rows:
                raise ApcscoreError(f"cannot resume {self.partial_path}: it holds row {indices[-1]} but this "
                                    f"run has {self.num_rows} rows; pass --overwrite to start over")
            clash = self.done_indices.intersection(indices)
            if clash:
                raise ApcscoreError(f"cannot resume {self.partial_path}: rows {sorted(clash)[:10]} appear twice; "
                                    "pass --overwrite to start over")
            self.done_indices.update(indices)
            self._parts.append((path, indices[0]))
            self._next_part = max(self._next_part, int(path.stem.split("-")[1]) + 1)
