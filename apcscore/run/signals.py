"""SIGINT and SIGTERM during a run, for every command: one `Interrupted` and one handler. A signal is only noted;
`Stop.check`, called between engine steps, raises `Interrupted`, so every finished row or response is kept (exit
130). A process forked meanwhile (lm-eval's bootstrap pool) gets the handlers from before back, so that
`Pool.terminate`'s SIGTERM kills it (a handler that re-raised in the child left a CI run hanging)."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Any, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 130  # every command's exit code after SIGINT/SIGTERM (128 + SIGINT, as a shell reports it)
_handlers_before: dict[int, Any] = {}  # while a run's handlers are installed: the ones they replaced


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived during a run (raised by `Stop.check`, between engine steps)."""


class Stop:
    """The signals caught so far; `check()` raises `Interrupted` once one has arrived."""

    def __init__(self) -> None:
        self.caught: list[int] = []

    def check(self, *_: Any) -> None:
        """The tick: raise `Interrupted` if SIGINT or SIGTERM arrived (takes and ignores the engine, so that it
        can be an engine's `on_step`)."""
        if self.caught:
            raise Interrupted()


def _restore_handlers_in_child() -> None:
    for signum, previous in _handlers_before.items():
        signal.signal(signum, previous)


os.register_at_fork(after_in_child=_restore_handlers_in_child)


@contextmanager
def stop_on_signals() -> Iterator[Stop]:
    """Install the run's SIGINT/SIGTERM handlers for the block; yield its `Stop`. The handlers from before are
    put back at the end (and in a child forked meanwhile, at once)."""
    stop = Stop()
    owner = os.getpid()

    def handler(signum: int, _frame: Any) -> None:
        if os.getpid() != owner:  # a forked child that missed _restore_handlers_in_child: die as usual
            signal.signal(signum, _handlers_before.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        stop.caught.append(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    _handlers_before.update(previous)
    try:
        yield stop
    finally:
        _handlers_before.clear()
        for s, h in previous.items():
            signal.signal(s, h)
