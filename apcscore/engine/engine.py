"""The batch engine: requests in, outputs out, through scheduler -> KV cache manager -> model runner -> model.

`Engine.run` pulls requests lazily from any iterable (so a huge dataset never sits in memory as
sequences), keeps a bounded look-ahead of waiting requests, and yields a RequestOutput for each request
as soon as it finishes (completion order). Problems of one request (too long, too big for the KV pool,
bad values) become an output with `error` set; they never stop the run.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from apcscore.config import EngineConfig
from apcscore.engine.block_manager import BlockManager
from apcscore.engine.counters import EngineCounters, EngineStats
from apcscore.engine.detokenizer import IncrementalDetokenizer
from apcscore.engine.gemm_probe import probe_numerics
from apcscore.engine.kv_cache import check_kv_pool, default_num_kv_blocks, profile_peak_memory
from apcscore.engine.devices import check_backend_device, resolve_device, resolve_dtype
from apcscore.engine.model_files import LoadedModel, loaded
from apcscore.engine.model_info import ModelInfo, capping_window, context_length
from apcscore.engine.model_runner import ModelRunner
from apcscore.engine.step import (PromptLogprobs, Request, RequestOutput, Sequence, StepOutput, TokenLogprobs,
                                  request_problem)
from apcscore.engine.scheduler import Scheduler
from apcscore.engine.stopping import stop_string_cut, stop_tokens
from apcscore.engine.score_store import ScoreStore, store_bytes_per_block
from apcscore.models.architecture import check_architecture
from apcscore.models.ops import Ops, select_ops
from apcscore.models.decoders import build_decoder, decoder_class
from apcscore.models.llama import LlamaDecoder
from apcscore.models.loading import LazyCheckpoint, eos_token_ids
from apcscore.models.tensor_parallel import check_tensor_parallel


def check_parallel(hf_config: Any, config: EngineConfig, device: torch.device) -> None:
    """Refuse a tensor-parallel configuration that cannot run, before any weights are read."""
    from apcscore.engine.parallel.ranks import check_devices

    check_tensor_parallel(hf_config, decoder_class(hf_config), config.tensor_parallel_size)
    check_devices(config.tensor_parallel_size, device)


class Engine:
    """One model, one KV pool, one scheduler: the native engine. Build it with `Engine.from_model`.

    from_model / from_parts build this engine whatever the config's --model-backend says; to have it picked
    (the transformers fallback, apcscore.engine.hf_engine, for an architecture we do not implement), build
    through `apcscore.engine.loader.load_engine` / `engine_from_parts`.
    """

    model_backend = "native"

    def __init__(self, model: LlamaDecoder, tokenizer: Any, config: EngineConfig, info: ModelInfo,
                 device: torch.device, dtype: torch.dtype, ops: Ops, parallel: Any = None) -> None:
        """parallel: rank 0's engine.parallel.runner.ParallelContext under tensor parallelism, else None."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.info = info
        self.device = device
        self.dtype = dtype
        self.ops = ops
        self.attention_backend = ops.name  # "torch" | "triton", as the run metadata records it
        self.numerics = probe_numerics(model, ops, config, device)
        self.batch_invariant = self.numerics["batch_invariant"]
        profile = None
        if device.type == "cuda":  # the pool takes what the largest step leaves (kv_cache.profile_peak_memory)
            step = dict(max_batch_tokens=config.max_batch_tokens, max_model_len=info.max_model_len,
                        block_size=config.block_size, dtype=dtype, device=device,
                        logits_rows=config.logprobs_chunk_size, logprob_fn=ops.token_logprobs,
                        k=min(config.max_logprobs, info.vocab_size))
            profile = lambda: profile_peak_memory(model, **step)  # noqa: E731
            if parallel is not None:  # every rank runs the step (its collectives): the largest peak of all
                profile = lambda: parallel.profile(step)  # noqa: E731
        # exact reuse keeps a score-store entry per cached block (engine/score_store.py) in host memory: on the CPU
        # the pool's share of memory pays for it, on CUDA it is checked against free host memory
        store_per_block = store_bytes_per_block(config.block_size, model.config.hidden_size,
                                                torch.finfo(dtype).bits // 8, config.max_logprobs) \
            if config.exact_reuse else 0
        pool_config = model.config if parallel is None else parallel.rank_slice.pool_config()  # (a rank's heads)
        num_blocks = config.num_kv_blocks or default_num_kv_blocks(
            pool_config, config.block_size, dtype, device, config.kv_cache_memory_fraction, profile,
            host_bytes_per_block=store_per_block)
        check_kv_pool(pool_config, num_blocks, config.block_size, dtype, device, store_per_block)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.store = ScoreStore() if config.exact_reuse else None
        if self.store is not None:
            self.block_manager.on_evict = self.store.discard  # entries live and die with their KV block
        self.scheduler = Scheduler(self.block_manager, config.max_batch_tokens, config.max_num_seqs,
                                   config.exact_reuse, self.store)
        if parallel is None:
            self.runner = ModelRunner(model, num_blocks, config.block_size, device, dtype,
                                      config.logprobs_chunk_size, config.seed, ops.token_logprobs,
                                      use_cuda_graphs=config.use_cuda_graphs, max_num_seqs=config.max_num_seqs,
                                      capture_block_hidden=self.store is not None)
        else:  # the workers build theirs too, with the same pool size (engine/parallel/runner.py)
            self.runner = parallel.make_runner(num_blocks, dict(
                block_size=config.block_size, logprobs_chunk_size=config.logprobs_chunk_size, base_seed=config.seed,
                max_num_seqs=config.max_num_seqs, capture_block_hidden=self.store is not None))
            parallel.group.register(self, parallel.key)
        self.eos_token_ids = eos_token_ids(self.model.config, self.tokenizer)
        self.long_rope_after = model.long_rope_after  # long-rope: longer sequences use the long frequencies
        self.stats = EngineStats()
        self._arrivals = 0
        self._current_run: object | None = None  # the token of the run() whose sequences are in the scheduler

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model: LoadedModel | str, config: EngineConfig | None = None) -> "Engine":
        """Build the native engine around `model` (a `load_model` value, or a spec for it: alias, Hugging Face
        folder or .gguf path) and read its weights. `engine/loader.load_engine`, which checks the device first and
        picks the fallback where the native decoder cannot run the model, is the call most callers want.
        """
        from apcscore.models.loading import load_state_dict, weights_fingerprint

        config = config or EngineConfig()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        model = loaded(model)
        files = model.files
        check_architecture(model.config)  # before the weights are read
        if config.tensor_parallel_size > 1:  # each rank reads only its slices of the weights
            check_parallel(model.config, config, device)
            from apcscore.engine.parallel.ranks import serve_if_worker

            serve_if_worker(device)  # under torchrun a rank other than 0 serves rank 0 from here: never returns
            state: Any = LazyCheckpoint(files.path, dtype)
        else:
            state = load_state_dict(files.path, dtype=dtype, device="cpu")  # copied to the device tensor by tensor
        return cls.from_parts(model.config, state, model.tokenizer, config, name=files.name, path=str(files.path),
                              fingerprint=weights_fingerprint(files.path), rope=model.rope, consume_state=True)

    @classmethod
    def from_parts(cls, hf_config: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any,
                   config: EngineConfig | None = None, name: str = "custom", path: str = "",
                   fingerprint: str = "", rope: Any = None, consume_state: bool = False) -> "Engine":
        """Build the engine from a Hugging Face config and state dict (tests, benchmarks, random weights).

        The weights are copied into the model tensor by tensor, from any device and dtype; `state_dict` is left
        as it was unless consume_state=True (then each entry is dropped once copied: for callers that own it).
        rope: the config's RopeFrequencies if already known (apcscore.models.resolved), else None.
        """
        config = config or EngineConfig()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        arch = check_architecture(hf_config)
        check_backend_device(config)
        ops = select_ops(config.attention_backend, device.type, config.batch_invariant)
        window_cap = not decoder_class(hf_config).implements_sliding_window  # (Gemma masks its window)
        max_len = context_length(hf_config, config, window_cap)
        parallel = None
        if config.tensor_parallel_size > 1:
            check_parallel(hf_config, config, device)
            from apcscore.engine.parallel.ranks import rank_group, serve_if_worker

            serve_if_worker(device)  # under torchrun a rank other than 0 serves rank 0 from here: never returns
            from apcscore.engine.parallel.runner import ParallelContext, RankSlice, load_args

            group = rank_group(config.tensor_parallel_size, device)
            key = group.new_key()
            args = load_args(hf_config, state_dict, rope, max_len, config, dtype, device)
            group.call(key, "load", args)
            try:
                rank_slice = RankSlice.load(group.tp, args)
            except BaseException:
                group.dropped.append(key)  # the workers' slices of `key` go with the next call
                raise
            model, ops, device = rank_slice.model, rank_slice.ops, rank_slice.device
            parallel = ParallelContext(rank_slice, group, key)
        else:
            model = build_decoder(hf_config, ops, max_len, device, dtype, state_dict, rope, consume_state)
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the KV pool is sized from free memory: return what loading cached
            # the parameter count of the whole model (a rank holds a part: count a copy built on "meta", free)
            whole = model if parallel is None else decoder_class(hf_config)(hf_config, ops, device="meta")
            info = ModelInfo(
                name=name, path=path, architecture=arch, vocab_size=hf_config.vocab_size,
                max_model_len=max_len, fingerprint=fingerprint,
                num_parameters=sum(p.numel() for p in whole.parameters()),
                sliding_window=capping_window(hf_config, config, window_cap),
            )
            return cls(model, tokenizer, config, info, device, dtype, ops, parallel)
        except BaseException:
            if parallel is not None:  # (e.g. the KV pool check refused): the engine never owns the workers' slices
                parallel.drop()
            raise

    def counters(self) -> EngineCounters:
        """This engine's counters since it was built: its stats, its prefix cache's and its KV pool's."""
        bm = self.block_manager
        return EngineCounters.of(self.stats, bm.stats, bm.num_used_blocks, bm.num_blocks)

    # ---- running -------------------------------------------------------------------------------
    def run_recomputed(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """`run` with exact reuse off while these requests run: every scored position computed by a full prefill
        (--verify-reuse's reference); the setting is restored when the outputs are exhausted or dropped."""
        saved, self.scheduler.exact_reuse = self.scheduler.exact_reuse, False
        try:
            yield from self.run(requests)
        finally:
            self.scheduler.exact_reuse = saved

    def run(self, requests: Iterable[Request], on_step: Callable[["Engine"], None] | None = None
            ) -> Iterator[RequestOutput]:
        """Run every request; yield one RequestOutput per request, in completion order.

        One run at a time: a run left before its end (an exception in the consumer's loop, Ctrl-C, `on_step`
        raising, `close()`, the generator dropped) frees every sequence it left once its generator closes, and a
        new run frees what an earlier one not closed yet left (that generator then raises if resumed)."""
        self._abandon_run()  # an earlier run whose generator was neither exhausted nor closed (yet)
        token = self._current_run = object()
        pending = iter(requests)
        exhausted = False
        lookahead = 4 * self.config.max_num_seqs
        started = time.perf_counter()
        try:
            while True:
                while not exhausted and len(self.scheduler.waiting) < lookahead:
                    request = next(pending, None)
                    if request is None:
                        exhausted = True
                        break
                    problem = self._check(request)
                    if problem:
                        self.stats.errors += 1
                        yield RequestOutput(request.request_id, list(request.prompt_token_ids),
                                            finish_reason="error", error=problem)
                        self._check_current(token)
                        continue
                    self.scheduler.add(Sequence(request, self._arrivals, self.long_rope_after))
                    self._arrivals += 1
                if not self.scheduler.has_work:
                    if exhausted:
                        return
                    continue
                batch = self.scheduler.schedule()
                self.stats.preemptions += batch.num_preempted
                if not batch:
                    raise RuntimeError("scheduler made no progress: this is a bug, please report it")
                step = self.runner.execute(batch)
                for out in self._postprocess(batch, step):
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

    def _postprocess(self, batch, step: StepOutput) -> list[RequestOutput]:
        """Account a step's results; the outputs of the requests it finished, every one retired before any is seen."""
        finished: list[RequestOutput] = []
        for seq, lps in step.prompt_logprobs:
            seq.prompt_logprob_parts.append(lps)
        for seq, alternatives in step.alternatives:
            seq.alternative_logprobs = alternatives
        self.scheduler.finish_step(batch)
        if self.store is not None:  # after finish_step: the completed blocks are in the cache now
            for seq, hidden in step.block_hidden:
                self.store.publish(seq, hidden, self.block_manager.cached, self.block_manager.block_size)
        for seq, n in batch.items:
            if seq.num_computed_tokens <= seq.prompt_len:
                self.stats.prompt_tokens += n
        sampled = {id(seq): (tok, tl) for seq, tok, tl in step.sampled}
        for seq, _ in batch.items:
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
        self.scheduler.finish(seq, reason)
        self.stats.finished += 1
        req = seq.request
        prompt_lps = None
        if req.prompt_logprobs is not None:
            parts = seq.prompt_logprob_parts
            merged = TokenLogprobs.concat(parts, req.prompt_logprobs)
            positions = np.concatenate([p.positions for p in parts]) if parts else np.zeros(0, np.int64)
            prompt_lps = PromptLogprobs(**vars(merged), positions=positions)
        text = seq.output_text
        if text is None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True) if req.max_tokens else ""
        out_lps = TokenLogprobs.concat(seq.output_logprob_parts, req.sampling.logprobs or 0) \
            if req.sampling is not None and req.sampling.logprobs is not None else None
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), prompt_logprobs=prompt_lps,
            output_token_ids=list(seq.output_token_ids), output_text=text, output_logprobs=out_lps,
            finish_reason=reason, num_cached_tokens=seq.num_cached_tokens or 0,
            last_token_alternatives=seq.alternative_logprobs,
        )

