"""`--ray ADDRESS`: the Ray executor: score / perplexity / generate on Ray replicas (run/ray_replicas.py, the
replicas eval's `--ray` runs on too), while this process (the one driver, run/driver.py) writes the file.

How a run goes:
1. The driver checks everything a single run checks (options, output, dataset, the model's config and
   tokenizer) before any weights load, then starts `--replicas` actors (run/ray_replicas.ReplicaPool), each a
   `LocalExecutor` holding an Engine (`--gpus-per-replica`, `--cpus-per-replica`).
2. It splits the records prefix-aware with the function `--shard` uses (scale/partition.py; the requests are
   built with the model's tokenizer and engine/loader.engine_context_length), so records that share their
   first KV blocks run on one replica and hit its prefix cache.
3. Each replica gets its records in dataset order, in chunks of CHUNK_RECORDS, at most IN_FLIGHT chunks queued
   at a time; finished chunks' rows go through our ResultsWriter, which writes the one parquet file in dataset
   order with the single run's schema and metadata, plus `ray` (address, replicas, the partition, per-replica
   counters). Apart from timings, the file equals a single run's bitwise (the batch-invariance contract).
4. With --verify-reuse each replica keeps its own seeded sample (the sample is a function of the record's
   position, so it is the single run's) and re-scores it at the end; the reports are combined into one.

Faults: the actors are created with `max_restarts=MAX_RESTARTS` and `max_task_retries=MAX_TASK_RETRIES`: Ray
restarts a replica whose process died (its engine loads again) and runs its unfinished chunk again, a bounded
number of times. A chunk's rows reach the writer only when the whole chunk has come back, and the writer refuses
a record written twice, so no record is lost or duplicated. A chunk that still fails (a record that gets its
worker killed every time, say by running out of memory) takes its replica down: the other replicas finish, the
finished rows are kept in `<out>.partial`, the run names the records not run and why, and exits 1 (`--resume`
retries them). SIGINT / SIGTERM stop the driver after the chunks in hand: the finished rows are kept in
`<out>.partial` and `--resume` continues (the split is recomputed over the whole dataset, so it is the same).

Provenance: every replica describes itself before any work; replicas that differ in what fixes the bits
(the RAY view of io/identity.py: versions, numerics, engine settings, device ...) are refused, and each replica's
device, numerics, versions and KV pool are recorded in `ray.per_replica`.

Why plain actors and not Ray Data's `map_batches` with an actor pool (the issue's suggestion): an actor pool
hands each block to whichever actor is free, so records of one prefix group would be scattered over replicas
unless a whole part were one block, and then nothing would come back until a part was finished (no streaming to
the writer, no resume, a fault reruns a whole part). Actors addressed by part give prefix-aware routing with
chunk-sized retries.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from apcscore.engine.counters import EngineCounters
from apcscore.engine.loader import engine_context_length
from apcscore.engine.model_files import LoadedModel
from apcscore.errors import ApcscoreError
from apcscore.io.reader import LoadedDataset
from apcscore.options.commands import RunOptions
from apcscore.run.verify import combine_reports
from apcscore.run.local import LocalExecutor
from apcscore.run.ray_replicas import MAX_TASK_RETRIES, ReplicaPool, replica_run
from apcscore.scale.shard import Split, split_dataset

CHUNK_RECORDS = 64
IN_FLIGHT = 2


class RayExecutor:
    """Records run on `--replicas` Ray actors (scale/replica.py); the driver writes their rows.
    It implements run/executor.Executor."""

    def __init__(self, command: str, opts: RunOptions, model: LoadedModel) -> None:
        self.command, self.opts, self.block_size = command, opts, opts.engine.block_size
        self.tokenizer = model.tokenizer
        self.warnings: list[tuple[str, bool]] = []
        self.pool = ReplicaPool(command, opts, LocalExecutor)  # started, described, checked to agree
        self.actors = self.pool.actors
        self.max_model_len = engine_context_length(model.config, opts.engine)  # what each replica's engine has
        self.split: Split | None = None
        self.run_start = time.perf_counter()
        self.failed: list[tuple[int, list[Any], str]] = []  # (replica, records not run, why)

    def metadata(self, job: Any) -> dict:
        return self.pool.metadata(0)

    def rows(self, job: Any, data: LoadedDataset, todo: list[Any],
             tick: Callable[[], None]) -> Iterator[tuple[int, dict]]:
        """Split the whole dataset prefix-aware over the replicas (the same split on every resume), then feed
        each its records not done yet in chunks; rows as chunks come back."""
        self.split = split_dataset(job, data, len(self.actors), self.block_size, self.opts.partition)
        self.run_start = time.perf_counter()
        return self._rows(todo, tick)

    def _rows(self, todo: list[Any], tick: Callable[[], None]) -> Iterator[tuple[int, dict]]:
        split = self.split
        assert split is not None
        mine: list[list[Any]] = [[] for _ in self.actors]  # each replica's records not done yet, in dataset order
        for rec in todo:
            mine[split.part_of[rec.index]].append(rec)
        queues = [[m[i:i + CHUNK_RECORDS] for i in range(0, len(m), CHUNK_RECORDS)] for m in mine]
        # tick: the driver's interrupt stops the feed; the chunks in hand are written
        for r, chunk, rows in self.pool.feed("run", queues, tick, IN_FLIGHT):
            if isinstance(rows, ApcscoreError):  # this replica is done; its other chunks are not run
                self.failed.append((r, chunk, str(rows)))
                self.failed.extend((r, later, "not run: its replica failed before") for later in queues[r])
                queues[r] = []
                continue
            yield from rows

    def progress(self) -> dict:
        return {}

    def snapshot(self, run_seconds: float) -> dict | None:
        """None: the replicas' counters are read at the end only (a killed Ray session's tokens are not kept)."""
        return None

    def finish(self, interrupted: bool, run_seconds: float) -> tuple[dict, dict]:
        stats = self.pool.stats({r for r, _, _ in self.failed}, interrupted)
        got = [s for s in stats if s is not None]
        load_seconds = max((s["load_seconds"] for s in got), default=0.0)
        dead = {r for r, _, _ in self.failed}
        split = self.split
        per_replica = [{"replica": r, "records_assigned": split.records[r] if split else 0,
                        "load_assigned": split.loads[r] if split else 0, **self.pool.described(r),
                        **(replica_run(s, "records") if s is not None else
                           {"stats": "failed" if r in dead else "not available (interrupted while busy)"})}
                       for r, s in enumerate(stats)]
        ray_meta = {**self.pool.section(), "chunk_records": CHUNK_RECORDS,
                    "partition": split.metadata() if split else None, "per_replica": per_replica}
        total = sum((s["counters"] for s in got), EngineCounters())  # the replicas' counters added up
        return total.to_timings(load_seconds, run_seconds), {"ray": ray_meta}

    def verify(self) -> dict | None:
        """The replicas' --verify-reuse reports as one."""
        if not self.opts.verify_reuse:
            return None
        dead = {r for r, _, _ in self.failed}
        reports = [self.pool.get(a.verify.remote()) for r, a in enumerate(self.actors) if r not in dead]
        return combine_reports([r for r in reports if r is not None])

    def failure(self) -> str | None:
        """Chunks that failed after their retries: the records not run and why."""
        if not self.failed:
            return None
        lines = []
        for r, records, why in self.failed:
            ids = [rec.id for rec in records]
            shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
            lines.append(f"replica {r}: {len(ids)} records ({shown}): {why}")
        missing = sum(len(records) for _, records, _ in self.failed)
        return (f"--ray: {missing} records were not run (a chunk failed {MAX_TASK_RETRIES + 1} times):\n"
                + "\n".join(lines))

    def closing_line(self) -> str | None:
        return f"ray: {len(self.actors)} replicas; records per replica {self.split.records if self.split else []}"

    def close(self) -> None:
        self.pool.close()
