"""`apcscore compare`, inputs: open two result files, check they are comparable, align their records by id
and set aside the records that failed on either side."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from apcscore.compare.exact import differs, first_index
from apcscore.errors import ApcscoreError, a
from apcscore.io.token_text import tokenizer_path
from apcscore.io.result_tables import open_result_file

EXAMPLES = 5  # ids quoted in an error message
GATED_COMMANDS = ("score", "perplexity")  # the commands whose files compare measures


_COLUMNS = (
    "id", "status", "error", "num_tokens", "num_scored", "sum_logprob", "perplexity", "num_words", "num_bytes",
    "token_ids", "token_logprobs", "top_ids", "top_logprobs",
    "pred", "pred_norm", "correct", "correct_norm", "answer", "choice_logprobs", "continuation_num_tokens",
    "ref_token_logprobs", "token_kl", "token_top1_agree",  # score --reference-model (compare/reference_kl.py)
)


@dataclass
class ResultFile:
    """One apcscore parquet file: its run metadata and the columns compare reads."""

    path: Path
    role: str  # "baseline" | "candidate", for messages
    meta: dict[str, Any]
    table: pa.Table

    def has(self, column: str) -> bool:
        return column in self.table.column_names

    @property
    def model(self) -> dict[str, Any]:
        model = self.meta.get("model")
        return model if isinstance(model, dict) else {"name": model} if model is not None else {}

    @property
    def vocab_size(self) -> int | None:
        v = self.model.get("vocab_size")
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None

    @property
    def dataset(self) -> dict[str, Any]:
        ds = self.meta.get("dataset")
        return ds if isinstance(ds, dict) else {}


def load_result_file(path: Path, role: str) -> ResultFile:
    """Open a parquet file written by `apcscore score` / `perplexity`, or refuse with a clear message."""
    path = Path(path)
    pf, meta = open_result_file(path, f"{role} file {path}", "compare", "`apcscore score` or `apcscore perplexity`")
    schema = pf.schema_arrow
    command = meta.get("command")
    if command is not None and command not in GATED_COMMANDS:
        raise ApcscoreError(f"{role} file {path} was written by `apcscore {command}`: compare gates the files of "
                            "`apcscore score` and `apcscore perplexity` (prompt logprobs, perplexity, accuracy), and "
                            f"{a(str(command))} file has none of them to compare — score the same dataset with "
                            "`apcscore score` for both models and compare those files")
    missing = [c for c in ("id", "status") if c not in schema.names]
    if missing:
        raise ApcscoreError(f"{role} file {path} is not apcscore output: no column {', '.join(missing)}")
    try:
        table = pq.read_table(path, columns=[c for c in _COLUMNS if c in schema.names])
    except (pa.ArrowException, OSError) as e:
        raise ApcscoreError(f"{role} file {path} is damaged: its data cannot be read ({e}) — write it again") from None
    ids = table["id"]
    if ids.null_count:
        raise ApcscoreError(f"{role} file {path}: {ids.null_count} record(s) have no id")
    if not pa.types.is_string(ids.type):
        table = table.set_column(0, "id", pc.cast(ids, pa.string()))
    counts = pc.value_counts(table["id"])  # struct<values, counts>
    dup = counts.filter(pc.greater(counts.field("counts"), 1))
    if len(dup):
        names = dup.field("values").to_pylist()
        raise ApcscoreError(f"{role} file {path}: duplicate record ids {examples(names)}; ids must be unique")
    return ResultFile(path, role, meta, table)


def examples(values: list[Any], shown: Callable[[Any], str] = repr) -> str:
    """The first EXAMPLES values, and how many more."""
    head = ", ".join(shown(v) for v in values[:EXAMPLES])
    return head + (f" and {len(values) - EXAMPLES} more" if len(values) > EXAMPLES else "")


WINDOWING = {"window": "--window", "stride": "--stride", "prefix_token_id": "prefix token"}  # perplexity's job


def check_same_run_kind(base: ResultFile, new: ResultFile) -> None:
    """Refuse files of different commands, windows or vocabularies (exit 2); datasets: `match_records`."""
    cb, cn = base.meta.get("command"), new.meta.get("command")
    if cb and cn and cb != cn:
        raise ApcscoreError(f"the baseline was written by `apcscore {cb}` and the candidate by `apcscore {cn}`; "
                            f"compare two runs of the same command")
    if cb == cn == "perplexity":  # another window or stride is another measurement, not a regression
        jb, jn = base.meta.get("job") or {}, new.meta.get("job") or {}
        keys = [k for k in WINDOWING if k in jb and k in jn and jb[k] != jn[k]]
        if keys:
            def shown(job: dict) -> str:
                return " ".join(f"{WINDOWING[k]} {job[k]}" for k in keys)

            raise ApcscoreError(f"the files measure perplexity with other windows (baseline {shown(jb)}, candidate "
                                f"{shown(jn)}), so their perplexities differ whatever the models do; compare two "
                                "runs with the same windows")
    vb, vn = base.vocab_size, new.vocab_size
    if vb and vn and vb != vn:
        raise ApcscoreError(f"the models have different vocabularies (baseline {vb} tokens, candidate {vn}); "
                            f"compare needs the same tokenizer")


COMMON_RECORDS = "--common-records"
# What a record's input is, as a result file stores it (the prompt text is not stored): its tokens (else their
# count), and for the other record kinds the answer, the number of choices and the continuation's length.
IDENTITY = ("token_ids", "num_tokens", "num_bytes", "answer", "choice_logprobs", "continuation_num_tokens")


@dataclass
class LeftOut:
    """Records that are not the same in the two files: left out of the comparison by --common-records, else named
    in the refusal."""

    only_baseline: list[str] = field(default_factory=list)
    only_candidate: list[str] = field(default_factory=list)
    edited: list[tuple[str, str]] = field(default_factory=list)  # (id, what differs), e.g. token_ids at position 4

    @property
    def count(self) -> int:
        return len(self.only_baseline) + len(self.only_candidate) + len(self.edited)

    def describe(self) -> str:
        """e.g. "2 only in the baseline ('r6', 'r7'); 1 edited (same id, another input): 'r3' (token_ids differ
        from position 4)"."""
        parts = []
        if self.only_baseline:
            parts.append(f"{len(self.only_baseline)} only in the baseline ({examples(self.only_baseline)})")
        if self.only_candidate:
            parts.append(f"{len(self.only_candidate)} only in the candidate ({examples(self.only_candidate)})")
        if self.edited:
            shown = examples(self.edited, lambda e: f"{e[0]!r} ({e[1]})")
            parts.append(f"{len(self.edited)} edited (same id, another input): {shown}")
        return "; ".join(parts)


def _edited(base: pa.Table, new: pa.Table) -> list[tuple[str, str]]:
    """Records (aligned tables) ok on both sides whose input differs (IDENTITY), with the first thing that differs.
    A record that failed on either side is not judged here: it is excluded, or a new error, as any other."""
    ok = (pc.equal(base["status"], "ok").to_numpy(zero_copy_only=False)
          & pc.equal(new["status"], "ok").to_numpy(zero_copy_only=False))
    why: dict[int, str] = {}  # row -> the first thing that differs in it
    for c in IDENTITY:
        if c not in base.column_names or c not in new.column_names:
            continue
        b, n = base[c].combine_chunks(), new[c].combine_chunks()
        if c == "choice_logprobs":  # the output per choice; its length is the number of choices
            b, n, c = pc.list_value_length(b), pc.list_value_length(n), "number of choices"
        for i in np.flatnonzero(ok & differs(b, n)).tolist():  # integers (int64 in every result file): bits are values
            x, y = b[i].as_py(), n[i].as_py()
            j = first_index(x, y)
            why.setdefault(i, f"{c} {x} in the baseline, {y} in the candidate" if j is None else
                           f"{c} differ from position {j}" if len(x) == len(y) else
                           f"{c}: {len(x)} in the baseline, {len(y)} in the candidate, first difference at "
                           f"position {j}")
    ids = base["id"]
    return [(str(ids[i].as_py()), why[i]) for i in sorted(why)]


def match_records(base: ResultFile, new: ResultFile, common: bool = False) -> tuple[pa.Table, pa.Table, LeftOut]:
    """Join the two files by record id: the candidate's rows in the baseline's order (a reordered file compares).

    Records only one file holds, and records whose input differs (`IDENTITY`: another tokenization, answer, number
    of choices) are refused with their ids named (exit 2), as are files whose metadata names another dataset
    (`dataset.sha256`) — unless `common` (--common-records): then only the records present and identical in both
    are returned, and `LeftOut` says which were left out and why.
    """
    pos = pc.index_in(base.table["id"], value_set=new.table["id"])  # [n] int32, null = not in the candidate
    left = LeftOut(base.table["id"].filter(pos.is_null()).to_pylist(),
                   new.table["id"].filter(pc.invert(pc.is_in(new.table["id"], value_set=base.table["id"]))).to_pylist())
    keep = pos.is_valid()
    bt = base.table if not left.only_baseline else base.table.filter(keep)
    order = pos.filter(keep).to_numpy(zero_copy_only=False).astype(np.int64)
    nt = new.table if np.array_equal(order, np.arange(new.table.num_rows)) else new.table.take(order)
    left.edited = _edited(bt, nt)
    hb, hn = base.dataset.get("sha256"), new.dataset.get("sha256")
    other_dataset = bool(hb and hn and hb != hn)
    if common:
        if left.edited:
            same = pc.invert(pc.is_in(bt["id"], value_set=pa.array([rid for rid, _ in left.edited])))
            bt, nt = bt.filter(same), nt.filter(same)
        if not bt.num_rows:
            raise ApcscoreError(f"{COMMON_RECORDS}: no record is present and identical in both files "
                                f"({left.describe()}): there is nothing to compare")
        return bt, nt, left
    if not (left.count or other_dataset):
        return bt, nt, left
    alike = bt.num_rows - len(left.edited)
    hint = (f" — score the same dataset with both models, or pass {COMMON_RECORDS} to compare the {alike} "
            "record(s) present and identical in both (the report lists the others)" if alike else
            " — score the same dataset with both models (no record is present and identical in both)")
    if other_dataset:
        what = left.describe() or "every record present in both is identical"
        raise ApcscoreError(
            f"the files are runs on different datasets: baseline {base.dataset.get('path', '?')} (sha256 "
            f"{str(hb)[:12]}...), candidate {new.dataset.get('path', '?')} (sha256 {str(hn)[:12]}...); records: "
            f"{what}{hint}")
    if left.only_baseline or left.only_candidate:
        raise ApcscoreError(f"the files hold different records: record ids {left.describe()}. compare needs two runs "
                            f"on the same dataset{hint}")
    first, why = left.edited[0]
    raise ApcscoreError(f"the files were tokenized differently (another tokenizer, or an edited dataset?): the input "
                        f"differs in {len(left.edited)} record(s) ({examples([r for r, _ in left.edited])}); record "
                        f"{first!r}: {why}. compare needs two runs with the same tokenizer on the same data{hint}")


@dataclass
class Excluded:
    """A record left out of the comparison because it failed in one file or both."""

    id: str
    side: str  # "baseline" | "candidate" | "both"
    error: str


def split_excluded(base: pa.Table, new: pa.Table) -> tuple[np.ndarray, list[Excluded]]:
    """ok [n] mask of records with status "ok" in both (aligned tables), and the others, listed."""
    for t, role in ((base, "baseline"), (new, "candidate")):
        bad = pc.invert(pc.is_in(pc.fill_null(t["status"], ""), value_set=pa.array(["ok", "error"])))
        if pc.any(bad).as_py():
            v = t["status"].filter(bad)[0].as_py()
            raise ApcscoreError(f"{role} file: status {v!r} is neither 'ok' nor 'error': not apcscore output")
    ok_b = pc.equal(base["status"], "ok").to_numpy(zero_copy_only=False)
    ok_n = pc.equal(new["status"], "ok").to_numpy(zero_copy_only=False)
    out = []
    err_b = base["error"].to_pylist() if "error" in base.column_names else [None] * len(base)
    err_n = new["error"].to_pylist() if "error" in new.column_names else [None] * len(new)
    for i in np.flatnonzero(~(ok_b & ok_n)):
        side = "both" if not (ok_b[i] or ok_n[i]) else "baseline" if not ok_b[i] else "candidate"
        msg = (f"baseline: {err_b[i] or 'no message'}; candidate: {err_n[i] or 'no message'}" if side == "both"
               else (err_b[i] if side == "baseline" else err_n[i]) or "no message")
        out.append(Excluded(str(base["id"][i].as_py()), side, msg))
    return ok_b & ok_n, out


@dataclass
class FileInfo:
    """What the run metadata says about one side."""

    path: str
    command: str | None
    model: str | None
    dtype: str | None
    apcscore_version: str | None
    dataset: str | None
    dataset_sha256: str | None
    vocab_size: int | None
    top_k: int  # largest top-K stored (0 = none)
    num_records: int
    tokenizer: str | None = None  # where the run's tokenizer was read from (token texts of reports)
    # what computed the numbers, one text per property of RUN_PROPERTIES (None: not in the metadata)
    run: dict[str, str | None] = field(default_factory=dict)


# The keys of the metadata's numerics section that decide bits or explain why they moved (docs/architecture.md,
# "A run's identity"), each its own property of the "runs differ in" block.
NUMERICS_KEYS = ("batch_invariant", "portable", "math", "linear", "simd", "device_capability", "torch_threads")


def _text(v: Any) -> str | None:
    return None if v is None else ("true" if v else "false") if isinstance(v, bool) else str(v)


def run_properties(f: ResultFile, top_k: int) -> dict[str, str | None]:
    """The properties of a run that can move its numbers, in the order the "runs differ in" block lists them
    (docs/compare.md, "What differs between the runs"); None: not recorded."""
    m = f.meta
    code = m.get("code") if isinstance(m.get("code"), dict) else {}
    numerics = m.get("numerics") if isinstance(m.get("numerics"), dict) else {}
    blas = numerics.get("blas") if isinstance(numerics.get("blas"), dict) else {}
    return {
        "apcscore version": _text(m.get("apcscore_version")),
        **{f"numerics code: {part}": _text(h) for part, h in code.items()},
        "model": _text(f.model.get("name")),
        "weights fingerprint": _text(f.model.get("fingerprint")),
        "dtype": _text(m.get("dtype")),
        "device": _text(m.get("device")),
        "model backend": _text(m.get("model_backend")),
        "attention backend": _text(m.get("attention_backend")),
        **{f"numerics: {k}": _text(numerics.get(k)) for k in NUMERICS_KEYS},
        "numerics: blas": _text(blas.get("library")),
        "dataset sha256": _text(f.dataset.get("sha256")),
        "top-K stored": str(top_k),
    }


def file_info(f: ResultFile, top_k: int) -> FileInfo:
    m, ds = f.meta, f.dataset
    return FileInfo(str(f.path), _text(m.get("command")), _text(f.model.get("name")), _text(m.get("dtype")),
                    _text(m.get("apcscore_version")), _text(ds.get("path")), _text(ds.get("sha256")),
                    f.vocab_size, top_k, f.table.num_rows, tokenizer_path(f.meta), run_properties(f, top_k))


@dataclass
class RunDifference:
    """One property of the two runs that differs (None: not in that file's metadata)."""

    property: str
    baseline: str | None
    candidate: str | None


def run_differences(base: FileInfo, new: FileInfo) -> list[RunDifference]:
    """The run properties (`run_properties`) whose values differ, in that order. A property neither file records
    is left out; one that only one file records is a difference (None on the other side: not recorded)."""
    names = list(base.run) + [k for k in new.run if k not in base.run]
    return [RunDifference(k, base.run.get(k), new.run.get(k)) for k in names if base.run.get(k) != new.run.get(k)]
