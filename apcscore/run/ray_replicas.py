"""Ray replicas: `--replicas` actors (scale/replica.Replica), each hosting an engine, fed by run/ray_engine.RayEngine:
started, described, refused when they differ in what fixes the bits, fed and stopped (faults: docs/scale-out.md).
Ray is imported here only, and only for `--ray`."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from apcscore.errors import ApcscoreError
from apcscore.io.identity import EVAL, RAY, differing
from apcscore.options.commands import ScaleOptions
from apcscore.run.metadata import add_timings
from apcscore.scale.replica import Replica

MAX_RESTARTS = 2  # times Ray restarts a replica whose process died
MAX_TASK_RETRIES = 2  # times Ray runs a chunk again after its replica died


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ApcscoreError("--ray needs Ray, which is not installed: pip install 'apcscore[ray]' "
                            "(or make install), or run without --ray") from None
    return ray


def connect(ray: Any, address: str) -> bool:
    """Join the cluster at `address` (auto | local | ray://... | host:port); True when this call started Ray."""
    if ray.is_initialized():  # this process already holds a Ray session (e.g. a test's ray.init)
        return False
    try:
        if address == "local":
            ray.init(include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise ApcscoreError(f"--ray {address}: no Ray cluster to join ({exc}) — start one (`ray start --head`), "
                            "or use --ray local to start one on this machine") from None
    return True


def replica_resources(ray: Any, opts: ScaleOptions) -> tuple[float, float]:
    """(CPUs, GPUs) of one replica: --cpus-per-replica (default 1) and --gpus-per-replica (default 1 on a
    cluster with GPUs unless --device cpu, else 0)."""
    have = ray.cluster_resources()
    gpus = opts.gpus_per_replica
    if gpus is None:
        gpus = 1 if have.get("GPU", 0) > 0 and opts.engine.device != "cpu" else 0
    cpus = opts.cpus_per_replica if opts.cpus_per_replica is not None else 1
    for name, key, need in (("GPU", "gpus", gpus), ("CPU", "cpus", cpus)):
        if need > have.get(name, 0):  # the actor would wait for them forever, without a word
            shown = ", ".join(f"{k} {v:g}" for k, v in sorted(have.items()) if k in ("CPU", "GPU")) or "none"
            cpu_hint = " (--gpus-per-replica 0 runs on the CPU)" if name == "GPU" else ""
            raise ApcscoreError(f"--{key}-per-replica {need:g}: the Ray cluster has {have.get(name, 0):g} {name}s "
                                f"in all ({shown}), so no replica could start — ask for at most "
                                f"{have.get(name, 0):g}{cpu_hint}, or join a cluster that has them (--ray ADDRESS)")
    return cpus, gpus


def ray_get(ray: Any, ref: Any) -> Any:
    """ray.get, with a replica's failure as an ApcscoreError that quotes its cause (exit 2 for a refusal, 1 for a
    fault)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ApcscoreError):
            raise ApcscoreError(f"a Ray replica refused the run: {cause}", exit_code=cause.exit_code) from None
        text = str(exc)
        at = text.rfind("ApcscoreError: ")  # raised in a replica's creation task: only its text comes back
        if at >= 0:
            raise ApcscoreError(f"a Ray replica refused the run: {text[at + 15:].strip()}") from None
        lines = [line for line in text.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else type(exc).__name__
        raise ApcscoreError(f"a Ray replica failed: {last}", exit_code=1) from None


class ReplicaPool:
    """`--replicas` Ray actors, each a `Replica(opts)`: started, described and checked to agree: on the RAY view of
    io/identity.py (they write one file), or for eval the EVAL view (their responses make one run)."""

    def __init__(self, command: str, opts: ScaleOptions) -> None:
        view, output = (EVAL, "responses") if command == "eval" else (RAY, "rows")
        ray = self.ray = import_ray()
        self.address = opts.ray
        self.started_ray = connect(ray, opts.ray)
        self.actors: list[Any] = []
        self.closed = False
        try:
            cpus, gpus = replica_resources(ray, opts)
            self.resources = {"gpus_per_replica": gpus, "cpus_per_replica": cpus}
            remote = ray.remote(Replica).options(num_cpus=cpus, num_gpus=gpus, max_restarts=MAX_RESTARTS,
                                                 max_task_retries=MAX_TASK_RETRIES)
            self.load_start = time.perf_counter()
            self.actors = [remote.remote(opts) for _ in range(int(opts.replicas))]
            self.descs = [self.get(ref) for ref in [a.describe.remote() for a in self.actors]]
            check_replicas([d["metadata"] for d in self.descs], view, output)
        except BaseException:
            self.close()  # the actors started, and the Ray this call started
            raise
        self.setup_seconds = time.perf_counter() - self.load_start

    def __len__(self) -> int:
        return len(self.actors)

    def get(self, ref: Any) -> Any:
        return ray_get(self.ray, ref)

    def feed(self, method: str, queues: list[list[list[Any]]], tick: Callable[[], None], in_flight: int
             ) -> Iterator[tuple[int, list[Any], Any]]:
        """Send replica r its chunks `queues[r]` in order to `method`, at most `in_flight` queued; yield (replica,
        chunk, result) as they come back. A chunk that still fails after Ray's retries gives its ApcscoreError as
        the result and its replica no more chunks (the unsent ones stay in `queues[r]`). tick() is called while
        waiting (it may raise to stop)."""
        pending: dict[Any, tuple[int, list[Any]]] = {}

        def submit(r: int) -> None:
            if queues[r]:
                chunk = queues[r].pop(0)
                pending[getattr(self.actors[r], method).remote(chunk)] = (r, chunk)

        for r in range(len(self.actors)):
            for _ in range(in_flight):
                submit(r)
        while pending:
            tick()
            ready, _ = self.ray.wait(list(pending), num_returns=1, timeout=0.5)
            for ref in ready:
                r, chunk = pending.pop(ref)
                try:
                    result = self.get(ref)
                except ApcscoreError as exc:
                    if exc.exit_code != 1:  # a refusal, not a fault
                        raise
                    yield r, chunk, exc  # retried MAX_TASK_RETRIES times: this replica is done
                    continue
                yield r, chunk, result
                submit(r)

    def described(self, replica: int) -> dict:
        """What a replica's own metadata says about where it ran (recorded per replica)."""
        meta = self.descs[replica]["metadata"]
        return {"device": meta.get("device"), "numerics": meta.get("numerics"), "versions": meta.get("versions"),
                "num_kv_blocks": (meta.get("engine") or {}).get("num_kv_blocks"),
                "started_pid": self.descs[replica].get("pid")}

    def section(self) -> dict:
        """The metadata's `ray` section's common part: the address, the replicas and their resources."""
        return {"address": self.address, "replicas": len(self.actors), **self.resources,
                "setup_seconds": round(self.setup_seconds, 3)}

    def close(self) -> None:
        """Stop the actors (and the Ray this pool started); once."""
        if self.closed:
            return
        self.closed = True
        for actor in self.actors:
            self.ray.kill(actor)
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False


def replica_run(stats: dict) -> dict:
    """What one replica ran (recorded per replica): its process and timings, from its latest `Replica.stats`."""
    timings = stats["counters"].to_timings(stats["load_seconds"], stats["run_seconds"])
    return {"pid": stats["pid"], "timings": add_timings(None, timings)}


def check_replicas(metas: list[dict], view: str = RAY, output: str = "rows") -> None:
    """Refuse replicas that would make one output of several configurations (other hardware, numerics,
    versions)."""
    for r, meta in enumerate(metas[1:], start=1):
        diff = differing(metas[0], meta, view)
        if diff:
            raise ApcscoreError(f"--ray: replica {r} does not run the configuration of replica 0 ("
                                f"{'; '.join(diff)}), so their {output} would differ in bits; run the replicas on "
                                "one kind of machine and software (e.g. a Ray resource or node label per kind)")
