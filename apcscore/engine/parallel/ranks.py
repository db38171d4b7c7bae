"""The ranks of a tensor-parallel engine (`EngineConfig.tensor_parallel_size` N > 1) on torch.distributed.

Rank 0 is the process that builds the `Engine`: its scheduler, block manager and score store run there only. It
broadcasts each call (`RankGroup.call`: an operation and its arguments, e.g. a step's StepInputs) to the other
ranks, which hold their slice of the model and a KV cache of their heads and run the same call in step
(engine/parallel/runner.py); only rank 0 keeps outputs. Rank 0 spawns the others (engine/parallel/spawn.py), or
torchrun starts every rank and the others become workers at the engine (`serve_if_worker`). One process keeps its
group for later engines (each engine's slices are keyed on the workers). The design: docs/decisions.md, "Tensor
parallelism".
"""

from __future__ import annotations

import atexit
import os
import tempfile
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from apcscore.errors import ApcscoreError
from apcscore.engine.parallel.faults import FailureWatch, failure_note
from apcscore.engine.parallel.runner import serve, torchrun_env
from apcscore.engine.parallel.spawn import on_loopback, spawn_workers
from apcscore.models.tensor_parallel import RanksFailed, TensorParallel

TIMEOUT = timedelta(minutes=30)  # of one collective: a step of a large model on the CPU can be long


def check_devices(world_size: int, device: torch.device) -> None:
    """Refuse more ranks than CUDA devices (one GPU per rank), before anything is loaded."""
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ApcscoreError(f"--tensor-parallel {world_size} needs {world_size} CUDA devices (one per rank), and "
                            f"{torch.cuda.device_count()} are visible; lower --tensor-parallel or make more visible")


@dataclass
class RankGroup:
    """Rank 0's handle on the ranks: `call` runs an operation on every worker (rank 0 then runs its own part)."""

    tp: TensorParallel
    backend: str
    processes: list[Any] = field(default_factory=list)  # the workers apcscore spawned (none under torchrun)
    dropped: list[int] = field(default_factory=list)  # engines collected since the last call (keys to free)
    next_key: int = 1
    # False once a call on rank 0 failed half-way: the workers may be waiting in a collective rank 0 left, so
    # shutdown ends them instead of broadcasting (which would wait for them until the timeout)
    in_sync: bool = True
    threads_before: int | None = None  # rank 0's torch threads before it took its share (restored at shutdown)
    watch: FailureWatch | None = None  # NCCL: aborts the group when a worker fails (engine/parallel/faults.py)

    def new_key(self) -> int:
        """A key for one engine's slices on the workers; `register` frees them when rank 0's engine goes."""
        key, self.next_key = self.next_key, self.next_key + 1
        return key

    def register(self, owner: Any, key: int) -> None:
        """Free the workers' slices of `key` once `owner` (rank 0's engine) is garbage collected. The drop
        travels with the next call: a finalizer may run between two collectives, where a broadcast would
        desynchronise the ranks."""
        weakref.finalize(owner, self.dropped.append, key)

    def call(self, key: int, op: str, *args: Any) -> None:
        """Broadcast `op(*args)` for engine `key` to the workers (which run it now); rank 0 runs its part next."""
        import torch.distributed as dist

        drops, self.dropped[:] = list(self.dropped), []
        self.check_alive()
        try:
            dist.broadcast_object_list([(key, op, args, drops)], src=0)
        except RuntimeError as e:
            self.in_sync = False
            raise RanksFailed(failure_note() or e) from e

    def check_alive(self) -> None:
        """Refuse to go on when a spawned rank has ended (RanksFailed)."""
        dead = [(r, p) for r, p in enumerate(self.processes, 1) if not p.is_alive()]
        if dead:
            rank, proc = dead[0]
            raise RanksFailed(f"rank {rank}, process {proc.pid}, exited with code {proc.exitcode}")

    def shutdown(self) -> None:
        """Tell the workers to exit, wait for them, and leave the process group."""
        import torch.distributed as dist

        global _GROUP
        _GROUP = None
        if self.watch is not None:
            self.watch.stop()
        try:
            if self.in_sync and all(p.is_alive() for p in self.processes):
                dist.broadcast_object_list([(0, "shutdown", (), [])], src=0)
            else:  # (SIGKILL: the workers ignore SIGTERM, engine/parallel/spawn.py)
                for p in self.processes:
                    p.kill()
        except RuntimeError:  # a rank already gone: nothing to tell it
            pass
        finally:
            for p in self.processes:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except RuntimeError:  # (a group the watch aborted)
                pass
            if self.threads_before is not None:
                torch.set_num_threads(self.threads_before)


_GROUP: RankGroup | None = None
_EXIT_HOOK: list[bool] = []  # the atexit hook is registered once per process


def rank_group(world_size: int, device: torch.device) -> RankGroup:
    """This process's group of `world_size` ranks (started now if needed; this process is rank 0)."""
    import torch.distributed as dist

    global _GROUP
    if _GROUP is not None and (not _GROUP.in_sync or not all(p.is_alive() for p in _GROUP.processes)):
        _GROUP.shutdown()  # a rank died, or a call failed half-way (the run that saw it failed): start afresh
    if _GROUP is not None:
        if _GROUP.tp.world_size != world_size:
            raise ApcscoreError(f"this process already drives {_GROUP.tp.world_size} tensor-parallel ranks; one "
                                f"process runs one degree at a time, not --tensor-parallel {world_size} too")
        return _GROUP  # (every rank alive: checked above)
    backend = "nccl" if device.type == "cuda" else "gloo"
    env = torchrun_env()
    processes: list[Any] = []
    threads_before = None
    if env is not None:
        if env[1] != world_size:
            raise ApcscoreError(f"the launcher started {env[1]} ranks (WORLD_SIZE) but --tensor-parallel is "
                                f"{world_size}; make them equal")
        join_launched_group(backend, env[0])
    else:
        rendezvous = tempfile.NamedTemporaryFile(prefix="apcscore-tp-", delete=False)
        rendezvous.close()
        os.unlink(rendezvous.name)  # the file store creates it
        init = f"file://{rendezvous.name}"
        threads_before = torch.get_num_threads()
        threads = max(1, threads_before // world_size)
        with on_loopback(backend):  # (all the ranks are local)
            processes = spawn_workers(world_size, init, backend, threads, TIMEOUT)
            dist.init_process_group(backend, init_method=init, rank=0, world_size=world_size, timeout=TIMEOUT)
        torch.set_num_threads(threads)  # rank 0 takes its share of the cores too (threads do not change bits)
    if not _EXIT_HOOK:
        atexit.register(shutdown_ranks)
        _EXIT_HOOK.append(True)
    _GROUP = RankGroup(TensorParallel(0, world_size), backend, processes, threads_before=threads_before,
                       watch=FailureWatch(processes).start() if backend == "nccl" else None)
    return _GROUP


def current_group() -> RankGroup | None:
    """This process's ranks, if started."""
    return _GROUP


def shutdown_ranks() -> None:
    """Stop this process's ranks, if any (also at exit); a later tensor-parallel engine starts new ones."""
    if _GROUP is not None:
        _GROUP.shutdown()


def join_launched_group(backend: str, rank: int) -> None:
    """Join the group a launcher (torchrun) started. On NCCL this process's GPU becomes cuda:LOCAL_RANK first:
    the collectives (the first broadcast included) run on the current device, which is otherwise cuda:0 on
    every rank."""
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=TIMEOUT)


def serve_if_worker(device: torch.device) -> None:
    """Under torchrun, a rank other than 0 serves rank 0 here and then exits the process (SystemExit 0): the
    command's own work (options, dataset, output) is rank 0's."""
    env = torchrun_env()
    if env is None or env[0] == 0:
        return
    join_launched_group("nccl" if device.type == "cuda" else "gloo", env[0])
    serve(TensorParallel(env[0], env[1]))
    raise SystemExit(0)
