"""One `--ray` replica: a Ray actor hosting an engine, which keeps its prefix cache from chunk to chunk and returns
its counters with each. This module does not import ray (run/ray_replicas.ReplicaPool wraps it)."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Iterator

from apcscore.engine.loader import load_engine
from apcscore.models.loaded import load_model
from apcscore.engine.provenance import describe
from apcscore.engine.step import Request, RequestOutput
from apcscore.options.commands import ScaleOptions


class Replica:
    """An engine replica. `opts` are the run's resolved options (options/resolve.resolve_options)."""

    def __init__(self, opts: ScaleOptions) -> None:
        started = time.perf_counter()
        self.config = opts.engine
        self.engine = load_engine(load_model(opts.model), opts.engine)  # this process's engine
        self.load_seconds = time.perf_counter() - started
        self.run_seconds = 0.0

    def describe(self) -> dict:
        """This replica's engine as a single process's metadata describes it, its model facts and its process."""
        return {"metadata": describe(self.engine, self.config), "info": self.engine.info, "pid": os.getpid()}

    def run_requests(self, requests: list[Request]) -> tuple[list[RequestOutput], dict]:
        """The engine's output of each request, in completion order, and this replica's `stats()` after them."""
        return self._run(self.engine.run, requests)

    def run_recomputed(self, requests: list[Request]) -> tuple[list[RequestOutput], dict]:
        """`run_requests` by full recompute (the reference of --verify-reuse)."""
        return self._run(self.engine.run_recomputed, requests)

    def _run(self, run: Callable[[Iterable[Request]], Iterator[RequestOutput]], requests: list[Request]
             ) -> tuple[list[RequestOutput], dict]:
        started = time.perf_counter()
        outputs = list(run(requests))
        self.run_seconds += time.perf_counter() - started
        return outputs, self.stats()

    def stats(self) -> dict[str, Any]:
        """Counters of this replica since it (re)started: its process, load and run seconds, and the engine's counters
        (an EngineCounters, which the Ray engine adds up): run/ray_replicas.replica_run records them."""
        return {"pid": os.getpid(), "load_seconds": self.load_seconds, "run_seconds": self.run_seconds,
                "counters": self.engine.counters()}
