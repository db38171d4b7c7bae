"""The local executor: one engine in this process runs the records (the run without `--ray`); the interface it
implements is run/executor.Executor."""

from __future__ import annotations

import time
import warnings
from typing import Callable, Iterator

from apcscore.engine.model_files import LoadedModel
from apcscore.io.reader import LoadedDataset
from apcscore.io.schemas import Record
from apcscore.jobs.base import Job
from apcscore.run.executor import Executor
from apcscore.run.metadata import run_metadata
from apcscore.options.commands import RunOptions
from apcscore.run.runner import run_records


class LocalExecutor(Executor):
    """One engine, built around the already located and checked model (`engine/model_files.LoadedModel`)."""

    def __init__(self, command: str, opts: RunOptions, model: LoadedModel) -> None:
        from apcscore.engine.loader import load_engine
        from apcscore.engine.hf_engine import NO_CACHE_WARNING

        self.command, self.opts = command, opts
        cfg = opts.engine
        started = time.perf_counter()
        with warnings.catch_warnings():  # the probe's warning is printed by the driver, as one line
            warnings.filterwarnings("ignore", message="the start-up probe")
            self.engine = load_engine(model, cfg, reference=getattr(opts, "reference_model", None))
        self.load_seconds = time.perf_counter() - started
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.info.max_model_len
        engine = self.engine
        native = engine.model_backend == "native"
        self.warnings: list[tuple[str, bool]] = [(w, True) for w in model.files.warnings]  # GGUF reading left out
        if not native:
            self.warnings.append((NO_CACHE_WARNING, True))
        if cfg.batch_invariant and not engine.batch_invariant and native:
            # (--exact-reuse, which --verify-reuse needs, was refused by the engine)
            self.warnings.append((f"{engine.numerics['reason']}: a record's scores may depend on what shares its "
                                  "steps (metadata numerics.batch_invariant = false)", True))
        if cfg.max_model_len and cfg.max_model_len > self.max_model_len and not engine.info.sliding_window:
            self.warnings.append((f"--max-model-len {cfg.max_model_len} is above the model's context length: the "
                                  f"context stays {self.max_model_len} tokens (longer prompts are refused or "
                                  "truncated)", False))
        if engine.info.sliding_window:
            self.warnings.append((f"the model's sliding attention window is not implemented: the context is capped "
                                  f"at its {engine.info.sliding_window} tokens (longer prompts are refused or "
                                  "truncated)", False))
        self.verifier = None
        if opts.verify_reuse:
            from apcscore.run.verify import ReuseVerifier

            self.verifier = ReuseVerifier(opts.verify_reuse, cfg.seed)

    def metadata(self, job: Job) -> dict:
        return run_metadata(self.command, self.engine, job, self.opts)

    def rows(self, job: Job, data: LoadedDataset, todo: list[Record],
             tick: Callable[[], None]) -> Iterator[tuple[int, dict]]:
        return run_records(job, self.engine, todo, tick, self.verifier)

    def progress(self) -> dict:
        counters = self.engine.counters()
        return {"tok_s": counters.tokens_per_second, "hit": counters.hit_rate,
                "kv": f"{counters.used_kv_blocks}/{counters.num_kv_blocks}"}

    def finish(self, interrupted: bool, run_seconds: float) -> tuple[dict, dict]:
        return self.engine.counters().to_timings(self.load_seconds, run_seconds), {}

    def snapshot(self, run_seconds: float) -> dict | None:
        """This session's timings so far (kept in the partial, so that a killed session still counts)."""
        return self.engine.counters().to_timings(self.load_seconds, run_seconds)

    def verify(self) -> dict | None:
        return self.verifier.check(self.engine) if self.verifier is not None else None
