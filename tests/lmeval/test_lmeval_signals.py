"""The run's SIGINT/SIGTERM handlers (run/signals.py, every command's, eval's too) and forked children (lm-eval's
bootstrap pool forks workers).

A worker forked while the run's handlers are installed must die of `Pool.terminate`'s SIGTERM, even while it
waits on a lock (where the pool's workers sit when it terminates them); the run itself must still stop after
the current step (its tick raises). No model is loaded.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from apcscore.run.signals import Interrupted, stop_on_signals


def _report_and_wait(conn, lock) -> None:
    conn.send((signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
               signal.getsignal(signal.SIGINT) is signal.default_int_handler))
    with lock:  # held by the parent: blocks, like a pool worker waiting for the queue's lock
        pass


@pytest.fixture
def plain_handlers():
    """The handlers of a fresh Python process while the test runs (Ray's driver, for one, installs a SIGTERM
    handler that exits with status 15: it would be the child's "handler from before" after a Ray test)."""
    saved = {signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL),
             signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_a_forked_worker_dies_of_sigterm_and_the_eval_stops_after_its_step(plain_handlers) -> None:
    ctx = multiprocessing.get_context("fork")
    lock = ctx.Lock()
    lock.acquire()
    parent, child = ctx.Pipe()
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals() as check_stop:
        worker = ctx.Process(target=_report_and_wait, args=(child, lock))
        worker.start()
        try:
            assert parent.poll(30), "the worker did not start"
            restored = parent.recv()
            worker.terminate()  # what Pool.terminate does
            worker.join(10)
            assert not worker.is_alive() and worker.exitcode == -signal.SIGTERM, "SIGTERM did not end the worker"
            assert restored == (True, True)  # it ran with the handlers from before the eval, not the eval's
        finally:
            if worker.is_alive():
                worker.kill()
            lock.release()
        check_stop()  # no signal yet: the run goes on
        os.kill(os.getpid(), signal.SIGTERM)  # the run's own process: stops after the current step
        with pytest.raises(Interrupted):
            check_stop()
    assert signal.getsignal(signal.SIGTERM) == before
