"""The run metadata names the model the user asked for (issue 15, item 9): `Engine.from_parts` once reused
the variable `name` in its loop over the state dict, so every run recorded a tensor name
("model.norm.weight") instead. Checked through the command line for an alias, a Hugging Face directory and a
`.gguf` path."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app
from apcscore.models.locate import _alias_gguf
from conftest import DEFAULT_MODEL

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["alias", "directory", "gguf"])
def test_metadata_records_the_model_spec(kind: str, tmp_path, write_jsonl, tiny_model_dir) -> None:
    spec = {"alias": DEFAULT_MODEL, "directory": str(tiny_model_dir("llama")),
            "gguf": str(_alias_gguf(DEFAULT_MODEL))}[kind]
    assert kind != "gguf" or spec.endswith(".gguf")
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "Hello there, world."}])
    out = tmp_path / "out.parquet"
    result = CliRunner().invoke(app, ["score", str(data), "--model", spec, "--out", str(out), "--device", "cpu",
                                      "--num-kv-blocks", "64", "--quiet"])
    assert result.exit_code == 0, result.output
    meta = json.loads(pq.read_table(out).schema.metadata[b"apcscore"])
    assert meta["model"]["name"] == spec
    assert meta["model"]["path"]
