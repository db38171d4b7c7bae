"""The KV cache pool: how many blocks fit (`default_num_kv_blocks`) and its allocation, one (K, V) pair of
[num_blocks, block_size, Hkv, D] caches per layer, attached to the model's attention layers."""

from __future__ import annotations

import math
import mmap
import os

import torch

from apcscore.models.llama import LlamaDecoder


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * block_size * heads * head_dim * torch.finfo(dtype).bits // 8


def default_num_kv_blocks(hf_config, block_size: int, dtype: torch.dtype, device: torch.device,
                          fraction: float | None) -> int:
    """KV pool size from free memory: a share of free host memory on CPU (at most 4 GiB), of GPU memory on CUDA."""
    per_block = kv_bytes_per_block(hf_config, block_size, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * (fraction or 0.85)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(free * (fraction or 0.25), 4 * 2**30)
    return max(16, int(budget // per_block))


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
    allocate = getattr(attn0.backend, "allocate_kv_cache", None)
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
