"""Bindings of cpu_attention.c: the torch backend's fixed-order paged attention for every query row of a layer in one
call, on the CPU, with the torch ops' bits (the C file's header says why; tests/attention/test_fused_attention.py
checks it). It covers causal attention without a sliding window or soft-capping, head_dim a multiple of 16; the
torch ops run the rest (`supported`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from apcscore.kernels.cpu_library import available, forced_simd, library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_vec.h's DT_*
LANES = 16  # head_dim must be a multiple of this (the kernel's vector width over head_dim)


@dataclass
class Items:
    """Where one step's sequences' queries and keys are: the same in every layer (built once per step)."""

    q_starts: torch.Tensor  # [B] int64: the first query row of each sequence
    q_lens: torch.Tensor  # [B] int64: its query rows this step
    seq_lens: torch.Tensor  # [B] int64: its keys after this step (its last query sits at seq_len - 1)
    tables: torch.Tensor  # [B, max_blocks] int32, contiguous: its block ids
    num_rows: int  # the query rows of all sequences: rows [0, num_rows) of the step

    @classmethod
    def of(cls, cu_seqlens: list[int], seq_lens: list[int], block_tables: torch.Tensor) -> "Items":
        return cls(q_starts=torch.tensor(cu_seqlens[:-1], dtype=torch.int64),
                   q_lens=torch.tensor([b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])], dtype=torch.int64),
                   seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
                   tables=block_tables.to(device="cpu", dtype=torch.int32).contiguous(), num_rows=cu_seqlens[-1])


def supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, window: int | None,
              softcap: float | None) -> bool:
    """Whether this call can run here: CPU tensors, the library built, no window or soft-cap, head_dim a multiple of
    LANES, both caches of one dtype and layout with head_dim contiguous."""
    return (query.device.type == "cpu" and k_cache.device.type == "cpu" and not window and not softcap
            and query.shape[-1] % LANES == 0 and k_cache.dtype in DTYPE_CODES and v_cache.dtype == k_cache.dtype
            and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and available())


def attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, items: Items, scale: float,
              out: torch.Tensor) -> None:
    """Writes out's rows of every item: causal attention of query [T, Hq, D] over the paged caches
    [num_blocks, block_size, Hkv, D] (see paged_attention), query head h reading KV head h // (Hq / Hkv)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    q = query if query.dtype == torch.float32 and query.stride(-1) == 1 else query.float().contiguous()
    dst = out if out.dtype == torch.float32 and out.stride(-1) == 1 else torch.empty(out.shape, dtype=torch.float32)
    ptr = ctypes.c_void_p
    status = library().apc_attention(
        len(items.q_lens), ptr(items.q_starts.data_ptr()), ptr(items.q_lens.data_ptr()),
        ptr(items.seq_lens.data_ptr()), ptr(items.tables.data_ptr()), items.tables.stride(0),
        ptr(q.data_ptr()), q.stride(0), q.stride(1), num_heads, k_cache.shape[2], head_dim, scale,
        ptr(k_cache.data_ptr()), ptr(v_cache.data_ptr()), DTYPE_CODES[k_cache.dtype], k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), k_cache.shape[1], ptr(dst.data_ptr()), dst.stride(0), dst.stride(1),
        torch.get_num_threads(), forced_simd())
    if status != 0:
        raise MemoryError("the fixed-order CPU attention could not allocate its workspace")
    if dst is not out:  # the items' rows are the first ones, one after another (cu_seqlens)
        end = items.num_rows
        out[:end] = dst[:end].to(out.dtype)
