"""Load and validate a JSONL dataset before any model is loaded.

Every problem is found in one pass and reported as ``FILE:LINE: what is wrong (what to do)``. Without
``skip_invalid`` any problem raises `ApcscoreError` (exit code 2) and nothing runs; with it, invalid records
come back in `LoadedDataset.invalid` (they become ``status="error"`` rows) and the rest in `records`.

The file is read line by line with the standard library's ``json``, not with Hugging Face ``datasets``, for the
reasons in docs/decisions.md, "Datasets are read with the standard json module". Measured on 100,000 short records
(datasets 5.2, 2 cores), it also took longer (1.5-3.2 s to import and load, not validated; here 1.2-1.8 s to read
and validate) and 2.7 times the memory (238 MB; here 88 MB).

The file is streamed once in binary: each line is hashed (sha256 of the whole file), decoded as UTF-8 (an error
names the byte offset), parsed with ``json.loads`` (an error names the column) and validated; only the validated
fields of each record are kept (one copy of the data plus a small `Record` per line).

Conventions where the format leaves room: a field whose value is null counts as absent (files exported
by pandas or ``datasets.Dataset.to_json`` fill missing keys with null); a UTF-8 byte-order mark is
skipped; ``NaN``/``Infinity`` (which Python's json accepts) and duplicate keys in an object are errors, and so
is a number field that parses to infinity (``1e400``: `apcscore.config.finite_problem`, the record checks');
an empty ``prompt`` or ``context`` is valid here (the job decides at run time, as for an empty ``text``); a
string holding a lone ``\\uD800``..``\\uDFFF`` escape (JSON allows it, but it is not text: the tokenizer and
parquet refuse it) is that record's problem, named by its field. ``--columns`` must map to fields of the
command's records, from columns that some record has.

Ids (docs/decisions.md, "Ids"): a record whose id another record has is refused, and its error row gets an id of
its own (``ID#lineN``), so the output's ids stay unique as compare, show and merge need (an OpenAI result line
keeps its request's custom_id, how a client matches answers to requests). The error row of a record without a
usable id, or of a line that does not parse, is ``#lineN``, given once every id is read and suffixed (``.2``)
where a record wrote it, so a stand-in never takes a real record's id.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any

from apcscore.errors import ApcscoreError
from apcscore.io.json_line import SURROGATE, SURROGATE_ESCAPE, NotUtf8, parse_line, surrogate_problem
from apcscore.io.openai_batch import INPUT_FORMATS, is_batch_line, to_record
from apcscore.io.schemas import (COMMANDS, InvalidRecord, Record, accepted_kinds, check_record, known_fields,
                                unknown_fields)
from apcscore.io.tabular_input import is_tabular, read_table_records, rename

MAX_LISTED_PROBLEMS = 20


@dataclass
class LoadedDataset:
    """The dataset's valid and invalid records (each in file order) and its warnings."""

    path: Path
    sha256: str  # of the whole file, also when `limit` stopped reading records early
    records: list[Record]
    invalid: list[InvalidRecord]
    warnings: list[str] = field(default_factory=list)
    format: str = "apcscore"  # or "openai-batch" (request lines; each record's fields["openai"] is its BatchLine)
    # openai-batch: the invalid lines that gave no custom_id (their rows' id is the line number, their result
    # lines' custom_id null)
    no_custom_id: frozenset[int] = frozenset()

    @property
    def num_records(self) -> int:
        """Records read (valid and invalid): the rows the run will write."""
        return len(self.records) + len(self.invalid)


# ---------------------------------------------------------------- the file

def _sniff(path: Path, head: bytes) -> None:
    """Raise for files that are not UTF-8 text at all (so nothing line-level makes sense)."""
    name = str(path)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ApcscoreError(f"{name} is UTF-16 text (it starts with a UTF-16 byte-order mark); "
                            "save it as UTF-8 JSONL")
    if head.startswith(b"\x1f\x8b"):
        raise ApcscoreError(f"{name} is gzip-compressed; decompress it first (gunzip {name})")
    if b"\x00" in head:
        raise ApcscoreError(f"{name} is not UTF-8 text (it contains NUL bytes: UTF-16 or a binary file?); "
                            "give a UTF-8 JSONL file, one JSON object per line")


def _head(path: Path, n: int) -> bytes:
    """The first n bytes of a file (b"" when it cannot be read: the reader says why)."""
    try:
        with path.open("rb") as f:
            return f.read(n)
    except OSError:
        return b""


def listed_problems(lines: list[str], indent: str = "  ") -> str:
    """The first MAX_LISTED_PROBLEMS lines, each indented, then "... and N more" for the rest."""
    more = len(lines) - MAX_LISTED_PROBLEMS
    listed = [indent + m for m in lines[:MAX_LISTED_PROBLEMS]]
    return "\n".join(listed + ([f"{indent}... and {more} more"] if more > 0 else []))


def load_dataset(path: str | Path, command: str, *, skip_invalid: bool = False,
                 limit: int | None = None, columns: dict[str, str] | None = None, input_format: str = "auto",
                 max_logprobs: int = 20, model_names: frozenset[str] | None = None) -> LoadedDataset:
    """Read and validate the dataset at `path` for `command` ("score", "generate" or "perplexity").

    JSONL, or parquet / CSV / a `save_to_disk` directory (`io/tabular_input.py`); `columns` maps a record field to
    the column (or JSON key) it is read from.

    `input_format` auto (OpenAI Batch request lines when the first line is one, else our records), apcscore or
    openai-batch (`io/openai_batch.py`; JSONL only; `max_logprobs` caps a body's logprobs, `model_names` are the
    names a body's model may have, None: any).

    `limit` keeps the first N records (valid or invalid) of the file. Raises `ApcscoreError` (exit code 2)
    listing every problem (up to 20, then "... and N more") unless `skip_invalid`; file-level problems
    (unreadable, empty, not UTF-8 text) always raise.
    """
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, not {command!r}")
    if limit is not None and limit < 1:
        raise ApcscoreError(f"--limit must be at least 1, not {limit}")
    path = Path(path)
    name = str(path)
    if path.suffix.lower() not in (".parquet", ".pq") and path.is_file() and _head(path, 4) == b"PAR1":
        raise ApcscoreError(f"{name} is a parquet file whatever its name says (results of apcscore?); to read it as "
                            f"a dataset, name it {path.with_suffix('.parquet').name}")

    records: list[Record] = []
    invalid: list[InvalidRecord] = []
    unnamed: list[int] = []  # indexes into invalid of error rows whose record gave no usable id
    unknown_seen: dict[str, list[int]] = {}  # field -> [first line, count]
    first_line_of_id: dict[str, int] = {}  # ids the records gave, and (apcscore records only) line-number stand-ins
    no_custom_id: set[int] = set()  # openai-batch: indices of lines without a custom_id
    columns = columns or {}
    if input_format not in INPUT_FORMATS:
        raise ApcscoreError(f"--input-format must be one of {', '.join(INPUT_FORMATS)}, not {input_format!r}")
    if input_format == "openai-batch" and is_tabular(path):
        raise ApcscoreError(f"{name}: --input-format openai-batch reads JSONL request lines, not a table")
    # auto reads request lines only from JSONL (a table is our records)
    fmt = {"chosen": ("apcscore" if is_tabular(path) else None) if input_format == "auto" else input_format}

    def unique_id(rid: str, lineno: int) -> str:
        """`rid`, or with a suffix where some record has it, claimed for line `lineno`'s row (a later record
        giving it is refused as a duplicate)."""
        candidate, n = rid, 1
        while candidate in first_line_of_id:
            n += 1
            candidate = f"{rid}.{n}"
        first_line_of_id[candidate] = lineno
        return candidate

    unknown_targets = sorted(set(columns) - known_fields(command))
    if unknown_targets:
        raise ApcscoreError(f"--columns: {', '.join(map(repr, unknown_targets))} is not a field of a {command} record "
                            f"(it reads {', '.join(sorted(known_fields(command)))}); write FIELD=COLUMN, the field "
                            "first")
    columns_seen: set[str] = set()  # mapped columns that some record has
    keys_seen: dict[str, None] = {}  # every record key, in order of appearance (for the message)

    def accept(obj: Any, lineno: int, where: str, escaped_surrogate: bool = False) -> None:
        """Check one parsed record (`where`: `FILE:LINE` or `FILE:row N`) into records or invalid
        (`escaped_surrogate`: its line has a \\uD800..\\uDFFF escape, which may be unpaired)."""
        if fmt["chosen"] is None:  # auto: the first line decides
            fmt["chosen"] = "openai-batch" if is_batch_line(obj) else "apcscore"
            if fmt["chosen"] == "openai-batch":  # lines before it that did not parse gave no custom_id
                no_custom_id.update(r.index for r in invalid)
                first_line_of_id.clear()
        if columns and isinstance(obj, dict):
            columns_seen.update(c for c in columns.values() if c in obj)
            if len(keys_seen) < 50:
                keys_seen.update(dict.fromkeys(obj))
        batch = fmt["chosen"] == "openai-batch"
        if batch:
            converted = to_record(obj, command, max_logprobs=max_logprobs, model_names=model_names)
            record = converted.record
            _, kind, fields, problems = check_record(record, command) if record is not None else (None, None, {}, [])
            problems, given_id = [*converted.problems, *problems], converted.custom_id
            if converted.line is not None and not problems:
                fields["openai"] = asdict(converted.line)
        else:
            record = rename(obj, columns)
            given_id, kind, fields, problems = check_record(record, command)
        for key in unknown_fields(record, command, fields):
            seen = unknown_seen.setdefault(key, [lineno, 0])
            seen[1] += 1
        rid = given_id if given_id is not None else str(lineno)
        if escaped_surrogate and (surrogate := surrogate_problem(obj)):
            problems = [*problems, surrogate]
            if SURROGATE.search(rid):  # the id itself: shown as its escape, which parquet can hold
                rid = rid.encode("utf-8", "backslashreplace").decode("utf-8")
        if given_id is None and problems:  # no usable id (openai-batch: no custom_id): as a line that does not parse
            unreadable(lineno, f"{where}: " + "; ".join(problems))
            return
        label = "custom_id" if batch else "id"
        if rid in first_line_of_id:  # a duplicate: its error row gets an id of its own (an OpenAI line keeps it)
            own = rid if batch else unique_id(f"{rid}#line{lineno}", lineno)
            problems = [*problems, f"duplicate {label} {rid!r}: line {first_line_of_id[rid]} has the same "
                                   f"{label} (give every record a unique {label}" +
                        ("" if batch else "; a record without one gets its line number") + ")" +
                        ("" if batch else f"; this error row's {label} is {own!r}")]
            rid = own
        else:
            first_line_of_id[rid] = lineno
        if problems:
            invalid.append(InvalidRecord(len(records) + len(invalid), lineno, rid, f"{where}: " + "; ".join(problems)))
        else:
            records.append(Record(len(records) + len(invalid), lineno, rid, kind, fields))

    def unreadable(lineno: int, message: str) -> None:
        """A line that does not parse, or a record without a usable id: an error row without an id of its own (given
        at the end); in an OpenAI batch file, its result line's custom_id is null."""
        if fmt["chosen"] == "openai-batch":
            no_custom_id.add(len(records) + len(invalid))
        unnamed.append(len(invalid))
        invalid.append(InvalidRecord(len(records) + len(invalid), lineno, "", message))

    if is_tabular(path):
        digest, rows = read_table_records(path, columns)
        for row_number, obj in islice(rows, limit):
            accept(obj, row_number, f"{name}:row {row_number}")
        index, utf8_errors = len(records) + len(invalid), 0
    else:
        digest, index, utf8_errors = _read_jsonl(path, name, limit, accept, unreadable)
    for i in unnamed:  # the stand-in ids, now that every real id is known
        invalid[i] = replace(invalid[i], id=unique_id(f"#line{invalid[i].line}", invalid[i].line))
    if index == 0:
        raise ApcscoreError(f"{name} has no records (it is empty or holds only blank lines); "
                            f"a {command} dataset is JSONL with one record per line: {accepted_kinds(command)}")
    if utf8_errors and utf8_errors == index:
        raise ApcscoreError(f"{name} is not UTF-8 text (no line decodes as UTF-8); save it as UTF-8 JSONL")
    missing = {f: c for f, c in columns.items() if c not in columns_seen}
    if missing and fmt["chosen"] != "openai-batch":
        raise ApcscoreError(
            f"--columns {', '.join(f'{f}={c}' for f, c in missing.items())}: no record of {name} has "
            + (f"a column {next(iter(missing.values()))!r}" if len(missing) == 1 else "these columns")
            + f" (its records have {', '.join(map(repr, keys_seen)) or 'no fields'}); give each column's name as "
              "it is in the file")
    warnings = [
        f"{name}:{first}: unknown field {key!r} ignored" + (f" (in {count} records)" if count > 1 else "")
        + f" ({command} reads {accepted_kinds(command)})"
        for key, (first, count) in unknown_seen.items()
    ]
    if invalid and not skip_invalid:
        raise ApcscoreError(
            f"{name}: {len(invalid)} of {index} records are invalid; nothing was run:\n"
            + listed_problems([r.message for r in invalid])
            + "\nFix these lines, or pass --skip-invalid to write them as error rows and run the rest."
        )
    return LoadedDataset(path, digest, records, invalid, warnings, fmt["chosen"] or "apcscore",
                         frozenset(no_custom_id) if fmt["chosen"] == "openai-batch" else frozenset())


def _read_jsonl(path: Path, name: str, limit: int | None, accept: Any, unreadable: Any) -> tuple[str, int, int]:
    """Stream the JSONL file: (sha256 of the whole file, records read, lines that are not UTF-8); each parsed line
    goes to `accept(obj, lineno, where)`, each line that does not parse to `unreadable(lineno, message)`."""
    sha = hashlib.sha256()
    utf8_errors = 0
    index = 0
    if path.is_dir():
        raise ApcscoreError(f"{name} is a directory; give a JSONL file (one JSON object per line), a parquet or "
                            "CSV file, or a directory written by datasets' save_to_disk")
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise ApcscoreError(f"{name} does not exist; check the path of the dataset") from None
    except OSError as e:
        raise ApcscoreError(f"cannot read {name}: {e.strerror or e}") from None
    with f:
        try:
            _sniff(path, f.read(4096))
            f.seek(0)
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                sha.update(raw)
                start = offset
                offset += len(raw)
                if limit is not None and index >= limit:
                    continue  # keep hashing the whole file
                body = raw.rstrip(b"\r\n")
                if lineno == 1 and body.startswith(b"\xef\xbb\xbf"):
                    body, start = body[3:], start + 3
                if not body or body.isspace():
                    continue
                try:
                    obj = parse_line(body, start)
                except ValueError as e:
                    utf8_errors += isinstance(e, NotUtf8)
                    unreadable(lineno, f"{name}:{lineno}: {e}")
                    index += 1
                    continue
                accept(obj, lineno, f"{name}:{lineno}", SURROGATE_ESCAPE.search(body) is not None)
                index += 1
        except OSError as e:
            raise ApcscoreError(f"cannot read {name}: {e.strerror or e}") from None
    return sha.hexdigest(), index, utf8_errors
