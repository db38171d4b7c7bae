"""A reference model in the same run (`score --reference-model A`): the exact divergence of the model from it at
every scored position, from both models' logits chunks as they are produced: a second decoder and KV pool on the
same block tables (one scheduler), both forwards each step (docs/compare.md, "Exact KL", says what is computed,
what is checked and what is refused). Here: the checks, the pairing and the shared pool size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from apcscore.config import EngineConfig
from apcscore.models.loaded import LoadedModel
from apcscore.errors import ApcscoreError


def check_same_vocabulary(model: LoadedModel, reference: LoadedModel) -> None:
    """Refuse a reference whose token ids mean other tokens than the model's, with the reason."""
    name, ref_name = model.name, reference.name
    sizes = int(model.config.vocab_size), int(reference.config.vocab_size)
    if sizes[0] != sizes[1]:
        raise ApcscoreError(f"--reference-model {ref_name} has a vocabulary of {sizes[1]:,} entries and the model "
                            f"{name} one of {sizes[0]:,}: the exact divergence needs both models to read the same "
                            "token ids (the same tokenizer and vocabulary)")
    vocab, ref_vocab = model.tokenizer.get_vocab(), reference.tokenizer.get_vocab()
    if vocab != ref_vocab:
        differ = sorted(set(vocab.items()) ^ set(ref_vocab.items()), key=lambda kv: kv[1])
        token = differ[0][0]
        raise ApcscoreError(f"--reference-model {ref_name}'s tokenizer maps tokens to other ids than the model "
                            f"{name}'s ({len(vocab):,} vs {len(ref_vocab):,} tokens; e.g. {token!r}: "
                            f"{vocab.get(token)} vs {ref_vocab.get(token)}): the exact divergence needs both "
                            "models to read the same token ids")


def check_reference_config(config: EngineConfig, model: LoadedModel, reference: LoadedModel) -> None:
    """Refuse the settings a reference model cannot run with."""
    from apcscore.models.architecture import choose_model_backend

    if config.tensor_parallel_size > 1:
        raise ApcscoreError("--reference-model runs on one device: drop --tensor-parallel")
    if config.exact_reuse:
        raise ApcscoreError("--reference-model cannot run with --exact-reuse (the score store keeps one model's "
                            "results): drop --exact-reuse")
    for which, m in (("the model", model), ("--reference-model", reference)):
        if choose_model_backend(m.config, config.model_backend) != "native":
            raise ApcscoreError(f"{which} {m.name} runs through the transformers fallback; the exact "
                                "divergence needs the native engine for both models")


def pair(engine: Any, ref_engine: Any) -> None:
    """Put `ref_engine`'s model beside `engine`'s (both new, with pools of the same size, from
    engine/loader.load_paired_engine): its runner runs each step's batch too, the context is the shorter of the
    two, and the numerics are batch-invariant only if both are."""
    if ref_engine.info.max_model_len < engine.info.max_model_len:  # both models must take every scored position
        engine.info = dataclasses.replace(engine.info, max_model_len=ref_engine.info.max_model_len)
    engine.runner.reference = ref_engine.runner
    engine.reference = ref_engine
    if engine.batch_invariant and not ref_engine.batch_invariant:
        engine.batch_invariant = False
        engine.numerics = {**engine.numerics, "batch_invariant": False,
                           "reason": f"the reference model: {ref_engine.numerics['reason']}"}


def resize_pools(engine: Any, ref_engine: Any, num_blocks: int) -> None:
    """Give both engines' runners KV pools of `num_blocks` blocks, and `engine` a block manager and scheduler of
    that size (the engines are new: nothing is cached or scheduled yet)."""
    from apcscore.engine.block_manager import BlockManager
    from apcscore.engine.kv_cache import allocate_kv_cache, check_kv_pool
    from apcscore.engine.scheduler import Scheduler

    cfg = engine.config
    for e in (engine, ref_engine):
        check_kv_pool(e.model.config, num_blocks, cfg.block_size, e.dtype, e.device)
    for e in (engine, ref_engine):
        allocate_kv_cache(e.model, num_blocks, cfg.block_size, e.dtype, e.device)
    engine.scheduler = Scheduler(BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching), cfg)
    engine.block_manager = engine.scheduler.bm
    engine.stats = engine.block_manager.stats  # (the engine's one tally is its block manager's)


def shared_num_kv_blocks(engine: Any, ref_engine: Any) -> int:
    """The blocks both pools get: the budget one engine's pool would get (kv_cache.pool_budget, with both models
    loaded and the larger of their largest steps' peaks), over both models' bytes per block."""
    from apcscore.engine.kv_cache import kv_bytes_per_block, largest_step_profile, pool_budget

    cfg, device, dtype = engine.config, engine.device, engine.dtype
    engines = (engine, ref_engine)
    per_block = sum(kv_bytes_per_block(e.model.config, cfg.block_size, dtype) for e in engines)
    profiles = [largest_step_profile(e.model, cfg, e.info, device, dtype, e.ops) for e in engines]
    larger_peak = None if None in profiles else lambda: max(profile() for profile in profiles)  # (None: not CUDA)
    return max(16, int(pool_budget(device, cfg.kv_cache_memory_fraction, larger_peak) // per_block))
