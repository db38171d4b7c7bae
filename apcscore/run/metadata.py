"""What a run's file records about itself (the parquet key `apcscore`): the run metadata of one engine
(engine/provenance.py), the dataset, and the `timings` of all the sessions that wrote the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from apcscore.engine.interface import BatchEngine
from apcscore.engine.provenance import describe, model_section, run_header
from apcscore.io.tabular_input import parse_columns
from apcscore.options.commands import RequestOptions, RunOptions


def dataset_metadata(data: Any, opts: RunOptions) -> dict:
    """The metadata's `dataset`: where, its content, the records read and the --columns mapping read with."""
    return {"path": str(Path(data.path).resolve()), "sha256": data.sha256, "num_records": data.num_records,
            "columns": parse_columns(opts.columns)}


def run_metadata(command: str, engine: BatchEngine, job: Any, opts: RunOptions) -> dict:
    """The run metadata of `command` on `engine` (engine/provenance.describe; a Ray engine brings replica 0's,
    `sections`); the driver adds `argv`, `created` and `dataset`."""
    tok = engine.tokenizer
    job_meta = job.metadata()
    if isinstance(opts, RequestOptions):  # score and generate
        job_meta["truncate"] = opts.truncate
    if getattr(engine, "reference", None) is not None:  # score --reference-model: its weights change the columns
        job_meta["reference_model"] = model_section(engine.reference)
    return {**run_header(command), **(getattr(engine, "sections", None) or describe(engine, opts.engine)),
            "tokenizer": {"class": type(tok).__name__, "name_or_path": str(getattr(tok, "name_or_path", "")),
                          "vocab_size": len(tok)},
            "job": job_meta, "dataset": None}


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
