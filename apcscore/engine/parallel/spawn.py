"""How apcscore starts the ranks of a tensor-parallel group itself (without torchrun): spawned workers, their
signals and their lifetime (the reasons: docs/decisions.md, "Tensor parallelism", signals and faults).

- **Signals.** The workers ignore SIGINT and SIGTERM from their first line: rank 0 alone decides what a stop means
  (it finishes the step, keeps the finished rows, then tells them to exit).
- **Lifetime.** A worker whose rank 0 is gone exits by itself within a second (`watch_parent`).
- **Loopback.** Spawned ranks are all local, so gloo talks over the loopback interface (`on_loopback`); a
  GLOO_SOCKET_IFNAME the user set wins.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch

from apcscore.errors import ApcscoreError

PARENT_POLL_SECONDS = 1.0
START_TIMEOUT = 300.0  # seconds for a spawned rank to reach apcscore's code (a new Python importing torch)


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM do nothing in this process (a worker: rank 0 stops the group)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def watch_parent(parent: int) -> None:
    """End this process (exit code 1, no cleanup: its collectives may be stuck) once its parent is no longer
    `parent`, checked every PARENT_POLL_SECONDS by a daemon thread."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="apcscore-watch-rank-0", daemon=True).start()


def loopback_interface() -> str | None:
    """The loopback interface's name (lo on Linux, lo0 on macOS), or None where there is none to name."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


@contextmanager
def on_loopback(backend: str) -> Iterator[None]:
    """GLOO_SOCKET_IFNAME = the loopback interface while the ranks start and join (the workers inherit it when
    they are spawned), unless the user set it or the backend is not gloo; then the environment is as before."""
    name = loopback_interface() if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ else None
    if name is None:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def spawn_workers(world_size: int, init: str, backend: str, threads: int, timeout: timedelta) -> list[Any]:
    """Start ranks 1..world_size-1 (spawn) for the rendezvous `init`, and wait until each runs apcscore's code."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(1, world_size)]
    processes = []
    for rank in range(1, world_size):
        proc = ctx.Process(target=worker_main, args=(rank, world_size, init, backend, threads, ready[rank - 1],
                                                     timeout, os.getpid()), daemon=True)
        proc.start()
        processes.append(proc)
    wait_ready(processes, ready)
    return processes


def wait_ready(processes: list[Any], ready: list[Any], timeout: float | None = None) -> None:
    """Wait until every spawned rank runs apcscore's code, at most `timeout` seconds (START_TIMEOUT); a rank that
    ends first is refused with the likely cause (rather than a rendezvous that waits for it until the timeout)."""
    limit = START_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + limit
    while not all(event.is_set() for event in ready):
        for rank, proc in enumerate(processes, 1):
            if not proc.is_alive() and not ready[rank - 1].is_set():
                for other in processes:
                    other.kill()
                raise ApcscoreError(
                    f"tensor-parallel rank {rank} ended while starting (exit code {proc.exitcode}). The ranks are "
                    "new Python processes (spawn) that import the main module first: a script that builds an "
                    "engine must do so under `if __name__ == \"__main__\":`", exit_code=1)
        if time.monotonic() > deadline:
            late = [rank for rank, event in enumerate(ready, 1) if not event.is_set()]
            for other in processes:
                other.kill()
            raise ApcscoreError(
                f"tensor-parallel rank {late[0]} did not start within {limit:g} s (a new Python process that imports "
                "torch and apcscore; a machine short of memory or CPU slows that down) — rerun when the machine is "
                "less loaded, or with a lower --tensor-parallel", exit_code=1)
        time.sleep(0.02)


def worker_main(rank: int, world_size: int, init: str, backend: str, threads: int, ready: Any,
                timeout: timedelta, parent: int) -> None:
    """A spawned worker: join the group, then serve rank 0 (engine/parallel.runner.serve) until it says shutdown."""
    import torch.distributed as dist

    from apcscore.engine.parallel.runner import serve
    from apcscore.models.tensor_parallel import TensorParallel

    ignore_stop_signals()
    watch_parent(parent)
    ready.set()  # (the main module and apcscore are imported: rank 0 may rendezvous now)
    torch.set_num_threads(threads)  # the ranks share the machine's cores (the thread count does not change bits)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size, timeout=timeout)
    try:
        serve(TensorParallel(rank, world_size))
    finally:
        dist.destroy_process_group()
