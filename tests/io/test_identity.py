"""A run's identity (issue 40): the table "A run's identity" of docs/architecture.md, read here, decides for each
field whether two runs that differ only in it are refused or accepted by --resume (the results writer), merge
(check_shards), Ray (the replica check) and the eval cache (the store's identity). The doc and the code cannot
drift: every field io/identity.py classifies has a row, and every row is checked through the real checks."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from apcscore.errors import ApcscoreError
from apcscore.io import identity
from apcscore.io.result_tables import METADATA_KEY
from apcscore.io.writer import ResultsWriter
from apcscore.run.parquet_shards import check_shards
from apcscore.run.ray_replicas import check_replicas

ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
SCHEMA = pa.schema([pa.field("id", pa.string())])
COLUMNS = {"resume": 2, "merge": 3, "ray": 4, "eval": 5}  # the table's columns of each view


def base() -> dict[str, Any]:
    """A score run's metadata as run/metadata.run_metadata writes it: a portable CPU run whose probe passed."""
    return {
        "apcscore_version": "0.1.0", "code": {"kernels": "k1", "matmul_configs": "m1", "models": "d1"},
        "command": "score", "argv": ["apcscore"], "created": "2026-01-01T00:00:00Z",
        "model": {"name": "m", "path": "/models/m", "architecture": "LlamaForCausalLM", "fingerprint": "f1",
                  "files": {"config.json": "c1", "tokenizer.json": "t1", "tokenizer_config.json": "tc1"}},
        "tokenizer": {"class": "PreTrainedTokenizerFast", "name_or_path": "/models/m", "vocab_size": 100},
        "dtype": "float32", "device": "cpu", "attention_backend": "torch", "model_backend": "native",
        "engine": {"device": "auto", "dtype": "auto", "block_size": 16, "num_kv_blocks": 100,
                   "max_batch_tokens": 2048, "max_num_seqs": 64, "enable_prefix_caching": True, "max_logprobs": 20,
                   "logprobs_chunk_size": 1024, "attention_backend": "auto", "kv_cache_memory_fraction": None,
                   "seed": 0, "max_model_len": None, "use_cuda_graphs": True, "batch_invariant": True,
                   "model_backend": "auto", "exact_reuse": False, "tensor_parallel_size": 1},
        "job": {"prompt_logprobs": 5}, "shard": None,
        "dataset": {"path": "/d.jsonl", "sha256": "s1", "num_records": 2, "columns": {}},
        "versions": {"torch": "2.13", "transformers": "5.25", "tokenizers": "0.23", "triton": None},
        "numerics": {"batch_invariant": True, "reason": None,
                     "linear": "apcscore fixed-order GEMM, order 2064 (blocked fma chains)",
                     "probe": {"passed": True, "reason": None, "seconds": 0.1}, "portable": True,
                     "math": "apcscore portable math v1", "torch_threads": 2, "cpu_capability": "AVX512",
                     "simd": "avx512", "device_capability": None,
                     "hardware": {"cpu": {"vendor": "AuthenticAMD", "model": "AMD EPYC"}},
                     "blas": {"library": "mkl 2024", "env": {}}},
    }


def probe_failed(meta: dict) -> None:
    meta["numerics"].update(batch_invariant=False, portable=False, math="torch's ops (follow the CPU's ISA)",
                            linear="library GEMM on rows padded to 16 (probed, not by construction)",
                            probe={"passed": False, "reason": "a 57-row call differs"}, reason="the probe failed")


def no_batch_invariant(meta: dict) -> None:
    meta["engine"]["batch_invariant"] = False
    meta["numerics"].update(batch_invariant=False, portable=False, math="torch's ops (follow the CPU's ISA)",
                            linear="library GEMM (not batch-invariant)", probe=None,
                            reason="turned off (--no-batch-invariant)")


def not_portable(meta: dict) -> None:  # no C compiler: the pad-16 construction, probe passed
    meta["numerics"].update(portable=False, math="torch's ops (follow the CPU's ISA)",
                            linear="library GEMM on rows padded to 16 (probed, not by construction)")


# a row's case (the words in parentheses after its field) -> how the base run is set up
SETUPS: dict[str, Callable[[dict], None]] = {"probe failed": probe_failed, "--no-batch-invariant": no_batch_invariant,
                                            "not portable": not_portable, "pad-16": not_portable}


def put(meta: dict, path: str, value: Any) -> None:
    """Set the dotted `path` of `meta` to `value`."""
    *parents, last = path.split(".")
    for part in parents:
        if not isinstance(meta.get(part), dict):
            meta[part] = {}
        meta = meta[part]
    meta[last] = value


def other(value: Any) -> Any:
    """A value of the same kind that differs."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, dict):
        return {**value, "changed": 1}
    return f"{value}-other" if value is not None else "other"


# (field, case) -> the two values of the pair where a generic change would not say what the row means
PAIRS: dict[tuple[str, str], tuple[Any, Any]] = {
    ("dataset", ""): ({"path": "/d.jsonl", "sha256": "s1", "num_records": 2, "columns": {}},
                      {"path": "/d.jsonl", "sha256": "s2", "num_records": 2, "columns": {}}),
    ("model.files", "config.json edited"): ({"config.json": "c1", "tokenizer.json": "t1"},
                                           {"config.json": "c2", "tokenizer.json": "t1"}),
    ("model.files", "tokenizer.json edited"): ({"config.json": "c1", "tokenizer.json": "t1"},
                                              {"config.json": "c1", "tokenizer.json": "t2"}),
    ("device", "cpu vs cuda"): ("cpu", "cuda:0"),
    ("device", "cuda:0 vs cuda:1"): ("cuda:0", "cuda:1"),
    ("engine.device", "auto vs cpu"): ("auto", "cpu"),
    ("engine.dtype", "auto vs float32"): ("auto", "float32"),
    ("engine.attention_backend", "auto vs torch"): ("auto", "torch"),
    ("engine.model_backend", "auto vs native"): ("auto", "native"),
    ("numerics.hardware", "--no-batch-invariant, Intel vs AMD"): (
        {"cpu": {"vendor": "GenuineIntel", "model": "Intel Xeon"}}, {"cpu": {"vendor": "AuthenticAMD",
                                                                             "model": "AMD EPYC"}}),
    ("numerics.hardware", "pad-16, Intel vs AMD"): (
        {"cpu": {"vendor": "GenuineIntel", "model": "Intel Xeon"}}, {"cpu": {"vendor": "AuthenticAMD",
                                                                             "model": "AMD EPYC"}}),
    ("numerics.cpu_capability", ""): ("AVX2", "AVX512"),
    ("numerics.cpu_capability", "not portable"): ("AVX2", "AVX512"),
    ("numerics.simd", ""): ("avx2", "avx512"),
}


def table() -> list[dict[str, Any]]:
    """The rows of the table "A run's identity": field, case, and each view's verdict (True: refused)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text[text.index("## A run's identity"):]
    section = section[:section.index("\n## ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`([\w.]+)`(?: \((.+)\))?", cells[0]) if len(cells) == 6 else None
        if not match:
            continue
        verdicts = {view: cells[col] for view, col in COLUMNS.items()}
        assert set(verdicts.values()) <= {"refused", "accepted"}, line
        rows.append({"field": match.group(1), "case": match.group(2) or "",
                     "refused": {v: verdict == "refused" for v, verdict in verdicts.items()}})
    return rows


ROWS = table()


def pair(row: dict) -> tuple[dict, dict]:
    """Two runs that differ only in the row's field, on the base run of its case."""
    a = base()
    for word, setup in SETUPS.items():
        if row["case"].startswith(word):
            setup(a)
    b = copy.deepcopy(a)
    field, case = row["field"], row["case"]
    if (field, case) in PAIRS:
        x, y = PAIRS[field, case]
        put(a, field, x)
        put(b, field, y)
    elif case == "moved":
        put(b, field if field.endswith("path") else f"{field}.path", "/elsewhere/moved")
    else:
        put(b, field, other(identity.lookup(a, field)))
    return a, b


def resume_refused(tmp_path: Path, a: dict, b: dict) -> bool:
    out = tmp_path / "r.parquet"
    writer = ResultsWriter(out, SCHEMA, a, num_rows=2, resume_check=identity.resume_check)
    writer.add(0, {"id": "a"})
    writer.flush()
    writer.release()  # the first run ended: its partial is no longer locked
    try:
        ResultsWriter(out, SCHEMA, b, num_rows=2, resume=True, resume_check=identity.resume_check).release()
    except ApcscoreError as err:
        assert "cannot resume" in str(err) and "--overwrite" in str(err)
        return True
    return False


def shard_file(path: Path, index: int, meta: dict) -> Path:
    meta = dict(meta, shard={"index": index, "count": 2, "partition": "prefix", "block_size": 16,
                             "fingerprint": "x", "num_rows": 1, "loads": [1, 1]})
    table_ = pa.table({"id": [str(index)], "record_index": pa.array([index], pa.int64())})
    pq.write_table(table_.replace_schema_metadata({METADATA_KEY: json.dumps(meta)}), path)
    return path


def merge_refused(tmp_path: Path, a: dict, b: dict) -> bool:
    try:
        check_shards([shard_file(tmp_path / "a.parquet", 0, a), shard_file(tmp_path / "b.parquet", 1, b)])
    except ApcscoreError as err:
        assert "shard" in str(err) or "batch invariance" in str(err)
        return True
    return False


def ray_refused(a: dict, b: dict) -> bool:
    try:
        check_replicas([a, b])
    except ApcscoreError:
        return True
    return False


def eval_refused(a: dict, b: dict) -> bool:
    # another identity: another store file, never read
    return identity.view(a, identity.EVAL) != identity.view(b, identity.EVAL)


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['field']}({r['case']})" if r["case"] else r["field"] for r in ROWS])
def test_each_field_is_refused_or_accepted_as_the_table_says(tmp_path: Path, row: dict) -> None:
    a, b = pair(row)
    got = {"resume": resume_refused(tmp_path, a, b), "merge": merge_refused(tmp_path, a, b),
           "ray": ray_refused(a, b), "eval": eval_refused(a, b)}
    assert got == row["refused"]
    # the module's own views say what the table says (merge refuses failed-probe shards outright, so its check
    # alone cannot tell whether the MERGE view compares the field there)
    assert {v: bool(identity.differing(a, b, v)) for v in identity.VIEWS} == row["refused"]
    # the control: the base run against itself is accepted (merge: but for a failed probe)
    same = copy.deepcopy(a)
    assert not any((resume_refused(tmp_path / "same", a, same), ray_refused(a, same), eval_refused(a, same)))
    assert merge_refused(tmp_path, a, same) == row["case"].startswith("probe failed")


def test_the_table_has_a_row_for_every_field_the_identity_classifies() -> None:
    fields = {r["field"] for r in ROWS}
    assert {f.path for f in identity.FIELDS} <= fields
    assert set(identity.NOT_BITS) <= fields
    known = {case for _, case in PAIRS} | {"moved"}
    assert all(r["case"] in known or r["case"].split(",")[0] in SETUPS for r in ROWS)  # no case left unread


def test_every_engine_setting_and_numerics_field_is_classified() -> None:
    """A field EngineConfig or describe_numerics gains must be classified (compared by default, named here)."""
    from apcscore.config import EngineConfig

    classified = identity.KNOWN
    assert {f"engine.{k}" for k in EngineConfig().to_dict()} <= classified
    assert {f"numerics.{k}" for k in base()["numerics"]} <= classified


def test_messages_name_the_field_and_how_to_start_afresh(tmp_path: Path) -> None:
    a, b = base(), base()
    b["code"]["matmul_configs"] = "m2"
    assert resume_refused(tmp_path, a, b)
    with pytest.raises(ApcscoreError) as err:
        ResultsWriter(tmp_path / "r.parquet", SCHEMA, b, num_rows=2, resume=True,
                      resume_check=identity.resume_check)
    text = str(err.value)
    assert 'code.matmul_configs: partial "m1", this run "m2"' in text
    assert "computes other bits" in text and "--overwrite" in text and "another --out" in text
    with pytest.raises(ApcscoreError, match=r"code\.matmul_configs: \"m1\" vs \"m2\".*one apcscore.*new --out"):
        check_shards([shard_file(tmp_path / "a.parquet", 0, a), shard_file(tmp_path / "b.parquet", 1, b)])
