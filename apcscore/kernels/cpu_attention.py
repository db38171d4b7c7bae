"""Bindings of cpu_attention.c: the torch backend's fixed-order paged attention for every query row of a layer in one
call, on the CPU, with the torch ops' bits (the C file's header says why; tests/attention/test_fused_attention.py
checks it). It covers causal attention without a sliding window or soft-capping, head_dim a multiple of 16; the
torch ops run the rest (`supported`).
"""

from __future__ import annotations

import torch

from apcscore.kernels.cpu_gemm import DTYPE_CODES
from apcscore.kernels.cpu_library import available, forced_simd, library

LANES = 16  # head_dim must be a multiple of this (the kernel's vector width over head_dim)


def supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None,
              softcap: float | None) -> bool:
    """Whether this call can run here: CPU tensors, the library built, no window or soft-cap, head_dim a multiple of
    LANES, both caches of one dtype and layout with head_dim contiguous."""
    return (query.device.type == "cpu" and k_cache.device.type == "cpu" and not window and not softcap
            and query.shape[-1] % LANES == 0 and k_cache.dtype in DTYPE_CODES and v_cache.dtype == k_cache.dtype
            and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and available())


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens: torch.Tensor,
              seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Writes out's rows of every sequence: causal attention of query [T, Hq, D] over the paged caches
    [num_blocks, block_size, Hkv, D] (see paged_attention), query head h reading KV head h // (Hq / Hkv).
    The step's AttentionMetadata says where each sequence is: cu_seqlens [B + 1] (its query rows), seq_lens [B]
    (its keys after this step: its last query sits at seq_len - 1), block_tables [B, max_blocks] (its block ids)."""
    cu, lens, tables = (t.to(device="cpu", dtype=torch.int32).contiguous() for t in (cu_seqlens, seq_lens,
                                                                                       block_tables))
    num_heads, head_dim = query.shape[1], query.shape[2]
    q = query if query.dtype == torch.float32 and query.stride(-1) == 1 else query.float().contiguous()
    dst = out if out.dtype == torch.float32 and out.stride(-1) == 1 else torch.empty(out.shape, dtype=torch.float32)
    status = library().apc_attention(
        len(lens), cu.data_ptr(), lens.data_ptr(), tables.data_ptr(), tables.stride(0), q.data_ptr(), q.stride(0),
        q.stride(1), num_heads, k_cache.shape[2], head_dim, scale, k_cache.data_ptr(), v_cache.data_ptr(),
        DTYPE_CODES[k_cache.dtype], *k_cache.stride()[:3], k_cache.shape[1], dst.data_ptr(), dst.stride(0),
        dst.stride(1), torch.get_num_threads(), forced_simd())
    if status != 0:
        raise MemoryError("the fixed-order CPU attention could not allocate its workspace")
    if dst is not out:  # the sequences' rows are the first ones, one after another (cu_seqlens)
        end = int(cu[-1])
        out[:end] = dst[:end].to(out.dtype)
