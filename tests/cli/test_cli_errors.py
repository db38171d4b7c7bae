"""Bad input gets a clear error before the model loads (exit 2, nothing written), or an error row at run time."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from apcscore.cli import app

runner = CliRunner()


def test_invalid_dataset_is_refused_with_file_and_line(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "fine"}, "{not json", {"prompt": 5}, {"text": "x"}])
    out = tmp_path / "o.parquet"
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--quiet"])
    assert res.exit_code == 2
    assert f"{data}:2:" in res.output and f"{data}:3:" in res.output and f"{data}:4:" in res.output
    assert not out.exists() and not (tmp_path / "o.parquet.partial").exists()


def test_skip_invalid_turns_bad_records_into_error_rows(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "bad.jsonl", [{"id": "a", "prompt": "fine"}, "{not json", {"id": "c", "prompt": 5},
                                                {"id": "d", "prompt": "also fine"}])
    out = tmp_path / "o.parquet"
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--quiet", "--skip-invalid"])
    assert res.exit_code == 0, res.output
    rows = pq.read_table(out).to_pylist()
    assert [r["status"] for r in rows] == ["ok", "error", "error", "ok"]
    assert [r["id"] for r in rows] == ["a", "#line2", "c", "d"]  # a line that does not parse claims no id
    assert ":2:" in rows[1]["error"] and "prompt" in rows[2]["error"]


def test_run_time_problems_become_error_rows(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [
        {"id": "long", "prompt_token_ids": list(range(1, 2100))},  # the tiny model's context is 2048
        {"id": "ok", "prompt": "a short prompt"},
        {"id": "empty", "prompt": ""},
    ])
    out = tmp_path / "o.parquet"
    # an empty prompt has no tokens with this tokenizer: found before the weights load, like any invalid record
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--quiet"])
    assert res.exit_code == 2 and f"{data}:3: 'prompt' is empty" in res.output, res.output
    assert not out.exists()
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--quiet", "--skip-invalid"])
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert rows["long"]["status"] == "error" and "2048" in rows["long"]["error"]
    assert "--truncate left" in rows["long"]["error"]  # the message names the way out
    assert rows["ok"]["status"] == "ok"
    assert rows["empty"]["status"] == "error" and "no tokens" in rows["empty"]["error"]


def test_request_larger_than_the_kv_pool_is_an_error_row_not_a_hang(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "big", "prompt_token_ids": list(range(1, 200))},
                                              {"id": "small", "prompt_token_ids": [1, 2, 3]}])
    out = tmp_path / "o.parquet"
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--quiet",
                              "--num-kv-blocks", "4", "--block-size", "16"])
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert rows["big"]["status"] == "error" and "--num-kv-blocks" in rows["big"]["error"]
    assert rows["small"]["status"] == "ok"


@pytest.mark.parametrize("args, message", [
    (["--max-batch-tokens", "0"], "--max-batch-tokens"),
    (["--block-size", "12"], "power of two"),
    (["--device", "tpu"], "--device"),
    (["--attention-backend", "flash"], "--attention-backend"),
    (["--prompt-logprobs", "-1"], "--prompt-logprobs"),
])
def test_bad_option_values(tmp_path, write_jsonl, args, message):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    res = runner.invoke(app, ["score", str(data), "--out", str(tmp_path / "o.parquet"), *args])
    assert res.exit_code == 2 and message in res.output, res.output


def test_generate_logprobs_cap_and_missing_dataset(tmp_path, write_jsonl):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    res = runner.invoke(app, ["generate", str(data), "--logprobs", "50", "--out", str(tmp_path / "o.parquet")])
    assert res.exit_code == 2 and "--logprobs 50" in res.output and "--max-logprobs 50" in res.output
    res = runner.invoke(app, ["score", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o.parquet")])
    assert res.exit_code == 2 and "missing.jsonl" in res.output


@pytest.mark.slow
def test_truncate_left_keeps_the_newest_tokens_and_counts_the_dropped(tmp_path, write_jsonl, tiny):
    long_ids = list(range(1, 2101))  # the tiny model's context is 2048
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "long", "prompt_token_ids": long_ids},
                                              {"id": "short", "prompt_token_ids": [1, 2, 3]}])
    out = tmp_path / "o.parquet"
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--quiet", "--truncate", "left"])
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert rows["long"]["status"] == "ok" and rows["long"]["num_truncated_tokens"] == 52
    assert rows["long"]["token_ids"] == long_ids[52:]
    assert rows["short"]["num_truncated_tokens"] == 0
    gen = tmp_path / "g.parquet"
    res = runner.invoke(app, ["generate", str(data), "--model", tiny, "--out", str(gen), "--quiet",
                              "--truncate", "left", "--max-tokens", "4"])
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in pq.read_table(gen).to_pylist()}
    assert rows["long"]["num_prompt_tokens"] == 2044 and rows["long"]["num_truncated_tokens"] == 56
    assert len(rows["long"]["completion_token_ids"]) == 4
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(tmp_path / "x.parquet"),
                              "--truncate", "right"])
    assert res.exit_code == 2 and "--truncate" in res.output


def one_line(res) -> str:
    return " ".join(res.output.split())


def test_a_bad_apcscore_cache_is_one_clear_error(tmp_path, write_jsonl, tiny):
    """Issue 46, item 8: $APCSCORE_CACHE naming a file or an impossible path was a traceback (converting the
    default model) or a silent fallback from the fixed-order CPU GEMM (a tiny model)."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    (tmp_path / "file").write_text("x")
    cases = {str(tmp_path / "file"): "is a file, not a folder",
             str(tmp_path / "file" / "sub"): "is a file, not a folder",
             "/proc/apcscore-cache": "cannot write in /proc"}
    for cache, message in cases.items():
        for model in ([tiny], []):
            res = runner.invoke(app, ["score", str(data), *(["--model", *model] if model else []), "--out",
                                      str(tmp_path / "o.parquet"), "-q"], env={"APCSCORE_CACHE": cache})
            assert res.exit_code == 2 and f"APCSCORE_CACHE={cache}" in one_line(res) and message in one_line(res), \
                res.output
            assert "Traceback" not in res.output and not (tmp_path / "o.parquet").exists()


def test_a_truncated_safetensors_names_the_file_and_what_to_delete(tmp_path, write_jsonl, tiny, monkeypatch):
    """Issue 46, item 8: a truncated model.safetensors was safetensors' traceback; in a model folder the file is
    named, in the model cache the converted copy's folder to delete."""
    import shutil

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    folder = shutil.copytree(tiny, tmp_path / "m")
    cached = shutil.copytree(tiny, tmp_path / "cache" / "models" / "tiny-0123456789ab")
    for copy in (folder, cached):
        weights = copy / "model.safetensors"
        with weights.open("r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    res = runner.invoke(app, ["score", str(data), "--model", str(folder), "--out", str(tmp_path / "o.parquet"), "-q"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"{folder / 'model.safetensors'}: the weight file is damaged or incomplete" in one_line(res)
    res = runner.invoke(app, ["score", str(data), "--model", str(cached), "--out", str(tmp_path / "o.parquet"), "-q"])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "the cached converted copy of the model is damaged" in one_line(res)
    assert f"delete the folder {cached}; the next run converts the model again" in one_line(res)


@pytest.mark.slow
def test_a_damaged_run_json_on_resume_is_one_clear_error(tmp_path, write_jsonl, tiny):
    """Issue 46, item 8: a damaged OUT.partial/run.json was a JSONDecodeError traceback on --resume."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    out = tmp_path / "o.parquet"
    (tmp_path / "o.parquet.partial").mkdir()
    for damaged in ('{"metadata": {"comm', '{"metadata": {}}', '[1, 2]', '{"metadata": 5, "schema": "zz"}'):
        (tmp_path / "o.parquet.partial" / "run.json").write_text(damaged)
        res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--resume", "-q"])
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert f"cannot resume: {out}.partial/run.json is damaged" in one_line(res)
        assert "pass --overwrite to start over" in one_line(res)


def test_a_model_folder_without_its_tokenizer_is_bad_input(tmp_path, write_jsonl, tiny):
    """Issue 46, item 9: a model folder without its tokenizer files exited 1 (a run that failed), where bad input
    exits 2; the message (transformers' holds line breaks) is one line."""
    import shutil

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    folder = shutil.copytree(tiny, tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    res = runner.invoke(app, ["score", str(data), "--model", str(folder), "--out", str(tmp_path / "o.parquet"), "-q"],
                        env={"COLUMNS": "100000"})
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert res.output.startswith(f"error: Could not load a tokenizer from {folder}") and res.output.count("\n") == 1
    assert "tokenizer.json and tokenizer_config.json" in res.output and not (tmp_path / "o.parquet").exists()


def test_a_choices_record_too_long_is_reported_by_its_longest_choice(tmp_path, write_jsonl, tiny):
    """Issue 46, item 13: a multiple-choice record too long for the context reported its first choice's length."""
    from pathlib import Path

    from apcscore.models.loading import load_tokenizer

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "m", "context": "one two three", "choices": [
        " four five six seven eight nine", " five six seven eight nine ten eleven twelve thirteen fourteen", " x"],
        "answer": 0}])
    out = tmp_path / "o.parquet"
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--max-model-len", "8", "-q"])
    assert res.exit_code == 1, res.output  # every record failed
    (row,) = pq.read_table(out).to_pylist()
    tok = load_tokenizer(Path(tiny))
    longest = len(tok.encode("one two three five six seven eight nine ten eleven twelve thirteen fourteen"))
    assert row["error"].startswith(f"context and continuation have {longest} tokens, more than the model's context")


def test_truncate_left_reserves_room_for_generation_for_every_prompt(tmp_path, write_jsonl, tiny):
    """Issue 46, item 14: with --truncate left, room for --max-tokens was reserved only for prompts longer than the
    context: in a context of 8, a 9-token prompt got 4 new tokens, a 5-token one 3 and a 7-token one 1. Every
    prompt now keeps its newest tokens so that the new tokens fit."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"n{n}", "prompt_token_ids": list(range(100, 100 + n))}
                                              for n in (4, 5, 7, 9)])
    out = tmp_path / "o.parquet"
    res = runner.invoke(app, ["generate", str(data), "--model", tiny, "--out", str(out), "--max-model-len", "8",
                              "--max-tokens", "4", "--truncate", "left", "-q"])
    assert res.exit_code == 0, res.output
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert {k: r["num_truncated_tokens"] for k, r in rows.items()} == {"n4": 0, "n5": 1, "n7": 3, "n9": 5}
    assert all(len(r["completion_token_ids"]) == 4 or r["finish_reason"] == "stop" for r in rows.values())


@pytest.mark.slow
def test_a_partial_another_run_is_writing_is_refused_untouched(tmp_path, write_jsonl, tiny):
    """Issue 46, item 5: run B, started with --resume (or --overwrite) on the .partial of a run A still going,
    finished first and A then failed ("partial ... is inconsistent"). The partial is locked (flock on the folder)
    while a run writes it; B is refused with one line and touches nothing."""
    from apcscore.io.partial import lock_partial

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}, {"prompt": "there"}])
    out, partial = tmp_path / "o.parquet", tmp_path / "o.parquet.partial"
    partial.mkdir()
    (partial / "run.json").write_text('{"metadata": {}, "schema": ""}')  # what run A wrote (not read: refused first)
    held = lock_partial(partial)  # run A, still going
    try:
        for flag in ("--resume", "--overwrite"):
            res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), flag, "-q"])
            assert res.exit_code == 2 and "Traceback" not in res.output, res.output
            assert f"{partial} is in use by another apcscore run that is still going" in one_line(res)
            assert [p.name for p in partial.iterdir()] == ["run.json"] and not out.exists()
    finally:
        os.close(held)
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--overwrite", "-q"])
    assert res.exit_code == 0 and out.exists() and not partial.exists(), res.output  # A gone: the lock went with it


def test_a_partial_without_run_json_is_discarded_with_a_note(tmp_path, write_jsonl, tiny):
    """Issue 46, item 14: a .partial without run.json (its run ended before writing one) was discarded on --resume
    without a word."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    out, partial = tmp_path / "o.parquet", tmp_path / "o.parquet.partial"
    partial.mkdir()
    (partial / "part-000000.parquet.tmp").write_text("")
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--resume", "-q"])
    assert res.exit_code == 0 and out.exists(), res.output
    assert (f"note: {partial} had no run.json (its run ended before writing one), so it held no rows; its 1 "
            "leftover file(s) were removed; starting a fresh run") in one_line(res)


def test_a_path_in_a_message_is_never_broken(tmp_path, write_jsonl, tiny, monkeypatch):
    """Issue 53, item 12: Rich wrapped a long message inside a path (`o.parquet.par tial`), so the path could not be
    copied from a log, and the test above failed under a longer TMPDIR. Two notes and an error, each with a
    path of over 250 characters, printed at 80 columns: each path is whole on one line of the output."""
    from apcscore.cli import console

    monkeypatch.setenv("COLUMNS", "80")
    deep = tmp_path / ("d" * 120) / ("e" * 120)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Hello"}])
    out, partial = deep / "o.parquet", deep / "o.parquet.partial"
    partial.mkdir(parents=True)
    (partial / "part-000000.parquet.tmp").write_text("")
    assert len(str(partial)) > 250 and console.width < 250
    note = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "--resume", "-q"])
    assert note.exit_code == 0, note.output
    assert any(line.startswith(f"note: {partial} had no run.json") for line in note.output.splitlines()), note.output
    other = deep / "p.parquet"
    fresh = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(other), "--resume", "-q"])
    assert fresh.exit_code == 0, fresh.output
    assert f"note: nothing to resume: {other}.partial does not exist" in fresh.output.splitlines()[0]
    error = runner.invoke(app, ["score", str(data), "--model", tiny, "--out", str(out), "-q"])
    assert error.exit_code == 2 and f"error: {out} exists" in error.output.splitlines()[0], error.output


def test_an_engine_setting_is_named_as_the_user_gave_it(tmp_path):
    """EngineConfig's errors name its fields (issue 54, item 2); the command line names each setting the user typed
    by its flag, and one from the config file by its key."""
    from apcscore.config import ConfigError, EngineConfig
    from apcscore.errors import ApcscoreError
    from apcscore.options.resolve import resolve_options

    with pytest.raises(ConfigError, match="^block_size must be a power of two, not 12$"):
        EngineConfig(block_size=12)
    config = tmp_path / "c.toml"
    config.write_text("batch_invariant = false\nmodel_backend = \"transformers\"\n")
    cases = [({"exact_reuse": True}, "--exact-reuse needs batch invariance: without it a cached block's KV is not "
              "bitwise what a fresh prefill writes, so reused scores could differ from a full recompute — drop "
              "batch_invariant=False (or --exact-reuse)"),
             ({"tensor_parallel_size": 2}, "--tensor-parallel 2 needs the native engine: the transformers fallback "
              "(model_backend=transformers) runs on one device — drop one of the two"),
             ({"tensor_parallel_size": 2, "model_backend": "transformers", "device": "cpu"},
              "--tensor-parallel 2 needs the native engine: the transformers fallback (--model-backend transformers) "
              "runs on one device — drop one of the two")]
    for cli, message in cases:
        with pytest.raises(ApcscoreError) as err:
            resolve_options("score", cli, config)
        assert str(err.value) == message
    config.write_text("block_size = 12\n")
    with pytest.raises(ApcscoreError, match="^block_size must be a power of two, not 12$"):
        resolve_options("score", {}, config)
    with pytest.raises(ApcscoreError, match="^--block-size must be a power of two, not 12$"):
        resolve_options("score", {"block_size": 12}, None)


def test_reference_model_with_ray_is_refused_before_loading(tmp_path, write_jsonl, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    out = tmp_path / "o.parquet"
    res = runner.invoke(app, ["score", str(data), "--model", tiny, "--reference-model", tiny, "--ray", "local",
                              "--out", str(out), "--quiet"])
    assert res.exit_code == 2 and "--reference-model" in res.output and "--ray" in res.output, res.output
    assert not out.exists()
