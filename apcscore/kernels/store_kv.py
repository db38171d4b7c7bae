"""Triton kernel: write this step's keys and values into the paged KV cache (same as torch_backend.store_kv)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apcscore.kernels._checks import (FLOAT_DTYPES, INDEX_DTYPES, check_dtype, check_float_input, check_shape,
                                      check_tensors)


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     num_cache_slots, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cslot, stride_ch,  # cache strides of one slot and one head (both caches alike)
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per token: copies its [num_kv_heads, head_dim] key and value to cache slot slot_mapping[t]."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_cache_slots):  # -1: padding / not stored; past the pool: never write out of it
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    dst = slot * stride_cslot + h[:, None] * stride_ch + d[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into the paged cache, in place.

    key, value: [T, num_kv_heads, head_dim] (any float dtype, converted to the cache dtype; token and head
    strides free, head_dim contiguous); k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim],
    contiguous; slot_mapping: [S] int32/int64 with S <= T, block_id * block_size + offset, -1 = skip.
    Rows of key/value past S are ignored, as in the torch backend. Slots past the pool are skipped (the torch
    backend raises there); checking them here would cost a device sync.
    """
    name = "store_kv"
    check_tensors(name, key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    for arg, t in (("key", key), ("value", value)):
        check_float_input(name, arg, t, 3)
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_shape(name, arg, t, 4)
        check_dtype(name, arg, t, FLOAT_DTYPES)
        if not t.is_contiguous():
            raise ValueError(f"{name}: {arg} must be contiguous, got strides {t.stride()}")
    check_shape(name, "slot_mapping", slot_mapping, 1)
    check_dtype(name, "slot_mapping", slot_mapping, INDEX_DTYPES)
    if key.shape != value.shape:
        raise ValueError(f"{name}: key {tuple(key.shape)} and value {tuple(value.shape)} differ in shape")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)} {v_cache.dtype} must match")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"{name}: key rows are [num_kv_heads, head_dim] = {tuple(key.shape[1:])}, "
                         f"the cache holds {tuple(k_cache.shape[2:])}")
    num_slots = slot_mapping.shape[0]
    if num_slots > key.shape[0]:
        raise ValueError(f"{name}: slot_mapping has {num_slots} entries for only {key.shape[0]} key rows")
    if num_slots == 0:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    _store_kv_kernel[(num_slots,)](
        key, value, k_cache, v_cache, slot_mapping, k_cache.shape[0] * k_cache.shape[1],
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
