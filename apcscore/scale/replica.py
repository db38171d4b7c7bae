"""One `--ray` replica: a Ray actor that holds an Engine and its job, and turns chunks of records into rows.

The actor runs the very code a single process runs (`jobs/runner.run_records`, the command's job, the
Engine); the driver (run/driver.py through scale/ray_run.RayExecutor) writes its rows. It keeps its engine,
and so its prefix cache, from chunk to chunk, and with --verify-reuse its own sample of requests, re-scored
by `verify()` at the end. This module does not import ray: the executor wraps the class with `ray.remote`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from apcscore.engine.loader import load_engine
from apcscore.jobs.metadata import run_metadata
from apcscore.jobs.options import RunOptions
from apcscore.jobs.registry import job_class
from apcscore.jobs.runner import run_records
from apcscore.jobs.verify import ReuseVerifier


class Replica:
    """An engine replica. `opts` are the run's resolved options (jobs/options.resolve_options)."""

    def __init__(self, command: str, opts: RunOptions) -> None:
        self.command, self.opts = command, opts
        self.cfg = opts.engine
        started = time.perf_counter()
        self.engine = load_engine(opts.model, self.cfg)
        self.load_seconds = time.perf_counter() - started
        self.job = job_class(command)(self.engine.tokenizer, self.engine.info.max_model_len, opts)
        self.verifier = ReuseVerifier(opts.verify_reuse, self.cfg.seed) if opts.verify_reuse else None
        self.run_seconds = 0.0
        self.records = 0
        self.started = time.time()

    def describe(self) -> dict:
        """This replica's run metadata (as a single process would record it; the driver sets `dataset`, `argv`
        and `created`) and its process."""
        return {"metadata": run_metadata(self.command, self.engine, self.job, self.opts),
                "pid": os.getpid()}

    def run(self, records: list[Any]) -> list[tuple[int, dict]]:
        """The rows (dataset position, row) of `records`, in completion order."""
        started = time.perf_counter()
        rows = list(run_records(self.job, self.engine, list(records), verifier=self.verifier))
        self.run_seconds += time.perf_counter() - started
        self.records += len(rows)
        return rows

    def stats(self) -> dict:
        """Counters of this replica since it (re)started: records, load and run seconds, and the engine's
        counters (an EngineCounters, which the executor adds up)."""
        return {"pid": os.getpid(), "records": self.records, "started": self.started,
                "load_seconds": self.load_seconds, "run_seconds": self.run_seconds,
                "counters": self.engine.counters()}

    def verify(self) -> dict | None:
        """--verify-reuse's re-scoring of this replica's sample (None without --verify-reuse)."""
        return self.verifier.check(self.engine) if self.verifier is not None else None

    def pid(self) -> int:
        return os.getpid()
