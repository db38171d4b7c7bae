"""Records -> engine -> rows, in this process: the rows of a job's records as the engine finishes them.

Every record yields exactly one row: records whose requests cannot be built and requests the engine refuses
become `status = "error"` rows (invalid records are the driver's: they need no engine). `tick` is called
after every engine step and every row; it may raise (the driver's interrupt), which ends the run after the
current step.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from apcscore.engine.interface import BatchEngine
from apcscore.engine.step import Request, RequestOutput
from apcscore.errors import ApcscoreError
from apcscore.io.schemas import Record
from apcscore.jobs.base import Job, RecordPlan


class _RecordGroup:
    """One record's plan and the outputs of its requests, until all have arrived."""

    def __init__(self, plan: RecordPlan, count: int) -> None:
        self.plan = plan
        self.record = plan.record
        self.outputs: list[RequestOutput | None] = [None] * count
        self.remaining = count
        self.error: str | None = None


def run_records(job: Job, engine: BatchEngine, records: list[Record], tick: Callable[[], None] | None = None,
                verifier: Any = None) -> Iterator[tuple[int, dict]]:
    """(dataset position, finished row) of every record, in completion order, through `engine` (an Engine or
    a TransformersEngine). `verifier` (run/verify.ReuseVerifier) sees each request and output."""
    groups: dict[int, _RecordGroup] = {}
    failed: list[tuple[Record, str]] = []  # records whose requests could not be built, not yielded yet

    def requests() -> Iterator[Request]:
        for record in records:
            try:
                reqs, plan = job.requests(record)
            except ApcscoreError as exc:
                failed.append((record, str(exc)))
                continue
            groups[record.index] = _RecordGroup(plan, len(reqs))
            for j, req in enumerate(reqs):
                req.request_id = (record.index, j)
                if verifier is not None:
                    verifier.observe_request(record.index, record.id, req)
                yield req

    def finished_failures() -> Iterator[tuple[int, dict]]:
        while failed:
            record, message = failed.pop(0)
            yield record.index, job.finish_row(job.error_row(record.id, message))

    def on_step(_engine: Any) -> None:
        if tick is not None:
            tick()

    for out in engine.run(requests(), on_step=on_step):
        yield from finished_failures()
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
            yield index, job.finish_row(row, group.plan)
            if tick is not None:
                tick()
    yield from finished_failures()
