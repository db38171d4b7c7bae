"""SIGINT and SIGTERM during a run, for every command: one `Interrupted` and one handler. A signal is only noted;
the run's check (what `stop_on_signals` yields), called between engine steps, raises `Interrupted`, so every
finished row or response is kept (exit 130). A process forked meanwhile (lm-eval's bootstrap pool) gets the
handlers from before back, so that `Pool.terminate`'s SIGTERM kills it (a handler that re-raised in the child
left a CI run hanging)."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Any, Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 130  # every command's exit code after SIGINT/SIGTERM (128 + SIGINT, as a shell reports it)
_handlers_before: dict[int, Any] = {}  # while a run's handlers are installed: the ones they replaced


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived during a run (raised by the run's check, between engine steps)."""


def _restore_handlers_in_child() -> None:
    for signum, previous in _handlers_before.items():
        signal.signal(signum, previous)


os.register_at_fork(after_in_child=_restore_handlers_in_child)


@contextmanager
def stop_on_signals() -> Iterator[Callable[..., None]]:
    """Install the run's SIGINT/SIGTERM handlers for the block; yield its check, which raises `Interrupted` once
    one has arrived (it takes and ignores any arguments, so that it can be an engine's `on_step`). The handlers
    from before are put back at the end (and in a child forked meanwhile, at once)."""
    caught: list[int] = []
    owner = os.getpid()

    def handler(signum: int, _frame: Any) -> None:
        if os.getpid() != owner:  # a forked child that missed _restore_handlers_in_child: die as usual
            signal.signal(signum, _handlers_before.get(signum, signal.SIG_DFL))
            os.kill(os.getpid(), signum)
            return
        caught.append(signum)

    def check(*_: Any) -> None:
        if caught:
            raise Interrupted()

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    _handlers_before.update(previous)
    try:
        yield check
    finally:
        _handlers_before.clear()
        for s, h in previous.items():
            signal.signal(s, h)
