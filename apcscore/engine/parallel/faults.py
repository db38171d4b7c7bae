"""How a failure on one tensor-parallel rank reaches rank 0 (issue 42 item 9; docs/decisions.md, "Tensor
parallelism", signals and faults).

A failing worker leaves `rank R failed: Type: message` in the group's store (`report_failure`) and ends; rank 0's
error (`RanksFailed`) names it (`failure_note`), not the transport's "connection reset". gloo's collective raises as
soon as the peer's socket closes; NCCL's would wait for the peer until the collective timeout (30 minutes), so on
NCCL rank 0 runs a `FailureWatch` that aborts the process group when a worker failed or ended.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

FAILED_KEY = "apcscore/tp-failed"


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def report_failure(rank: int, error: BaseException) -> None:
    """A worker's last word: its failure, in the group's store for rank 0 to read (best effort)."""
    lines = str(error).strip().splitlines()
    try:
        _store().set(FAILED_KEY, f"rank {rank} failed: {type(error).__name__}: {lines[0][:300] if lines else ''}")
    except Exception:  # noqa: BLE001 (the store may be gone too: the transport's error is then all rank 0 sees)
        pass


def failure_note() -> str | None:
    """What a failed worker left in the store, or None."""
    try:
        store = _store()
        return store.get(FAILED_KEY).decode("utf-8", "replace") if store.check([FAILED_KEY]) else None
    except Exception:  # noqa: BLE001 (no group, or its store is gone)
        return None


def abort_group() -> None:
    """Abort this process's NCCL communicators: the collectives in progress return an error."""
    from torch.distributed import distributed_c10d

    distributed_c10d._abort_process_group()


class FailureWatch:
    """Rank 0's watch over its workers (NCCL): every `poll` seconds, a failure note (`note`) or a spawned worker
    that ended calls `abort` once; `stop` ends the watch."""

    def __init__(self, processes: list[Any], note: Callable[[], str | None] = failure_note,
                 abort: Callable[[], None] = abort_group, poll: float = 0.5) -> None:
        self.processes, self.note, self.abort, self.poll = processes, note, abort, poll
        self._stop = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="apcscore-tp-failure-watch", daemon=True)

    def start(self) -> "FailureWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            if self.note() is not None or not all(p.is_alive() for p in self.processes):
                self.fired = True
                try:
                    self.abort()
                except Exception:  # noqa: BLE001 (then the collective's own timeout ends the wait)
                    pass
                return
