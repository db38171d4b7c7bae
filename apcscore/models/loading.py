"""Load a Hugging Face model directory's parts: weights (safetensors), tokenizer and config, never from the
network; and the weights' fingerprint for the run metadata. transformers and safetensors are imported
inside the functions that need them."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apcscore.errors import ApcscoreError
from apcscore.models.content_hash import stamped_sha256
from apcscore.models.gguf_cache import CACHE_MARKER, load_converted_tokenizer
from apcscore.models.locate import safetensors_files

if TYPE_CHECKING:
    import torch

FINGERPRINT_FILE = ".apcscore-fingerprint.json"
# A model directory's files besides the weights that change numbers: the config (rope, eps, soft-caps, window,
# eos), the generation config, the tokenizer's files and the chat template (models/loaded.py keys by them too)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
               "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
               "vocab.json", "merges.txt", "tokenizer.model")


def load_state_dict(
    path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory's safetensors files, under their Hugging Face names.

    Floating tensors are cast to `dtype` (None keeps the stored dtype), one tensor at a time. Tied weights
    are stored once: with `tie_word_embeddings`, "lm_head.weight" is usually absent and the decoder must
    reuse "model.embed_tokens.weight".
    """
    return {name: _cast(file.get_tensor(name), dtype) for name, file in _open_tensors(Path(path), device).items()}


def _open_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, Any]:
    """{tensor name: its open safetensors file} over every weight file of the directory `path`; refused when there
    is none, when the shard index names a missing one, or when two hold the same name."""
    from safetensors import safe_open

    files = safetensors_files(path)
    if not files:
        raise ApcscoreError(f"Model directory {path} has no *.safetensors weight files.")
    handles: dict[str, Any] = {}
    for file in files:
        if not file.is_file():
            raise ApcscoreError(f"{path / 'model.safetensors.index.json'} names {file.name}, which is missing.")
        handle = safe_open(str(file), framework="pt", device=str(device))
        for name in handle.keys():
            if name in handles:
                raise ApcscoreError(f"Tensor {name!r} appears in more than one weight file of {path}.")
            handles[name] = handle
    return handles


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


class LazyCheckpoint(Mapping):
    """A Hugging Face directory's safetensors tensors by name, read when asked (tensor-parallel ranks).

    `state[name]` reads a whole tensor (cast to `dtype` if floating); `lazy(name)` is safetensors' slice object
    (`get_shape()`, and indexing that reads only the rows or columns asked), which models.weights.WeightCopier uses
    for the parameters a rank holds a part of; `pop` reads and forgets. Each rank so reads about 1/N of the sharded
    weights, plus the replicated ones (embedding, norms).
    """

    def __init__(self, path: Path, dtype: torch.dtype | None = None) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self._files = _open_tensors(self.path)  # tensor name -> its open file
        self._dropped: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self:
            raise KeyError(name)
        return _cast(self._files[name].get_tensor(name), self.dtype)

    def lazy(self, name: str) -> Any:
        """The tensor as a safetensors slice (read in parts by indexing; copy_ casts the dtype)."""
        return self._files[name].get_slice(name)

    def pop(self, name: str) -> torch.Tensor:
        tensor = self[name]
        self._dropped.add(name)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._files and name not in self._dropped

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._files if n not in self._dropped)

    def __len__(self) -> int:
        return len(self._files) - len(self._dropped)


def load_tokenizer(path: Path):
    """The model's tokenizer (`AutoTokenizer`) from a Hugging Face directory, never from the network.

    A GGUF file's converted copy (it has the cache marker) is read as its tokenizer.json says
    (`gguf_cache.load_converted_tokenizer`): the tokenizer transformers builds from the GGUF file itself.
    """
    from transformers import AutoTokenizer

    try:
        if (Path(path) / CACHE_MARKER).is_file():
            return load_converted_tokenizer(Path(path))
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ApcscoreError(
            f"Could not load a tokenizer from {path} ({type(e).__name__}: {e}). A model directory needs its "
            "tokenizer files (tokenizer.json and tokenizer_config.json, as save_pretrained writes them).",
            exit_code=1,
        ) from e


def try_load_tokenizer(path: str | Path | None) -> tuple[Any | None, str | None]:
    """(tokenizer, None), or (None, why not) when `path` is unset or holds no tokenizer: for token texts that may
    fall back to ids (`apcscore show`, `compare --report-html`)."""
    if path is None:
        return None, "the run metadata names no tokenizer"
    if not Path(path).is_dir():
        return None, f"the tokenizer folder {path} does not exist here"
    try:
        return load_tokenizer(Path(path)), None
    except ApcscoreError as e:
        return None, str(e)


def load_config(path: Path):
    """The model's config (`AutoConfig`) from a Hugging Face directory, never from the network."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        config_file = Path(path) / "config.json"
        raise ApcscoreError(f"Could not read the model config {config_file} ({type(e).__name__}: {e}).") from e


def weights_fingerprint(path: Path) -> str:
    """sha256 (first 16 hex chars) of the directory's safetensors bytes, files concatenated in name order.

    For a single model.safetensors this is the start of `sha256sum model.safetensors`. The value is kept in
    .apcscore-fingerprint.json next to the weights, keyed by each file's size, mtime and inode
    (models/content_hash.py), so a second call is instant; a directory that cannot be written is simply hashed
    every time.
    """
    path = Path(path)
    files = safetensors_files(path)
    if not files:
        raise ApcscoreError(f"Model directory {path} has no *.safetensors weight files.")
    return stamped_sha256(files, path / FINGERPRINT_FILE)[:16]


def model_files_digest(path: str | Path) -> dict[str, str]:
    """{file name: the first 16 hex digits of its sha256} for each of MODEL_FILES present in the directory `path`
    (the run metadata's `model.files`: with the weights' fingerprint, the whole model). Empty for no directory."""
    path = Path(path) if path else None
    if path is None or not path.is_dir():
        return {}
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest()[:16] for name in MODEL_FILES
            if (path / name).is_file()}


def eos_token_ids(model_config: Any, tokenizer: Any) -> set[int]:
    """Every end-of-sequence id the model config and the tokenizer name (an int or a list each)."""
    ids: set[int] = set()
    for value in (getattr(model_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids
