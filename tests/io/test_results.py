"""ResultsWriter: dataset order from completion order, crash + resume, refusals, metadata, nested nulls."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from apcscore.errors import ApcscoreError
from apcscore.io.result_tables import read_run_metadata, records_to_table
from apcscore.io.writer import ResultsWriter

# The shape of a `score` results file (the jobs decide the real columns).
SCHEMA = pa.schema([
    ("id", pa.string()),
    ("status", pa.string()),
    ("error", pa.string()),
    ("num_tokens", pa.int64()),
    ("sum_logprob", pa.float64()),
    ("token_ids", pa.list_(pa.int64())),
    ("token_logprobs", pa.list_(pa.float32())),
    ("token_ranks", pa.list_(pa.int64())),
    ("top_ids", pa.list_(pa.list_(pa.int64()))),
    ("top_logprobs", pa.list_(pa.list_(pa.float32()))),
])
META = {"command": "score", "model": {"name": "tiny", "fingerprint": "abc123"}, "dtype": "float32",
        "dataset": {"path": "d.jsonl", "sha256": "00ff"}, "options": {"prompt_logprobs": 2}}


def make_row(i: int) -> dict:
    """A deterministic row; every 5th is an error row (nulls everywhere); lists start with null."""
    if i % 5 == 3:
        return {"id": f"r{i}", "status": "error", "error": f"record {i} is too long"}
    n = 1 + i % 4
    ids = [(i * 7 + j) % 50 for j in range(n)]
    # values exactly representable in float32, so the round trip is exact
    return {
        "id": f"r{i}", "status": "ok", "error": None, "num_tokens": n, "sum_logprob": -0.5 * (n - 1),
        "token_ids": ids,
        "token_logprobs": [None] + [-0.5] * (n - 1),
        "token_ranks": [None] + [1 + j for j in range(n - 1)],
        "top_ids": [None] + [[ids[j], (ids[j] + 1) % 50] for j in range(1, n)],
        "top_logprobs": [None] + [[-0.25, -1.75]] * (n - 1),
    }


def completion_order(n: int, window: int = 8, seed: int = 0) -> list[int]:
    """Indices as an engine would finish them: shuffled within a sliding window, plus a straggler."""
    rng = random.Random(seed)
    order = sorted(range(n), key=lambda i: i + rng.uniform(0, window))
    order.remove(0)
    return order + [0]  # record 0 finishes last


def expected_table(n: int) -> pa.Table:
    return records_to_table([make_row(i) for i in range(n)], SCHEMA)


def test_out_of_order_adds_give_dataset_order_and_metadata(tmp_path: Path) -> None:
    out = tmp_path / "run" / "scores.parquet"  # the parent folder is created
    writer = ResultsWriter(out, SCHEMA, META, row_group_size=4, num_rows=23)
    for i in completion_order(23):
        writer.add(i, make_row(i))
    assert writer.partial_path.is_dir() and not out.exists()
    writer.update_metadata({"timings": {"seconds": 1.5, "tokens_per_s": float("inf")}})
    assert writer.close() == out
    assert not writer.partial_path.exists()

    table = pq.read_table(out)
    assert "index" not in table.column_names
    assert table.schema.remove_metadata().equals(SCHEMA)
    assert table.to_pylist() == expected_table(23).to_pylist()
    assert pq.ParquetFile(out).metadata.num_row_groups == 6  # 23 rows in groups of 4
    meta = read_run_metadata(out)
    assert meta == {**META, "timings": {"seconds": 1.5, "tokens_per_s": None}}  # inf stored as null


def test_nested_list_nulls_survive(tmp_path: Path) -> None:
    out = tmp_path / "s.parquet"
    writer = ResultsWriter(out, SCHEMA, META, row_group_size=2)
    rows = {0: make_row(1), 1: make_row(3), 2: {**make_row(2), "top_ids": [None, [4, None], []],
                                                "top_logprobs": [None, None, [-1.0]]}}
    for i in (2, 0, 1):
        writer.add(i, rows[i])
    writer.close()
    got = pq.read_table(out).to_pylist()
    assert got[0]["token_logprobs"] == [None, -0.5] and got[0]["top_ids"][0] is None
    assert got[1]["status"] == "error" and got[1]["token_ids"] is None and got[1]["num_tokens"] is None
    assert got[2]["top_ids"] == [None, [4, None], []]
    assert got[2]["top_logprobs"] == [None, None, [-1.0]]


CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from test_results import SCHEMA, META, make_row, completion_order
    from apcscore.io.writer import ResultsWriter
    writer = ResultsWriter({out!r}, SCHEMA, META, row_group_size=4, num_rows={n})
    order = completion_order({n})
    for i in order[:{done}]:
        writer.add(i, make_row(i))
    os._exit(1)  # killed: no close, no flush, no atexit
""")


def test_crash_then_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    n, done = 30, 19
    ref = tmp_path / "ref.parquet"
    writer = ResultsWriter(ref, SCHEMA, META, row_group_size=4, num_rows=n)
    for i in completion_order(n):
        writer.add(i, make_row(i))
    writer.close()

    out = tmp_path / "out.parquet"
    script = CRASH_SCRIPT.format(tests=str(Path(__file__).parent), out=str(out), n=n, done=done)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert not out.exists()
    partial = out.with_name(out.name + ".partial")
    assert len(list(partial.glob("part-*.parquet"))) == done // 4  # 16 rows written; 3 were in the buffer

    with pytest.raises(ApcscoreError, match="--resume"):
        ResultsWriter(out, SCHEMA, META, num_rows=n)
    (partial / "part-000999.parquet.tmp").write_bytes(b"half a part")  # died while writing a part
    (partial / "final.parquet.tmp").write_bytes(b"half a file")  # or while assembling
    writer = ResultsWriter(out, SCHEMA, META, resume=True, row_group_size=4, num_rows=n)
    first = completion_order(n)[:done]
    assert writer.done_indices == set(first[:16])
    assert {i for part in partial.glob("part-*.parquet")
            for i in pq.read_table(part, columns=["id"]).column("id").to_pylist()} == {f"r{i}" for i in first[:16]}
    assert read_run_metadata(partial) == META
    for i in reversed(range(n)):  # the rest, in another order
        if i not in writer.done_indices:
            writer.add(i, make_row(i))
    writer.close()

    assert pq.read_table(out).equals(pq.read_table(ref))
    assert pq.read_schema(out).metadata == pq.read_schema(ref).metadata
    assert pq.ParquetFile(out).metadata.num_row_groups == pq.ParquetFile(ref).metadata.num_row_groups
    assert not partial.exists()


def test_abandoned_writer_then_close_with_missing_rows_keeps_partial(tmp_path: Path) -> None:
    out = tmp_path / "o.parquet"
    writer = ResultsWriter(out, SCHEMA, META, row_group_size=100, num_rows=10)
    for i in (9, 2, 5):
        writer.add(i, make_row(i))
    with pytest.raises(ApcscoreError, match="7 of 10 rows are missing.*--resume") as err:
        writer.close()  # flushes what it has, writes no final file
    assert err.value.exit_code == 1
    assert not out.exists()
    del writer
    writer = ResultsWriter(out, SCHEMA, META, resume=True, num_rows=10)
    assert writer.done_indices == {2, 5, 9}
    for i in range(10):
        if i not in writer.done_indices:
            writer.add(i, make_row(i))
    writer.close()
    assert pq.read_table(out).to_pylist() == expected_table(10).to_pylist()


def test_existing_output_is_not_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "o.parquet"
    out.write_bytes(b"precious")
    with pytest.raises(ApcscoreError, match="--overwrite.*--out") as err:
        ResultsWriter(out, SCHEMA, META)
    assert err.value.exit_code == 2 and out.read_bytes() == b"precious"
    writer = ResultsWriter(out, SCHEMA, META, overwrite=True, num_rows=1)
    writer.add(0, make_row(0))
    assert out.read_bytes() == b"precious"  # replaced only when the run completes
    writer.close()
    assert pq.read_table(out).num_rows == 1


def test_partial_needs_resume_or_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "o.parquet"
    writer = ResultsWriter(out, SCHEMA, META, row_group_size=1)
    writer.add(0, make_row(0))
    with pytest.raises(ApcscoreError, match="is in use by another apcscore run"):  # issue 46, item 5
        ResultsWriter(out, SCHEMA, META, overwrite=True)
    writer.release()  # its run ended (a crash): the lock went with it
    with pytest.raises(ApcscoreError, match="--resume.*--overwrite"):
        ResultsWriter(out, SCHEMA, META)
    writer = ResultsWriter(out, SCHEMA, META, overwrite=True)  # discards the partial
    assert writer.done_indices == set()
    assert not list(writer.partial_path.glob("part-*"))


def test_resume_refuses_a_different_run(tmp_path: Path) -> None:
    out = tmp_path / "o.parquet"
    writer = ResultsWriter(out, SCHEMA, META, row_group_size=1)
    writer.add(0, make_row(0))
    writer.release()  # its run ended (a crash): the lock went with it
    other = {**META, "dtype": "bfloat16", "model": {"name": "tiny", "fingerprint": "zzz"}, "timings": {"s": 1}}
    with pytest.raises(ApcscoreError) as err:
        ResultsWriter(out, SCHEMA, other, resume=True)
    msg = str(err.value)
    assert err.value.exit_code == 2
    assert "dtype" in msg and "bfloat16" in msg and "model" in msg and "--overwrite" in msg
    assert "command" not in msg and "dataset" not in msg and "timings" not in msg  # only what differs
    # fields outside the run's identity (io/identity.py) may differ
    ResultsWriter(out, SCHEMA, {**META, "timings": {"s": 2}}, resume=True)
    # other columns are refused too
    narrow = pa.schema([("id", pa.string()), ("status", pa.string())])
    with pytest.raises(ApcscoreError, match="other columns"):
        ResultsWriter(out, narrow, META, resume=True)


def test_resume_without_partial_starts_fresh_and_foreign_partial_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "o.parquet"
    writer = ResultsWriter(out, SCHEMA, META, resume=True, num_rows=1)
    assert writer.done_indices == set()
    writer.add(0, make_row(0))
    writer.close()
    other = tmp_path / "x.parquet"
    (tmp_path / "x.parquet.partial").mkdir()
    (tmp_path / "x.parquet.partial" / "notes.txt").write_text("mine")
    with pytest.raises(ApcscoreError, match="not an apcscore partial"):
        ResultsWriter(other, SCHEMA, META, overwrite=True)


def _lines_writer(out: Path, errors: Path | None, **kw) -> ResultsWriter:
    """A writer of JSON lines (`--output-format openai-batch`), the error rows' lines to `errors` when given."""
    writer = ResultsWriter(out, SCHEMA, META, row_group_size=4, num_rows=10,
                           max_buffer_seconds=3600, **kw)  # parts by count only: the same renames in every run
    writer.lines = lambda index, row: json.dumps({"index": index, "id": row["id"]})
    writer.errors_path = errors
    return writer


def test_errors_out_on_another_file_system_finishes_the_run(tmp_path: Path, monkeypatch) -> None:
    """Issue 53, item 5: the error lines' temporary was written in the partial and renamed to --errors-out: on
    another file system that rename fails (EXDEV) after all the compute. `mnt` stands for another file system here:
    a rename across its border fails as the kernel's does."""
    mnt, real = tmp_path / "mnt", os.replace

    def replace(src, dst) -> None:
        if (mnt in Path(src).parents) != (mnt in Path(dst).parents):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    out, errors = tmp_path / "o.jsonl", mnt / "errors.jsonl"
    writer = _lines_writer(out, errors)
    for i in range(10):
        writer.add(i, make_row(i))
    writer.close()
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == [0, 1, 2, 4, 5, 6, 7, 9]
    assert [json.loads(line)["index"] for line in errors.read_text().splitlines()] == [3, 8]
    assert not writer.partial_path.exists() and sorted(os.listdir(mnt)) == ["errors.jsonl"]


def test_a_partial_holds_only_files_the_writer_knows(tmp_path: Path, monkeypatch) -> None:
    """Issue 53, item 5: a run that failed at its end left errors.jsonl.tmp in the partial, a file `_check_ours` did
    not know, so --resume and --overwrite both refused the partial ("not an apcscore partial run; move it away").
    Every rename the writer makes is failed in turn (as a full disk or a kill there would): whatever the partial then
    holds is in the writer's list, and --resume, or --overwrite, then writes what an uninterrupted run writes."""
    from apcscore.io.partial import is_partial_file

    real, calls, fail_at = os.replace, [0], [0]

    def replace(src, dst) -> None:
        calls[0] += 1
        if calls[0] == fail_at[0]:
            raise OSError(errno.ENOSPC, "injected")
        real(src, dst)

    def run(out: Path, errors: Path | None, **kw) -> bool:
        """Write the 10 rows not yet done; whether it failed."""
        writer = None
        try:
            writer = _lines_writer(out, errors, **kw) if errors else ResultsWriter(
                out, SCHEMA, META, row_group_size=4, num_rows=10, max_buffer_seconds=3600, **kw)
            for i in completion_order(10):
                if i not in writer.done_indices:
                    writer.add(i, make_row(i))
            writer.close()
            return False
        except OSError:
            if writer is not None:
                writer.release()  # as the process's end would
            return True

    monkeypatch.setattr(os, "replace", replace)
    for lines in (True, False):
        name, calls[0] = "o.jsonl" if lines else "o.parquet", 0
        run(tmp_path / "ref" / name, tmp_path / "ref" / "err" / "errors.jsonl" if lines else None)
        expected = (tmp_path / "ref" / name).read_bytes()
        renames, calls[0] = calls[0], 0
        assert renames >= 5
        for k in range(1, renames + 1):
            for how in ("resume", "overwrite"):
                folder = tmp_path / f"{name}-{k}-{how}"
                out, errors = folder / name, (folder / "err" / "errors.jsonl" if lines else None)
                fail_at[0], calls[0] = k, 0
                assert run(out, errors), f"rename {k} was not failed"
                partial = out.with_name(out.name + ".partial")
                left = sorted(c.name for c in partial.iterdir())
                assert all(is_partial_file(n) for n in left), (k, left)
                assert not errors or not errors.with_name("errors.jsonl.tmp").exists()
                fail_at[0] = 0
                assert not run(out, errors, **{how: True})
                assert out.read_bytes() == expected and not partial.exists(), (k, how)
                if errors:
                    assert errors.read_bytes() == (tmp_path / "ref" / "err" / "errors.jsonl").read_bytes()


def test_a_partial_left_by_an_earlier_version_resumes(tmp_path: Path) -> None:
    """Issue 53, item 5: the errors.jsonl.tmp that a failed --errors-out rename left in the partial (before the fix)
    no longer blocks --resume or --overwrite."""
    for how in ("resume", "overwrite"):
        out = tmp_path / how / "o.jsonl"
        writer = _lines_writer(out, tmp_path / how / "errors.jsonl")
        for i in range(6):
            writer.add(i, make_row(i))
        writer.flush()
        writer.release()
        (writer.partial_path / "errors.jsonl.tmp").write_text('{"index": 3}\n')
        again = _lines_writer(out, tmp_path / how / "errors.jsonl", **{how: True})
        assert again.done_indices == (set(range(6)) if how == "resume" else set())
        for i in set(range(10)) - again.done_indices:
            again.add(i, make_row(i))
        again.close()
        assert len(out.read_text().splitlines()) == 8 and not again.partial_path.exists()


def test_bad_rows_and_bad_calls(tmp_path: Path) -> None:
    writer = ResultsWriter(tmp_path / "o.parquet", SCHEMA, META, num_rows=3)
    writer.add(0, make_row(0))
    with pytest.raises(ValueError, match="already"):
        writer.add(0, make_row(0))
    with pytest.raises(ValueError, match="out of range"):
        writer.add(3, make_row(3))
    writer.add(1, {**make_row(1), "num_tokens": "many"})
    with pytest.raises(ValueError, match="num_tokens"):
        writer.flush()
    with pytest.raises(ValueError, match="not columns"):
        records_to_table([{"id": "a", "nope": 1}], SCHEMA)
    with pytest.raises(ValueError, match="index"):
        ResultsWriter(tmp_path / "p.parquet", pa.schema([("index", pa.int64())]), META)


def test_read_run_metadata_errors(tmp_path: Path) -> None:
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1]}), plain)
    with pytest.raises(ApcscoreError, match="is not apcscore output: its parquet metadata has no 'apcscore' key"):
        read_run_metadata(plain)
    with pytest.raises(ApcscoreError, match="does not exist"):
        read_run_metadata(tmp_path / "missing.parquet")
    writer = ResultsWriter(tmp_path / "o.parquet", SCHEMA, META)
    writer.update_metadata({"extra": [1, 2]})
    assert read_run_metadata(writer.partial_path) == {**META, "extra": [1, 2]}


MEMORY_SCRIPT = textwrap.dedent("""
    import resource, sys, json, random
    import numpy as np, pyarrow as pa
    from apcscore.io.writer import ResultsWriter
    schema = pa.schema([("id", pa.string()), ("token_logprobs", pa.list_(pa.float32())),
                        ("token_ids", pa.list_(pa.int64()))])
    n, width = int(sys.argv[2]), 2000
    logprobs = np.linspace(-5, 0, width, dtype=np.float32)
    ids = np.arange(width, dtype=np.int64)
    def rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    writer = ResultsWriter(sys.argv[1], schema, {"command": "score"}, row_group_size=32, num_rows=n)
    rng = random.Random(0)
    order = sorted(range(n), key=lambda i: i + rng.uniform(0, 64))
    writer.add(order[0], {"id": str(order[0]), "token_logprobs": logprobs, "token_ids": ids})
    writer.flush()
    base = rss_mb()
    for i in order[1:]:
        writer.add(i, {"id": str(i), "token_logprobs": logprobs, "token_ids": ids})
    writer.close()
    print(json.dumps({"base_mb": base, "peak_mb": rss_mb(),
                      "arrow_peak_mb": pa.default_memory_pool().max_memory() / 2**20}))
""")


def _memory_run(out: Path, n: int) -> dict:
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(out), str(n)], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_memory_is_bounded_by_the_window_not_the_dataset(tmp_path: Path) -> None:
    """Rows of 2,000 tokens in a 64-row out-of-order window: 500 rows (~11 MB as Arrow) vs 4,000 (~92 MB).

    Peak RSS while writing and assembling may differ only by small per-row bookkeeping, not by the data.
    The runs use the system allocator: Arrow's default (mimalloc) keeps freed pages, a constant ~30-60 MB
    that would only add noise; the Arrow pool's own peak is checked as well.
    """
    small = _memory_run(tmp_path / "small.parquet", 500)
    big = _memory_run(tmp_path / "big.parquet", 4000)
    data_mb = (4000 - 500) * 2000 * (4 + 8) / 2**20
    assert big["arrow_peak_mb"] < data_mb / 10, big
    growth = (big["peak_mb"] - big["base_mb"]) - (small["peak_mb"] - small["base_mb"])
    assert growth < data_mb / 8, (small, big)
    out = tmp_path / "big.parquet"
    assert pq.ParquetFile(out).metadata.num_rows == 4000
    assert pq.ParquetFile(out).read_row_group(0).column("id").to_pylist() == [str(i) for i in range(32)]
