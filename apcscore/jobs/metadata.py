"""What a run's file records about itself (the parquet key `apcscore`, io/writer.METADATA_KEY): the run
metadata of one engine, the dataset, and the `timings` of all the sessions that wrote the file.

Built here, below the driver and the Ray replicas, so that a replica describes itself exactly as a single
process would (scale/replica.py) and the driver adds what only it knows (argv, created, dataset).
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
from apcscore.io.tabular_input import parse_columns
from apcscore.jobs.options import RunOptions


def dataset_metadata(data: Any, opts: RunOptions) -> dict:
    """The metadata's `dataset`: where, its content, the records read and the --columns mapping read with."""
    return {"path": str(Path(data.path).resolve()), "sha256": data.sha256, "num_records": data.num_records,
            "columns": parse_columns(opts.columns)}


def now() -> str:
    """The metadata's `created`: UTC, to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def run_metadata(command: str, engine: BatchEngine, job: Any, opts: RunOptions, dataset: dict | None = None) -> dict:
    """The run metadata of `command` on `engine`; `dataset` (dataset_metadata) is filled in by the driver."""
    tok = engine.tokenizer
    job_meta = job.metadata()
    if command in ("score", "generate"):
        job_meta["truncate"] = opts.truncate
    return {
        **run_header(command),
        "model": model_section(engine),
        "tokenizer": {"class": type(tok).__name__, "name_or_path": str(getattr(tok, "name_or_path", "")),
                      "vocab_size": len(tok)},
        **engine_sections(engine, opts.engine),
        "job": job_meta,
        "dataset": dataset,
        "versions": versions(triton=package_version("triton")),
        # what else the bits of a batch-invariant run depend on (docs/architecture.md, "The contract")
        "numerics": engine.numerics,
    }


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
    "kernels": ("kernels/*.c", "kernels/*.py"),
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
    return {"name": info.name, "path": info.path, "architecture": info.architecture,
            "fingerprint": info.fingerprint, "files": model_files_digest(info.path), "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len, "num_parameters": info.num_parameters,
            "context_capped_by_sliding_window": info.sliding_window}


def engine_sections(engine: BatchEngine, cfg: Any) -> dict:
    """Where and how the engine ran: dtype, device, attention backend, native or transformers, its settings."""
    return {"dtype": str(engine.dtype).removeprefix("torch."), "device": str(engine.device),
            "attention_backend": engine.attention_backend,
            "model_backend": engine.model_backend,  # native | transformers: the path that ran
            "engine": {**cfg.to_dict(), "num_kv_blocks": engine.counters().num_kv_blocks}}


def versions(**extra: str | None) -> dict:
    """The library versions the bits depend on: torch, transformers, tokenizers, and `extra` (triton, lm_eval)."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": package_version("tokenizers"), **extra}


def package_version(name: str) -> str | None:
    """An installed distribution's version without importing it (None when absent)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def add_timings(previous: dict | None, now: dict) -> dict:
    """Timings of all sessions: counters and seconds added up, rates recomputed from the sums."""
    total = {k: v for k, v in now.items() if k != "prefix_cache"}
    pc = dict(now["prefix_cache"])
    if isinstance(previous, dict):
        for key in total:
            total[key] += previous.get(key) or 0
        for key in pc:
            pc[key] += (previous.get("prefix_cache") or {}).get(key) or 0
    tokens = total["prompt_tokens"] + total["generated_tokens"]
    total["tokens_per_second"] = round(tokens / total["run_seconds"], 1) if total["run_seconds"] else 0.0
    total["load_seconds"], total["run_seconds"] = round(total["load_seconds"], 3), round(total["run_seconds"], 3)
    pc["hit_rate"] = round(pc["hit_tokens"] / pc["queried_tokens"], 4) if pc["queried_tokens"] else 0.0
    return {**total, "prefix_cache": pc}
