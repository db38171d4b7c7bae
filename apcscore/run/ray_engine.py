"""`eval --ray`: lm-eval's requests on Ray replicas, behind the engine interface.

The eval runs as one process does (run/eval.evaluate: one lm-eval, one journal in --out, the same resume,
signals, results and exit codes); only its engine differs. `RayEngine` is an engine/interface.BatchEngine whose
`run` sends the requests of each lm-eval call to `--replicas` Ray actors (run/ray_replicas.ReplicaPool, the
replicas score's `--ray` runs on) and yields their outputs as chunks come back, so `ApcscoreLM` journals each
response as it arrives:
- the requests are split prefix-aware (scale/partition.assign_prompts, the split of `eval --shard`), so the
  requests that share their first KV blocks (a task's few-shot prefix, a context's choices) run on one replica
  and hit its prefix cache;
- each replica gets its requests in order, in chunks of CHUNK_REQUESTS, at most IN_FLIGHT chunks queued;
- a replica's output is bitwise the one process's (the batch-invariance contract: a request's values do not
  depend on what shares its steps), and replicas that differ in what fixes the bits (io/identity.py's EVAL view)
  are refused before any request runs. So the journal, results.json and requests.parquet are one process's,
  and a `--ray` run can be resumed without `--ray` and the other way round.

Faults: Ray restarts a dead replica and runs its chunk again (run/ray_replicas.py); a chunk that still fails ends
the run with exit 1, the finished responses kept in the journal for `--resume`. SIGINT/SIGTERM: `on_step` raises
between chunks; the chunks in hand are dropped (their replicas are stopped by `close`), the journal is kept.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from apcscore.config import EngineConfig
from apcscore.engine.counters import EngineCounters
from apcscore.engine.model_files import LoadedModel
from apcscore.engine.step import Request, RequestOutput
from apcscore.errors import ApcscoreError
from apcscore.io.identity import EVAL
from apcscore.options.commands import EvalOptions
from apcscore.run.eval_shards import RecordedEngine
from apcscore.run.ray_replicas import MAX_TASK_RETRIES, ReplicaPool, replica_run
from apcscore.scale.partition import assign_prompts

CHUNK_REQUESTS = 256  # engine requests per chunk: enough for full steps, small enough to stream and retry
IN_FLIGHT = 2  # chunks queued per replica


class EngineHost:
    """What an eval replica hosts (scale/replica.Replica): the engine alone; lm-eval's model class, in the
    driver's process, makes the requests and reads the outputs."""

    def __init__(self, command: str, opts: EvalOptions, model: LoadedModel) -> None:
        from apcscore.engine.loader import load_engine

        self.config = opts.engine
        self.engine = load_engine(model, opts.engine)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.info.max_model_len

    def metadata(self, job: None) -> dict:
        """The sections the eval identity is made of (lmeval/results.config_sections), of this replica's engine."""
        from apcscore.lmeval.results import config_sections

        return config_sections(self.engine, self.config)

    def verify(self) -> None:
        return None  # --verify-reuse is not an eval option


class RayEngine(RecordedEngine):
    """A BatchEngine over Ray replicas: the tokenizer and model facts here, the weights on the replicas (each
    described its configuration: `sections`, replica 0's). Close it (`close`) when the eval is done."""

    def __init__(self, opts: EvalOptions, model: LoadedModel) -> None:
        self.pool = ReplicaPool("eval", opts, EngineHost, view=EVAL, output="responses")
        super().__init__(model.tokenizer, self.pool.metadata(0))
        self.config: EngineConfig = opts.engine
        self.partition = opts.partition
        sections = self.sections
        self.model_backend, self.attention_backend = sections["model_backend"], sections["attention_backend"]
        self.device, self.numerics = sections["device"], sections["numerics"]
        self.batch_invariant = bool((sections["numerics"] or {}).get("batch_invariant"))
        self.assigned = [0] * len(self.pool)  # engine requests sent to each replica

    def run(self, requests: Iterable[Request], on_step: Callable[[Any], None] | None = None
            ) -> Iterator[RequestOutput]:
        """Every request's output, in completion order (chunk by chunk); `on_step(self)` while waiting."""
        requests = list(requests)
        parts = assign_prompts([r.prompt_token_ids for r in requests],
                               [len(r.prompt_token_ids) + r.max_tokens for r in requests], len(self.pool),
                               self.config.block_size, self.partition)
        queues: list[list[list[Request]]] = []
        for part in range(len(self.pool)):
            mine = [r for r, p in zip(requests, parts) if p == part]
            self.assigned[part] += len(mine)
            queues.append([mine[i:i + CHUNK_REQUESTS] for i in range(0, len(mine), CHUNK_REQUESTS)])
        return self._outputs(queues, on_step)

    def _outputs(self, queues: list[list[list[Request]]], on_step: Callable[[Any], None] | None
                 ) -> Iterator[RequestOutput]:
        def tick() -> None:  # SIGINT/SIGTERM stop here: the responses yielded so far are journaled
            if on_step is not None:
                on_step(self)

        for r, chunk, outputs in self.pool.feed("run_requests", queues, tick, IN_FLIGHT):
            if isinstance(outputs, ApcscoreError):
                raise ApcscoreError(f"--ray: a chunk of {len(chunk)} requests failed {MAX_TASK_RETRIES + 1} times on "
                                    f"replica {r} ({outputs}); the responses finished so far are kept: fix the "
                                    "cause (e.g. memory) and rerun the same command with --resume",
                                    exit_code=1) from None
            yield from outputs

    def counters(self) -> EngineCounters:
        """The replicas' counters added up."""
        stats = [s for s in self.pool.stats() if s is not None]
        return sum((s["counters"] for s in stats), EngineCounters())

    def section(self) -> dict:
        """The results metadata's `ray`: the replicas, their resources, and what each ran where."""
        per_replica = []
        for r, stats in enumerate(self.pool.stats()):
            ran = replica_run(stats, "requests") if stats is not None else {}
            per_replica.append({"replica": r, "requests_assigned": self.assigned[r], **self.pool.described(r), **ran})
        return {**self.pool.section(), "chunk_requests": CHUNK_REQUESTS, "partition": self.partition,
                "per_replica": per_replica}

    def close(self) -> None:
        self.pool.close()
