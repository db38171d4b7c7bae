"""Provenance that --resume and merge check (issue 24, item 2; since issue 40 the views of io/identity.py): the
engine and numerics fields that change bits (and fields added later, until classified), but not the thread count or
the auto-sized KV pool; versions and the --columns mapping. tests/io/test_identity.py checks every field by the
table."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from apcscore.errors import ApcscoreError
from apcscore.io.identity import MERGE, differing, resume_check
from apcscore.io.result_tables import METADATA_KEY
from apcscore.io.writer import ResultsWriter
from apcscore.run.parquet_shards import check_shards

SCHEMA = pa.schema([pa.field("id", pa.string())])


def metadata(**changes) -> dict:
    """A run's metadata as run_metadata writes it (the sections resume and merge compare)."""
    meta = {"apcscore_version": "0", "command": "score", "model": {"fingerprint": "f"}, "tokenizer": {},
            "dtype": "float32", "device": "cpu", "attention_backend": "torch", "model_backend": "native",
            "job": {"prompt_logprobs": 0}, "shard": None,
            "dataset": {"path": "/d.jsonl", "sha256": "s", "num_records": 2, "columns": {}},
            "engine": {"block_size": 16, "num_kv_blocks": 100, "batch_invariant": True, "max_batch_tokens": 2048,
                       "max_num_seqs": 64, "exact_reuse": False},
            "numerics": {"batch_invariant": True, "torch_threads": 2, "cpu_capability": "AVX512",
                         "cpu_model": "Xeon"},
            "versions": {"torch": "2.13", "transformers": "5", "triton": None}}
    for path, value in changes.items():
        section, _, field = path.partition("__")
        if field:
            meta[section] = {**meta[section], field: value}
        else:
            meta[section] = value
    return meta


def partial(tmp_path, meta: dict):
    out = tmp_path / "r.parquet"
    writer = ResultsWriter(out, SCHEMA, meta, resume_check=resume_check, num_rows=2)
    writer.add(0, {"id": "a"})
    writer.flush()
    return out


def resume(out, meta: dict) -> ResultsWriter:
    return ResultsWriter(out, SCHEMA, meta, resume=True, resume_check=resume_check, num_rows=2)


@pytest.mark.parametrize("change, named", [
    ({"numerics__batch_invariant": False}, "numerics.batch_invariant"),  # --no-batch-invariant
    ({"numerics__cpu_model": "EPYC"}, "numerics.cpu_model"),  # a field the numerics gain later: covered
    ({"versions__torch": "2.14"}, "versions.torch"),
    ({"engine__tensor_parallel_size": 2}, "engine.tensor_parallel_size"),
    ({"apcscore_version": "0.2"}, "apcscore_version"),
    ({"dataset__columns": {"prompt": "text"}}, "dataset.columns"),  # --columns
])
def test_resume_refuses_another_configuration_naming_the_field(tmp_path, change: dict, named: str) -> None:
    out = partial(tmp_path, metadata())
    with pytest.raises(ApcscoreError, match="cannot resume") as err:
        resume(out, metadata(**change))
    assert named in str(err.value) and "this run" in str(err.value)


def test_resume_accepts_what_does_not_change_bits(tmp_path) -> None:
    out = partial(tmp_path, metadata())
    writer = resume(out, metadata(engine__num_kv_blocks=7, numerics__torch_threads=16, engine__max_num_seqs=2,
                                  engine__max_batch_tokens=64, dataset__path="/elsewhere/d.jsonl"))
    assert writer.done_indices == {0}


def shard_file(tmp_path, name: str, index: int, meta: dict):
    meta = dict(meta, shard={"index": index, "count": 2, "partition": "prefix", "block_size": 16,
                             "fingerprint": "x", "num_rows": 1, "loads": [1, 1]})
    table = pa.table({"id": ["a"], "record_index": pa.array([index], pa.int64())})
    path = tmp_path / name
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), path)
    return path


@pytest.mark.parametrize("change, named", [
    ({"dataset__columns": {"prompt": "body"}}, "dataset"),
    ({"numerics__cpu_model": "EPYC"}, "numerics.cpu_model"),
    ({"versions__torch": "2.14"}, "versions"),
])
def test_merge_refuses_shards_of_other_columns_or_numerics(tmp_path, change: dict, named: str) -> None:
    a = shard_file(tmp_path, "a.parquet", 0, metadata(dataset__columns={"prompt": "text"}))
    b = shard_file(tmp_path, "b.parquet", 1, metadata(**{"dataset__columns": {"prompt": "text"}, **change}))
    with pytest.raises(ApcscoreError, match="not shards of one dataset under one configuration") as err:
        check_shards([a, b])
    assert named in str(err.value)
    ok = shard_file(tmp_path, "c.parquet", 1, metadata(dataset__columns={"prompt": "text"}, numerics__torch_threads=9,
                                                       engine__num_kv_blocks=3))
    assert [m["shard"]["index"] for m in check_shards([ok, a])] == [0, 1]


def test_differing_names_fields_of_sections() -> None:
    assert differing(metadata(), metadata(numerics__torch_threads=1), MERGE) == []
    assert differing(metadata(), metadata(numerics__cpu_model="EPYC"), MERGE) == \
        ['numerics.cpu_model: "Xeon" vs "EPYC"']


def test_eval_replicas_are_compared_in_the_eval_view() -> None:
    """`eval --ray`'s replicas (run/ray_engine.py) must share the responses' identity (the EVAL view): the KV pool's
    size may differ, a library version may not, and the message says responses, not rows."""
    from apcscore.io.identity import EVAL
    from apcscore.run.ray_replicas import check_replicas

    check_replicas([metadata(), metadata(engine__num_kv_blocks=5)], EVAL, "responses")
    with pytest.raises(ApcscoreError, match=r"replica 1 .*versions.*so their responses would differ in bits"):
        check_replicas([metadata(), metadata(versions__torch="2.14")], EVAL, "responses")


def test_ray_refuses_replicas_of_other_hardware_or_numerics() -> None:
    from apcscore.run.ray_replicas import check_replicas

    check_replicas([metadata(), metadata(numerics__torch_threads=8, engine__num_kv_blocks=5)])  # same bits
    with pytest.raises(ApcscoreError, match=r"replica 2 does not run the configuration of replica 0 "
                                            r"\(numerics.cpu_model: \"Xeon\" vs \"EPYC\"\)"):
        check_replicas([metadata(), metadata(), metadata(numerics__cpu_model="EPYC")])
    with pytest.raises(ApcscoreError, match=r"replica 1 .*versions"):
        check_replicas([metadata(), metadata(versions__torch="2.14")])
