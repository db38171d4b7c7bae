"""A run's `<out>.partial` folder (io/writer.py writes its rows): the names of the files a run writes there, the lock
that keeps a second run out of it, the check of its run.json when a run resumes it, and the merge of its part files
into dataset order.

The lock is an exclusive `flock` on the folder itself, which the kernel drops when the process ends in any way
(SIGKILL included), so a crashed run never leaves a stale lock (docs/decisions.md, "One run per partial").
"""

from __future__ import annotations

import bisect
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from apcscore.errors import ApcscoreError
from apcscore.io.result_tables import RUN_FILE

INDEX_COLUMN = "index"  # a part file's extra column: the row's record position
PART_GLOB = "part-*.parquet"  # the part files (io/writer.py's flush)
_PART_FILE = re.compile(r"part-[0-9]{6,}\.parquet(\.tmp)?")  # a part file or its temporary
FINAL_TMP = "final.parquet.tmp"  # the final file's temporary, parquet
LINES_TMP = "final.jsonl.tmp"  # the final file's temporary, JSON lines
# Every other name a run writes in its partial: run.json and its temporary (result_tables.write_atomic), the final
# file's temporaries; and errors.jsonl.tmp, which the --errors-out file's temporary was before issue 53 (it is now
# written next to that file), so that a partial such a run left still resumes.
PARTIAL_FILES = (RUN_FILE, RUN_FILE + ".tmp", FINAL_TMP, LINES_TMP, "errors.jsonl.tmp")


def is_partial_file(name: str) -> bool:
    """Whether `name` is one of the files a run writes in its partial folder (`PARTIAL_FILES` and the part files):
    the writer touches a partial that holds nothing else, and only that."""
    return name in PARTIAL_FILES or _PART_FILE.fullmatch(name) is not None


def in_use(partial: Path) -> ApcscoreError:
    """The refusal of a run that finds `partial` locked (or created a moment ago) by another."""
    return ApcscoreError(f"{partial} is in use by another apcscore run that is still going; wait for it to finish "
                         "(or stop it), then rerun — with --resume to continue its rows")


def lock_partial(partial: Path) -> int:
    """Take the exclusive lock on the partial folder: the file descriptor returned holds it until closed
    (`os.close`, or the process ends)."""
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:  # seen a moment ago: the run writing it finished (or gave up) since
        raise ApcscoreError(f"{partial} was removed by another apcscore run a moment ago (it finished, or "
                            "failed before its first row) — rerun: see whether its output is there") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise in_use(partial) from None
    return fd


def check_run_file(partial: Path, metadata: dict, schema: pa.Schema,
                   resume_check: Callable[[dict, dict], list[str]]) -> dict | None:
    """The metadata of the run that wrote `partial` (None: it has no run.json, its run died before writing one),
    after checking that it is this run and has the same columns; ApcscoreError otherwise, or when run.json is
    damaged. `resume_check(old, new)` says in words what differs (apcscore.io.identity's resume view)."""
    run_file = partial / RUN_FILE
    if not run_file.exists():
        return None
    try:
        run = json.loads(run_file.read_text(encoding="utf-8"))
        old_meta, old_schema = run["metadata"], pa.ipc.read_schema(pa.py_buffer(bytes.fromhex(run["schema"])))
        if not isinstance(old_meta, dict):
            raise ValueError("its metadata is not an object")
    except (ValueError, KeyError, TypeError, pa.ArrowException) as e:
        raise ApcscoreError(f"cannot resume: {run_file} is damaged ({type(e).__name__}: {e}) — pass --overwrite "
                            "to start over (the rows in the partial are discarded)") from None
    differ = resume_check(old_meta, metadata)
    if differ:
        raise ApcscoreError(f"cannot resume {partial}: it was written by a different run ({'; '.join(differ)}); "
                            "rerun with the same settings, or start afresh: --overwrite, or another --out")
    if not old_schema.remove_metadata().equals(schema.remove_metadata()):
        raise ApcscoreError(f"cannot resume {partial}: it was written with other columns "
                            f"({', '.join(old_schema.names)}); pass --overwrite to start over")
    return old_meta


def merged_parts(parts: list[tuple[Path, int]], part_schema: pa.Schema, total: int, row_group_size: int,
                 partial: Path) -> Iterator[pa.Table]:
    """Tables of `row_group_size` consecutive indices 0..total-1, in order, merged from part files (each sorted by
    index; `parts` are (path, first index)). Memory follows the parts overlapping the window, not the dataset."""
    parts = sorted(parts, key=lambda p: p[1])
    next_part = 0
    open_parts: list[pa.Table] = []  # unconsumed rows of parts overlapping the output window
    for start in range(0, total, row_group_size):
        end = min(start + row_group_size, total)
        while next_part < len(parts) and parts[next_part][1] < end:
            open_parts.append(pq.read_table(parts[next_part][0], schema=part_schema))
            next_part += 1
        pieces, keep = [], []
        for table in open_parts:
            indices = table.column(INDEX_COLUMN).to_pylist()  # sorted within a part
            cut = bisect.bisect_left(indices, end)
            pieces.append(table.slice(0, cut))
            if cut < table.num_rows:
                keep.append(table.slice(cut))
        open_parts = keep
        chunk = pa.concat_tables(pieces).sort_by(INDEX_COLUMN) if pieces else part_schema.empty_table()
        if chunk.column(INDEX_COLUMN).to_pylist() != list(range(start, end)):
            raise RuntimeError(f"partial {partial} is inconsistent: rows {start}..{end - 1} are not all present "
                               "exactly once")
        yield chunk
