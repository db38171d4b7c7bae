"""The remembered transformers answers (apcscore.models.loaded) equal asking transformers again."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from apcscore.models.llama import LlamaDecoder
from apcscore.models.loading import load_config, load_tokenizer
from apcscore.models.loaded import LoadedModel, load_parts
from apcscore.models.locate import resolve_model
from apcscore.models.rope import portable_math

ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("APCSCORE_CACHE", str(cache))
    return cache


def parts(path) -> LoadedModel:
    """`load_parts` of a model folder, as `load_model` calls it."""
    return load_parts(str(path), *resolve_model(str(path)))


def transformers_tables(config, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(positions)[None, :])
    return cos[0], sin[0]


def our_tables(config, rope, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    from apcscore.models.ops import select_ops

    model = LlamaDecoder(config, select_ops("torch"), max_positions=positions, device="meta")
    model.embed_tokens.to_empty(device="cpu")
    model.build_rotary_tables(rope)
    return model.cos_table, model.sin_table


@pytest.mark.parametrize("arch", ARCHS)
def test_a_remembered_model_equals_what_transformers_resolves(arch, tiny_model_dir, own_cache):
    path = tiny_model_dir(arch)
    first = parts(path)  # asks transformers, then remembers
    assert len(list((own_cache / "resolved").glob("*.json"))) == 1
    again = parts(path)  # read back
    reference_config, reference_tokenizer = load_config(path), load_tokenizer(path)
    assert type(first.config) is type(reference_config)
    assert type(again.config) is not type(reference_config)  # really the remembered copy

    # every config attribute, rope parameters included
    assert vars(again.config) == json.loads(json.dumps(reference_config.to_dict()))
    # the same tokenizer class, ids, special tokens and chat template
    assert type(again.tokenizer) is type(reference_tokenizer)
    for text in ("Hello world", "  spaces\tand\nnewlines ", "émigré 東京 🙂"):
        assert again.tokenizer(text).input_ids == reference_tokenizer(text).input_ids
    assert again.tokenizer.all_special_ids == reference_tokenizer.all_special_ids
    assert (again.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == reference_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    # rotary tables bitwise equal to transformers' own module, from the remembered frequencies: its arithmetic with
    # the portable pow / cos / sin (issue 39: models/rope.portable_math), and within an ulp of its torch functions
    with portable_math():
        want = transformers_tables(reference_config, 300)
    got = our_tables(again.config, again.rope, 300)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    plain = transformers_tables(reference_config, 300)
    for ours, theirs in zip(got, plain):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=3e-7)


def test_a_changed_config_or_a_damaged_entry_is_resolved_again(tiny_model_dir, tmp_path, own_cache):
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    parts(path)
    config = json.loads((path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (path / "config.json").write_text(json.dumps(config))
    assert parts(path).config.rms_norm_eps == 1e-3  # a new key, not the old answer
    entries = sorted((own_cache / "resolved").glob("*.json"))
    assert len(entries) == 2
    for entry in entries:
        entry.write_text("{not json")
    assert parts(path).config.rms_norm_eps == 1e-3  # resolved again, and remembered again
    rewritten = [e for e in entries if e.read_text() != "{not json"]
    assert len(rewritten) == 1 and json.loads(rewritten[0].read_text())["config"]["rms_norm_eps"] == 1e-3


def test_a_cache_that_cannot_be_written_still_loads(tiny_model_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("APCSCORE_CACHE", str(blocker))  # <cache>/resolved cannot be created, even by root
    assert parts(tiny_model_dir("qwen3")).config.head_dim == 32
    assert parts(tiny_model_dir("qwen3")).config.head_dim == 32


@pytest.mark.slow
def test_a_remembered_load_skips_transformers_model_modules(tiny_model_dir, own_cache):
    """The point of remembering: a later process never imports the model's config module or torch._dynamo."""
    path = tiny_model_dir("llama3")
    parts(path)
    code = (
        "import sys; from apcscore.engine.loader import load_native_engine; from apcscore.config import EngineConfig;"
        f"e = load_native_engine({str(path)!r}, EngineConfig(device='cpu', num_kv_blocks=8));"
        "heavy = [m for m in ('transformers.models.llama.configuration_llama', 'torch._dynamo') if m in sys.modules];"
        "print(heavy)"
    )
    env = {**__import__("os").environ, "APCSCORE_CACHE": str(own_cache)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stderr
