"""What transformers resolves for a model directory, remembered so later runs skip its slowest imports.

For a model directory transformers decides the config (its class's defaults, rope normalisation), the
tokenizer class (`AutoTokenizer`'s rules) and the rotary inverse frequencies. Getting those answers means
importing the model's config module, which with transformers 5 pulls in torch.distributed and
torch._dynamo: about 2 s per process on a 2-core CPU, longer than loading SmolLM2-135M's weights.

So the first load of a directory asks transformers and stores its answers as JSON under
`<cache>/resolved/`, keyed by the bytes of the directory's config and tokenizer files and the transformers
version; later loads read them back and import only the tokenizer class. The answers are transformers'
own (`config.to_dict()`, `type(tokenizer).__name__`, `rotary.inv_freq`), so nothing is re-derived here.
Rope types whose frequencies depend on the sequence length (dynamic, longrope) are not remembered.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from apcscore.models.architecture import (LLAMA_FAMILIES, SUPPORTED_ARCHITECTURES, choose_model_backend,
                                          native_architecture)
from apcscore.models.gguf_cache import cache_root
from apcscore.models.loading import MODEL_FILES, load_config, load_tokenizer
from apcscore.models.rope import RopeFrequencies, rope_frequencies

FORMAT = 1  # bump when what is stored changes
KEY_FILES = MODEL_FILES  # the key's files: the config and tokenizer files


@dataclass
class ResolvedModel:
    config: Any  # a transformers config, or a namespace with the same attributes (config.to_dict())
    tokenizer: Any
    rope: RopeFrequencies | None  # None: let transformers' rotary module compute the tables


def _key(path: Path) -> str:
    import transformers

    h = hashlib.sha256(f"apcscore-resolved-{FORMAT}|transformers-{transformers.__version__}".encode())
    for name in KEY_FILES:
        file = path / name
        h.update(f"|{name}|".encode())
        if file.is_file():
            h.update(file.read_bytes())
    return h.hexdigest()[:24]


def _read(entry: Path, path: Path) -> ResolvedModel | None:
    try:
        data = json.loads(entry.read_text())
        import transformers

        tokenizer_class = getattr(transformers, data["tokenizer_class"])
        tokenizer = tokenizer_class.from_pretrained(str(path), local_files_only=True)
        rope = RopeFrequencies(torch.tensor(data["inv_freq"], dtype=torch.float32), float(data["attention_scaling"]))
        return ResolvedModel(SimpleNamespace(**data["config"]), tokenizer, rope)
    except Exception:  # a damaged or foreign entry: resolve again
        return None


def _write(entry: Path, resolved: ResolvedModel) -> None:
    if resolved.rope is None:
        return
    data = {"config": resolved.config.to_dict(), "tokenizer_class": type(resolved.tokenizer).__name__,
            "inv_freq": resolved.rope.inv_freq.tolist(), "attention_scaling": resolved.rope.attention_scaling}
    try:
        text = json.dumps(data, sort_keys=True)
    except TypeError:  # a config value JSON cannot hold: do not remember this one
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, entry)
    except OSError:  # a read-only cache: resolve every time
        pass


def resolve_model_parts(path: Path) -> ResolvedModel:
    """The config, tokenizer and rotary frequencies of a Hugging Face model directory (see the module doc)."""
    path = Path(path)
    try:
        entry = cache_root() / "resolved" / f"{_key(path)}.json"
    except OSError:
        entry = None
    if entry is not None and entry.is_file():
        resolved = _read(entry, path)
        if resolved is not None:
            return resolved
    config = load_config(path)
    choose_model_backend(config)  # a clear error for what no path runs (not a causal LM)
    # the Llama-family rotary tables (other families build their own from transformers' module)
    family = SUPPORTED_ARCHITECTURES.get(native_architecture(config) or "")
    rope = rope_frequencies(config) if family in LLAMA_FAMILIES else None
    resolved = ResolvedModel(config, load_tokenizer(path), rope)
    if entry is not None:
        _write(entry, resolved)
    return resolved
