"""`apcscore compare`, inputs: open two result files, check they are comparable, align their records by id
and set aside the records that failed on either side."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from apcscore.errors import ApcscoreError, a
from apcscore.io.token_text import tokenizer_path
from apcscore.io.result_tables import open_result_file

EXAMPLES = 5  # ids quoted in an error message
GATED_COMMANDS = ("score", "perplexity")  # the commands whose files compare measures


_COLUMNS = (
    "id", "status", "error", "num_tokens", "num_scored", "sum_logprob", "perplexity", "num_words", "num_bytes",
    "token_ids", "token_logprobs", "top_ids", "top_logprobs",
    "pred", "pred_norm", "correct", "correct_norm", "answer",
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


def examples(values: list[Any]) -> str:
    head = ", ".join(repr(v) for v in values[:EXAMPLES])
    return head + (f" and {len(values) - EXAMPLES} more" if len(values) > EXAMPLES else "")


WINDOWING = {"window": "--window", "stride": "--stride", "prefix_token_id": "prefix token"}  # perplexity's job


def check_same_run_kind(base: ResultFile, new: ResultFile) -> None:
    """Refuse files of different commands, datasets or vocabularies (exit 2)."""
    cb, cn = base.meta.get("command"), new.meta.get("command")
    if cb and cn and cb != cn:
        raise ApcscoreError(f"the baseline was written by `apcscore {cb}` and the candidate by `apcscore {cn}`; "
                            f"compare two runs of the same command")
    hb, hn = base.dataset.get("sha256"), new.dataset.get("sha256")
    if hb and hn and hb != hn:
        raise ApcscoreError(
            f"the files are runs on different datasets: baseline {base.dataset.get('path', '?')} (sha256 "
            f"{str(hb)[:12]}...), candidate {new.dataset.get('path', '?')} (sha256 {str(hn)[:12]}...); "
            f"score the same dataset with both models")
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


def align(base: ResultFile, new: ResultFile) -> np.ndarray:
    """For each baseline row, the candidate row with the same id; refuse when the id sets differ."""
    pos = pc.index_in(base.table["id"], value_set=new.table["id"])  # [n] int32, null = not in the candidate
    only_base = base.table["id"].filter(pos.is_null()).to_pylist()
    only_new = new.table["id"].filter(pc.invert(pc.is_in(new.table["id"], value_set=base.table["id"]))).to_pylist()
    if only_base or only_new:
        parts = []
        if only_base:
            parts.append(f"{len(only_base)} only in the baseline ({examples(only_base)})")
        if only_new:
            parts.append(f"{len(only_new)} only in the candidate ({examples(only_new)})")
        raise ApcscoreError(f"the files hold different records: record ids {'; '.join(parts)}. compare needs two "
                            f"runs on the same dataset")
    return pos.to_numpy(zero_copy_only=False).astype(np.int64)


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


def check_token_ids(base: pa.Table, new: pa.Table) -> None:
    """Refuse when a record was tokenized differently on the two sides (aligned tables of ok records)."""
    lb = pc.fill_null(pc.list_value_length(base["token_ids"]), -1).to_numpy()
    ln = pc.fill_null(pc.list_value_length(new["token_ids"]), -1).to_numpy()
    bad = np.flatnonzero(lb != ln)
    if not len(bad):
        vb = pc.list_flatten(base["token_ids"]).to_numpy()
        vn = pc.list_flatten(new["token_ids"]).to_numpy()
        diff = vb != vn
        if not diff.any():
            return
        rec = np.repeat(np.arange(len(base)), np.maximum(lb, 0))[diff]
        bad = np.unique(rec)
    i = int(bad[0])
    tb, tn = base["token_ids"][i].as_py() or [], new["token_ids"][i].as_py() or []
    j = next((k for k, (x, y) in enumerate(zip(tb, tn)) if x != y), min(len(tb), len(tn)))
    ids = [base["id"][int(k)].as_py() for k in bad]
    raise ApcscoreError(
        f"the files were tokenized differently (another tokenizer?): token ids differ in {len(bad)} record(s) "
        f"({examples(ids)}); record {ids[0]!r}: {len(tb)} tokens in the baseline, {len(tn)} in the candidate, "
        f"first difference at position {j}. compare needs two runs with the same tokenizer")


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
    """The properties of a run that can move its numbers, in the order the "runs differ in" block lists them:
    apcscore's version, the numerics code's fingerprint (per part), the model and its weights' fingerprint, dtype,
    device, backends, the numerics settings, the dataset's hash and the top-K stored (None: not recorded)."""
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
    def s(v: Any) -> str | None:
        return None if v is None else str(v)

    return FileInfo(str(f.path), s(f.meta.get("command")), s(f.model.get("name")), s(f.meta.get("dtype")),
                    s(f.meta.get("apcscore_version")), s(f.dataset.get("path")), s(f.dataset.get("sha256")),
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
