"""One `--ray` replica: a Ray actor that holds an Engine and its job, and turns chunks of records into rows.

The actor runs the very code a single process runs (`jobs/runner.run_job`, the command's job, the Engine), with
its rows collected instead of written: the driver (scale/ray_run.py) writes them through the results writer.
It keeps its engine, and so its prefix cache, from chunk to chunk. This module does not import ray: the driver
wraps the class with `ray.remote`.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from apcscore.io.reader import LoadedDataset
from apcscore.jobs.options import RunOptions


class _Rows:
    """The writer interface run_job needs, keeping the rows in memory."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.done_indices: set[int] = set()

    def add(self, index: int, row: dict) -> None:
        self.rows.append((index, row))

    def flush_if_due(self) -> None:
        pass

    def flush(self) -> None:
        pass


class Replica:
    """An engine replica. `opts` are the run's resolved options (jobs/options.resolve_options)."""

    def __init__(self, command: str, opts: RunOptions) -> None:
        from apcscore.engine.engine import Engine, check_backend_device
        from apcscore.jobs.session import _job_class

        self.command, self.opts = command, opts
        self.cfg = opts.engine
        check_backend_device(self.cfg)
        started = time.perf_counter()
        self.engine = Engine.from_model(opts.model, self.cfg)
        self.load_seconds = time.perf_counter() - started
        self.job = _job_class(command)(self.engine, opts)
        self.run_seconds = 0.0
        self.records = 0
        self.started = time.time()

    def describe(self) -> dict:
        """This replica's run metadata (as a single process would record it; the driver sets `dataset` and `argv`),
        and what the driver needs to build requests for partitioning."""
        from apcscore.jobs.session import run_metadata

        stub = LoadedDataset(Path("."), "", [], [])
        return {"metadata": run_metadata(self.command, self.engine, self.job, stub, self.cfg, self.opts),
                "max_model_len": self.engine.info.max_model_len, "pid": os.getpid()}

    def run(self, records: list[Any]) -> list[tuple[int, dict]]:
        """The rows (dataset position, row) of `records`, in completion order."""
        from apcscore.jobs.runner import run_job

        rows = _Rows()
        data = LoadedDataset(Path("."), "", list(records), [])
        quiet = Console(file=io.StringIO(), quiet=True)
        result = run_job(self.job, data, rows, quiet, show_progress=False, handle_signals=False)
        self.run_seconds += result.seconds
        self.records += len(rows.rows)
        return rows.rows

    def stats(self) -> dict:
        """Counters of this replica since it (re)started: records, timings, prefix cache."""
        from apcscore.jobs.session import session_timings

        return {"pid": os.getpid(), "records": self.records, "started": self.started,
                "timings": session_timings(self.engine, self.load_seconds, self.run_seconds)}

    def pid(self) -> int:
        return os.getpid()
