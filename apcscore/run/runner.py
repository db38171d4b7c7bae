"""Records -> requests -> engine -> rows -> the writer: the one loop of score, generate and perplexity, whatever the
engine. Every record yields one row (invalid records and refused requests as `status = "error"` rows), except
a record whose requests the engine aborted (kept out of the file, so that `--resume` runs it)."""

from __future__ import annotations

from typing import Any, Iterator

from rich.console import Console

from apcscore.engine.interface import BatchEngine
from apcscore.engine.step import Request, RequestOutput
from apcscore.errors import ApcscoreError
from apcscore.io.reader import LoadedDataset
from apcscore.io.schemas import Record
from apcscore.jobs.base import Job, RecordPlan
from apcscore.run.progress import make_progress
from apcscore.run.signals import Interrupted, stop_on_signals
from apcscore.run.verify import ReuseVerifier

ABORTED = "abort"  # the finish_reason of a request the engine did not run (run/ray_engine.py: a failed chunk)


def write_rows(job: Job, engine: BatchEngine, data: LoadedDataset, writer: Any, console: Console, quiet: bool,
               verifier: ReuseVerifier | None = None) -> tuple[int, int, bool, list[tuple[str, str]]]:
    """Invalid records' error rows, then the rows of the records not done yet, in completion order, into `writer`;
    (rows, error rows, interrupted, (id, why) of each record not run). `verifier` (run/verify.py) sees each request
    and output. Whatever goes wrong, every finished row is flushed to the partial file."""
    done = set(writer.done_indices)
    todo = [r for r in data.records if r.index not in done]
    invalid = [r for r in data.invalid if r.index not in done]
    waiting: dict[int, tuple[RecordPlan, list[RequestOutput | None]]] = {}  # record index -> its outputs so far
    first_error: dict[int, str] = {}  # record index -> the first error among its outputs, in completion order
    unbuilt: list[tuple[Record, str]] = []  # records whose requests could not be built, not written yet
    not_run: list[tuple[str, str]] = []
    counts = [0, 0]  # rows, error rows
    progress = make_progress(console, quiet)  # a bar with an ETA, or plain lines in a log (run/progress.py)
    task = progress.add_task(job.command, total=len(todo) + len(invalid), tok_s=0.0, hit=0.0, kv="0/0")

    def emit(index: int, row: dict) -> None:
        writer.add(index, row)
        job.observe(row)
        counts[0] += 1
        counts[1] += row.get("status") == "error"
        progress.update(task, advance=1)

    def tick(*_: Any) -> None:  # after every engine step (its on_step) and every row
        writer.flush_if_due()  # finished rows reach disk within max_buffer_seconds, even in a long generation
        c = engine.counters()
        progress.update(task, tok_s=c.tokens_per_second, hit=c.hit_rate, kv=f"{c.used_kv_blocks}/{c.num_kv_blocks}")
        check_stop()

    def requests() -> Iterator[Request]:
        for record in todo:
            try:
                reqs, plan = job.requests(record)
            except ApcscoreError as exc:
                unbuilt.append((record, str(exc)))
                continue
            waiting[record.index] = (plan, [None] * len(reqs))
            for j, req in enumerate(reqs):
                req.request_id = (record.index, j)
                if verifier is not None:
                    verifier.observe_request(record.index, record.id, req)
                yield req

    def write_unbuilt() -> None:
        while unbuilt:
            record, message = unbuilt.pop(0)
            emit(record.index, job.finish_row(job.error_row(record.id, message)))

    with stop_on_signals() as check_stop:  # held until every finished row is flushed
        try:
            with progress:
                for rec in invalid:
                    emit(rec.index, job.finish_row(job.error_row(rec.id, rec.message)))
                for out in engine.run(requests(), on_step=tick):
                    write_unbuilt()
                    index, j = out.request_id
                    if verifier is not None:
                        verifier.observe_output(out)
                    plan, outputs = waiting[index]
                    outputs[j] = out
                    if out.error:
                        first_error.setdefault(index, out.error)
                    if None in outputs:
                        continue
                    del waiting[index]
                    error = first_error.pop(index, None)
                    if any(o.finish_reason == ABORTED for o in outputs):
                        not_run.append((plan.record.id, str(error)))
                        continue
                    row = job.error_row(plan.record.id, error) if error else job.row(plan, outputs)
                    emit(index, job.finish_row(row, plan))
                    tick()
                write_unbuilt()
        except Interrupted:
            writer.flush()
            return counts[0], counts[1], True, not_run
        except BaseException:
            writer.flush()  # keep every finished row, whatever went wrong
            writer.abandon()  # a run that failed before its first row leaves no partial to block the next one
            raise
    return counts[0], counts[1], False, not_run
