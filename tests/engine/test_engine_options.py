"""Every engine setting can be given on the command line (issue 15, item 7), and a model whose sliding window
caps the context says so in the run's warning and metadata (the window itself is not implemented)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from apcscore import EngineConfig
from apcscore.cli import app
from apcscore.engine.loader import load_native_engine
from apcscore.options.specs import ENGINE_OPTIONS

SWITCHES = {"enable_prefix_caching": "--no-prefix-caching", "use_cuda_graphs": "--no-cuda-graphs",
            "batch_invariant": "--no-batch-invariant"}


@pytest.mark.parametrize("command", ["score", "generate", "perplexity"])
def test_every_engine_setting_has_an_option(command: str) -> None:
    group = typer.main.get_command(app)
    cmd = group.commands[command]
    names = {opt for param in cmd.params if param.param_type_name == "option" for opt in param.opts}
    for field in dataclasses.fields(EngineConfig):
        if field.name == "seed" and command != "generate":
            continue  # only generate samples
        declared = ENGINE_OPTIONS[field.name].flags  # may name its flags (--tensor-parallel for tensor_parallel_size)
        flag = SWITCHES.get(field.name, declared[0] if declared else "--" + field.name.replace("_", "-"))
        assert flag in names, (command, field.name)


def test_new_options_reach_the_engine(tmp_path, write_jsonl, tiny_model_dir) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "One two three four five six seven."}])
    out = tmp_path / "o.parquet"
    result = CliRunner().invoke(app, ["score", str(data), "--model", str(tiny_model_dir("llama")), "--out", str(out),
                                      "--device", "cpu", "--max-model-len", "64", "--logprobs-chunk-size", "3",
                                      "--kv-cache-memory-fraction", "0.1", "--no-cuda-graphs", "--quiet"])
    assert result.exit_code == 0, result.output
    meta = json.loads(pq.read_table(out).schema.metadata[b"apcscore"])
    engine = meta["engine"]
    assert (engine["max_model_len"], engine["logprobs_chunk_size"], engine["kv_cache_memory_fraction"],
            engine["use_cuda_graphs"]) == (64, 3, 0.1, False)
    assert meta["model"]["max_model_len"] == 64
    assert meta["model"]["context_capped_by_sliding_window"] is None


@pytest.fixture
def windowed_mistral(tmp_path, tiny_model_dir):
    src = tiny_model_dir("mistral")
    dst = tmp_path / "mistral-window"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sliding_window"] = 32
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_sliding_window_cap_is_stated(tmp_path, write_jsonl, windowed_mistral) -> None:
    engine = load_native_engine(str(windowed_mistral), EngineConfig(device="cpu", num_kv_blocks=64, block_size=4))
    assert engine.info.max_model_len == 32 and engine.info.sliding_window == 32
    capped = load_native_engine(str(windowed_mistral), EngineConfig(device="cpu", num_kv_blocks=64, block_size=4,
                                                                    max_model_len=16))
    assert capped.info.max_model_len == 16 and capped.info.sliding_window is None  # our cap, not the window's

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt_token_ids": list(range(1, 11))},
                                              {"id": "long", "prompt_token_ids": list(range(1, 41))}])
    out = tmp_path / "o.parquet"
    result = CliRunner().invoke(app, ["score", str(data), "--model", str(windowed_mistral), "--out", str(out),
                                      "--device", "cpu", "--num-kv-blocks", "64"])
    assert result.exit_code == 0, result.output
    assert "sliding attention window is not implemented" in result.output and "32 tokens" in result.output
    table = pq.read_table(out)
    meta = json.loads(table.schema.metadata[b"apcscore"])
    assert meta["model"]["context_capped_by_sliding_window"] == 32 and meta["model"]["max_model_len"] == 32
    assert table.column("status").to_pylist() == ["ok", "error"]
