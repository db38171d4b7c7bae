"""The GGUF conversion cache: a GGUF file is dequantized once through transformers and kept as a Hugging Face
copy (fp32 safetensors + tokenizer) under `cache_root()/models/<name>-<key>`, so every later run loads plain
safetensors in well under a second.

The key is derived from the GGUF file's whole sha256 (hashed once per file: a stamp kept in the cache spares
later runs the read); a marker file written last says a copy is complete and which content it was converted
from; conversion goes into a temp dir renamed into place (atomic; racing processes both end with a valid copy),
and temp dirs of conversions that died long ago are swept. transformers and torch are imported only to convert.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from apcscore.errors import ApcscoreError
from apcscore.models.content_hash import stamped_sha256
from apcscore.models.gguf_check import dropped_settings, transformers_gguf_architectures

logger = logging.getLogger(__name__)

# Bump when the layout or content of a converted cache entry changes: older entries are then ignored.
# 2: the tokenizer is saved as TokenizersBackend and checked; no randomly filled weights
# 3: keyed on the whole file's sha256 (was: its size and first and last 4 MiB); the marker records it
CACHE_FORMAT = 3
CACHE_MARKER = "apcscore-cache.json"  # written last into a converted copy: its presence means "complete"
_KEY_STAMPS = "gguf-sha256"  # under cache_root(): each GGUF file's content hash and stamp, by its path
_STALE_TMP_SECONDS = 24 * 3600


def cache_root() -> Path:
    """The apcscore cache folder: $APCSCORE_CACHE if set, else ~/.cache/apcscore (not created here)."""
    env = os.environ.get("APCSCORE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "apcscore"


def gguf_sha256(path: Path) -> str:
    """Hex sha256 of the whole GGUF file. Hashed once (seconds for gigabytes), then kept in the cache with the
    file's size, mtime and inode (models/content_hash.py), so later runs on the unchanged file read no bytes."""
    path = Path(path)
    by_path = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return stamped_sha256([path], cache_root() / _KEY_STAMPS / f"{by_path}.json")


def gguf_key(sha256: str) -> str:
    """The cache key of a GGUF file of this content hash (`gguf_sha256`): it changes with every byte of the file
    and with CACHE_FORMAT."""
    return hashlib.sha256(f"apcscore-gguf-v{CACHE_FORMAT}:{sha256}".encode()).hexdigest()[:16]


def cache_dir_name(name: str, key: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{key}"


def is_complete(path: Path, sha256: str) -> bool:
    """Whether `path` holds a finished copy (its marker is there) converted from the GGUF file of content hash
    `sha256` (as its marker records)."""
    try:
        return json.loads((path / CACHE_MARKER).read_text()).get("gguf_sha256") == sha256
    except (OSError, ValueError, AttributeError):
        return False


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
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file, dtype=torch.float32, output_loading_info=True, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except Exception as e:  # transformers raises many types for unreadable or unsupported files
        raise ApcscoreError(
            f"Could not load the GGUF file {gguf} through transformers ({type(e).__name__}: {e}). "
            "Check that the file is complete and its architecture is one transformers can read from GGUF "
            f"({', '.join(transformers_gguf_architectures())}); for another architecture, or a file whose "
            "settings transformers does not read, pass the original Hugging Face model directory instead.",
        ) from e
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        # transformers only warns, and fills them with random values: never cache such a model.
        raise ApcscoreError(
            f"transformers' GGUF loader read {gguf} as {type(model).__name__} but found no tensors in it for "
            f"{len(missing)} of its weights ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), so "
            "this file's layout is not one transformers can read (e.g. a Mixtral GGUF, which llama.cpp writes "
            "as 'llama' with expert tensors). Pass the original Hugging Face model directory instead."
        )
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
    _save_tokenizer(tokenizer, out_dir, gguf)


def load_converted_tokenizer(path: Path):
    """The tokenizer of a converted copy, exactly as its tokenizer.json says (transformers' TokenizersBackend).

    transformers builds a GGUF's tokenizer from the file's vocabulary, merges and pre-tokenizer type, but
    AutoTokenizer would load the saved copy as the model family's class (e.g. Qwen2Tokenizer, GemmaTokenizer,
    LlamaTokenizer), which puts the family's own normalizer / pre-tokenizer back in place of the file's:
    different token ids than transformers gives for the GGUF itself. So a converted copy is read as it is.
    """
    from transformers import PreTrainedTokenizerFast  # = TokenizersBackend in transformers 5

    return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)


def _save_tokenizer(tokenizer, out_dir: Path, gguf: Path) -> None:
    """Save the GGUF's tokenizer so that load_converted_tokenizer gives back the same pipeline, or refuse."""
    tokenizer.save_pretrained(out_dir)
    config_file = out_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "TokenizersBackend"  # what it is; AutoTokenizer may still pick the family's class
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    if load_converted_tokenizer(out_dir).backend_tokenizer.to_str() != tokenizer.backend_tokenizer.to_str():
        raise ApcscoreError(
            f"The tokenizer transformers builds from {gguf} does not load back the same from a saved copy, so "
            "apcscore cannot cache it. Pass the original Hugging Face model directory instead."
        )


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


def _dropped(gguf: Path, copy: Path) -> list[str]:
    """The GGUF's settings that transformers' reading (the copy's config.json) leaves out; logged as warnings."""
    try:
        dropped = dropped_settings(gguf, json.loads((copy / "config.json").read_text()))
    except Exception as e:  # a check for a warning: never the reason a conversion fails
        logger.info("Could not compare %s's settings with transformers' reading of it: %s", gguf, e)
        return []
    for setting in dropped:
        logger.warning("%s states %s", gguf.name, setting)
    return dropped


def ignored_settings(copy: Path) -> list[str]:
    """What the GGUF behind a converted copy states and transformers' reading of it (so our model) ignores."""
    try:
        return list(json.loads((copy / CACHE_MARKER).read_text()).get("transformers_ignored") or [])
    except (OSError, ValueError, AttributeError):
        return []


def convert_gguf(gguf: Path, dest: Path, sha256: str) -> None:
    """Build the cached copy of `gguf` (of content hash `sha256`) at `dest` atomically: convert into a temp dir,
    then rename it.

    A crash never leaves a half-written `dest`; when two processes race, the first rename wins and the
    other discards its own copy and uses the winner's.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale_tmp(dest.parent)
    if dest.exists() and not is_complete(dest, sha256):
        logger.warning("Removing an incomplete (or another file's) model cache at %s", dest)
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
            "gguf_sha256": sha256,
            "key": dest.name.rsplit("-", 1)[-1],
            "convert_seconds": round(time.perf_counter() - start, 3),
            "transformers_ignored": _dropped(gguf, tmp),
        }
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest, sha256):  # not a lost race: a real failure
                raise
            logger.info("Another process cached %s first; using its copy", dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
