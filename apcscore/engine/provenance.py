"""What a run's results were computed by, as its metadata records it: apcscore's version and the fingerprint of
its numerics code, the library versions, the model's files and the engine's settings, and the header every
command's metadata starts with (score, generate, perplexity and eval alike; docs/architecture.md, "A run's
identity", says which of these decide bits).

Here, at the engine's layer, so that the run layer (run/metadata.py) and the lm-eval adapter (lmeval/results.py)
describe an engine the same way.
"""

from __future__ import annotations

import hashlib
import sys
import time
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import apcscore
from apcscore.engine.interface import BatchEngine


def now() -> str:
    """The metadata's `created`: UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_header(command: str) -> dict:
    """The first keys of every run's metadata (score, generate, perplexity and eval alike)."""
    return {"apcscore_version": apcscore_version(), "code": code_fingerprint(), "command": command,
            "argv": sys.argv, "created": now()}


def apcscore_version() -> str:
    """apcscore's version as installed (the package metadata), else the source's `__version__`."""
    return package_version("apcscore") or apcscore.__version__


# The numerics fingerprint's parts: the files of the package that decide a result's numbers
# (docs/architecture.md, "A run's identity"). A change to any of them gives the part another hash.
CODE_PARTS: dict[str, tuple[str, ...]] = {
    "kernels": ("kernels/*.c", "kernels/*.h", "kernels/*.py"),
    "matmul_configs": ("kernels/matmul_configs.py",),
    "models": ("models/*.py", "attention/*.py", "engine/logprobs.py", "engine/sampler.py",
               "engine/parallel/logprobs.py", "engine/numerics.py"),
}


@lru_cache(maxsize=1)
def code_fingerprint(root: Path | None = None) -> dict[str, str]:
    """The metadata's `code`: per part of CODE_PARTS, the first 16 hex digits of the sha256 of its files (each
    file's path under the package and its bytes, in path order). The matmul table is its own part, not in
    `kernels`, so a message can say which changed."""
    root = Path(apcscore.__file__).parent if root is None else root
    out = {}
    for part, patterns in CODE_PARTS.items():
        files = sorted({f for pattern in patterns for f in root.glob(pattern)})
        if part == "kernels":
            files = [f for f in files if f.name != "matmul_configs.py"]
        h = hashlib.sha256()
        for f in files:
            h.update(f"{f.relative_to(root).as_posix()}\0".encode() + f.read_bytes() + b"\0")
        out[part] = h.hexdigest()[:16]
    return out


def model_section(engine: BatchEngine) -> dict:
    """The metadata's `model`: what ran, its weights' fingerprint, its other files' digests and context."""
    from apcscore.models.loading import model_files_digest

    info = engine.info
    path = str(info.path or "")  # "" for an engine built from parts
    return {"name": info.name, "path": path, "architecture": info.architecture,
            "fingerprint": info.fingerprint, "files": model_files_digest(path), "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len, "num_parameters": info.num_parameters,
            "context_capped_by_sliding_window": info.sliding_window}


def describe(engine: BatchEngine, cfg: Any) -> dict:
    """What fixes an engine's bits, as a run's metadata records it (every command's, and each `--ray` replica's
    of itself): apcscore's version and code, the model, where and how the engine ran (dtype, device, attention
    backend, native or transformers, its settings), numerics, and the library versions the bits depend on."""
    import torch
    import transformers

    return {"apcscore_version": apcscore_version(), "code": code_fingerprint(), "model": model_section(engine),
            "dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device),
            "attention_backend": engine.attention_backend,
            "model_backend": engine.model_backend,  # native | transformers: the path that ran
            "engine": {**cfg.to_dict(), "num_kv_blocks": engine.counters().num_kv_blocks},
            "numerics": engine.numerics,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "tokenizers": package_version("tokenizers"), "triton": package_version("triton")}}


def package_version(name: str) -> str | None:
    """An installed distribution's version without importing it (None when absent)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None
