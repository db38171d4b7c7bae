"""The KV cache pool: how many blocks fit (`default_num_kv_blocks`; on CUDA after a profile of the largest step,
`profile_peak_memory`) and its allocation, one (K, V) pair of [num_blocks, block_size, Hkv, D] caches per
layer, attached to the model's attention layers."""

from __future__ import annotations

import itertools
import math
import mmap
import os

from typing import Any, Callable

import torch

from apcscore.attention.metadata import AttentionMetadata, set_attention_metadata
from apcscore.config import EngineConfig
from apcscore.errors import ApcscoreError
from apcscore.models.llama import LlamaDecoder
from apcscore.models.loaded import LoadedModel
from apcscore.models.ops import Ops


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * block_size * heads * head_dim * torch.finfo(dtype).bits // 8


def cuda_pool_bytes(total: int, fraction: float, peak_allocated: int, non_torch: int) -> int:
    """Bytes for the KV pool on CUDA, vLLM's rule: the engine may use `fraction` of the card's `total`; the pool
    gets what is left after `peak_allocated` (torch's peak over the profile of the largest step: the weights
    plus that step's activations and logprob temporaries) and `non_torch` (memory outside torch's allocator:
    the CUDA context, other processes). Never negative."""
    return max(0, int(fraction * total) - peak_allocated - non_torch)


def default_num_kv_blocks(hf_config, block_size: int, dtype: torch.dtype, device: torch.device,
                          fraction: float | None, profile: Callable[[], int] | None = None,
                          host_bytes_per_block: int = 0) -> int:
    """KV pool size: `pool_budget` over the bytes per block. host_bytes_per_block: host memory that lives and dies
    with each block (exact reuse's score store); on the CPU it is paid from the same share (on CUDA it is host
    memory, outside the card's budget)."""
    per_block = kv_bytes_per_block(hf_config, block_size, dtype)
    if device.type == "cpu":
        per_block += host_bytes_per_block
    return max(16, int(pool_budget(device, fraction, profile) // per_block))


def pool_budget(device: torch.device, fraction: float | None, profile: Callable[[], int] | None = None) -> float:
    """The bytes a KV pool may take: on CPU a share of free host memory (default 0.25, at most 4 GiB); on CUDA
    `fraction` (default 0.85) of the card's total memory minus the peak of `profile()` (which runs the largest step
    and returns torch's peak allocated bytes; without it, the memory allocated now) and memory outside torch."""
    if device.type == "cuda":
        peak = profile() if profile is not None else torch.cuda.memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
        return cuda_pool_bytes(total, fraction or 0.85, peak, non_torch)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(free * (fraction or 0.25), 4 * 2**30)


BLOCK_HOST_BYTES = 256  # the block manager's Python objects per KV block (measured ~200 bytes)


def check_kv_pool(hf_config: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                  store_per_block: int = 0) -> None:
    """Refuse a KV pool that cannot fit in free memory (it would fail to allocate, or be killed when used).
    store_per_block: host bytes per block of exact reuse's score store when full (score_store.store_bytes_per_block)."""
    per_block = kv_bytes_per_block(hf_config, block_size, dtype)
    host_block = BLOCK_HOST_BYTES + store_per_block + (per_block if device.type == "cpu" else 0)
    checks = [(num_blocks * per_block, torch.cuda.mem_get_info(device)[0], per_block, "GPU")] \
        if device.type == "cuda" else []
    # on CUDA the block manager's objects and the score store still live in host memory
    checks.append((num_blocks * host_block, _host_available_bytes(), host_block, "host"))
    for need, free, each, where in checks:
        if need > free:
            raise ApcscoreError(
                f"the KV pool of {num_blocks:,} blocks of {block_size} tokens needs {need / 2**30:,.1f} GiB, "
                f"more than the {free / 2**30:,.1f} GiB of free {where} memory — use --num-kv-blocks "
                f"{max(int(free // each), 1)} or fewer" + (", or a smaller --block-size" if block_size > 16 else ""))


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (free plus reclaimable), else the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def run_largest_step(model: LlamaDecoder, max_batch_tokens: int, max_model_len: int, block_size: int,
                     dtype: torch.dtype, device: torch.device, logits_rows: int, logprob_fn: Callable[..., Any],
                     k: int) -> None:
    """The largest step an engine can run, on dummy tokens: a prefill of `max_batch_tokens` tokens (sequences of
    at most `max_model_len`) over a temporary KV pool just big enough, then the logprobs (top-`k`) of
    `logits_rows` rows. For profiling its peak memory; the model's KV caches are detached afterwards."""
    lengths = step_lengths(max_batch_tokens, max_model_len)
    blocks = [-(-n // block_size) for n in lengths]
    allocate_kv_cache(model, sum(blocks), block_size, dtype, device)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    slots, first = [], 0
    for i, (n, b) in enumerate(zip(lengths, blocks)):
        tables[i, :b] = torch.arange(first, first + b, dtype=torch.int32)
        slots.append(torch.arange(n) + first * block_size)
        first += b
    cu = [0, *itertools.accumulate(lengths)]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device), block_tables=tables.to(device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        cu_seqlens_q_list=cu, seq_lens_list=lengths, block_size=block_size)
    try:
        with torch.inference_mode(), set_attention_metadata(meta):
            positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
            hidden = model(torch.zeros(cu[-1], dtype=torch.int64, device=device), positions)
            rows = hidden[:min(logits_rows, cu[-1])]
            logits = model.compute_logits(rows)
            logprob_fn(logits, torch.zeros(rows.shape[0], dtype=torch.int64, device=device), k)
    finally:
        for layer in model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)


def profile_peak_memory(model: LlamaDecoder, **step: Any) -> int:
    """torch's peak allocated bytes on CUDA over `run_largest_step(model, **step)`, without its temporary KV
    pool (the real pool takes its place)."""
    device = step["device"]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_largest_step(model, **step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    blocks = sum(-(-n // step["block_size"]) for n in step_lengths(step["max_batch_tokens"], step["max_model_len"]))
    pool = blocks * kv_bytes_per_block(model.config, step["block_size"], step["dtype"])
    torch.cuda.empty_cache()
    return max(before, peak - pool)


def largest_step_profile(model: LlamaDecoder, config: EngineConfig, info: LoadedModel, device: torch.device,
                         dtype: torch.dtype, ops: Ops, parallel: Any = None) -> Callable[[], int] | None:
    """On CUDA, the profile the KV pool is sized after (`profile_peak_memory`: the pool takes what the
    largest step leaves; under tensor parallelism every rank runs it, and the largest peak counts); else None."""
    if device.type != "cuda":
        return None
    step = dict(max_batch_tokens=config.max_batch_tokens, max_model_len=info.max_model_len,
                block_size=config.block_size, dtype=dtype, device=device, logits_rows=config.logprobs_chunk_size,
                logprob_fn=ops.token_logprobs, k=min(config.max_logprobs, info.vocab_size))
    if parallel is not None:  # every rank runs the step (its collectives)
        return lambda: parallel.profile(step)
    return lambda: profile_peak_memory(model, **step)


def step_lengths(max_batch_tokens: int, max_model_len: int) -> list[int]:
    """The sequence lengths of the largest step: the token budget cut into sequences of at most max_model_len."""
    return [min(max_model_len, max_batch_tokens - start) for start in range(0, max_batch_tokens, max_model_len)]


def allocate_zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On the CPU an anonymous memory map: zero pages the OS hands out only when written,
    so a large KV pool costs memory only as it is used.

    The KV pool must hold finite values everywhere: attention multiplies masked (zero) probabilities with
    whatever sits past a sequence's end, and 0 * NaN would be NaN. Zeros, then real K/V, keep it finite.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
    buffer = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)


def allocate_kv_cache(model: LlamaDecoder, num_kv_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> None:
    """Allocate the zeroed pool and give each attention layer its k_cache and v_cache."""
    cfg = model.config
    attn0 = model.layers[0].self_attn
    # per layer [num_blocks, block_size, Hkv, D] caches; a backend may lay the pool out its own way
    allocate = getattr(attn0.attention_backend, "allocate_kv_cache", None)
    if allocate is not None:
        caches = allocate(cfg.num_hidden_layers, num_kv_blocks, block_size, attn0.num_kv_heads, attn0.head_dim,
                          lambda shape: allocate_zeroed(shape, dtype, device))
    else:
        shape = (2, cfg.num_hidden_layers, num_kv_blocks, block_size, attn0.num_kv_heads, attn0.head_dim)
        pool = allocate_zeroed(shape, dtype, device)
        caches = [(pool[0, i], pool[1, i]) for i in range(cfg.num_hidden_layers)]
    for layer, (k_cache, v_cache) in zip(model.layers, caches):
        layer.self_attn.k_cache = k_cache
        layer.self_attn.v_cache = v_cache
