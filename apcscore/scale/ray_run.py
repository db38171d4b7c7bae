"""`--ray ADDRESS`: score / perplexity / generate on Ray replicas; this process (the driver) writes the file.

How a run goes:
1. The driver checks everything a single run checks (options, output, dataset, the model's config and
   tokenizer) before any weights load, then starts `--replicas` actors (scale/replica.py), each holding an
   Engine (`--gpus-per-replica`, `--cpus-per-replica`).
2. It splits the records prefix-aware with the function `--shard` uses (scale/partition.py; the requests are
   built with the model's tokenizer and the context length replica 0 reports), so records that share their
   first KV blocks run on one replica and hit its prefix cache.
3. Each replica gets its records in dataset order, in chunks of CHUNK_RECORDS, at most IN_FLIGHT chunks queued
   at a time; finished chunks' rows go through our ResultsWriter, which writes the one parquet file in dataset
   order with the single run's schema and metadata, plus `ray` (address, replicas, the partition, per-replica
   counters). Apart from timings, the file equals a single run's bitwise (the batch-invariance contract).

Faults: the actors are created with `max_restarts=MAX_RESTARTS` and `max_task_retries=MAX_TASK_RETRIES`: Ray
restarts a replica whose process died (its engine loads again) and runs its unfinished chunk again, a bounded
number of times. A chunk's rows reach the writer only when the whole chunk has come back, and the writer refuses
a record written twice, so no record is lost or duplicated. A chunk that still fails (a record that gets its
worker killed every time, say by running out of memory) takes its replica down: the other replicas finish, the
finished rows are kept in `<out>.partial`, the run names the records not run and why, and exits 1 (`--resume`
retries them). SIGINT / SIGTERM stop the driver after the chunks in hand: the finished rows are kept in
`<out>.partial` and `--resume` continues (the split is recomputed over the whole dataset, so it is the same).

Provenance: every replica describes itself before any work; replicas that differ in what fixes the bits
(merge.configuration: versions, numerics, engine settings, device ...) are refused, and each replica's
device, numerics, versions and KV pool are recorded in `ray.per_replica`.

Why plain actors and not Ray Data's `map_batches` with an actor pool (the issue's suggestion): an actor pool
hands each block to whichever actor is free, so records of one prefix group would be scattered over replicas
unless a whole part were one block, and then nothing would come back until a part was finished (no streaming to
the writer, no resume, a fault reruns a whole part). Actors addressed by part give prefix-aware routing with
chunk-sized retries. Ray is imported only here, and only for `--ray`.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rich.console import Console
from rich.markup import escape

from apcscore.errors import ApcscoreError
from apcscore.io.reader import LoadedDataset
from apcscore.io.writer import ResultsWriter
from apcscore.jobs.options import RunOptions
from apcscore.jobs.preflight import check_against_model
from apcscore.io.provenance import differing
from apcscore.jobs.session import (RESUME_COMPARE, RESUME_KEYS, _job_class, _observe_previous, add_timings,
                                   dataset_metadata, exit_code, print_summary, start_session)
from apcscore.scale.merge import configuration
from apcscore.scale.replica import Replica
from apcscore.scale.shard import split_dataset

CHUNK_RECORDS = 64
IN_FLIGHT = 2
MAX_RESTARTS = 2  # times Ray restarts a replica whose process died
MAX_TASK_RETRIES = 2  # times Ray runs a chunk again after its replica died
_COUNTERS = ("prompt_tokens", "generated_tokens", "steps", "preemptions")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ApcscoreError("--ray needs Ray, which is not installed: pip install 'apcscore[ray]' "
                            "(or make install), or run without --ray") from None
    return ray


def connect(ray: Any, address: str) -> bool:
    """Join the cluster at `address` (auto | local | ray://... | host:port); True when this call started Ray."""
    if ray.is_initialized():  # this process already holds a Ray session (e.g. a test's ray.init)
        return False
    try:
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise ApcscoreError(f"--ray {address}: no Ray cluster to join ({exc}) — start one (`ray start --head`), "
                            "or use --ray local to start one on this machine") from None
    return True


def _get(ray: Any, ref: Any) -> Any:
    """ray.get, with a replica's failure as an ApcscoreError that quotes its cause."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ApcscoreError):
            raise ApcscoreError(f"a Ray replica refused the run: {cause}", exit_code=cause.exit_code) from None
        text = str(exc)
        at = text.rfind("ApcscoreError: ")  # raised in a replica's creation task: only its text comes back
        if at >= 0:
            raise ApcscoreError(f"a Ray replica refused the run: {text[at + 15:].strip()}") from None
        lines = [line for line in text.strip().splitlines() if line.strip()]
        raise ApcscoreError(f"a Ray replica failed: {lines[-1] if lines else type(exc).__name__}", exit_code=1) from None


def _sum_timings(stats: list[dict], load_seconds: float, run_seconds: float) -> dict:
    """The replicas' counters added up, with the driver's wall-clock seconds (session_timings' format)."""
    total = {"load_seconds": load_seconds, "run_seconds": run_seconds, **{k: 0 for k in _COUNTERS},
             "prefix_cache": {"queried_tokens": 0, "hit_tokens": 0, "reusable_tokens": 0}}
    for s in stats:
        for k in _COUNTERS:
            total[k] += s["timings"][k]
        for k in total["prefix_cache"]:
            total["prefix_cache"][k] += s["timings"]["prefix_cache"][k]
    return total


def run_on_ray(command: str, data: LoadedDataset, opts: RunOptions, out: Path, console: Console) -> int:
    """Run `command` over `data` on Ray replicas and write `out`; return the exit code (as run_command does)."""
    ray = import_ray()
    from apcscore.models.locate import resolve_model
    from apcscore.models.resolved import resolve_model_parts

    cfg = opts.engine
    parts = resolve_model_parts(resolve_model(opts.model).path)
    data = check_against_model(command, opts, data, int(parts.config.vocab_size), parts.tokenizer)
    started_ray = connect(ray, opts.ray)
    n = int(opts.replicas)
    gpus = opts.gpus_per_replica
    if gpus is None:
        gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 and opts.engine.device != "cpu" else 0
    cpus = opts.cpus_per_replica if opts.cpus_per_replica is not None else 1
    remote = ray.remote(Replica).options(num_cpus=cpus, num_gpus=gpus, max_restarts=MAX_RESTARTS,
                                         max_task_retries=MAX_TASK_RETRIES)
    load_start = time.perf_counter()
    actors = [remote.remote(command, opts) for _ in range(n)]
    try:
        return _drive(ray, actors, command, data, opts, out, console, cfg.block_size, parts.tokenizer,
                      {"gpus_per_replica": gpus, "cpus_per_replica": cpus}, load_start)
    finally:
        for actor in actors:
            ray.kill(actor)
        if started_ray:
            ray.shutdown()


def _drive(ray: Any, actors: list[Any], command: str, data: LoadedDataset, opts: RunOptions, out: Path,
           console: Console, block_size: int, tokenizer: Any, resources: dict, load_start: float) -> int:
    """Split, feed the replicas, write their rows; the exit code."""
    descs = [_get(ray, ref) for ref in [a.describe.remote() for a in actors]]
    desc = descs[0]
    _check_replicas([d["metadata"] for d in descs])
    light = SimpleNamespace(tokenizer=tokenizer, info=SimpleNamespace(max_model_len=desc["max_model_len"]))
    job = _job_class(command)(light, opts)  # builds no requests here: it sees the rows, for the summary
    split = split_dataset(_job_class(command)(light, opts), data, len(actors), block_size, opts.partition)
    metadata = dict(desc["metadata"], argv=sys.argv,
                    created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    dataset=dataset_metadata(data, opts))
    writer = ResultsWriter(out, job.output_schema(), metadata, overwrite=opts.overwrite, resume=opts.resume,
                           resume_keys=RESUME_KEYS, resume_compare=RESUME_COMPARE, num_rows=data.num_records)
    sessions, previous = start_session(writer, metadata["created"])
    before = _observe_previous(job, writer)
    done = set(writer.done_indices)
    counts = {"rows": 0, "errors": 0}

    def emit(index: int, row: dict) -> None:
        writer.add(index, row)
        job.observe(row)
        counts["rows"] += 1
        counts["errors"] += row.get("status") == "error"

    mine: list[list[Any]] = [[] for _ in actors]  # each replica's records not done yet, in dataset order
    for rec in data.records:
        if rec.index not in done:
            mine[split.part_of[rec.index]].append(rec)
    queues = [[m[i:i + CHUNK_RECORDS] for i in range(0, len(m), CHUNK_RECORDS)] for m in mine]
    pending: dict[Any, tuple[int, list[Any]]] = {}
    failed: list[tuple[int, list[Any], str]] = []  # (replica, records not run, why)

    def submit(r: int) -> None:
        if queues[r]:
            chunk = queues[r].pop(0)
            pending[actors[r].run.remote(chunk)] = (r, chunk)

    stop: dict[str, Any] = {"signal": None}

    def handler(signum, _frame) -> None:  # noqa: ANN001
        stop["signal"] = signum

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    run_start = time.perf_counter()
    try:
        for rec in data.invalid:  # invalid records need no replica
            if rec.index not in done:
                emit(rec.index, job.finish_row(rec, job.error_row(rec.id, rec.message)))
        for r in range(len(actors)):
            for _ in range(IN_FLIGHT):
                submit(r)
        while pending and stop["signal"] is None:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in ready:
                r, chunk = pending.pop(ref)
                try:
                    rows = _get(ray, ref)
                except ApcscoreError as exc:
                    if exc.exit_code != 1:  # a refusal, not a fault
                        raise
                    # retried MAX_TASK_RETRIES times: this replica is done; its other chunks are not run
                    failed.append((r, chunk, str(exc)))
                    failed.extend((r, later, "not run: its replica failed before") for later in queues[r])
                    queues[r] = []
                    continue
                for index, row in rows:
                    emit(index, row)
                submit(r)
            writer.flush_if_due()
    except BaseException:
        writer.flush()
        if not writer.done_indices:
            writer.abandon()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    run_seconds = time.perf_counter() - run_start
    dead = {r for r, _, _ in failed}
    refs = [a.stats.remote() for r, a in enumerate(actors) if r not in dead]  # after an interrupt, a replica busy
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=None if stop["signal"] is None else 2.0)  # is not awaited
    alive = iter(_get(ray, ref) if ref in ready else None for ref in refs)
    stats = [None if r in dead else next(alive) for r in range(len(actors))]
    got = [s for s in stats if s is not None]
    load_seconds = max((s["timings"]["load_seconds"] for s in got), default=0.0)
    timings = add_timings(previous.get("timings"), _sum_timings(got, load_seconds, run_seconds))
    per_replica = [{"replica": r, "records_assigned": split.records[r], "load_assigned": split.loads[r],
                    **_described(descs[r]),
                    **({"records_run": s["records"], "pid": s["pid"], "timings": add_timings(None, s["timings"])}
                       if s is not None else {"stats": "failed" if r in dead else
                                              "not available (interrupted while busy)"})}
                   for r, s in enumerate(stats)]
    writer.update_metadata({"timings": timings, "ray": {
        "address": opts.ray, "replicas": len(actors), **resources,
        "chunk_records": CHUNK_RECORDS, "partition": split.metadata(), "per_replica": per_replica,
        "setup_seconds": round(run_start - load_start, 3)}})
    if failed:
        return _report_failures(console, writer, failed, before[0] + counts["rows"])
    if stop["signal"] is not None:
        writer.flush()
        console.print(f"[yellow]interrupted:[/] {before[0] + counts['rows']} rows are saved in "
                      f"{escape(str(writer.partial_path))}; continue with the same command plus --resume",
                      highlight=False)
        return 130
    final = writer.close()
    rows, errors = before[0] + counts["rows"], before[1] + counts["errors"]
    if not opts.quiet:
        print_summary(console, command, final, rows, errors, sessions, timings, job.summary())
        console.print(f"ray: {len(actors)} replicas; records per replica {split.records}", highlight=False)
    return exit_code(console, final, rows, errors)


def _check_replicas(metas: list[dict]) -> None:
    """Refuse replicas that would write one file of several configurations (other hardware, numerics, versions)."""
    base = configuration(metas[0])
    for r, meta in enumerate(metas[1:], start=1):
        diff = differing(base, configuration(meta), base.keys())
        if diff:
            raise ApcscoreError(f"--ray: replica {r} does not run the configuration of replica 0 ("
                                f"{'; '.join(diff)}), so their rows would differ in bits; run the replicas on one "
                                "kind of machine and software (e.g. a Ray resource or node label per kind)")


def _described(desc: dict) -> dict:
    """What a replica's own metadata says about where it ran (recorded per replica)."""
    meta = desc["metadata"]
    return {"device": meta.get("device"), "numerics": meta.get("numerics"), "versions": meta.get("versions"),
            "num_kv_blocks": (meta.get("engine") or {}).get("num_kv_blocks"), "started_pid": desc.get("pid")}


def _report_failures(console: Console, writer: ResultsWriter, failed: list[tuple[int, list[Any], str]],
                     saved: int) -> int:
    """Chunks that failed after their retries: keep the finished rows, name the records not run and why; exit 1."""
    writer.flush()
    lines = []
    for r, records, why in failed:
        ids = [rec.id for rec in records]
        shown = ", ".join(ids[:10]) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
        lines.append(f"replica {r}: {len(ids)} records ({shown}): {why}")
    missing = sum(len(records) for _, records, _ in failed)
    console.print(f"[bold red]error:[/] --ray: {missing} records were not run (a chunk failed {MAX_TASK_RETRIES + 1} "
                  f"times):\n" + escape("\n".join(lines)) + f"\n{saved} rows are saved in "
                  f"{escape(str(writer.partial_path))}; fix the cause (e.g. memory) and rerun the same command plus "
                  "--resume", highlight=False, soft_wrap=True)
    return 1
