"""The model an engine runs, before its weights are read: `load_model(spec)` and `LoadedModel` (docs/architecture.md,
the `models/loaded.py` row). The engine (engine/loader.py) reads the weights.

What transformers resolves for a directory (config, tokenizer class, rotary inverse frequencies) costs importing the
model's config module, which with transformers 5 pulls in torch.distributed and torch._dynamo: about 2 s per process
on a 2-core CPU. So `load_parts` stores transformers' own answers (`config.to_dict()`, `type(tokenizer).__name__`,
`rotary.inv_freq`) as JSON under `<cache>/resolved/`, keyed by the bytes of the config and tokenizer files and the
transformers version; later loads read them back and import only the tokenizer class. Rope types whose frequencies
depend on the sequence length (dynamic, longrope) are not remembered.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from apcscore.errors import ApcscoreError
from apcscore.models.content_hash import write_cache_file
from apcscore.models.gguf_cache import cache_root
from apcscore.models.loading import MODEL_FILES, load_config, load_tokenizer
from apcscore.models.locate import resolve_model, safetensors_files

if TYPE_CHECKING:
    from apcscore.models.rope import Rope

FORMAT = 1  # bump when what is remembered changes
_CACHE_HINT = ("point it to a folder apcscore can write (it keeps converted models and compiled kernels there), or "
               "unset it to use ~/.cache/apcscore")


@dataclass(frozen=True)
class LoadedModel:
    """A model located and checked, its config and tokenizer read, its weights not yet (the engine reads them).

    name: the model as the user gave it (alias, folder or .gguf; "custom" for an engine built from parts).
    path: its Hugging Face folder: config.json, *.safetensors, tokenizer files (for an alias or a .gguf file, its
    converted copy in the cache; None for an engine built from parts).
    config: a transformers config, or a namespace with the same attributes (the remembered `config.to_dict()`).
    rope: the Llama-family rotary frequencies; None lets the model's own rotary module compute its tables.
    warnings: settings the GGUF file states that transformers' reading of it (so the model run) leaves out.

    The engine that runs it keeps a copy as its `info` with the rest filled in (engine/loader.py,
    engine/hf_engine.py), what the run metadata's `model` records: the architecture that runs, the weights'
    fingerprint and parameter count, the context length (engine/context.py) and the sliding window where it capped
    that length (the window itself is not implemented: inside it, full causal attention is the same thing).
    """

    name: str
    path: Path | None
    config: Any
    tokenizer: Any
    rope: Rope | None
    warnings: tuple[str, ...] = ()
    architecture: str = ""
    fingerprint: str = ""
    num_parameters: int = 0
    max_model_len: int = 0
    sliding_window: int | None = None

    @property
    def vocab_size(self) -> int:
        """The config's vocabulary size: the rows of the model's logits."""
        return int(self.config.vocab_size)


def load_model(spec: str) -> LoadedModel:
    """Locate the model `spec` names (alias, Hugging Face folder or .gguf, converted once into the cache) and check
    it: `$APCSCORE_CACHE`, the weight files complete, the config and tokenizer readable. Every refusal comes here,
    before any weights are read; a refusal of the config or tokenizer is bad input (exit 2, its message on one
    line)."""
    check_cache_env()
    path, warnings = resolve_model(spec)
    check_weight_files(path)
    try:
        return load_parts(spec, path, warnings)
    except ApcscoreError as e:
        raise ApcscoreError(" ".join(str(e).split()), exit_code=2) from None


def loaded(model: LoadedModel | str) -> LoadedModel:
    """`model` itself, or the `load_model` value of a spec (the engines' constructors take either)."""
    return load_model(model) if isinstance(model, str) else model


# ---- the checks ---------------------------------------------------------------------------------------------
def check_cache_env() -> None:
    """Refuse a set `$APCSCORE_CACHE` that is a file, lies under a file, or where nothing can be written."""
    env = os.environ.get("APCSCORE_CACHE")
    if not env:
        return
    folder = Path(env).expanduser()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ApcscoreError(f"APCSCORE_CACHE={env}: {folder} is a file, not a folder — {_CACHE_HINT}")
    try:  # permissions, a read-only or pseudo file system (/proc), ...
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ApcscoreError(f"APCSCORE_CACHE={env}: cannot write in {folder} ({e.strerror or e}) — {_CACHE_HINT}") \
            from None


def _problem(file: Path) -> str | None:
    """Why a safetensors file cannot be read whole (None: its header and sizes agree)."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"it has {size} bytes, less than the 8 of a safetensors header length"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"its header announces {length:,} bytes of header, and the file has {size:,} bytes in all"
        try:
            header = json.loads(f.read(length))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            return f"its header is not a safetensors header ({type(e).__name__}: {e})"
    if 8 + length + end != size:
        return f"its header announces {8 + length + end:,} bytes, and the file has {size:,}"
    return None


def check_weight_files(model_dir: Path) -> None:
    """Refuse a model directory whose safetensors files are truncated or damaged (one line, the file named; in the
    model cache, the folder to delete so that the next run converts the model again)."""
    models = (cache_root() / "models").absolute()
    for file in safetensors_files(model_dir):
        if not file.is_file():
            continue  # the loader names a file the index lists and that is missing
        problem = _problem(file)
        if problem is None:
            continue
        folder = model_dir.absolute()
        if folder.parent == models:
            raise ApcscoreError(f"{file}: the cached converted copy of the model is damaged ({problem}) — delete "
                                f"the folder {folder}; the next run converts the model again")
        raise ApcscoreError(f"{file}: the weight file is damaged or incomplete ({problem}) — copy or download it "
                            "again")


# ---- config, tokenizer and rope, remembered ------------------------------------------------------------------
def load_parts(name: str, path: Path, warnings: tuple[str, ...] = ()) -> LoadedModel:
    """The model `name` of the Hugging Face folder `path` (`resolve_model`'s answer): its config, tokenizer and
    rotary frequencies, remembered (see the module doc); no checks of `load_model`'s but the config's (a causal LM
    some path runs)."""
    from apcscore.models.architecture import (LLAMA_FAMILIES, SUPPORTED_ARCHITECTURES, choose_model_backend,
                                              native_architecture)
    from apcscore.models.rope import rope_frequencies

    try:
        entry = cache_root() / "resolved" / f"{_key(path)}.json"
    except OSError:
        entry = None
    if entry is not None and entry.is_file():
        remembered = _read(entry, name, path, warnings)
        if remembered is not None:
            return remembered
    config = load_config(path)
    choose_model_backend(config)  # a clear error for what no path runs (not a causal LM)
    # the Llama-family rotary tables (other families build their own from transformers' module)
    family = SUPPORTED_ARCHITECTURES.get(native_architecture(config) or "")
    rope = rope_frequencies(config) if family in LLAMA_FAMILIES else None
    model = LoadedModel(name, path, config, load_tokenizer(path), rope, warnings)
    if entry is not None:
        _write(entry, model)
    return model


def _key(path: Path) -> str:
    """The remembered entry's name: the config and tokenizer files' bytes (MODEL_FILES), the transformers version."""
    import transformers

    h = hashlib.sha256(f"apcscore-resolved-{FORMAT}|transformers-{transformers.__version__}".encode())
    for name in MODEL_FILES:
        file = path / name
        h.update(f"|{name}|".encode())
        if file.is_file():
            h.update(file.read_bytes())
    return h.hexdigest()[:24]


def _read(entry: Path, name: str, path: Path, warnings: tuple[str, ...]) -> LoadedModel | None:
    try:
        data = json.loads(entry.read_text())
        import torch
        import transformers

        tokenizer_class = getattr(transformers, data["tokenizer_class"])
        tokenizer = tokenizer_class.from_pretrained(str(path), local_files_only=True)
        rope = torch.tensor(data["inv_freq"], dtype=torch.float32), float(data["attention_scaling"])
        return LoadedModel(name, path, SimpleNamespace(**data["config"]), tokenizer, rope, warnings)
    except Exception:  # a damaged or foreign entry: resolve again
        return None


def _write(entry: Path, model: LoadedModel) -> None:
    if model.rope is None:
        return
    inv_freq, attention_scaling = model.rope
    data = {"config": model.config.to_dict(), "tokenizer_class": type(model.tokenizer).__name__,
            "inv_freq": inv_freq.tolist(), "attention_scaling": attention_scaling}
    try:
        text = json.dumps(data, sort_keys=True)
    except TypeError:  # a config value JSON cannot hold: do not remember this one
        return
    write_cache_file(entry, text + "\n")  # a read-only cache: resolve every time
