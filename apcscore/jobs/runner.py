"""Run a job over a dataset: records -> engine -> rows -> results writer, with progress and interrupts.

Every record yields exactly one row: invalid records (with --skip-invalid), records whose requests cannot
be built, and requests the engine refuses all become `status = "error"` rows. SIGINT/SIGTERM stop the run
after the current step; what finished is flushed to the partial file so `--resume` can continue.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from apcscore.engine.sequence import Request, RequestOutput
from apcscore.errors import ApcscoreError
from apcscore.io.reader import LoadedDataset
from apcscore.io.schemas import Record
from apcscore.io.writer import ResultsWriter
from apcscore.jobs.base import Job, RecordPlan


class Interrupted(Exception):
    """Raised inside the engine loop when SIGINT or SIGTERM arrived."""


@dataclass
class RunResult:
    out_path: Path
    num_rows: int
    num_errors: int
    seconds: float
    interrupted: bool


class _RecordGroup:
    """One record's plan and the outputs of its requests, until all have arrived."""

    def __init__(self, plan: RecordPlan, count: int) -> None:
        self.plan = plan
        self.record = plan.record
        self.outputs: list[RequestOutput | None] = [None] * count
        self.remaining = count
        self.error: str | None = None


def run_job(job: Job, engine: Any, dataset: LoadedDataset, writer: ResultsWriter, console: Console,
            show_progress: bool, verifier: Any = None, handle_signals: bool = True) -> RunResult:
    """Run every record not done yet through `engine` (an Engine or a TransformersEngine); `verifier`
    (jobs/verify.ReuseVerifier) sees each request and output. `handle_signals=False` leaves SIGINT/SIGTERM
    alone (a Ray replica: its driver handles them)."""
    done = set(getattr(writer, "done_indices", set()))
    todo = [r for r in dataset.records if r.index not in done]
    invalid = [r for r in dataset.invalid if r.index not in done]
    groups: dict[int, _RecordGroup] = {}
    counts = {"rows": 0, "errors": 0}
    stop = {"signal": None}

    def emit(record: Record, row: dict, plan: RecordPlan | None = None) -> None:
        index = record.index
        row = job.finish_row(row, plan)
        writer.add(index, row)
        job.observe(row)
        counts["rows"] += 1
        counts["errors"] += row.get("status") == "error"
        progress.update(task, advance=1)

    def requests() -> Iterator[Request]:
        for record in todo:
            try:
                reqs, plan = job.requests(record)
            except ApcscoreError as exc:
                emit(record, job.error_row(record.id, str(exc)))
                continue
            groups[record.index] = _RecordGroup(plan, len(reqs))
            for j, req in enumerate(reqs):
                req.request_id = (record.index, j)
                if verifier is not None:
                    verifier.observe_request(record.index, record.id, req)
                yield req

    def on_step(_engine: Any) -> None:
        writer.flush_if_due()  # finished rows reach disk within max_buffer_seconds, even in a long generation
        stats = _engine.stats
        bm = _engine.block_manager
        progress.update(task, tok_s=stats.tokens_per_second, hit=bm.stats.hit_rate,
                        kv=f"{bm.num_used_blocks}/{bm.num_blocks}")
        if stop["signal"] is not None:
            raise Interrupted()

    def handler(signum, _frame) -> None:
        stop["signal"] = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)} if handle_signals else {}
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[tok_s]:,.0f} tok/s  prefix hit {task.fields[hit]:.0%}  KV {task.fields[kv]}"),
        console=console, disable=not show_progress, transient=False,
    )
    task = progress.add_task(job.command, total=len(todo) + len(invalid), tok_s=0.0, hit=0.0, kv="0/0")
    started = time.perf_counter()
    interrupted = False
    try:
        with progress:
            for record in invalid:
                emit(record, job.error_row(record.id, record.message))
            for out in engine.run(requests(), on_step=on_step):
                index, j = out.request_id
                if verifier is not None:
                    verifier.observe_output(out)
                group = groups[index]
                group.outputs[j] = out
                group.remaining -= 1
                if out.error and group.error is None:
                    group.error = out.error
                if group.remaining == 0:
                    del groups[index]
                    row = (job.error_row(group.record.id, group.error) if group.error
                           else job.row(group.plan, group.outputs))
                    emit(group.record, row, group.plan)
                if stop["signal"] is not None:
                    raise Interrupted()
    except Interrupted:
        interrupted = True
    except BaseException:
        writer.flush()  # keep every finished row, whatever went wrong
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    seconds = time.perf_counter() - started
    if interrupted:
        writer.flush()
    return RunResult(Path(writer.out_path) if hasattr(writer, "out_path") else Path(), counts["rows"],
                     counts["errors"], seconds, interrupted)
