"""eval's side of a run's identity (issue 40, item 4), without a model: cache hits go into the run's journal (so
shards with a warm --cache merge), a merge names what differs between shards, and the results cache's identity
holds what changes a response's numbers and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apcscore.errors import ApcscoreError
from apcscore.engine.provenance import apcscore_version, code_fingerprint
from apcscore.run import eval_folder as outdir
from apcscore.run.eval_shards import read_shards
from apcscore.io.identity import EVAL, view
from apcscore.lmeval.store import ResponseStore
from tests.io.test_identity import base


def identity(meta: dict) -> dict:
    """The eval identity of a run's metadata (run/eval.py's)."""
    return view(meta, EVAL)


def sections(**numerics) -> dict:
    """lmeval/results.config_sections' shape: the sections of a run's metadata that describe model and engine."""
    meta = base()
    meta["numerics"].update(numerics)
    return {k: meta[k] for k in ("apcscore_version", "code", "model", "dtype", "device", "attention_backend",
                                 "model_backend", "engine", "numerics", "versions")}


def journal(folder: Path, ident: dict) -> list[str]:
    path = folder / ResponseStore(ident).name
    return [json.loads(line)["k"] for line in path.read_text().splitlines()[1:]]


def test_a_cache_hit_goes_into_the_run_s_journal_once(tmp_path) -> None:
    ident = identity(sections())
    cache, out = tmp_path / "cache", tmp_path / "out"
    warm = ResponseStore(ident, journals=[cache])
    warm.put("k1", [-1.5, True])
    warm.put("k2", [-2.5, False])
    warm.close()
    store = ResponseStore(ident, folders=[cache], journals=[out, cache])
    assert store.get("k1") == [-1.5, True] and store.get("k1") == [-1.5, True]
    store.put("k3", [-3.0, False])
    store.close()
    assert journal(out, ident) == ["k1", "k3"]  # the hit once, then the computed one; k2 was not asked
    assert journal(cache, ident) == ["k1", "k2", "k3"]  # the cache gets no second copy of its own


def test_the_eval_identity_leaves_out_what_changes_no_response() -> None:
    a, b = sections(), sections(simd="scalar", torch_threads=9)
    b["device"] = "cuda:1"
    a["device"] = "cuda:0"
    b["engine"] = {**b["engine"], "logprobs_chunk_size": 64, "max_logprobs": 5, "use_cuda_graphs": False,
                   "device": "cuda", "seed": 3, "num_kv_blocks": 7}
    b["versions"] = {**b["versions"], "lm_eval": "0.4.14"}
    assert identity(a) == identity(b)
    for path, value in (("apcscore_version", "0.2.0"), ("versions.triton", "3.6"), ("versions.tokenizers", "0.24")):
        c = sections()
        section, _, key = path.partition(".")
        if key:
            c[section] = {**c[section], key: value}
        else:
            c[section] = value
        assert identity(c) != identity(a), path


def test_the_eval_identity_keeps_the_reuse_switches_where_the_probe_failed() -> None:
    failed = dict(batch_invariant=False, portable=False, probe={"passed": False}, reason="probe failed")
    a, b = sections(**failed), sections(**failed)
    b["engine"] = {**b["engine"], "enable_prefix_caching": False}
    assert identity(a) != identity(b)
    c, d = sections(), sections()
    d["engine"] = {**d["engine"], "enable_prefix_caching": False, "exact_reuse": True}
    assert identity(c) == identity(d)  # batch invariant: a hit is bitwise a recompute


def finished_shard(folder: Path, values: dict, shard: str, ident: dict) -> None:
    folder.mkdir(parents=True)
    run = {"run": {**{k: values.get(k) for k in outdir.RUN_KEYS}, "shard": shard}, "identity": ident,
           "options": values}
    (folder / outdir.SHARD_FILE).write_text(json.dumps({"shard": shard, "run": run, "config": {}}))


def test_eval_merge_names_what_differs_between_shards(tmp_path) -> None:
    values = {k: None for k in outdir.RUN_KEYS} | {"model": "m", "tasks": "a"}
    finished_shard(tmp_path / "s0", values, "0/2", {"model.fingerprint": "f1", "dtype": "float32"})
    finished_shard(tmp_path / "s1", values, "1/2", {"model.fingerprint": "f2", "dtype": "float32"})
    with pytest.raises(ApcscoreError, match=r"different configurations \(model.fingerprint: \"f1\" vs \"f2\"\)"):
        read_shards([tmp_path / "s0", tmp_path / "s1"])


def test_eval_records_the_numerics_code_model_files_and_library_versions(tiny_model_dir) -> None:
    """What the eval identity is made of (lmeval/results.config_sections): apcscore's code, the model's files, and the
    tokenizers and Triton versions among the libraries (issue 40 items 2, 3)."""
    from types import SimpleNamespace

    from apcscore.config import EngineConfig
    from apcscore.engine.counters import EngineCounters
    from apcscore.engine.provenance import package_version
    from apcscore.lmeval.results import config_sections

    path = tiny_model_dir("llama")
    info = SimpleNamespace(name="tiny", path=str(path), architecture="LlamaForCausalLM", fingerprint="f",
                           vocab_size=10, max_model_len=64, num_parameters=1, sliding_window=None)
    engine = SimpleNamespace(info=info, dtype="torch.float32", device="cpu", attention_backend="torch",
                             model_backend="native", counters=EngineCounters, numerics=base()["numerics"])
    sections = config_sections(engine, EngineConfig())
    assert sections["code"] == code_fingerprint() and sections["apcscore_version"] == apcscore_version()
    assert {"config.json", "tokenizer.json"} <= set(sections["model"]["files"])
    versions = sections["versions"]
    assert versions["tokenizers"] == package_version("tokenizers") and "triton" in versions
    assert versions["triton"] == package_version("triton") and versions["lm_eval"] == package_version("lm_eval")
    ident = identity(sections)
    assert ident["code.models"] == code_fingerprint()["models"] and "versions.triton" in ident


def test_an_edited_config_or_tokenizer_misses_the_eval_cache(tiny_model_dir, tmp_path) -> None:
    """The eval cache's file is named by the identity of the model's real files (lmeval/results.config_sections):
    an edited config.json or tokenizer.json names another file, so a warm --cache is not read (issue 40 item 3)."""
    import shutil
    from types import SimpleNamespace

    from apcscore.config import EngineConfig
    from apcscore.engine.counters import EngineCounters
    from apcscore.lmeval.results import config_sections

    path = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "model"))
    info = SimpleNamespace(name="tiny", path=str(path), architecture="LlamaForCausalLM", fingerprint="f",
                           vocab_size=10, max_model_len=64, num_parameters=1, sliding_window=None)
    engine = SimpleNamespace(info=info, dtype="torch.float32", device="cpu", attention_backend="torch",
                             model_backend="native", counters=EngineCounters, numerics=base()["numerics"])

    def cache_file() -> str:
        return ResponseStore(identity(config_sections(engine, EngineConfig()))).name

    original = cache_file()
    assert cache_file() == original  # the same files: the same cache file
    for name, edit in (("config.json", lambda text: json.dumps({**json.loads(text), "rms_norm_eps": 1e-3})),
                       ("tokenizer.json", lambda text: text + "\n")):
        before = (path / name).read_text()
        (path / name).write_text(edit(before))
        assert cache_file() != original, name
        (path / name).write_text(before)
        assert cache_file() == original
