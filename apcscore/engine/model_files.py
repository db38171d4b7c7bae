"""Checks of what a model is loaded from, made before anything is read or converted, so that a bad file or folder
is one clear error (exit 2) naming it, not a traceback from deep inside a loader:

- `check_cache_env`: `$APCSCORE_CACHE`, where set, is a folder apcscore can create and write (converted models,
  compiled kernels);
- `check_weight_files`: every safetensors file of a model directory is complete (its header and the tensor bytes
  it announces), and a damaged converted copy in the cache is named with the folder to delete;
- `resolve_parts`: the config and tokenizer (`models.resolved`), whose refusals are bad input (exit 2, one line);
- `load_model(spec)`: all of these once, as one `LoadedModel` value that is handed down to the engine
  (`loaded` takes either).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apcscore.errors import ApcscoreError
from apcscore.models.gguf_cache import cache_root
from apcscore.models.locate import safetensors_files

if TYPE_CHECKING:  # (models.resolved imports torch: this module stays cheap)
    from apcscore.models.locate import ModelFiles
    from apcscore.models.resolved import ResolvedModel

_CACHE_HINT = ("point it to a folder apcscore can write (it keeps converted models and compiled kernels there), or "
               "unset it to use ~/.cache/apcscore")


def check_cache_env() -> None:
    """Refuse a set `$APCSCORE_CACHE` that is a file, lies under a file, or where nothing can be written."""
    env = os.environ.get("APCSCORE_CACHE")
    if not env:
        return
    root = Path(env).expanduser()
    if root.exists() and not root.is_dir():
        raise ApcscoreError(f"APCSCORE_CACHE={env} is a file, not a folder — {_CACHE_HINT}")
    folder = root
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


def resolve_parts(model_dir: Path) -> ResolvedModel:
    """`models.resolved.resolve_model_parts(model_dir)`; a refusal (a folder without its tokenizer, a config no path
    runs) comes before anything ran, so it is bad input: exit 2, its message on one line."""
    from apcscore.models.resolved import resolve_model_parts

    try:
        return resolve_model_parts(model_dir)
    except ApcscoreError as e:
        raise ApcscoreError(" ".join(str(e).split()), exit_code=2) from None


@dataclass(frozen=True)
class LoadedModel:
    """A model located and checked, before its weights are read: what every later step takes instead of
    resolving the spec again. The engine that runs it (engine/loader.load_engine) reads the weights.

    files: where the Hugging Face files are (`models.locate.ModelFiles`: name, path, source, GGUF warnings).
    parts: the config, tokenizer and rope tables (`models.resolved.ResolvedModel`).
    """

    files: ModelFiles
    parts: ResolvedModel

    @property
    def config(self) -> Any:
        return self.parts.config

    @property
    def tokenizer(self) -> Any:
        return self.parts.tokenizer

    @property
    def rope(self) -> Any:
        return self.parts.rope


def load_model(spec: str) -> LoadedModel:
    """Locate the model `spec` names (alias, Hugging Face folder or .gguf, converted once into the cache) and check
    it: `$APCSCORE_CACHE`, the weight files complete, the config and tokenizer readable. Every refusal comes here,
    before any weights are read."""
    from apcscore.models.locate import resolve_model

    check_cache_env()
    files = resolve_model(spec)
    check_weight_files(files.path)
    return LoadedModel(files, resolve_parts(files.path))


def loaded(model: LoadedModel | str) -> LoadedModel:
    """`model` itself, or the `load_model` value of a spec (the engines' constructors take either)."""
    return load_model(model) if isinstance(model, str) else model
