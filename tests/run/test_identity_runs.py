"""A run's identity end to end (issue 40, and issue 46 item 10): real runs of a tiny model, interrupted and resumed
or sharded and merged, refused or accepted as io/identity.py says: settings compared as resolved, the model's
config and tokenizer files, apcscore's numerics fingerprint."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.io.writer import ResultsWriter
from apcscore.engine import provenance as run_metadata

runner = CliRunner()


def run(*args) -> object:
    return runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def meta(path: Path) -> dict:
    return json.loads(pq.read_table(path).schema.metadata[b"apcscore"])


def records(n: int) -> list[dict]:
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    return [{"id": f"r{i}", "prompt": " ".join(words[j % 8] for j in range(i % 5 + 3))} for i in range(n)]


@pytest.fixture
def model(tiny_model_dir, tmp_path) -> Path:
    """A private copy of the tiny Llama (the tests edit its files)."""
    return Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "model"))


@pytest.fixture
def interrupted(tmp_path, write_jsonl, model, monkeypatch):
    """interrupted(*options) -> (out, data): a score run with `options`, stopped by SIGINT after 2 rows."""
    def start(*options) -> tuple[Path, Path]:
        data = write_jsonl(tmp_path / "d.jsonl", records(8))
        out = tmp_path / "o.parquet"
        original, count = ResultsWriter.add, {"rows": 0}

        def add(self, index, row):
            original(self, index, row)
            count["rows"] += 1
            if count["rows"] == 2:
                os.kill(os.getpid(), signal.SIGINT)
        with monkeypatch.context() as patch:
            patch.setattr(ResultsWriter, "add", add)
            res = run("score", data, "--model", model, "--out", out, "--max-num-seqs", 1, "--max-batch-tokens", 16,
                      *options)
        assert res.exit_code == 130, res.output
        return out, data
    return start


@pytest.mark.slow
def test_resume_compares_settings_as_resolved_not_as_typed(interrupted, model) -> None:
    out, data = interrupted()  # all defaults: auto device, dtype, backends
    res = run("score", data, "--model", model, "--out", out, "--resume", "--device", "cpu", "--dtype", "float32",
              "--attention-backend", "torch", "--model-backend", "native")
    assert res.exit_code == 0, res.output
    m = meta(out)
    assert m["device"] == "cpu" and m["engine"]["device"] == "cpu"


@pytest.mark.slow
def test_resume_refuses_an_edited_config_or_tokenizer(interrupted, model) -> None:
    out, data = interrupted()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    res = run("score", data, "--model", model, "--out", out, "--resume")
    assert res.exit_code == 2 and "model.files.config.json" in res.output, res.output
    (model / "config.json").write_text(json.dumps(config))
    tokenizer = model / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + "\n")  # any byte: the identity is the file's sha256
    res = run("score", data, "--model", model, "--out", out, "--resume")
    assert res.exit_code == 2 and "model.files.tokenizer.json" in res.output, res.output


def test_resume_refuses_other_numerics_code_and_says_how_to_start_afresh(interrupted, model,
                                                                        monkeypatch) -> None:
    out, data = interrupted()
    recorded = json.loads((out.with_name(out.name + ".partial") / "run.json").read_text())["metadata"]
    assert set(recorded["code"]) == {"kernels", "matmul_configs", "models"}
    assert recorded["versions"]["tokenizers"] and recorded["model"]["files"]["tokenizer.json"]
    monkeypatch.setattr(run_metadata, "code_fingerprint", lambda: {**recorded["code"], "matmul_configs": "0" * 16})
    res = run("score", data, "--model", model, "--out", out, "--resume")
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "code.matmul_configs" in text and "computes other bits" in text
    assert "--overwrite" in text and "another --out" in text


def test_shards_of_auto_and_cpu_merge(tmp_path, write_jsonl, model) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", records(6))
    a, b, merged = tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "m.parquet"
    assert run("score", data, "--model", model, "--shard", "0/2", "--out", a).exit_code == 0
    res = run("score", data, "--model", model, "--shard", "1/2", "--out", b, "--device", "cpu", "--dtype",
              "float32", "--attention-backend", "torch", "--model-backend", "native")
    assert res.exit_code == 0, res.output
    res = run("merge", merged, a, b)
    assert res.exit_code == 0, res.output
    assert pq.read_table(merged).num_rows == 6


def test_code_fingerprint_names_the_part_that_changed(tmp_path) -> None:
    package = Path(run_metadata.__file__).resolve().parents[1]
    root = tmp_path / "apcscore"
    for part in ("kernels", "models", "attention", "engine"):
        shutil.copytree(package / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    before = run_metadata.code_fingerprint(root)
    assert before == run_metadata.code_fingerprint()  # the copy hashes as the package
    (root / "kernels" / "matmul_configs.py").write_text((root / "kernels" / "matmul_configs.py").read_text() + "#\n")
    (root / "attention" / "tiles.py").write_text((root / "attention" / "tiles.py").read_text() + "#\n")
    run_metadata.code_fingerprint.cache_clear()
    after = run_metadata.code_fingerprint(root)
    assert after["kernels"] == before["kernels"]
    assert after["matmul_configs"] != before["matmul_configs"] and after["models"] != before["models"]
    (root / "kernels" / "cpu_gemm.c").write_text((root / "kernels" / "cpu_gemm.c").read_text() + "\n")
    run_metadata.code_fingerprint.cache_clear()
    with_c = run_metadata.code_fingerprint(root)["kernels"]
    assert with_c != before["kernels"]
    # the C headers too
    (root / "kernels" / "cpu_vec.h").write_text((root / "kernels" / "cpu_vec.h").read_text() + "\n")
    run_metadata.code_fingerprint.cache_clear()
    assert run_metadata.code_fingerprint(root)["kernels"] != with_c


def test_apcscore_version_comes_from_the_package_metadata(monkeypatch) -> None:
    monkeypatch.setattr(run_metadata, "package_version", lambda name: "9.9" if name == "apcscore" else None)
    assert run_metadata.apcscore_version() == "9.9" and run_metadata.run_header("score")["apcscore_version"] == "9.9"
    monkeypatch.setattr(run_metadata, "package_version", lambda name: None)
    import apcscore

    assert run_metadata.apcscore_version() == apcscore.__version__


@pytest.fixture
def probe_fails(monkeypatch) -> None:
    """Every engine's batch-invariant linear splits K above 4 rows (as a BLAS may by M): the start-up probe fails."""
    from apcscore.models import ops as ops_module
    from tests.engine.test_gemm_probe import SplitKAboveRows

    real = ops_module.select_linear
    monkeypatch.setattr(ops_module, "select_linear",
                        lambda device, invariant: SplitKAboveRows(4) if invariant else real(device, invariant))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the start-up probe found")
def test_resume_after_a_failed_probe_refuses_another_budget(interrupted, model, probe_fails) -> None:
    """The issue's hole: the schedule was dropped wherever invariance was asked for, even where the probe failed."""
    out, data = interrupted()
    recorded = json.loads((out.with_name(out.name + ".partial") / "run.json").read_text())["metadata"]
    assert recorded["numerics"]["batch_invariant"] is False and recorded["engine"]["batch_invariant"] is True
    res = run("score", data, "--model", model, "--out", out, "--resume", "--max-num-seqs", 1,
              "--max-batch-tokens", 32)
    assert res.exit_code == 2 and "engine.max_batch_tokens" in " ".join(res.output.split()), res.output
    res = run("score", data, "--model", model, "--out", out, "--resume", "--max-num-seqs", 1,
              "--max-batch-tokens", 16)  # the same budget: the same steps
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).num_rows == 8


def shards_on(tmp_path: Path, data: Path, model: Path, vendors: tuple[str, str], monkeypatch, *options) -> object:
    """Score `data` as two shards, shard i on a CPU of `vendors[i]` (its description), then merge them."""
    from apcscore.engine import numerics

    paths, name = [], "-".join(vendors) + "".join(options)
    for i, vendor in enumerate(vendors):
        monkeypatch.setattr(numerics, "cpu_description", lambda v=vendor: {"vendor": v, "model": f"{v} CPU"})
        paths.append(tmp_path / f"{name}{i}.parquet")
        res = run("score", data, "--model", model, "--shard", f"{i}/2", "--out", paths[-1], *options)
        assert res.exit_code == 0, res.output
    return run("merge", tmp_path / f"{name}.parquet", *paths)


@pytest.mark.slow
def test_no_batch_invariant_shards_of_two_cpu_vendors_do_not_merge(tmp_path, write_jsonl, model,
                                                                  monkeypatch) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", records(6))
    res = shards_on(tmp_path, data, model, ("GenuineIntel", "AuthenticAMD"), monkeypatch, "--no-batch-invariant")
    assert res.exit_code == 2, res.output
    assert "numerics.hardware.cpu" in " ".join(res.output.split()) and "GenuineIntel" in res.output
    # the same vendor merges, and so do the fixed-order GEMM's portable shards of two vendors
    assert shards_on(tmp_path, data, model, ("AuthenticAMD", "AuthenticAMD"), monkeypatch,
                     "--no-batch-invariant").exit_code == 0
    res = shards_on(tmp_path, data, model, ("GenuineIntel", "AuthenticAMD"), monkeypatch)
    assert res.exit_code == 0, res.output
