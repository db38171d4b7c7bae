"""One `--ray` replica: a Ray actor that holds an engine, and turns chunks of work into results.

The actor runs a host handed in by the run layer (run/ray_replicas.ReplicaPool), so this package needs nothing
of it:
- for score, generate and perplexity, a local executor (`run/local.LocalExecutor`), the very code a single
  process runs, with the command's job: `run(records)` gives rows, which the driver writes;
- for eval, the engine alone (`run/ray_engine.EngineHost`): `run_requests(requests)` gives the engine's
  outputs, which lm-eval's model class in the driver's process turns into responses.
It keeps its engine, and so its prefix cache, from chunk to chunk, and with --verify-reuse its own sample of
requests, re-scored by `verify()` at the end. This module does not import ray: the pool wraps the class with
`ray.remote`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from apcscore.engine.model_files import load_model
from apcscore.engine.step import Request, RequestOutput
from apcscore.jobs.registry import JOBS
from apcscore.options.commands import ScaleOptions


class Replica:
    """An engine replica. `opts` are the run's resolved options (options/resolve.resolve_options)."""

    def __init__(self, command: str, opts: ScaleOptions, executor_class: Callable[..., Any]) -> None:
        """executor_class: what this replica hosts, built as executor_class(command, opts, model): it has `engine`,
        `tokenizer`, `max_model_len`, `metadata(job)`, `rows(...)` and `verify()` (run/local.LocalExecutor, whose
        interface is run/executor.Executor; eval's host has the engine and metadata only)."""
        self.command, self.opts = command, opts
        started = time.perf_counter()
        self.executor = executor_class(command, opts, load_model(opts.model))  # this process's engine
        self.load_seconds = time.perf_counter() - started
        self.engine = self.executor.engine
        job = JOBS.get(command)  # None for eval: lm-eval's model class makes its requests, in the driver
        self.job = job(self.executor.tokenizer, self.executor.max_model_len, opts) if job is not None else None
        self.run_seconds = 0.0
        self.records = 0  # records run (score, generate, perplexity)
        self.requests = 0  # engine requests run (eval)
        self.started = time.time()

    def describe(self) -> dict:
        """This replica's metadata (as a single process would record it; the driver sets `dataset`, `argv` and
        `created`) and its process."""
        return {"metadata": self.executor.metadata(self.job),
                "pid": os.getpid()}

    def run(self, records: list[Any]) -> list[tuple[int, dict]]:
        """The rows (dataset position, row) of `records`, in completion order."""
        started = time.perf_counter()
        rows = list(self.executor.rows(self.job, None, list(records), lambda: None))
        self.run_seconds += time.perf_counter() - started
        self.records += len(rows)
        return rows

    def run_requests(self, requests: list[Request]) -> list[RequestOutput]:
        """The engine's output of each request (eval), in completion order."""
        started = time.perf_counter()
        outputs = list(self.engine.run(requests))
        self.run_seconds += time.perf_counter() - started
        self.requests += len(outputs)
        return outputs

    def stats(self) -> dict:
        """Counters of this replica since it (re)started: records or requests, load and run seconds, and the
        engine's counters (an EngineCounters, which the executor adds up)."""
        return {"pid": os.getpid(), "records": self.records, "requests": self.requests, "started": self.started,
                "load_seconds": self.load_seconds, "run_seconds": self.run_seconds,
                "counters": self.engine.counters()}

    def verify(self) -> dict | None:
        """--verify-reuse's re-scoring of this replica's sample (None without --verify-reuse)."""
        return self.executor.verify()

    def pid(self) -> int:
        return os.getpid()
