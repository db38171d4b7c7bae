"""One `--ray` replica: a Ray actor that holds an engine and its job, and turns chunks of records into rows.

The actor runs a local executor (`run/local.LocalExecutor`, handed in by run/ray_executor.RayExecutor, so this
package needs nothing from the run layer): the very code a single process runs, the command's job and the
engine. The driver (run/driver.py through RayExecutor) writes its rows. It keeps its engine, and so its prefix
cache, from chunk to chunk, and with --verify-reuse its own sample of requests, re-scored by `verify()` at the
end. This module does not import ray: the executor wraps the class with `ray.remote`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from apcscore.engine.model_files import load_model
from apcscore.jobs.registry import job_class
from apcscore.options.commands import RunOptions


class Replica:
    """An engine replica. `opts` are the run's resolved options (options/resolve.resolve_options)."""

    def __init__(self, command: str, opts: RunOptions, executor_class: Callable[..., Any]) -> None:
        """executor_class: run/local.LocalExecutor (its interface is run/executor.Executor)."""
        self.command, self.opts = command, opts
        started = time.perf_counter()
        self.executor = executor_class(command, opts, load_model(opts.model))  # this process's engine
        self.load_seconds = time.perf_counter() - started
        self.engine = self.executor.engine
        self.job = job_class(command)(self.executor.tokenizer, self.executor.max_model_len, opts)
        self.run_seconds = 0.0
        self.records = 0
        self.started = time.time()

    def describe(self) -> dict:
        """This replica's run metadata (as a single process would record it; the driver sets `dataset`, `argv`
        and `created`) and its process."""
        return {"metadata": self.executor.metadata(self.job),
                "pid": os.getpid()}

    def run(self, records: list[Any]) -> list[tuple[int, dict]]:
        """The rows (dataset position, row) of `records`, in completion order."""
        started = time.perf_counter()
        rows = list(self.executor.rows(self.job, None, list(records), lambda: None))
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
        return self.executor.verify()

    def pid(self) -> int:
        return os.getpid()
