"""`apcscore compare --exact`: any differing bit fails, and the first difference is named.

The slow tests score datasets/sample_prompts.jsonl with the default model three times through the CLI (float32
twice, bfloat16 once): two runs of the same data must compare bit for bit, and the dtype change must fail naming
the first record, column, position and token, each checked here against the files read with pyarrow.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.compare.exact import compare_tables, differs
from apcscore.errors import ApcscoreError

REPO = Path(__file__).resolve().parents[2]


def _bits(v: object, t: pa.DataType) -> object:
    """An independent reference: a value as bytes (floats packed in their own width), lists element by element."""
    if v is None:
        return None
    if pa.types.is_list(t):
        return tuple(_bits(x, t.value_type) for x in v)
    if pa.types.is_float32(t):
        return struct.pack("<f", v)
    if pa.types.is_float64(t):
        return struct.pack("<d", v)
    return v


def _reference(b: pa.Array, n: pa.Array) -> np.ndarray:
    return np.array([_bits(x, b.type) != _bits(y, n.type) for x, y in zip(b.to_pylist(), n.to_pylist())])


def test_differs_compares_bits_not_values() -> None:
    nan = float("nan")
    b = pa.array([0.0, 1.0, nan, None, 2.0, None], pa.float64())
    n = pa.array([-0.0, 1.0, nan, None, None, 3.0], pa.float64())
    assert differs(b, n).tolist() == [True, False, False, False, True, True]  # -0.0 != +0.0; NaN == same NaN
    lb = pa.array([[1.0, 2.0], [1.0], None, []], pa.list_(pa.float32()))
    ln = pa.array([[1.0, 2.5], [1.0, 0.0], None, []], pa.list_(pa.float32()))
    assert differs(lb, ln).tolist() == [True, True, False, False]
    nested_b = pa.array([[[1, 2], [3]], [[4]], [[5], None]], pa.list_(pa.list_(pa.int64())))
    nested_n = pa.array([[[1, 2], [3]], [[4, 0]], [[5], []]], pa.list_(pa.list_(pa.int64())))
    assert differs(nested_b, nested_n).tolist() == [False, True, True]  # a null inner list is not an empty one


def test_differs_agrees_with_a_reference_on_random_nested_columns() -> None:
    rng = np.random.default_rng(0)
    for t in (pa.float32(), pa.float64(), pa.int64()):
        outer = pa.list_(pa.list_(t))
        rows_b, rows_n = [], []
        for _ in range(200):
            row = [[float(rng.normal()) if t != pa.int64() else int(rng.integers(9)) for _ in range(rng.integers(3))]
                   for _ in range(rng.integers(4))] if rng.random() > 0.1 else None
            other = None if row is None else [list(x) for x in row]
            if other and rng.random() < 0.3:  # change one element, or drop one
                i = int(rng.integers(len(other)))
                if other[i] and rng.random() < 0.7:
                    x = other[i][0]
                    other[i][0] = x + 1 if t == pa.int64() else float(np.nextafter(np.float32(x), np.float32(9)))
                else:
                    other[i] = other[i][:-1] if other[i] else None
            rows_b.append(row)
            rows_n.append(other)
        b, n = pa.array(rows_b, outer), pa.array(rows_n, outer)
        expected = _reference(b, n)
        assert expected.any() and not expected.all()
        assert differs(b, n).tolist() == expected.tolist()


def test_compare_tables_names_the_first_difference_and_ignores_scheduling_columns() -> None:
    base = pa.table({"id": ["a", "b", "c"], "num_cached_tokens": [0, 16, 32],
                     "token_ids": [[1, 2, 3], [4, 5, 6], [7, 8]],
                     "token_logprobs": pa.array([[None, -1.0, -2.0], [None, -3.0, -4.0], [None, -5.0]],
                                                pa.list_(pa.float32())),
                     "sum_logprob": [-3.0, -7.0, -5.0]})
    new = base.set_column(1, "num_cached_tokens", pa.array([5, 0, 0]))  # another batching: not a result
    same = compare_tables(base, new.take([2, 0, 1]))  # rows matched by id, not by order
    assert same.passed and "num_cached_tokens" not in same.columns
    lp = pa.array([[None, -1.0, -2.0], [None, -3.0, -4.5], [None, -5.0]], pa.list_(pa.float32()))
    changed = new.set_column(3, "token_logprobs", lp).set_column(4, "sum_logprob", pa.array([-3.0, -7.5, -5.0]))
    diff = compare_tables(base, changed)
    assert not diff.passed and diff.num_differing_records == 1
    assert diff.differing == {"token_logprobs": 1, "sum_logprob": 1}
    f = diff.first
    assert (f.id, f.column, f.position, f.token, f.base, f.new) == ("b", "token_logprobs", 2, 6, -4.0, -4.5)
    assert "record 'b', column token_logprobs, position 2 (token id 6)" in diff.summary()
    with pytest.raises(ApcscoreError, match="different records"):
        compare_tables(base, base.slice(0, 2))


# ---- real runs of the default model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def score_runs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    """sample_prompts.jsonl scored by the CLI: float32 twice (separate runs), bfloat16 once; top-5 stored."""
    from apcscore.cli import app

    out = tmp_path_factory.mktemp("exact")
    runs = {}
    for name, dtype in (("a", "float32"), ("b", "float32"), ("bf16", "bfloat16")):
        path = out / f"{name}.parquet"
        r = CliRunner().invoke(app, ["score", str(REPO / "datasets" / "sample_prompts.jsonl"), "--dtype", dtype,
                                     "--prompt-logprobs", "5", "--out", str(path), "-q"])
        assert r.exit_code == 0, r.output
        runs[name] = path
    return runs


def _compare(*args: object) -> object:
    from apcscore.cli import app

    return CliRunner().invoke(app, ["compare", *map(str, args)], env={"COLUMNS": "400"})


@pytest.mark.slow
def test_exact_passes_on_two_runs_of_the_same_data(score_runs) -> None:
    r = _compare(score_runs["a"], score_runs["b"], "--exact")
    assert r.exit_code == 0, r.output
    assert "all 8 records are bit-identical" in r.output and "token_logprobs" in r.output


@pytest.mark.slow
def test_exact_fails_on_a_changed_dtype_naming_the_first_difference(score_runs, tmp_path) -> None:
    report = tmp_path / "r.json"
    r = _compare(score_runs["a"], score_runs["bf16"], "--exact", "--report-json", report)
    assert r.exit_code == 1, r.output
    base, new = pq.read_table(score_runs["a"]).to_pylist(), pq.read_table(score_runs["bf16"]).to_pylist()
    # independently: the first record that differs in any per-token value, and its first differing position
    per_token = ("token_logprobs", "token_ranks", "top_ids", "top_logprobs")
    first = next(i for i, (x, y) in enumerate(zip(base, new)) if any(x[c] != y[c] for c in per_token))
    x, y = base[first], new[first]
    pos = min(next(j for j, (u, v) in enumerate(zip(x[c], y[c])) if u != v) for c in per_token if x[c] != y[c])
    token = x["token_ids"][pos]
    assert f"first difference: record {x['id']!r}" in r.output
    assert f"position {pos} (token id {token})" in r.output
    assert all(x["token_ids"] == y["token_ids"] for x, y in zip(base, new))  # the same tokens, other numbers
    import json

    data = json.loads(report.read_text())
    exact = [c for c in data["checks"] if c["option"] == "--exact"]
    assert exact and not exact[0]["passed"] and exact[0]["value"] >= 1


@pytest.mark.slow
def test_exact_ignores_metadata_but_not_a_status(score_runs, tmp_path) -> None:
    """Run metadata (timings, command line, created) differs between any two runs and is never compared; a
    changed column value is found even where the numbers are equal."""
    table = pq.read_table(score_runs["b"])
    meta = dict(table.schema.metadata)
    assert meta != pq.read_table(score_runs["a"]).schema.metadata  # e.g. created, timings
    edited = tmp_path / "edited.parquet"
    status = table["status"].to_pylist()
    status[3] = "error"
    pq.write_table(table.set_column(table.column_names.index("status"), "status", pa.array(status)), edited)
    r = _compare(score_runs["a"], edited, "--exact", "--max-new-errors", "5")
    assert r.exit_code == 1 and "column status" in r.output and f"{table['id'][3].as_py()!r}" in r.output
    # other token ids: compare refuses the files (exit 2 without --exact); --exact names the difference (exit 1)
    ids = table["token_ids"].to_pylist()
    ids[2] = ids[2][:-1] + [ids[2][-1] + 1]
    retok = tmp_path / "retokenized.parquet"
    pq.write_table(table.set_column(table.column_names.index("token_ids"), "token_ids", pa.array(ids)), retok)
    assert _compare(score_runs["a"], retok).exit_code == 2
    r = _compare(score_runs["a"], retok, "--exact")
    assert r.exit_code == 1 and "column token_ids" in r.output and "tokenized differently" in r.output
    copy = tmp_path / "copy.parquet"
    shutil.copy(score_runs["a"], copy)
    assert _compare(score_runs["a"], copy, "--exact").exit_code == 0
