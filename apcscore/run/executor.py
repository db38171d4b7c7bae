"""The executor interface: where a run's records become rows.

The driver (run/driver.py) owns everything around an executor: the writer, resume, signals, progress, the summary
and the exit code. Two executors implement `Executor`: run/local.LocalExecutor (one engine in this process; it
subclasses `Executor` for the defaults of `failure`, `closing_line` and `close`) and run/ray_executor.RayExecutor
(Ray replicas).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, runtime_checkable

from apcscore.io.reader import LoadedDataset
from apcscore.io.schemas import Record
from apcscore.jobs.base import Job


@runtime_checkable
class Executor(Protocol):
    """Runs records through engines; built from the resolved options and the checked model
    (`engine/model_files.LoadedModel`)."""

    tokenizer: Any  # what a job is built from, with max_model_len
    max_model_len: int
    warnings: list[tuple[str, bool]]  # (text, soft_wrap) lines the driver prints after loading

    def metadata(self, job: Job) -> dict:
        """The run metadata as the engine side knows it (the driver adds argv, created and dataset)."""
        ...

    def rows(self, job: Job, data: LoadedDataset, todo: list[Record],
             tick: Callable[[], None]) -> Iterator[tuple[int, dict]]:
        """(dataset position, row) of the records `todo` of `data`, in completion order; `tick()` is called often
        and may raise to stop."""
        ...

    def progress(self) -> dict:
        """The progress bar's fields (tok_s, hit, kv)."""
        ...

    def snapshot(self, run_seconds: float) -> dict | None:
        """This session's timings so far (kept in the partial, so that a killed session still counts)."""
        ...

    def finish(self, interrupted: bool, run_seconds: float) -> tuple[dict, dict]:
        """(this session's timings, extra metadata)."""
        ...

    def verify(self) -> dict | None:
        """The --verify-reuse report, or None without it."""
        ...

    def failure(self) -> str | None:
        """Why records were not run, or None (the default: an executor that stops by raising)."""
        return None

    def closing_line(self) -> str | None:
        """A line for after the summary, or None (the default)."""
        return None

    def close(self) -> None:
        """Release what the executor holds (the default: nothing)."""
