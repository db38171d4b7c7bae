"""`--ray`: the one Ray engine, an engine/interface.BatchEngine whose requests run on `--replicas` actors
(run/ray_replicas.ReplicaPool), for score / generate / perplexity and eval alike: the requests split prefix-aware
(a record's requests one group), fed in chunks, a chunk that fails after Ray's retries aborted with its replica's
later ones (run/runner.ABORTED). How and why (plain actors, not Ray Data): docs/scale-out.md."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch

from apcscore.engine.counters import EngineCounters
from apcscore.models.loaded import LoadedModel
from apcscore.engine.step import Request, RequestOutput
from apcscore.errors import ApcscoreError
from apcscore.options.commands import ScaleOptions
from apcscore.run.ray_replicas import MAX_TASK_RETRIES, ReplicaPool, replica_run
from apcscore.run.runner import ABORTED
from apcscore.scale.partition import assign_prompts

IN_FLIGHT = 2  # chunks queued per replica


def group_of(request: Request) -> Any:
    """The group a request runs with: its record for an id `(record, j)`, else itself."""
    rid = request.request_id
    return rid[0] if isinstance(rid, tuple) else rid


class RayEngine:
    """A BatchEngine over Ray replicas: the tokenizer here, the weights on the replicas, the model facts and the
    metadata sections replica 0's (`info`, `sections`: engine/provenance.describe). `close` it when done."""

    def __init__(self, command: str, opts: ScaleOptions, model: LoadedModel) -> None:
        self.pool = ReplicaPool(command, opts)  # started, described, checked to agree
        first = self.pool.descs[0]
        self.sections, self.info = first["metadata"], first["info"]
        self.tokenizer, self.config, self.partition = model.tokenizer, opts.engine, opts.partition
        self.model_backend, self.attention_backend = self.sections["model_backend"], self.sections["attention_backend"]
        self.device, self.dtype = torch.device(self.sections["device"]), getattr(torch, self.sections["dtype"])
        self.numerics = self.sections["numerics"]
        self.batch_invariant = bool((self.numerics or {}).get("batch_invariant"))
        # a group is an eval request (small: a step wants many) or a record's requests
        self.unit, self.chunk = ("requests", 256) if command == "eval" else ("records", 64)
        n = len(self.pool)
        self.assigned, self.ran, self.loads = [0] * n, [0] * n, [0] * n  # groups sent, groups back, their load
        self.stats: list[dict | None] = [None] * n  # each replica's latest Replica.stats (with its last chunk)
        self.failed: set[int] = set()  # replicas whose chunk failed after Ray's retries

    def run(self, requests: Iterable[Request], on_step: Callable[[Any], None] | None = None
            ) -> Iterator[RequestOutput]:
        """Every request's output, in completion order (chunk by chunk); `on_step(self)` while waiting."""
        return self._outputs(self._queues(requests), on_step)

    def run_recomputed(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """`run` by full recompute on the replicas (the reference of --verify-reuse)."""
        return self._outputs(self._queues(requests), None, "run_recomputed")

    def _queues(self, requests: Iterable[Request]) -> list[list[list[Request]]]:
        """Each replica's chunks: the groups of `requests` split prefix-aware, in order, `chunk` groups a chunk."""
        groups: dict[Any, list[Request]] = {}
        for request in requests:
            groups.setdefault(group_of(request), []).append(request)
        grouped = list(groups.values())
        loads = [sum(len(r.prompt_token_ids) + r.max_tokens for r in g) for g in grouped]
        parts = assign_prompts([g[0].prompt_token_ids for g in grouped], loads, len(self.pool),
                               self.config.block_size, self.partition)
        queues = []
        for part in range(len(self.pool)):
            mine = [g for g, p in zip(grouped, parts) if p == part]
            self.assigned[part] += len(mine)
            self.loads[part] += sum(load for load, p in zip(loads, parts) if p == part)
            queues.append([[r for g in mine[i:i + self.chunk] for r in g] for i in range(0, len(mine), self.chunk)])
        return queues

    def _outputs(self, queues: list[list[list[Request]]], on_step: Callable[[Any], None] | None,
                 method: str = "run_requests") -> Iterator[RequestOutput]:
        def tick() -> None:  # SIGINT/SIGTERM stop here: the outputs yielded so far are kept
            if on_step is not None:
                on_step(self)

        for r, chunk, result in self.pool.feed(method, queues, tick, IN_FLIGHT):
            if isinstance(result, ApcscoreError):  # this replica is done; its other chunks are not run
                self.failed.add(r)
                yield from aborted(chunk, f"--ray: a chunk of {len(chunk)} requests failed {MAX_TASK_RETRIES + 1} "
                                          f"times on replica {r} ({result})")
                for later in queues[r]:
                    yield from aborted(later, f"--ray: not run, as replica {r} failed before")
                queues[r] = []
                continue
            outputs, self.stats[r] = result
            self.ran[r] += len({group_of(req) for req in chunk})
            yield from outputs

    def counters(self) -> EngineCounters:
        """The replicas' counters added up (each replica's as of its last chunk)."""
        return sum((s["counters"] for s in self.stats if s is not None), EngineCounters())

    def section(self) -> dict:
        """The metadata's `ray`: the replicas, their resources, and what each was sent and ran, where."""
        per_replica = [{"replica": r, f"{self.unit}_assigned": self.assigned[r], f"{self.unit}_run": self.ran[r],
                        "load_assigned": self.loads[r], **self.pool.described(r),
                        **({"stats": "failed"} if r in self.failed else replica_run(s) if s is not None else
                           {"stats": "not available (no chunk came back)"})}
                       for r, s in enumerate(self.stats)]
        return {**self.pool.section(), f"chunk_{self.unit}": self.chunk, "partition": self.partition,
                "per_replica": per_replica}

    def close(self) -> None:
        self.pool.close()


def aborted(requests: list[Request], why: str) -> Iterator[RequestOutput]:
    """The outputs of requests that were not run."""
    return (RequestOutput(r.request_id, r.prompt_token_ids, finish_reason=ABORTED, error=why) for r in requests)
