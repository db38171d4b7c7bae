"""Which engine runs a model, and how it is built: the native `Engine` (engine/engine.py) or the transformers fallback
`TransformersEngine` (engine/hf_engine.py), as --model-backend says (models/architecture.choose_model_backend); the
only module that knows both. What it builds for the native engine, in order: docs/architecture.md's module table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from apcscore.config import EngineConfig
from apcscore.engine.block_manager import BlockManager
from apcscore.engine.devices import check_backend_device, device_and_dtype
from apcscore.engine.engine import Engine
from apcscore.engine.gemm_probe import probe_numerics
from apcscore.engine.hf_engine import TransformersEngine
from apcscore.engine.kv_cache import check_kv_pool, default_num_kv_blocks, largest_step_profile
from apcscore.models.loaded import LoadedModel, loaded
from apcscore.engine.context import capping_window, context_length
from apcscore.engine.model_runner import ModelRunner
from apcscore.engine.reference import (check_reference_config, check_same_vocabulary, pair, resize_pools,
                                      shared_num_kv_blocks)
from apcscore.engine.scheduler import Scheduler
from apcscore.engine.score_store import ScoreStore, store_bytes_per_block
from apcscore.errors import ApcscoreError
from apcscore.models.architecture import check_architecture, choose_model_backend
from apcscore.models.decoders import build_decoder, decoder_class
from apcscore.models.llama import LlamaDecoder
from apcscore.models.loading import LazyCheckpoint, load_state_dict, weights_fingerprint
from apcscore.models.ops import Ops, select_ops
from apcscore.models.tensor_parallel import check_tensor_parallel

def load_engine(model: LoadedModel | str, config: EngineConfig | None = None,
                reference: LoadedModel | str | None = None) -> Engine | TransformersEngine:
    """Build the engine that runs `model` (a `load_model` value, or a spec for it: alias, Hugging Face folder or
    .gguf path): the native `Engine` or the transformers fallback, as --model-backend says.

    The device checks are made here, once, before the model is located: a Triton backend without a GPU and
    --device cuda without one are refused before any weights are read; so is an architecture no path runs.
    reference: a reference model beside it (score --reference-model; engine/reference.py), native only.
    """
    config = config or EngineConfig()
    check_backend_device(config)
    device_and_dtype(config)
    model = loaded(model)
    if reference is not None:
        return load_paired_engine(model, reference, config)
    if choose_model_backend(model.config, config.model_backend) == "transformers":
        if config.tensor_parallel_size > 1:  # (the transformers fallback runs on one device)
            name = getattr(model.config, "model_type", None) or "this architecture"
            raise ApcscoreError(f"--tensor-parallel {config.tensor_parallel_size} needs the native engine, and "
                                f"{name} runs through the transformers fallback (one device); run it with "
                                "--tensor-parallel 1")
        return TransformersEngine.from_model(model, config)
    return load_native_engine(model, config)


def load_paired_engine(model: LoadedModel | str, reference: LoadedModel | str, config: EngineConfig) -> Engine:
    """The native engine of `model` with `reference` beside it (engine/reference.py): both checked (vocabulary,
    settings) before any weights are read, then both built with one KV pool size (from --num-kv-blocks, else from
    the memory left once both are loaded, shared in proportion to each model's bytes per block)."""
    model, reference = loaded(model), loaded(reference)
    check_reference_config(config, model, reference)
    check_same_vocabulary(model, reference)
    sized = config.num_kv_blocks is not None
    config = dataclasses.replace(config, use_cuda_graphs=False, num_kv_blocks=config.num_kv_blocks or 16)
    engine, ref_engine = load_native_engine(model, config), load_native_engine(reference, config)
    if not sized:  # both built with a placeholder pool: now the memory left by both is known
        resize_pools(engine, ref_engine, shared_num_kv_blocks(engine, ref_engine))
    pair(engine, ref_engine)
    return engine


# ---- the native engine ---------------------------------------------------------------------------------------
def load_native_engine(model: LoadedModel | str, config: EngineConfig | None = None) -> Engine:
    """The native engine around `model` (a `load_model` value, or a spec for it), whatever --model-backend says,
    its weights read: the whole state dict, or under tensor parallelism each rank's slices only."""
    config = config or EngineConfig()
    device, dtype = device_and_dtype(config)
    model = loaded(model)
    check_architecture(model.config)  # before the weights are read
    if config.tensor_parallel_size > 1:  # each rank reads only its slices of the weights
        check_parallel(model.config, config, device)
        state: Any = LazyCheckpoint(model.path, dtype)
    else:
        state = load_state_dict(model.path, dtype=dtype, device="cpu")  # copied to the device tensor by tensor
    model = dataclasses.replace(model, fingerprint=weights_fingerprint(model.path))
    return native_engine(model, state, config, consume_state=True)


def native_engine_from_parts(hf_config: Any, state_dict: dict[str, torch.Tensor], tokenizer: Any,
                             config: EngineConfig | None = None) -> Engine:
    """The native engine from a Hugging Face config and state dict (tests, benchmarks, random weights), whatever
    --model-backend says; `state_dict` is left as it was."""
    return native_engine(LoadedModel("custom", None, hf_config, tokenizer, rope=None), state_dict, config)


def native_engine(model: LoadedModel, state_dict: dict[str, torch.Tensor], config: EngineConfig | None = None,
                  consume_state: bool = False) -> Engine:
    """The native engine around `model` with the weights `state_dict`, copied into the decoder tensor by tensor,
    from any device and dtype; `state_dict` is left as it was unless consume_state=True (then each entry is
    dropped once copied: for callers that own it). Its `info` is `model` with the rest filled in."""
    config = config or EngineConfig()
    hf_config, rope = model.config, model.rope
    device, dtype = device_and_dtype(config)
    arch = check_architecture(hf_config)
    check_backend_device(config)
    ops = select_ops(config.attention_backend, device.type, config.batch_invariant)
    window_cap = not decoder_class(hf_config).implements_sliding_window  # (Gemma masks its window)
    max_len = context_length(hf_config, config, window_cap)
    parallel = None
    if config.tensor_parallel_size > 1:
        parallel = start_slices(hf_config, state_dict, rope, max_len, config, dtype, device)
        decoder, ops, device = parallel.rank_slice.model, parallel.rank_slice.ops, parallel.rank_slice.device
    else:
        decoder = build_decoder(hf_config, ops, max_len, device, dtype, state_dict, rope, consume_state)
    try:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the KV pool is sized from free memory: return what loading cached
        # the parameter count of the whole model (a rank holds a part: count a copy built on "meta", free)
        whole = decoder if parallel is None else decoder_class(hf_config)(hf_config, ops, device="meta")
        info = dataclasses.replace(model, architecture=arch, max_model_len=max_len,
                                   num_parameters=sum(p.numel() for p in whole.parameters()),
                                   sliding_window=capping_window(hf_config, config, window_cap))
        return assemble(decoder, config, info, device, dtype, ops, parallel)
    except BaseException:
        if parallel is not None:  # (e.g. the KV pool check refused): the engine never owns the workers' slices
            parallel.drop()
        raise


def check_parallel(hf_config: Any, config: EngineConfig, device: torch.device) -> None:
    """Refuse a tensor-parallel configuration that cannot run, before any weights are read; under torchrun a
    rank other than 0 serves rank 0 from here (and never returns)."""
    from apcscore.engine.parallel.ranks import check_devices, serve_if_worker

    check_tensor_parallel(hf_config, decoder_class(hf_config), config.tensor_parallel_size)
    check_devices(config.tensor_parallel_size, device)
    serve_if_worker(device)


def start_slices(hf_config: Any, state: Any, rope: Any, max_len: int, config: EngineConfig, dtype: torch.dtype,
                 device: torch.device) -> Any:
    """Rank 0's `ParallelContext` (engine/parallel/runner.py): the ranks started if needed, every rank told to
    load its slice of the model, rank 0's loaded here."""
    from apcscore.engine.parallel.ranks import rank_group
    from apcscore.engine.parallel.runner import ParallelContext, RankSlice, load_args

    check_parallel(hf_config, config, device)
    group = rank_group(config.tensor_parallel_size, device)
    key = group.new_key()
    args = load_args(hf_config, state, rope, max_len, config, dtype, device)
    group.call(key, "load", args)
    try:
        rank_slice = RankSlice.load(group.tp, args)
    except BaseException:
        group.dropped.append(key)  # the workers' slices of `key` go with the next call
        raise
    return ParallelContext(rank_slice, group, key)


def assemble(model: LlamaDecoder, config: EngineConfig, info: LoadedModel, device: torch.device,
             dtype: torch.dtype, ops: Ops, parallel: Any = None) -> Engine:
    """The engine around a built model: the start-up probe, then the KV pool (with exact reuse's score store),
    the scheduler and the model runner. parallel: rank 0's ParallelContext under tensor parallelism, else None."""
    numerics = probe_numerics(model, ops, config, device)
    # exact reuse keeps a score-store entry per cached block (engine/score_store.py) in host memory: on the CPU
    # the pool's share of memory pays for it, on CUDA it is checked against free host memory
    store_per_block = store_bytes_per_block(config.block_size, model.config.hidden_size,
                                            torch.finfo(dtype).bits // 8, config.max_logprobs) \
        if config.exact_reuse else 0
    pool_config = model.config if parallel is None else parallel.rank_slice.pool_config()  # (a rank's heads)
    num_blocks = config.num_kv_blocks or default_num_kv_blocks(
        pool_config, config.block_size, dtype, device, config.kv_cache_memory_fraction,
        largest_step_profile(model, config, info, device, dtype, ops, parallel), host_bytes_per_block=store_per_block)
    check_kv_pool(pool_config, num_blocks, config.block_size, dtype, device, store_per_block)
    block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    store = ScoreStore() if config.exact_reuse else None
    if store is not None:
        block_manager.on_evict = store.discard  # entries live and die with their KV block
    scheduler = Scheduler(block_manager, config, store)
    if parallel is None:
        runner = ModelRunner(model, num_blocks, config, device, dtype, ops.token_logprobs,
                             capture_block_hidden=store is not None)
    else:  # the workers build theirs too, with the same pool size (engine/parallel/runner.py)
        runner = parallel.make_runner(num_blocks, capture_block_hidden=store is not None)
    engine = Engine(model, config, info, ops, numerics, scheduler, runner)
    if parallel is not None:
        parallel.group.register(engine, parallel.key)  # the workers drop its slices once it is collected
    return engine
