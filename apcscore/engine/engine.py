"""The batch engine, which only runs (engine/loader.py builds it): requests in, one output per request out, in
completion order; each step reads add -> schedule -> execute -> postprocess (docs/architecture.md, "The engine step").
A request's own problem (too long, too big for the KV pool, bad values) is an output with `error` set.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator

from apcscore.config import EngineConfig
from apcscore.engine.counters import EngineCounters
from apcscore.engine.detokenizer import IncrementalDetokenizer
from apcscore.engine.model_runner import ModelRunner
from apcscore.engine.scheduler import Scheduler
from apcscore.engine.step import (Request, RequestOutput, ScheduledBatch, Sequence, TokenLogprobs,
                                  request_problem)
from apcscore.engine.stopping import stop_string_cut, stop_tokens
from apcscore.models.llama import LlamaDecoder
from apcscore.models.loaded import LoadedModel
from apcscore.models.loading import eos_token_ids
from apcscore.models.ops import Ops


class Engine:
    """One model, one KV pool, one scheduler: the native engine. Build it with engine/loader.py (`load_engine`,
    or `load_native_engine` / `native_engine_from_parts` to have the native engine whatever --model-backend says).
    """

    model_backend = "native"

    def __init__(self, model: LlamaDecoder, config: EngineConfig, info: LoadedModel, ops: Ops, numerics: dict,
                 scheduler: Scheduler, runner: ModelRunner) -> None:
        """info: the model it runs, its facts filled in (engine/loader.native_engine); numerics: the start-up
        probe's run metadata section (engine/gemm_probe.probe_numerics); runner: the model runner (under tensor
        parallelism rank 0's SliceRunner), with the KV pool of the scheduler's block manager."""
        self.model = model
        self.tokenizer = info.tokenizer
        self.config = config
        self.info = info
        self.ops = ops
        self.attention_backend = ops.name  # "torch" | "triton", as the run metadata records it
        self.numerics = numerics
        self.batch_invariant = numerics["batch_invariant"]
        self.scheduler = scheduler
        self.block_manager = scheduler.bm
        self.store = scheduler.store  # exact reuse's score store, or None
        self.runner = runner
        self.device, self.dtype = runner.device, runner.dtype
        self.eos_token_ids = eos_token_ids(model.config, self.tokenizer)
        self.long_rope_after = model.long_rope_after  # long-rope: longer sequences use the long frequencies
        self.stats = self.block_manager.stats  # one tally: the engine's counts and its prefix cache's
        self._arrivals = 0
        self._current_run: object | None = None  # the token of the run() whose sequences are in the scheduler

    def counters(self) -> EngineCounters:
        """This engine's counters since it was built: its stats, its prefix cache's and its KV pool's."""
        bm = self.block_manager
        return EngineCounters.of(self.stats, bm.num_used_blocks, bm.num_blocks)

    # ---- running -------------------------------------------------------------------------------
    def run(self, requests: Iterable[Request], on_step: Callable[["Engine"], None] | None = None
            ) -> Iterator[RequestOutput]:
        """Run every request; yield one RequestOutput per request, in completion order.

        One run at a time: a run left before its end (an exception in the consumer's loop, Ctrl-C, `on_step`
        raising, `close()`, the generator dropped) frees every sequence it left once its generator closes, and a
        new run frees what an earlier one not closed yet left (that generator then raises if resumed)."""
        self._abandon_run()  # an earlier run whose generator was neither exhausted nor closed (yet)
        token = self._current_run = object()
        pending = iter(requests)
        started = time.perf_counter()
        try:
            while True:
                for out in self._add(pending):  # refused requests come back at once, as error outputs
                    yield out
                    self._check_current(token)
                if not self.scheduler.has_work:  # (_add leaves work to do unless the requests are exhausted)
                    return
                batch = self.scheduler.schedule()  # (it counts its preemptions into self.stats)
                if not batch:
                    raise RuntimeError("scheduler made no progress: this is a bug, please report it")
                sampled = self.runner.execute(batch)
                for out in self._postprocess(batch, sampled):
                    yield out
                    self._check_current(token)
                self.stats.steps += 1
                self.stats.seconds = time.perf_counter() - started
                if on_step is not None:
                    on_step(self)
        finally:
            self.stats.seconds = time.perf_counter() - started
            if self._current_run is token:  # (else a later run owns the scheduler now)
                self._abandon_run()

    def run_recomputed(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """`run` with exact reuse off while these requests run: every scored position computed by a full prefill
        (--verify-reuse's reference); the setting is restored when the outputs are exhausted or dropped."""
        saved, self.scheduler.exact_reuse = self.scheduler.exact_reuse, False
        try:
            yield from self.run(requests)
        finally:
            self.scheduler.exact_reuse = saved

    # ---- add -----------------------------------------------------------------------------------
    def _add(self, pending: Iterator[Request]) -> Iterator[RequestOutput]:
        """Queue requests until the look-ahead (4 x --max-num-seqs) waits or `pending` is exhausted; yield an
        error output for each request that cannot run."""
        while len(self.scheduler.waiting) < 4 * self.config.max_num_seqs:
            request = next(pending, None)  # (an exhausted iterator stays exhausted)
            if request is None:
                return
            problem = self._check(request)
            if problem:
                self.stats.errors += 1
                yield RequestOutput(request.request_id, list(request.prompt_token_ids), finish_reason="error",
                                    error=problem)
                continue
            self.scheduler.add(Sequence(request, self._arrivals, self.long_rope_after))
            self._arrivals += 1

    def _check(self, request: Request) -> str | None:
        """Why this request cannot run, or None."""
        problem = request_problem(request, self.info.max_model_len, self.info.vocab_size, self.config.max_logprobs)
        if problem:
            return problem
        n, max_len = len(request.prompt_token_ids), self.info.max_model_len
        need = self.block_manager.blocks_needed(min(n + request.max_tokens, max_len))
        if need > self.block_manager.num_blocks:
            return (f"the request needs {need} KV blocks, more than the whole pool of "
                    f"{self.block_manager.num_blocks}; raise --num-kv-blocks or shorten the request")
        return None

    # ---- postprocess ---------------------------------------------------------------------------
    def _postprocess(self, batch: ScheduledBatch,
                     sampled_tokens: list[tuple[Sequence, int, TokenLogprobs | None]]) -> list[RequestOutput]:
        """Account a step's results (its scores are on its sequences, its sampled tokens given); the outputs of the
        requests it finished, every one retired before any is seen."""
        finished: list[RequestOutput] = []
        self.scheduler.finish_step(batch)
        for seq, n in batch:
            if seq.block_hidden is not None:  # after finish_step: the completed blocks are in the cache now
                self.store.publish(seq, seq.block_hidden, self.block_manager.cached, self.block_manager.block_size)
                seq.block_hidden = None
            if seq.num_computed_tokens <= seq.prompt_len:
                self.stats.prompt_tokens += n
        sampled = {id(seq): (tok, tl) for seq, tok, tl in sampled_tokens}
        for seq, _ in batch:
            if id(seq) in sampled:
                tok, tl = sampled[id(seq)]
                seq.token_ids.append(tok)
                self.stats.generated_tokens += 1
                if tl is not None:
                    seq.output_logprob_parts.append(tl)
                reason = self._stop_reason(seq, tok)
                if reason:
                    finished.append(self._finish(seq, reason))
                elif self.long_rope_after is not None and not seq.rope_long and seq.num_tokens > self.long_rope_after:
                    self.scheduler.switch_to_long_rope(seq)
            elif seq.num_computed_tokens >= seq.num_tokens and seq.request.max_tokens <= len(seq.output_token_ids):
                finished.append(self._finish(seq, "length" if seq.request.max_tokens else None))
        return finished

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        params = seq.request.sampling
        if tok in stop_tokens(params, self.eos_token_ids):
            return "stop"
        if params.stop:  # decode only the new tokens' window (engine/detokenizer.py): O(n) per completion
            if seq.detokenizer is None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer)
            cut = stop_string_cut(seq.detokenizer, seq.token_ids, seq.prompt_len, params.stop)
            if cut is not None:
                seq.output_text = seq.detokenizer.text[:cut]
                return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.info.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str | None) -> RequestOutput:
        self.scheduler.finish(seq)
        self.stats.finished += 1
        req = seq.request
        prompt_lps = None
        if req.prompt_logprobs is not None:
            prompt_lps = TokenLogprobs.concat(seq.prompt_logprob_parts, req.prompt_logprobs)
        text = seq.output_text
        if text is None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if req.max_tokens else ""
        out_lps = TokenLogprobs.concat(seq.output_logprob_parts, req.sampling.logprobs) \
            if req.sampling is not None and req.sampling.logprobs is not None else None
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), prompt_logprobs=prompt_lps,
            output_token_ids=list(seq.output_token_ids), output_text=text, output_logprobs=out_lps,
            finish_reason=reason, num_cached_tokens=seq.num_cached_tokens or 0,
            last_token_alternatives=seq.alternative_logprobs,
        )

    # ---- one run at a time ---------------------------------------------------------------------
    def _check_current(self, token: object) -> None:
        """Raise if a later run started while this run's generator was suspended (it freed this run's sequences)."""
        if self._current_run is not token:
            raise RuntimeError("this Engine.run() generator was resumed after a later run() of the same engine "
                               "started, which dropped its unfinished requests; finish or close one run before "
                               "starting the next")

    def _abandon_run(self) -> None:
        """Free every sequence the current run left in the scheduler (none when it ran to the end)."""
        self._current_run = None
        self.scheduler.abort_all()
