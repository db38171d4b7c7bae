"""Progress of a run (score / generate / perplexity): Rich's bar on a terminal; in a log (stderr not a terminal)
plain lines with the ETA, at most one per `MIN_SECONDS`, at least one per `MAX_SECONDS`, one per `STEP` of the
records in between, one at the end when any was printed; nothing with `--quiet`. `make_progress` picks one."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

MIN_SECONDS = 10.0  # plain lines: never closer than this
MAX_SECONDS = 60.0  # never further apart than this
STEP = 0.05  # a line when this share of the records is done since the last one (and MIN_SECONDS passed)

_FIELDS = "{task.fields[tok_s]:,.0f} tok/s  prefix hit {task.fields[hit]:.0%}  KV {task.fields[kv]}"


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))


class PlainProgress:
    """Progress as plain periodic lines, for output that is not a terminal (one task)."""

    def __init__(self, console: Console, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console
        self.clock = clock
        self.description = ""
        self.total = 0
        self.done = 0
        self.fields: dict[str, Any] = {}
        self.started = self.last_time = 0.0
        self.last_done = 0
        self.lines = 0  # printed so far

    def add_task(self, description: str, total: int, **fields: Any) -> int:
        self.description, self.total, self.fields = description, total, dict(fields)
        self.started = self.last_time = self.clock()
        return 0

    def update(self, task: int, advance: int = 0, **fields: Any) -> None:
        self.done += advance
        self.fields.update(fields)
        now = self.clock()
        since = now - self.last_time
        stepped = self.done - self.last_done >= max(1.0, STEP * self.total)
        if since >= MAX_SECONDS or (since >= MIN_SECONDS and stepped):
            self._line(now)

    def _line(self, now: float) -> None:
        """Print the progress line as of `now`."""
        elapsed = now - self.started
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        left = self.total - self.done
        eta = _clock(elapsed / self.done * left) if self.done and left > 0 else "0:00:00" if not left else "-"
        f = self.fields
        line = (f"{self.description}: {self.done:,}/{self.total:,} records{share}, {_clock(elapsed)} elapsed, "
                f"ETA {eta}, {f.get('tok_s', 0.0):,.0f} tok/s, prefix hit {f.get('hit', 0.0):.0%}, "
                f"KV {f.get('kv', '-')}")
        self.console.print(escape(line), highlight=False, soft_wrap=True)
        self.last_time, self.last_done = now, self.done
        self.lines += 1

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        # where it ended, when a line was printed before (a run shorter than MIN_SECONDS prints none: its
        # summary follows)
        if exc[0] is None and self.lines and self.done != self.last_done:
            self._line(self.clock())


def make_progress(console: Console, quiet: bool) -> Progress | PlainProgress:
    """Rich's bar with an ETA on a terminal, plain periodic lines elsewhere, nothing (a disabled bar) when quiet."""
    if not quiet and not console.is_terminal:
        return PlainProgress(console)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), TextColumn(_FIELDS), console=console, disable=quiet,
                    transient=False)
